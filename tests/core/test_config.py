"""One typed config: defaults < YAML file < DRAFTMESH_* env < flags."""

from __future__ import annotations

import argparse

import pytest

from draftmesh.config import EngineConfig, add_config_arguments, config_from_args, load_config


def test_layers_override_in_order(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text("model: gemma3-270m\nmax_nodes: 32\nthreads: 3\nsource_options: {rules: {window: 100}}\n")
    env = {"DRAFTMESH_MAX_NODES": "8", "DRAFTMESH_SOURCES": "history,rules"}
    cfg = load_config(file=cfg_file, env=env, overrides={"threads": 2, "model": None})
    assert cfg.model == "gemma3-270m"  # file beats default, an unset flag does not override
    assert cfg.max_nodes == 8  # env beats file
    assert cfg.threads == 2  # flag beats file
    assert cfg.sources == ["history", "rules"]
    assert cfg.source_options == {"rules": {"window": 100}}


def test_flags_are_generated_from_the_fields():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = parser.parse_args(["--max-nodes", "12", "--sources", "history", "--dtype", "float32"])
    cfg = config_from_args(args)
    assert (cfg.max_nodes, cfg.sources, cfg.dtype) == (12, ["history"], "float32")
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "float64"])
    with pytest.raises(SystemExit):  # structured options are file-only
        parser.parse_args(["--source-options", "x"])


@pytest.mark.parametrize(
    "text, env, message",
    [
        ("bogus: 1\n", {}, "unknown keys bogus"),
        ("- a\n", {}, "must hold a mapping"),
        ("", {"DRAFTMESH_THREADS": "many"}, "must be an integer"),
        ("", {"DRAFTMESH_SOURCE_OPTIONS": "x"}, "only be set in the config file"),
        ("threads: -1\n", {}, "threads must be >= 0"),
        ("dtype: float64\n", {}, "dtype must be one of"),
    ],
)
def test_bad_config_is_a_clear_error(tmp_path, text, env, message):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config(EngineConfig, file=cfg_file, env=env)
