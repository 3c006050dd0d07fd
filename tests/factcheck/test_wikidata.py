"""The Wikidata client against a local HTTP server replaying recorded API answers, the entity
model on real entity JSON, and the offline store on real dump excerpts (no network)."""

from __future__ import annotations

import gzip
import json
import logging
import threading
import time
import urllib.parse
import uuid
from decimal import Decimal
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from draftmesh.factcheck.wikidata import (
    DEFAULT_PROPERTIES,
    DEFAULT_USER_AGENT,
    Entity,
    EntityLookup,
    OfflineEntityStore,
    SearchHit,
    WikidataClient,
    WikidataError,
    WikidataTime,
    WikidataUnavailable,
)
from draftmesh.net import free_port

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "wikidata"
SAMPLE_DUMP = FIXTURES / "sample-dump-20150815.json.gz"
ENTITY_Q42 = FIXTURES / "entity-Q42.json"
UA = "draftmesh-tests/1.0 (https://example.org/draftmesh-tests; tests@example.org)"


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text(encoding="utf-8"))


# ------------------------------------------------------------------------------------------
# A stand-in for the API


class FakeWikidata:
    """Answers like wikidata.org from the recorded responses, routed by the query; ``script``
    holds answers (status, headers, body, delay) served first, to stage failures."""

    def __init__(self) -> None:
        self.entities: dict[str, dict] = {}
        for name in ("wbgetentities-Q1.json", "wbgetentities-Q6-Q42-P31.json", "wbgetentities-Q32063953.json"):
            self.entities.update(fixture(name)["entities"])  # keyed by the asked id (Q32063953 redirects)
        self.searches = {"abc": fixture("wbsearchentities-abc.json")}
        self.script: list[tuple[int, dict, object, float]] = []
        self.requests: list[tuple[dict[str, str], dict[str, str]]] = []
        self.lock = threading.Lock()

    def route(self, params: dict[str, str]) -> tuple[int, dict, object]:
        action = params.get("action")
        if action == "wbsearchentities":
            return 200, {}, self.searches.get(params.get("search", "").casefold(), fixture("wbsearchentities-empty.json"))
        if action == "wbgetentities":
            ids = params.get("ids", "").split("|")
            return 200, {}, {"entities": {i: self.entities.get(i, {"id": i, "missing": ""}) for i in ids}, "success": 1}
        return 200, {}, {"error": {"code": "unknown_action", "info": f"Unrecognized value for parameter action: {action}"}}

    def handle(self, handler: BaseHTTPRequestHandler) -> None:
        params = {k: v[-1] for k, v in urllib.parse.parse_qs(urllib.parse.urlsplit(handler.path).query).items()}
        with self.lock:
            self.requests.append((params, dict(handler.headers)))
            scripted = self.script.pop(0) if self.script else None
        if scripted:
            status, headers, body, delay = scripted
            time.sleep(delay)
        else:
            status, headers, body = self.route(params)
        if isinstance(body, (dict, list)):
            payload = json.dumps(body).encode()
            headers = {"Content-Type": "application/json; charset=utf-8", **headers}
            if "gzip" in handler.headers.get("Accept-Encoding", ""):
                payload, headers = gzip.compress(payload), {**headers, "Content-Encoding": "gzip"}
        else:
            payload = body if isinstance(body, bytes) else str(body).encode()
        handler.send_response(status)
        for key, value in headers.items():
            handler.send_header(key, value)
        handler.send_header("Content-Length", str(len(payload)))
        handler.end_headers()
        handler.wfile.write(payload)

    def params(self, i: int = -1) -> dict[str, str]:
        return self.requests[i][0]


@pytest.fixture
def api():
    fake = FakeWikidata()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            try:
                fake.handle(self)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (timeout test)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    fake.url = f"http://127.0.0.1:{server.server_address[1]}/w/api.php"
    yield fake
    server.shutdown()
    server.server_close()


def client_for(api: FakeWikidata, **options) -> WikidataClient:
    options = {"user_agent": UA, "backoff_s": 0.01, "retries": 3, "timeout_s": 2.0, **options}
    return WikidataClient(api.url, **options)


# ------------------------------------------------------------------------------------------
# Client: answers


def test_search_returns_hits_and_sends_policy_headers(api):
    client = client_for(api)
    assert isinstance(client, EntityLookup)
    hits = client.search("ABC")
    assert len(hits) == 7
    assert hits[0] == SearchHit("Q169889", "American Broadcasting Company", "American broadcast television network", "ABC")
    assert hits[1] == SearchHit("Q286874", "ABC", "Wikimedia disambiguation page", "ABC")
    params, headers = api.requests[0]
    assert params == {
        "action": "wbsearchentities",
        "search": "ABC",
        "language": "en",
        "uselang": "en",
        "type": "item",
        "limit": "7",
        "format": "json",
        "maxlag": "5",
    }
    assert headers["User-Agent"] == UA
    assert client.search("some search string with no results") == []


def test_default_user_agent_names_the_software(api):
    WikidataClient(api.url).search("ABC")
    agent = api.requests[0][1]["User-Agent"]
    assert agent == DEFAULT_USER_AGENT and agent.startswith("draftmesh-factcheck/")


def test_get_entities_missing_ids_and_redirects(api):
    client = client_for(api)
    got = client.get(["Q42", "Q6", "Q32063953", "Q1", "Q42"])
    assert list(got) == ["Q42", "Q6", "Q32063953", "Q1"]  # asked order, duplicates once
    assert len(api.requests) == 1
    assert api.params()["ids"] == "Q42|Q6|Q32063953|Q1"
    assert api.params()["languages"] == "en"
    assert api.params()["props"] == "labels|descriptions|aliases|claims"

    q42 = got["Q42"]
    assert q42.id == "Q42" and q42.label() == "Douglas Adams"
    assert q42.description() == "English writer and humorist"
    assert "Douglas Noël Adams" in q42.aliases["en"]
    # a 2015 answer: "numeric-id" without "id", 11-digit years
    assert q42.instance_of() == frozenset({"Q5"})
    assert q42.times("P569") == [WikidataTime(1952, 3, 11, 11)]
    assert [str(t) for t in q42.times("P570")] == ["2001-05-11"]

    assert got["Q6"] is None
    karlsruhe = got["Q32063953"]
    assert karlsruhe.id == "Q1040" and karlsruhe.label() == "Karlsruhe"
    assert "Q515" in karlsruhe.instance_of()
    assert got["Q1"].label() == "universe"


def test_get_batches_fifty_ids_per_call(api):
    ids = [f"Q{i}" for i in range(1, 121)]
    got = WikidataClient(api.url, user_agent=UA).get(ids)
    assert [len(p["ids"].split("|")) for p, _ in api.requests] == [50, 50, 20]
    assert got["Q1"].label() == "universe" and got["Q42"].label() == "Douglas Adams"
    assert sum(e is not None for e in got.values()) == 2


def test_bad_arguments_are_refused_before_any_call(api):
    client = client_for(api)
    with pytest.raises(ValueError, match="not Wikidata entity ids"):
        client.get(["Q42", "bogus"])
    with pytest.raises(ValueError, match="sequence of ids"):
        client.get("Q42")
    with pytest.raises(ValueError, match="limit"):
        client.search("ABC", limit=0)
    with pytest.raises(ValueError, match="language"):
        client.search("ABC", language="English")
    assert api.requests == []
    with pytest.raises(ValueError, match="http"):
        WikidataClient("ftp://example.org/api.php")
    with pytest.raises(ValueError, match="timeout_s"):
        WikidataClient(api.url, timeout_s=0)
    with pytest.raises(ValueError, match="retries"):
        WikidataClient(api.url, retries=-1)


# ------------------------------------------------------------------------------------------
# Client: retries and errors


def test_maxlag_waits_retry_after_then_succeeds(api):
    api.script.append((200, {"Retry-After": "1"}, fixture("error-maxlag.json"), 0))
    started = time.monotonic()
    hits = client_for(api, backoff_s=0.001).search("ABC")
    assert len(hits) == 7 and len(api.requests) == 2
    assert time.monotonic() - started >= 0.9  # the server's Retry-After, not the 1 ms back-off


def test_maxlag_retry_after_is_capped_and_gives_up(api):
    api.script.extend([(200, {"Retry-After": "3600"}, fixture("error-maxlag.json"), 0)] * 5)
    client = client_for(api, retries=2, retry_after_cap_s=0.01)
    started = time.monotonic()
    with pytest.raises(WikidataUnavailable) as err:
        client.search("ABC")
    assert err.value.code == "maxlag" and "lagged" in err.value.info
    assert len(api.requests) == 3  # 1 + retries
    assert time.monotonic() - started < 2


@pytest.mark.parametrize("status", [500, 502, 503, 429])
def test_transient_http_errors_are_retried(api, status):
    api.script.extend([(status, {}, b"<html>busy</html>", 0)] * 2)
    got = client_for(api).get(["Q1"])
    assert got["Q1"].label() == "universe"
    assert len(api.requests) == 3


def test_persistent_failure_raises_unavailable_after_all_tries(api):
    api.script.extend([(503, {}, b"Service Unavailable", 0)] * 10)
    with pytest.raises(WikidataUnavailable, match="HTTP 503") as err:
        client_for(api, retries=2).search("ABC")
    assert isinstance(err.value, WikidataError)
    assert len(api.requests) == 3


@pytest.mark.parametrize(
    "answer, code", [("error-badtoken.json", "badtoken"), ("error-spam-filter.json", "failed-save")]
)
def test_api_errors_are_not_retried(api, answer, code):
    api.script.append((200, {}, fixture(answer), 0))
    with pytest.raises(WikidataError) as err:
        client_for(api).search("ABC")
    assert type(err.value) is WikidataError and err.value.code == code
    assert len(api.requests) == 1


def test_client_http_errors_are_not_retried(api):
    api.script.append((404, {}, b"Not Found", 0))
    with pytest.raises(WikidataError) as err:
        client_for(api).search("ABC")
    assert type(err.value) is WikidataError and err.value.code == "http-404"
    assert len(api.requests) == 1


def test_timeout_is_retried(api):
    api.script.append((200, {}, fixture("wbsearchentities-abc.json"), 1.0))
    started = time.monotonic()
    hits = client_for(api, timeout_s=0.2).search("ABC")
    assert len(hits) == 7 and len(api.requests) == 2
    assert time.monotonic() - started < 1.0  # did not wait for the slow answer


def test_unreadable_answer_is_retried(api):
    api.script.append((200, {"Content-Type": "text/html"}, b"<html>proxy error</html>", 0))
    assert len(client_for(api).search("ABC")) == 7
    assert len(api.requests) == 2


def test_unreachable_api_raises_unavailable():
    client = WikidataClient(f"http://127.0.0.1:{free_port()}/w/api.php", user_agent=UA, retries=1, backoff_s=0.01)
    with pytest.raises(WikidataUnavailable, match="after 2 tries"):
        client.search("ABC")


# ------------------------------------------------------------------------------------------
# Client: Redis cache


def test_cache_answers_repeat_lookups_without_http(api, redis_client):
    prefix = f"test:{uuid.uuid4().hex}:"
    client = client_for(api, cache=redis_client, cache_ttl_s=120, cache_prefix=prefix)
    first = client.search("ABC")
    assert client.search("  abc ") == first  # same normalized query
    assert len(api.requests) == 1
    key = f"{prefix}search:en:7:abc"
    assert 0 < redis_client.ttl(key) <= 120
    assert json.loads(redis_client.get(key))[0]["id"] == "Q169889"

    got = client.get(["Q42", "Q6", "Q32063953"])
    again = client.get(["Q32063953", "Q6", "Q42"])
    assert len(api.requests) == 2
    assert again == got and again["Q6"] is None and again["Q32063953"].id == "Q1040"
    assert redis_client.get(f"{prefix}entity:en:Q6") == b"null"  # missing ids are cached too
    assert 0 < redis_client.ttl(f"{prefix}entity:en:Q42") <= 120

    # a partly cached batch asks the API only for the rest
    client.get(["Q42", "Q1"])
    assert api.params()["ids"] == "Q1"


def test_cache_ttl_zero_disables_caching(api, redis_client):
    prefix = f"test:{uuid.uuid4().hex}:"
    client = client_for(api, cache=redis_client, cache_ttl_s=0, cache_prefix=prefix)
    client.search("ABC")
    client.search("ABC")
    assert len(api.requests) == 2
    assert redis_client.keys(f"{prefix}*") == []


def test_broken_cache_does_not_break_lookups(api, caplog):
    # nothing listens there; no redis-py retries, so that the test stays fast
    down = redis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.2, retry=Retry(NoBackoff(), 0))
    client = client_for(api, cache=down)
    with caplog.at_level(logging.WARNING, logger="draftmesh.factcheck.wikidata"):
        assert len(client.search("ABC")) == 7
        assert client.get(["Q1"])["Q1"].label() == "universe"
    assert len(api.requests) == 2
    warnings = [r for r in caplog.records if "cache" in r.getMessage()]
    assert len(warnings) == 1  # then the cache is left alone for cache_pause_s, not retried per lookup


def test_garbage_in_the_cache_is_a_miss(api, redis_client):
    prefix = f"test:{uuid.uuid4().hex}:"
    redis_client.set(f"{prefix}entity:en:Q1", b"{not json")
    redis_client.set(f"{prefix}search:en:7:abc", b'[{"unexpected": 1}]')
    client = client_for(api, cache=redis_client, cache_prefix=prefix)
    assert client.get(["Q1"])["Q1"].label() == "universe"
    assert len(client.search("ABC")) == 7
    assert len(api.requests) == 2
    assert json.loads(redis_client.get(f"{prefix}entity:en:Q1"))["id"] == "Q1"  # refreshed


# ------------------------------------------------------------------------------------------
# Entity model


def test_entity_skips_deprecated_statements_and_reads_huge_negative_years():
    universe = Entity.from_json(fixture("wbgetentities-Q1.json")["entities"]["Q1"])
    assert [st["rank"] for st in universe.claims["P361"]] == ["deprecated"]
    assert universe.items("P361") == []
    (start,) = universe.times("P580")  # -13798000000-00-00, precision 3
    assert (start.year, start.month, start.day, start.precision) == (-13798000000, 0, 0, 3)
    assert str(start) == "-13798000000"


def test_entity_quantities_put_the_preferred_statement_first():
    raw = fixture("wbgetentities-Q32063953.json")["entities"]["Q32063953"]
    karlsruhe = Entity.from_json(raw)
    preferred = [st for st in raw["claims"]["P1082"] if st["rank"] == "preferred"]
    population = karlsruhe.quantities("P1082")
    assert len(population) == len(raw["claims"]["P1082"])
    assert population[0] == (Decimal(preferred[0]["mainsnak"]["datavalue"]["value"]["amount"]), "1")
    height = Entity.from_json(json.loads(ENTITY_Q42.read_text(encoding="utf-8"))).quantities("P2048")
    assert height == [(Decimal("1.96"), "Q11573")]  # metre


def test_entity_ignores_novalue_and_somevalue():
    def statement(snaktype):
        return {"mainsnak": {"snaktype": snaktype, "property": "P570"}, "rank": "normal"}

    entity = Entity.from_json({"id": "Q1", "claims": {"P570": [statement("novalue"), statement("somevalue")]}})
    assert entity.times("P570") == [] and entity.label() == ""


def test_wikidata_time_precisions():
    assert str(WikidataTime.parse({"time": "+1952-00-00T00:00:00Z", "precision": 9})) == "1952"
    assert str(WikidataTime.parse({"time": "+1952-03-00T00:00:00Z", "precision": 10})) == "1952-03"
    ides = WikidataTime.parse(
        {"time": "-0044-03-15T00:00:00Z", "precision": 11, "calendarmodel": "http://www.wikidata.org/entity/Q1985786"}
    )
    assert (ides.year, str(ides), ides.is_julian) == (-44, "-0044-03-15", True)
    with pytest.raises(ValueError, match="not a Wikidata time"):
        WikidataTime.parse({"time": "1952-03-11", "precision": 11})


def test_entity_from_json_rejects_missing_and_idless():
    with pytest.raises(ValueError, match="missing"):
        Entity.from_json({"id": "Q6", "missing": ""})
    with pytest.raises(ValueError, match="no id"):
        Entity.from_json({"labels": {}})


# ------------------------------------------------------------------------------------------
# Offline store


def dump_lines() -> list[str]:
    with gzip.open(SAMPLE_DUMP, "rt", encoding="utf-8") as fh:
        return fh.read().splitlines()


@pytest.fixture
def plain_dump(tmp_path) -> Path:
    """Wikidata-Toolkit's mock-dump-for-long-testing.json: the sample dump, uncompressed."""
    path = tmp_path / "mock-dump-for-long-testing.json"
    path.write_bytes(gzip.decompress(SAMPLE_DUMP.read_bytes()))
    return path


def test_store_reads_the_gzipped_and_the_plain_dump(plain_dump, tmp_path):
    gz = OfflineEntityStore.from_dump(SAMPLE_DUMP)
    assert isinstance(gz, EntityLookup)
    assert len(gz) == 101 and gz.skipped == 0  # 55 items and 46 properties
    assert sum(eid.startswith("Q") for eid in gz._blobs) == 55
    plain = OfflineEntityStore.from_dump([plain_dump])
    assert len(plain) == 101
    ids = ["Q1", "Q8", "P19", "Q42", "Q298"]
    assert plain.get(ids) == gz.get(ids)
    assert gz.get(["Q42"])["Q42"].instance_of() == frozenset({"Q5"})
    assert gz.get(["Q8"])["Q8"].instance_of() == frozenset({"Q331769", "Q9415"})
    assert gz.get(["Q404"]) == {"Q404": None}

    # the same entities as JSON lines (no array brackets, no trailing commas)
    jsonl = tmp_path / "dump.jsonl"
    jsonl.write_text("\n".join(line.rstrip(",") for line in dump_lines() if line not in ("[", "]")) + "\n")
    assert OfflineEntityStore.from_dump([jsonl]).get(ids) == gz.get(ids)


def test_store_search_by_label_and_alias():
    store = OfflineEntityStore.from_dump([ENTITY_Q42])
    assert len(store) == 1
    (hit,) = store.search("Douglas Adams")
    assert hit == SearchHit("Q42", "Douglas Adams", "author and humorist", "Douglas Adams")
    assert store.search("  douglas   ADAMS ") == [hit]  # normalized
    assert store.search("douglas noël adams") == [SearchHit("Q42", "Douglas Adams", "author and humorist", "Douglas Noël Adams")]
    assert store.search("Douglas N. Adams")[0].match_text == "Douglas N. Adams"
    assert store.search("Douglas") == []  # exact names only, no prefix search
    with pytest.raises(ValueError, match="not loaded"):
        store.search("Douglas Adams", language="de")


def test_store_keeps_only_the_configured_languages_and_properties():
    raw = json.loads(ENTITY_Q42.read_text(encoding="utf-8"))
    q42 = OfflineEntityStore.from_dump([ENTITY_Q42]).get(["Q42"])["Q42"]
    assert set(q42.labels) == {"en"} and set(q42.descriptions) == {"en"}
    assert set(q42.claims) == set(raw["claims"]) & DEFAULT_PROPERTIES == {"P31", "P569", "P570"}
    assert q42.times("P569") == [WikidataTime(1952, 3, 11, 11)]
    assert "references" not in q42.claims["P31"][0]

    narrow = OfflineEntityStore.from_dump([ENTITY_Q42], languages=("en", "de"), properties={"P31"})
    q42 = narrow.get(["Q42"])["Q42"]
    assert set(q42.claims) == {"P31"} and set(q42.labels) == {"en", "de"}
    assert narrow.search("Douglas Adams", language="de")[0].id == "Q42"
    with pytest.raises(ValueError, match="property ids"):
        OfflineEntityStore(properties={"instance of"})


def test_store_later_file_replaces_an_entity():
    # the dump's Q42 (2015) has no labels; entity-Q42.json has them
    store = OfflineEntityStore.from_dump([SAMPLE_DUMP, ENTITY_Q42])
    assert len(store) == 101 and store.search("Douglas Adams")[0].id == "Q42"
    store = OfflineEntityStore.from_dump([ENTITY_Q42, SAMPLE_DUMP])
    assert len(store) == 101 and store.search("Douglas Adams") == []  # the index follows


def test_store_ranks_label_matches_before_alias_matches(tmp_path):
    # hand-made entities: the recorded data has no name shared by two entities
    def entity(eid, label, aliases=()):
        return {
            "type": "item",
            "id": eid,
            "labels": {"en": {"language": "en", "value": label}},
            "aliases": {"en": [{"language": "en", "value": a} for a in aliases]},
            "claims": {},
        }

    path = tmp_path / "names.jsonl"
    path.write_text("\n".join(json.dumps(e) for e in (entity("Q900001", "Quicksilver", ["Mercury"]), entity("Q900002", "Mercury"))))
    store = OfflineEntityStore.from_dump([path])
    assert [h.id for h in store.search("mercury")] == ["Q900002", "Q900001"]
    assert [h.match_text for h in store.search("mercury")] == ["Mercury", "Mercury"]
    assert [h.id for h in store.search("mercury", limit=1)] == ["Q900002"]


def test_store_skips_malformed_lines(tmp_path, caplog):
    lines = dump_lines()
    lines[5] = '{"type":"item","id":"Q24","claims":'  # cut off
    lines[7] = "not json at all,"
    lines[9] = '{"type":"item","labels":{}},'  # no id
    path = tmp_path / "damaged.json"
    path.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING, logger="draftmesh.factcheck.wikidata"):
        store = OfflineEntityStore.from_dump([path])
    assert len(store) == 98 and store.skipped == 3
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert f"{path}:6: skipped" in messages and "skipped 3 malformed" in messages


def test_store_needs_files():
    with pytest.raises(ValueError, match="at least one dump file"):
        OfflineEntityStore.from_dump([])
    with pytest.raises(FileNotFoundError):
        OfflineEntityStore.from_dump(["no-such-dump.json"])
