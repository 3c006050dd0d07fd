"""One typed config: a root of sections, filled from defaults < YAML file < environment < flags."""

from __future__ import annotations

import argparse
import dataclasses
import typing

import pytest
import yaml

from draftmesh.config import (
    BuilderConfig,
    DraftmeshConfig,
    EngineConfig,
    FactCheckConfig,
    RemoteSource,
    add_config_arguments,
    config_from_args,
    leaves,
    load_config,
)


def test_layers_override_in_order(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(
        "engine: {model: gemma3-270m, threads: 3}\n"
        "builder: {max_nodes: 32}\n"
        "sources: {options: {rules: {window: 100}}}\n"
    )
    env = {"DRAFTMESH_MAX_NODES": "8", "DRAFTMESH_SOURCES": "history,rules"}
    cfg = load_config(file=cfg_file, env=env, overrides={"engine.threads": 2, "engine.model": None})
    assert cfg.engine.model == "gemma3-270m"  # file beats default, an unset flag does not override
    assert cfg.builder.max_nodes == 8  # env beats file
    assert cfg.engine.threads == 2  # flag beats file
    assert cfg.sources.names == ["history", "rules"]
    assert cfg.sources.options == {"rules": {"window": 100}}
    assert cfg.serve == DraftmeshConfig().serve  # untouched sections keep their defaults


def test_flags_are_generated_from_the_fields_with_section_prefixes():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser)
    args = parser.parse_args([
        "--max-nodes", "12", "--sources", "history", "--dtype", "float32", "--builder-min-gain", "1.5",
        "--builder-prior", "4,1", "--factcheck-workers", "0", "--no-factcheck", "--grpc-port", "9100",
        "--max-documents", "2", "--source-deadline-ms", "50",
    ])
    cfg = config_from_args(args)
    assert (cfg.builder.max_nodes, cfg.sources.names, cfg.engine.dtype) == (12, ["history"], "float32")
    assert cfg.builder.min_gain == 1.5 and cfg.builder.prior == (4.0, 1.0)
    assert cfg.factcheck.workers == 0 and cfg.factcheck.enabled is False
    assert cfg.serve.grpc_port == 9100 and cfg.limits.max_documents == 2 and cfg.sources.deadline_ms == 50
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "float64"])
    with pytest.raises(SystemExit):  # structured options are file-only
        parser.parse_args(["--source-options", "x"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--builder-prior", "1,2,3"])


def test_sections_limit_the_flags():
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, sections=("engine",))
    assert parser.parse_args(["--model", "x"]).model == "x"
    with pytest.raises(SystemExit):
        parser.parse_args(["--grpc-port", "1"])


def test_every_field_is_documented_and_flags_and_env_names_are_unique():
    all_leaves = leaves()
    assert all(leaf.field.metadata.get("help") for leaf in all_leaves), [l.name for l in all_leaves if not l.field.metadata.get("help")]
    flags = [leaf.flag for leaf in all_leaves]
    envs = [leaf.env for leaf in all_leaves]
    assert len(set(flags)) == len(flags) and len(set(envs)) == len(envs)
    for leaf in all_leaves:
        assert leaf.env == "DRAFTMESH_" + leaf.flag.upper().replace("-", "_")
    # the typed spec's fields are documented too
    assert all(f.metadata.get("help") for f in dataclasses.fields(RemoteSource))


def test_env_names_are_the_flags_and_the_workers_section_keeps_its_prefix():
    by_name = {leaf.name: leaf for leaf in leaves()}
    assert by_name["engine.model"].env == "DRAFTMESH_MODEL"
    assert by_name["serve.api_keys_file"].env == "DRAFTMESH_API_KEYS_FILE"
    assert by_name["factcheck.python"].env == "DRAFTMESH_FACTCHECK_PYTHON"
    assert by_name["builder.min_gain"].flag == "builder-min-gain"
    worker = {leaf.name: leaf for leaf in leaves(FactCheckConfig)}
    assert worker["redis_url"].flag == "redis-url" and worker["redis_url"].env == "DRAFTMESH_FACTCHECK_REDIS_URL"
    assert "workers" not in worker and "enabled" not in worker  # the mesh's knobs, not the worker's


def test_redis_url_falls_back_to_REDIS_URL_and_the_factcheck_redis_follows_the_mesh():
    cfg = load_config(env={"REDIS_URL": "redis://a:1/0"})
    assert cfg.serve.redis_url == "redis://a:1/0"
    assert cfg.factcheck.redis_url is None and cfg.factcheck_config().redis_url == "redis://a:1/0"
    # a flag beats REDIS_URL, and the fact-check streams follow the flag, not the environment
    cfg = load_config(env={"REDIS_URL": "redis://a:1/0"}, overrides={"serve.redis_url": "redis://b:2/0"})
    assert cfg.serve.redis_url == cfg.factcheck_config().redis_url == "redis://b:2/0"
    cfg = load_config(env={"REDIS_URL": "redis://a:1/0", "DRAFTMESH_FACTCHECK_REDIS_URL": "redis://c:3/0"})
    assert cfg.factcheck_config().redis_url == "redis://c:3/0"
    # the worker alone: REDIS_URL when its own variable is unset
    assert load_config(FactCheckConfig, env={"REDIS_URL": "redis://a:1/0"}).redis_url == "redis://a:1/0"
    assert load_config(FactCheckConfig, env={}).redis_url is None


def test_plain_data_round_trip_is_the_same_config():
    cfg = DraftmeshConfig.from_dict({
        "engine": {"model": "gemma3-270m"},
        "builder": {"prior": [2, 1], "source_priors": {"rules": [1, 3]}},
        "sources": {"remote": {"llm": {"deployment": {"num_gpus": 1}}, "ext": {"address": "h:1", "timeout_ms": 50}}},
        "serve": {"api_keys": ["k"]},
    })
    data = cfg.to_dict()
    assert yaml.safe_load(yaml.safe_dump(data)) == data  # plain YAML (tuples became lists)
    again = DraftmeshConfig.from_dict(data)
    assert again == cfg
    assert again.builder.source_priors == {"rules": (1, 3)} and again.builder.prior == (2, 1)
    assert isinstance(again.sources.remote["llm"], RemoteSource) and again.sources.remote["llm"].resources.num_gpus == 1
    assert again.sources.remote["ext"].external and again.sources.remote["ext"].timeout_ms == 50


def test_a_section_loaded_alone_reads_its_own_file(tmp_path):
    f = tmp_path / "w.yaml"
    f.write_text(yaml.safe_dump(load_config(env={}).factcheck_config().to_dict()))
    assert load_config(FactCheckConfig, file=f, env={}) == FactCheckConfig()


@pytest.mark.parametrize(
    "text, env, message",
    [
        ("bogus: 1\n", {}, "unknown keys bogus"),
        ("grpc_port: 1\n", {}, r"grpc_port \(did you mean serve.grpc_port\?\)"),
        ("serve: {grpc_prot: 1}\n", {}, "serve: unknown keys grpc_prot"),
        ("sources: {remote: {x: {adress: 'h:1'}}}\n", {}, "sources.remote.x: unknown keys adress"),
        ("- a\n", {}, "must hold a mapping"),
        ("", {"DRAFTMESH_THREADS": "many"}, "DRAFTMESH_THREADS must be an integer"),
        ("", {"DRAFTMESH_FACTCHECK": "maybe"}, "DRAFTMESH_FACTCHECK must be true or false"),
        ("", {"DRAFTMESH_SOURCE_OPTIONS": "x"}, "only be set in the config file"),
        ("engine: {threads: -1}\n", {}, "engine.threads must be >= 0"),
        ("engine: {dtype: float64}\n", {}, "engine.dtype must be one of"),
        ("serve: {grpc_port: 70000}\n", {}, "serve.grpc_port must be <= 65535"),
        ("serve: {tls_cert: c.pem}\n", {}, "tls_cert and serve.tls_key must be given together"),
        ("limits: {default_max_new_tokens: 9000}\n", {}, "exceeds limits.max_new_tokens_cap"),
        ("builder: {max_nodes: 5000}\n", {}, "builder.max_nodes must be <= 1024"),
        ("builder: {prior: [1, -1]}\n", {}, "Beta prior"),
        ("factcheck: {wikidata: offline}\n", {}, "needs factcheck.wikidata_dump"),
        ("sources: {remote: {x: {}}}\n", {}, "sources.remote.x: give address"),
        ("sources: {remote: {x: {address: nocolon}}}\n", {}, "sources.remote.x: address must be host:port"),
        ("sources: {remote: {x: {address: 'h:1', deployment: {}}}}\n", {}, "cannot also be a deployment"),
        ("sources: {names: [rag], remote: {rag: {address: 'h:1'}}}\n", {}, "listed both in-process"),
        ("sources: {remote: {x: {factory: nomodule}}}\n", {}, "package.module:callable"),
    ],
)
def test_bad_config_is_a_clear_error_naming_the_field(tmp_path, text, env, message):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_config(file=cfg_file, env=env)


def test_every_bounded_field_is_checked_at_its_bound():
    """The bounds in a field's metadata are what its section enforces (and the chart's schema reads)."""
    for section in dataclasses.fields(DraftmeshConfig):
        cls = section.default_factory
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            lo = f.metadata.get("min")
            if lo is None:
                continue
            low = int(lo) if hints[f.name] is int else lo
            others = {"default_max_new_tokens": 1} if f.name == "max_new_tokens_cap" else {}  # default <= cap
            cls(**{f.name: low, **others})
            if hints[f.name] is int:
                with pytest.raises(ValueError, match=f"{section.name}.{f.name} must be >= "):
                    cls(**{f.name: low - 1, **others})


def test_engine_and_builder_sections_are_what_the_engine_reads():
    assert EngineConfig().dtype == "auto" and BuilderConfig().max_nodes == 64
    cfg = DraftmeshConfig().replace(builder={"max_nodes": 7}, engine={"model": "m"})
    assert cfg.builder.max_nodes == 7 and cfg.engine.model == "m" and cfg.builder.min_gain == BuilderConfig().min_gain
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.engine.model = "x"  # type: ignore[misc]


def test_a_verifier_replica_is_routed_a_full_batch_by_default():
    """Serve routes a replica at most serve.verifier_max_ongoing requests: below engine.max_batch_rows,
    `draftmesh serve` would cap continuous batching there, whatever the engine can batch."""
    cfg = DraftmeshConfig()
    assert cfg.serve.verifier_max_ongoing >= cfg.engine.max_batch_rows
    assert cfg.serve.max_in_flight >= cfg.serve.verifier_max_ongoing  # the router admits as many
