"""Bearer API-key auth: accepted, refused with a short reason, keys never shown."""

from __future__ import annotations

import pytest

from draftmesh.config import ServeConfig, load_config
from draftmesh.router.auth import ApiKeyAuth

KEYS = ["sk-alpha-123", "sk-beta-4567890"]


@pytest.fixture
def auth():
    return ApiKeyAuth(KEYS)


def test_disabled_allows_everything():
    for keys in (None, []):
        a = ApiKeyAuth(keys)
        assert not a.enabled
        assert a.check([]) is None
        assert a.check([("authorization", "Bearer whatever")]) is None


@pytest.mark.parametrize("key", KEYS)
def test_accepted_keys(auth, key):
    assert auth.enabled
    assert auth.check([("user-agent", "grpc"), ("authorization", f"Bearer {key}")]) is None


@pytest.mark.parametrize(
    "metadata, reason",
    [
        ([], "missing authorization metadata"),
        (None, "missing authorization metadata"),
        ([("x-api-key", KEYS[0])], "missing authorization metadata"),
        ([("authorization", KEYS[0])], "authorization must be 'Bearer <key>'"),
        ([("authorization", f"Basic {KEYS[0]}")], "authorization must be 'Bearer <key>'"),
        ([("authorization", "Bearer")], "authorization must be 'Bearer <key>'"),
        ([("authorization", f"Bearer {KEYS[0]} extra")], "authorization must be 'Bearer <key>'"),
        ([("authorization", b"Bearer \xff\xfe")], "authorization must be 'Bearer <key>'"),
        ([("authorization", f"Bearer {KEYS[0]}"), ("authorization", "Bearer x")], "authorization must be 'Bearer <key>'"),
        ([("authorization", "Bearer sk-alpha-12")], "invalid API key"),
        ([("authorization", "Bearer sk-alpha-1234")], "invalid API key"),
        ([("authorization", "Bearer SK-ALPHA-123")], "invalid API key"),
        ([("authorization", "Bearer " + "x" * 10_000)], "invalid API key"),
    ],
)
def test_refusals(auth, metadata, reason):
    got = auth.check(metadata)
    assert got == reason
    assert all(k not in got for k in KEYS)


def test_metadata_key_case_insensitive_and_scheme_case_insensitive(auth):
    assert auth.check([("Authorization", f"Bearer {KEYS[0]}")]) is None
    assert auth.check([("AUTHORIZATION", f"bearer {KEYS[1]}")]) is None


def test_bytes_values(auth):
    assert auth.check([("authorization", f"Bearer {KEYS[1]}".encode())]) is None
    assert auth.check([("authorization", b"Bearer nope")]) == "invalid API key"


def test_repr_hides_keys(auth):
    text = repr(auth) + str(auth) + repr(vars(auth))
    assert all(k not in text for k in KEYS)
    assert "keys=2" in repr(auth)


@pytest.mark.parametrize("keys", [[""], ["  "], ["ok", "\n"], ["has space"], ["ünï"]])
def test_bad_configured_keys(keys):
    with pytest.raises(ValueError) as err:
        ApiKeyAuth(keys)
    assert "#" in str(err.value)
    for k in keys:
        if k.strip():
            assert k not in str(err.value)


def test_configured_keys_are_stripped():
    assert ApiKeyAuth(["  sk-x \n"]).check([("authorization", "Bearer sk-x")]) is None


def test_from_config_and_key_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# mounted secret\nsk-file-1\n\n  sk-file-2  \r\n")
    a = ApiKeyAuth.from_config(ServeConfig(api_keys=["sk-cfg"], api_keys_file=str(f)))
    assert len(a) == 3
    for key in ("sk-cfg", "sk-file-1", "sk-file-2"):
        assert a.check([("authorization", f"Bearer {key}")]) is None
    assert a.check([("authorization", "Bearer # mounted secret")]) is not None

    assert not ApiKeyAuth.from_config(ServeConfig()).enabled
    only_file = ApiKeyAuth.from_config(ServeConfig(api_keys_file=str(f)))
    assert only_file.enabled and len(only_file) == 2


def test_key_file_errors_fail_closed(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n# nothing\n")
    with pytest.raises(ValueError, match="holds no keys"):
        ApiKeyAuth.from_config(ServeConfig(api_keys_file=str(empty)))
    with pytest.raises(ValueError, match="cannot read"):
        ApiKeyAuth.from_config(ServeConfig(api_keys_file=str(tmp_path / "missing")))


def test_the_key_file_comes_from_the_environment_through_the_config(tmp_path):
    f = tmp_path / "keys"
    f.write_text("sk-env\n")
    serve = load_config(env={"DRAFTMESH_API_KEYS_FILE": str(f)}).serve
    assert ApiKeyAuth.from_config(serve).check([("authorization", "Bearer sk-env")]) is None


def test_every_key_is_compared(auth, monkeypatch):
    import hmac

    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(hmac, "compare_digest", lambda a, b: calls.append(1) or real(a, b))
    assert auth.check([("authorization", f"Bearer {KEYS[0]}")]) is None
    assert len(calls) == len(KEYS)
