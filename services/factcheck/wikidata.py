"""Wikidata entities for the entity checks: one lookup interface, a live client and an offline store.

``EntityLookup`` is all a check needs: ``search`` a name, ``get`` entities by id. Two
implementations share it:

- ``WikidataClient`` calls the Wikidata API (``wbsearchentities``, ``wbgetentities``) with the
  stdlib only, retries what is transient (maxlag, 5xx, 429, timeouts, dropped connections),
  fails fast on real API errors, and caches answers in Redis;
- ``OfflineEntityStore`` reads dump-format JSON files into memory, for air-gapped workers and
  tests: exact label/alias matches only, and only the properties the checks read.

Entities are parsed into ``Entity``, which keeps the claims raw (the API's JSON shape) and
offers the few typed views the checks need (``instance_of``, ``times``, ``quantities``).
"""

from __future__ import annotations

import gzip
import http.client
import json
import logging
import random
import re
import sys
import time
import unicodedata
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import IO, Any, Iterable, Iterator, Mapping, Protocol, Sequence, runtime_checkable

import redis

log = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_API_URL",
    "DEFAULT_PROPERTIES",
    "DEFAULT_USER_AGENT",
    "Entity",
    "EntityLookup",
    "OfflineEntityStore",
    "SearchHit",
    "WikidataClient",
    "WikidataError",
    "WikidataTime",
    "WikidataUnavailable",
    "normalize_name",
]

DEFAULT_API_URL = "https://www.wikidata.org/w/api.php"
MAX_IDS_PER_CALL = 50
"""wbgetentities refuses more ids per call (for clients without the apihighlimits right)."""
MAX_SEARCH_LIMIT = 50

GREGORIAN = "Q1985727"
JULIAN = "Q1985786"

DEFAULT_PROPERTIES: frozenset[str] = frozenset({
    # types
    "P31",  # instance of
    "P279",  # subclass of
    # dates
    "P569",  # date of birth
    "P570",  # date of death
    "P571",  # inception (founded, established, formed)
    "P576",  # dissolved, abolished or demolished
    "P577",  # publication date (released, published)
    "P580",  # start time
    "P582",  # end time
    "P585",  # point in time
    # quantities
    "P1082",  # population
    "P1128",  # employees
    "P2044",  # elevation above sea level
    "P2046",  # area
})
"""Properties ``OfflineEntityStore`` keeps by default: what the entity checks compare (types,
the dates of the date rules) plus a few figures numeric checks may use. Everything else in a
dump is dropped at load time so that the store stays small."""


def _default_user_agent() -> str:
    try:
        from importlib.metadata import version

        ours = version("draftmesh")
    except Exception:  # not installed as a distribution: still identify the software
        ours = "0"
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    return f"draftmesh-factcheck/{ours} (draftmesh fact-check service; no operator contact configured) Python-urllib/{py}"


DEFAULT_USER_AGENT = _default_user_agent()
"""Wikimedia's User-Agent policy asks for name/version plus a way to reach the operator: a
deployment talking to wikidata.org should pass its own ``user_agent`` with a contact URL."""


class WikidataError(Exception):
    """An error answer of the Wikidata API (``{"error": {"code", "info"}}``) or an unusable reply."""

    def __init__(self, code: str, info: str = "") -> None:
        super().__init__(f"{code}: {info}" if info else code)
        self.code = code
        self.info = info


class WikidataUnavailable(WikidataError):
    """The API could not be reached or kept failing transiently (after all retries)."""


# ---------------------------------------------------------------------------------------------
# Entities


_TIME_RE = re.compile(r"^([+-])(\d+)-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})Z$")
_ENTITY_PREFIX = {"item": "Q", "property": "P", "lexeme": "L"}
_ID_RE = re.compile(r"^(?:[QPLM][1-9]\d*|L[1-9]\d*-[FS][1-9]\d*)$")


@dataclass(frozen=True)
class WikidataTime:
    """A Wikidata time value: ``+1952-03-11T00:00:00Z`` at a precision (9 year, 10 month, 11 day).

    Months and days below the precision are 0 (``+1952-00-00T00:00:00Z`` at 9); years may be
    negative (BCE) or huge (``-13798000000`` at precision 3, the age of the universe)."""

    year: int
    month: int
    day: int
    precision: int
    calendar: str = GREGORIAN
    """Calendar model id: Q1985727 (proleptic Gregorian) or Q1985786 (proleptic Julian)."""

    @classmethod
    def parse(cls, value: Mapping[str, Any]) -> "WikidataTime":
        """From a datavalue's value (``{"time", "precision", "calendarmodel", ...}``)."""
        raw = value.get("time")
        m = _TIME_RE.match(raw) if isinstance(raw, str) else None
        if m is None:
            raise ValueError(f"not a Wikidata time value: {raw!r}")
        sign, year, month, day = m.group(1), int(m.group(2)), int(m.group(3)), int(m.group(4))
        if month > 12 or day > 31:
            raise ValueError(f"month or day out of range in Wikidata time {raw!r}")
        precision = value.get("precision", 11)
        if not isinstance(precision, int) or not 0 <= precision <= 14:
            raise ValueError(f"bad precision {precision!r} in Wikidata time {raw!r}")
        calendar = str(value.get("calendarmodel") or GREGORIAN).rsplit("/", 1)[-1]
        return cls(-year if sign == "-" else year, month, day, precision, calendar)

    @property
    def is_julian(self) -> bool:
        return self.calendar == JULIAN

    def __str__(self) -> str:
        year = f"{'-' if self.year < 0 else ''}{abs(self.year):04d}"
        if self.precision >= 11 and self.month and self.day:
            return f"{year}-{self.month:02d}-{self.day:02d}"
        if self.precision >= 10 and self.month:
            return f"{year}-{self.month:02d}"
        return year


def _as_dict(value: Any) -> dict:
    """Old dumps write an empty object as ``[]`` (PHP arrays): read both as a dict."""
    return value if isinstance(value, dict) else {}


def _entity_id_of(value: Mapping[str, Any]) -> str | None:
    """The id of a ``wikibase-entityid`` value; dumps before 2015 have only ``numeric-id``."""
    if isinstance(value.get("id"), str):
        return value["id"]
    prefix = _ENTITY_PREFIX.get(value.get("entity-type", "item"))
    numeric = value.get("numeric-id")
    return f"{prefix}{numeric}" if prefix and isinstance(numeric, int) else None


@dataclass(frozen=True)
class Entity:
    """One Wikidata entity: terms by language and the raw claims (treat them as read-only)."""

    id: str
    labels: dict[str, str] = field(default_factory=dict)
    descriptions: dict[str, str] = field(default_factory=dict)
    aliases: dict[str, list[str]] = field(default_factory=dict)
    claims: dict[str, list[dict]] = field(default_factory=dict)
    """As in the API: {property id: [statement {mainsnak, rank, qualifiers?, ...}]}."""
    type: str = "item"

    __hash__ = None  # dict fields: equality yes, hashing no

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Entity":
        """From the entity JSON of wbgetentities and of the dumps (``labels`` as {lang: {language, value}})."""
        if not isinstance(data, Mapping):
            raise ValueError(f"entity JSON must be an object, got {type(data).__name__}")
        eid = data.get("id")
        if not isinstance(eid, str) or not eid:
            raise ValueError("entity JSON has no id")
        if "missing" in data:
            raise ValueError(f"entity {eid} is missing (no such entity)")
        labels = {lang: v["value"] for lang, v in _as_dict(data.get("labels")).items() if isinstance(v, dict) and "value" in v}
        descriptions = {lang: v["value"] for lang, v in _as_dict(data.get("descriptions")).items() if isinstance(v, dict) and "value" in v}
        aliases = {
            lang: [a["value"] for a in vs if isinstance(a, dict) and "value" in a]
            for lang, vs in _as_dict(data.get("aliases")).items()
            if isinstance(vs, list)
        }
        # mediainfo entities (Commons) call their claims "statements"
        claims = _as_dict(data.get("claims") if "claims" in data else data.get("statements"))
        claims = {pid: sts for pid, sts in claims.items() if isinstance(sts, list)}
        return cls(eid, labels, descriptions, aliases, claims, str(data.get("type") or "item"))

    def label(self, lang: str = "en") -> str:
        """The label in ``lang``, or "" if the entity has none there."""
        return self.labels.get(lang, "")

    def description(self, lang: str = "en") -> str:
        return self.descriptions.get(lang, "")

    def _values(self, pid: str, value_type: str) -> Iterator[Any]:
        """Values of the statements on ``pid``: preferred rank first, deprecated ones and
        novalue/somevalue snaks skipped (they say nothing checkable)."""
        statements = [st for st in self.claims.get(pid, ()) if isinstance(st, dict) and st.get("rank") != "deprecated"]
        statements.sort(key=lambda st: st.get("rank") != "preferred")
        for st in statements:
            snak = st.get("mainsnak")
            if not isinstance(snak, dict) or snak.get("snaktype", "value") != "value":
                continue
            datavalue = snak.get("datavalue")
            if isinstance(datavalue, dict) and datavalue.get("type") == value_type and isinstance(datavalue.get("value"), dict):
                yield datavalue["value"]

    def items(self, pid: str) -> list[str]:
        """Entity ids that ``pid`` points to (e.g. P31 -> ["Q5"])."""
        out = []
        for value in self._values(pid, "wikibase-entityid"):
            eid = _entity_id_of(value)
            if eid and eid not in out:
                out.append(eid)
        return out

    def instance_of(self) -> frozenset[str]:
        """The P31 (instance of) item ids."""
        return frozenset(self.items("P31"))

    def times(self, pid: str) -> list[WikidataTime]:
        """Time values of ``pid`` (e.g. P569 date of birth); malformed values are skipped."""
        out = []
        for value in self._values(pid, "time"):
            try:
                out.append(WikidataTime.parse(value))
            except ValueError as exc:
                log.debug("entity %s %s: %s", self.id, pid, exc)
        return out

    def quantities(self, pid: str) -> list[tuple[Decimal, str]]:
        """(amount, unit) of ``pid``; unit is "1" for plain numbers, else the unit's item id."""
        out = []
        for value in self._values(pid, "quantity"):
            try:
                amount = Decimal(str(value.get("amount")))
            except InvalidOperation:
                log.debug("entity %s %s: bad amount %r", self.id, pid, value.get("amount"))
                continue
            unit = str(value.get("unit") or "1")
            out.append((amount, unit.rsplit("/", 1)[-1] if "/entity/" in unit else unit))
        return out


@dataclass(frozen=True)
class SearchHit:
    """One search result: the entity id, its label and description, and the text that matched."""

    id: str
    label: str
    description: str
    match_text: str
    """The label or alias that matched the query (the API searches by prefix)."""


@runtime_checkable
class EntityLookup(Protocol):
    """What the entity checks need from Wikidata, live or offline."""

    def search(self, name: str, language: str = "en", limit: int = 7) -> list[SearchHit]:
        """Entities whose label or alias matches ``name``, best first."""
        ...

    def get(self, ids: Sequence[str], language: str = "en") -> dict[str, Entity | None]:
        """Entities by id (None for a missing id); a redirected id maps to its target entity."""
        ...


def normalize_name(text: str) -> str:
    """The form names are matched in: NFKC, casefolded, whitespace collapsed."""
    return " ".join(unicodedata.normalize("NFKC", text).casefold().split())


def _check_ids(ids: Sequence[str] | str) -> list[str]:
    if isinstance(ids, str):
        raise ValueError("ids must be a sequence of ids, not one string (use [id])")
    unique = list(dict.fromkeys(ids))
    bad = [i for i in unique if not isinstance(i, str) or not _ID_RE.match(i)]
    if bad:
        raise ValueError(f"not Wikidata entity ids: {', '.join(map(repr, bad[:5]))} (expected e.g. Q42, P31)")
    return unique


def _check_language(language: str) -> None:
    if not isinstance(language, str) or not re.fullmatch(r"[a-z]{2,3}(?:-[a-z0-9-]+)?", language):
        raise ValueError(f"language must be a Wikimedia language code like 'en', got {language!r}")


def _slim_statement(statement: Any, *, qualifiers: bool) -> dict | None:
    """A statement without what no check reads (references, statement ids, snak hashes)."""
    if not isinstance(statement, dict) or not isinstance(statement.get("mainsnak"), dict):
        return None
    snak = statement["mainsnak"]
    out: dict[str, Any] = {
        "mainsnak": {k: snak[k] for k in ("snaktype", "property", "datavalue") if k in snak},
        "rank": statement.get("rank", "normal"),
    }
    if qualifiers and statement.get("qualifiers"):
        out["qualifiers"] = statement["qualifiers"]
    return out


def _slim_entity(
    data: Mapping[str, Any],
    languages: Iterable[str] | None = None,
    properties: frozenset[str] | None = None,
    *,
    qualifiers: bool = True,
) -> dict:
    """The entity JSON cut down to terms in ``languages`` and claims on ``properties`` (None: all)."""
    langs = None if languages is None else set(languages)

    def terms(key: str) -> dict:
        return {lang: v for lang, v in _as_dict(data.get(key)).items() if langs is None or lang in langs}

    claims = _as_dict(data.get("claims") if "claims" in data else data.get("statements"))
    slim_claims = {}
    for pid, statements in claims.items():
        if (properties is not None and pid not in properties) or not isinstance(statements, list):
            continue
        kept = [s for s in (_slim_statement(st, qualifiers=qualifiers) for st in statements) if s is not None]
        if kept:
            slim_claims[pid] = kept
    return {
        "id": data.get("id"),
        "type": data.get("type", "item"),
        "labels": terms("labels"),
        "descriptions": terms("descriptions"),
        "aliases": terms("aliases"),
        "claims": slim_claims,
    }


# ---------------------------------------------------------------------------------------------
# Live client


class _Transient(Exception):
    """A failure worth retrying; ``retry_after`` is the server's hint in seconds, if any."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


def _retry_after(value: str | None) -> float | None:
    """Retry-After in seconds: an integer per RFC 9110 (a fraction is accepted, dates are not)."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if seconds >= 0 else None


# Failures of the cache that must not fail a lookup: Redis down or timing out, garbage stored.
_CACHE_ERRORS = (redis.RedisError, OSError, ValueError, TypeError)


class WikidataClient:
    """The Wikidata API over HTTP (stdlib urllib), with retries and an optional Redis cache.

    Retry policy: a ``maxlag`` error waits the server's Retry-After (capped at
    ``retry_after_cap_s``); HTTP 5xx/429, timeouts, refused or dropped connections and
    non-JSON bodies back off exponentially with jitter (``backoff_s * 2**n``, scaled by a
    random factor in [0.5, 1]). ``retries`` is the number of retries, so a call makes at most
    ``1 + retries`` requests before ``WikidataUnavailable``. Any other API error (badtoken,
    no-such-entity, a spam filter hit) is not transient: ``WikidataError`` at once.
    ``timeout_s`` bounds the connect and each socket read, not a whole call.

    Cache: search results per (language, limit, normalized query) and entities per
    (language, id), missing ids included, as JSON with a TTL of ``cache_ttl_s`` (0: no
    caching). A failing cache is logged and bypassed, never fatal; after a failure it is left
    alone for ``cache_pause_s`` so that an outage (and redis-py's own retries) does not slow
    every lookup."""

    def __init__(
        self,
        api_url: str = DEFAULT_API_URL,
        *,
        user_agent: str = DEFAULT_USER_AGENT,
        timeout_s: float = 5.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        maxlag: int | None = 5,
        cache: "redis.Redis | None" = None,
        cache_ttl_s: int = 86400,
        cache_prefix: str = "draftmesh:wikidata:",
        retry_after_cap_s: float = 10.0,
        cache_pause_s: float = 30.0,
    ) -> None:
        if not isinstance(api_url, str) or urllib.parse.urlsplit(api_url).scheme not in ("http", "https"):
            raise ValueError(f"api_url must be an http(s) URL, got {api_url!r}")
        if not user_agent or not user_agent.strip():
            raise ValueError("user_agent must not be empty (Wikimedia blocks anonymous clients)")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        if backoff_s < 0 or retry_after_cap_s < 0 or cache_pause_s < 0:
            raise ValueError(
                f"backoff_s, retry_after_cap_s and cache_pause_s must be >= 0, got {backoff_s}, {retry_after_cap_s}, {cache_pause_s}"
            )
        if maxlag is not None and maxlag < 0:
            raise ValueError(f"maxlag must be >= 0 or None, got {maxlag}")
        if cache_ttl_s < 0:
            raise ValueError(f"cache_ttl_s must be >= 0, got {cache_ttl_s}")
        self.api_url = api_url
        self.user_agent = user_agent
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.maxlag = maxlag
        self.cache = cache
        self.cache_ttl_s = cache_ttl_s
        self.cache_prefix = cache_prefix
        self.retry_after_cap_s = retry_after_cap_s
        self.cache_pause_s = cache_pause_s
        self._cache_down_until = 0.0
        if user_agent == DEFAULT_USER_AGENT and urllib.parse.urlsplit(api_url).hostname == "www.wikidata.org":
            log.warning("calling wikidata.org with the default User-Agent: pass user_agent with a contact URL (Wikimedia policy)")

    # -- public API

    def search(self, name: str, language: str = "en", limit: int = 7) -> list[SearchHit]:
        """wbsearchentities: items whose label or alias starts with ``name`` (the API's ranking)."""
        _check_language(language)
        if not 1 <= limit <= MAX_SEARCH_LIMIT:
            raise ValueError(f"limit must be in 1..{MAX_SEARCH_LIMIT}, got {limit}")
        query = " ".join(name.split())
        if not query:
            return []
        key = f"{self.cache_prefix}search:{language}:{limit}:{normalize_name(query)}"
        cached = self._cache_get([key])[0]
        if cached is not None:
            try:
                return [SearchHit(**hit) for hit in cached]
            except TypeError as exc:
                log.warning("wikidata cache: unusable search hits at %s: %s", key, exc)
        data = self._call({
            "action": "wbsearchentities",
            "search": query,
            "language": language,
            "uselang": language,
            "type": "item",
            "limit": str(limit),
        })
        raw_hits = data.get("search")
        if not isinstance(raw_hits, list):
            raise WikidataError("badresponse", "wbsearchentities answer has no search list")
        hits = []
        for raw in raw_hits:
            if not isinstance(raw, dict) or not isinstance(raw.get("id"), str):
                continue
            match = raw.get("match") if isinstance(raw.get("match"), dict) else {}
            label = str(raw.get("label") or "")
            hits.append(SearchHit(raw["id"], label, str(raw.get("description") or ""), str(match.get("text") or label)))
        self._cache_set({key: [h.__dict__ for h in hits]})
        return hits

    def get(self, ids: Sequence[str], language: str = "en") -> dict[str, Entity | None]:
        """wbgetentities in batches of 50: {asked id: entity, or None if missing}.

        A redirected id (merged items) maps to the target entity, whose ``id`` differs."""
        _check_language(language)
        unique = _check_ids(ids)
        out: dict[str, Entity | None] = {}
        keys = [f"{self.cache_prefix}entity:{language}:{eid}" for eid in unique]
        todo = []
        for eid, cached in zip(unique, self._cache_get(keys, missing=_NOT_CACHED)):
            try:
                if cached is not _NOT_CACHED:
                    out[eid] = None if cached is None else Entity.from_json(cached)
                    continue
            except ValueError as exc:
                log.warning("wikidata cache: unusable entity %s: %s", eid, exc)
            todo.append(eid)
        for start in range(0, len(todo), MAX_IDS_PER_CALL):
            batch = todo[start : start + MAX_IDS_PER_CALL]
            data = self._call({
                "action": "wbgetentities",
                "ids": "|".join(batch),
                "languages": language,
                "props": "labels|descriptions|aliases|claims",
            })
            entities = data.get("entities")
            if not isinstance(entities, dict):
                raise WikidataError("badresponse", "wbgetentities answer has no entities object")
            found: dict[str, dict] = {}
            for key, raw in entities.items():
                if not isinstance(raw, dict) or "missing" in raw or not isinstance(raw.get("id"), str):
                    continue
                slim = _slim_entity(raw)
                redirect = raw.get("redirects")
                asked = redirect.get("from") if isinstance(redirect, dict) and redirect.get("from") else key
                found[asked] = slim
                found.setdefault(raw["id"], slim)
            to_cache = {}
            for eid in batch:
                raw = found.get(eid)
                out[eid] = Entity.from_json(raw) if raw is not None else None
                to_cache[f"{self.cache_prefix}entity:{language}:{eid}"] = raw
            self._cache_set(to_cache)
        return {eid: out[eid] for eid in unique}

    # -- HTTP

    def _call(self, params: Mapping[str, str]) -> dict:
        """One API call with the retry policy; returns the decoded JSON answer."""
        query = {**params, "format": "json"}
        if self.maxlag is not None:
            query["maxlag"] = str(self.maxlag)
        url = self.api_url + ("&" if "?" in self.api_url else "?") + urllib.parse.urlencode(query)
        tries = 1 + self.retries
        for attempt in range(1, tries + 1):
            try:
                data, headers = self._fetch(url)
            except _Transient as exc:
                if attempt == tries:
                    raise WikidataUnavailable("unavailable", f"{exc} (after {tries} tries)") from exc
                delay = self._backoff(attempt) if exc.retry_after is None else min(exc.retry_after, self.retry_after_cap_s)
                log.warning("wikidata %s: %s; retry %d/%d in %.2fs", params.get("action"), exc, attempt, self.retries, delay)
                time.sleep(delay)
                continue
            error = data.get("error")
            if not isinstance(error, dict):
                return data
            code, info = str(error.get("code") or "unknown"), str(error.get("info") or "")
            if code != "maxlag":
                raise WikidataError(code, info)
            if attempt == tries:
                raise WikidataUnavailable("maxlag", f"{info} (after {tries} tries)")
            hint = _retry_after(headers.get("Retry-After"))
            delay = min(hint if hint is not None else self._backoff(attempt), self.retry_after_cap_s)
            log.warning("wikidata maxlag (%s); retry %d/%d in %.2fs", info, attempt, self.retries, delay)
            time.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    def _backoff(self, attempt: int) -> float:
        return min(self.backoff_s * 2 ** (attempt - 1), 60.0) * random.uniform(0.5, 1.0)

    def _fetch(self, url: str) -> tuple[dict, Mapping[str, str]]:
        request = urllib.request.Request(
            url, headers={"User-Agent": self.user_agent, "Accept": "application/json", "Accept-Encoding": "gzip"}
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body = response.read()
                headers = response.headers
        except urllib.error.HTTPError as exc:
            with exc:
                if exc.code >= 500 or exc.code == 429:
                    raise _Transient(f"HTTP {exc.code} {exc.reason}", _retry_after(exc.headers.get("Retry-After"))) from exc
                raise WikidataError(f"http-{exc.code}", str(exc.reason)) from exc
        except (OSError, http.client.HTTPException) as exc:  # URLError, timeouts, resets, bad status lines
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            raise _Transient(f"{type(reason).__name__}: {reason}" if str(reason) else type(reason).__name__) from exc
        try:
            if headers.get("Content-Encoding", "").lower() == "gzip":
                body = gzip.decompress(body)
            data = json.loads(body)
        except (OSError, EOFError, ValueError) as exc:  # a proxy's HTML page, a truncated body
            raise _Transient(f"unreadable answer: {exc}") from exc
        if not isinstance(data, dict):
            raise _Transient("answer is not a JSON object")
        return data, headers

    # -- cache

    def _cache_usable(self) -> bool:
        return self.cache is not None and self.cache_ttl_s > 0 and time.monotonic() >= self._cache_down_until

    def _cache_get(self, keys: list[str], missing: Any = None) -> list[Any]:
        """Decoded cached values for ``keys`` (``missing`` where absent or the cache fails)."""
        if not keys or not self._cache_usable():
            return [missing] * len(keys)
        try:
            raws = self.cache.mget(keys)
        except _CACHE_ERRORS as exc:
            self._cache_failed("read", exc)
            return [missing] * len(keys)
        values = []
        for key, raw in zip(keys, raws):
            try:
                values.append(missing if raw is None else json.loads(raw))
            except ValueError as exc:  # garbage under our key: a miss, refreshed by the next set
                log.warning("wikidata cache: unreadable value at %s: %s", key, exc)
                values.append(missing)
        return values

    def _cache_set(self, values: Mapping[str, Any]) -> None:
        if not values or not self._cache_usable():
            return
        try:
            pipe = self.cache.pipeline(transaction=False)
            for key, value in values.items():
                pipe.set(key, json.dumps(value, ensure_ascii=False, separators=(",", ":")), ex=self.cache_ttl_s)
            pipe.execute()
        except _CACHE_ERRORS as exc:
            self._cache_failed("write", exc)

    def _cache_failed(self, what: str, exc: Exception) -> None:
        log.warning("wikidata cache %s failed, using the API only for %.0fs: %s", what, self.cache_pause_s, exc)
        self._cache_down_until = time.monotonic() + self.cache_pause_s


_NOT_CACHED = object()


# ---------------------------------------------------------------------------------------------
# Offline store


def _open_text(path: Path) -> IO[str]:
    """The file as text; gzip is recognized by its magic bytes, whatever the name."""
    with open(path, "rb") as fh:
        magic = fh.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _entities_in(obj: Any) -> Iterator[Any]:
    """Entity objects inside one parsed JSON value: an entity, a list of them, or a
    wbgetentities answer (``{"entities": {...}}``)."""
    if isinstance(obj, list):
        yield from obj
    elif isinstance(obj, dict) and "id" not in obj and isinstance(obj.get("entities"), dict):
        yield from obj["entities"].values()
    else:
        yield obj


class OfflineEntityStore:
    """Entities from dump-format JSON files, in memory, for workers without the API.

    Accepted files (plain or gzip): the Wikidata JSON dump (a JSON array with one entity per
    line, lines ending in ","), JSON lines (one entity per line), and a single entity object
    (``entity-Q42.json``, pretty-printed or not; such a file is parsed whole) or a saved
    wbgetentities answer (``{"entities": {...}}``). Dumps are read line by line, never loaded
    whole.

    To keep memory low only the terms in ``languages`` and the claims on ``properties``
    (default ``DEFAULT_PROPERTIES``) are kept, without references, qualifiers, deprecated
    statements or sitelinks, as compact JSON per entity; ``get`` parses on demand.
    ``search`` is an exact match of the normalized name (``normalize_name``) against labels,
    then aliases: no prefix or fuzzy search. A later file's entity replaces an earlier one
    with the same id. Malformed lines are skipped, counted in ``skipped`` and logged."""

    def __init__(self, languages: Sequence[str] = ("en",), properties: Iterable[str] | None = None) -> None:
        if isinstance(languages, str):
            languages = (languages,)
        if not languages:
            raise ValueError("languages must name at least one language, e.g. ('en',)")
        for lang in languages:
            _check_language(lang)
        self.languages: tuple[str, ...] = tuple(dict.fromkeys(languages))
        self.properties: frozenset[str] = DEFAULT_PROPERTIES if properties is None else frozenset(properties)
        bad = sorted(p for p in self.properties if not re.fullmatch(r"P[1-9]\d*", str(p)))
        if bad:
            raise ValueError(f"properties must be property ids like P31, got {', '.join(map(repr, bad))}")
        self.skipped = 0
        self._blobs: dict[str, bytes] = {}
        self._by_label: dict[tuple[str, str], list[str]] = {}
        self._by_alias: dict[tuple[str, str], list[str]] = {}

    @classmethod
    def from_dump(
        cls,
        paths: str | Path | Sequence[str | Path],
        languages: Sequence[str] = ("en",),
        properties: Iterable[str] | None = None,
    ) -> "OfflineEntityStore":
        """A store loaded from one or more dump files (see the class docstring for formats)."""
        if isinstance(paths, (str, Path)):
            paths = [paths]
        if not paths:
            raise ValueError("from_dump needs at least one dump file")
        store = cls(languages, properties)
        for path in paths:
            store.load(path)
        return store

    def load(self, path: str | Path) -> int:
        """Add the entities of one file; returns how many were added."""
        path = Path(path)
        added = skipped = 0
        for lineno, obj, error in self._read(path):
            entities = () if error else _entities_in(obj)
            for raw in entities:
                if isinstance(raw, dict) and "missing" in raw:
                    continue
                try:
                    self.add(raw)
                except ValueError as exc:
                    error = f"bad entity: {exc}"
                else:
                    added += 1
            if error:
                skipped += 1
                if skipped <= 5:
                    log.warning("%s:%d: skipped: %s", path, lineno, error)
        self.skipped += skipped
        if skipped:
            log.warning("%s: skipped %d malformed line(s), loaded %d entities", path, skipped, added)
        else:
            log.info("%s: loaded %d entities", path, added)
        return added

    @staticmethod
    def _read(path: Path) -> Iterator[tuple[int, Any, str]]:
        """(line number, parsed JSON value, error message or "") per line holding JSON."""
        with _open_text(path) as fh:
            opened_array = parsed_any = False
            for lineno, line in enumerate(fh, 1):
                text = line.strip()
                if text in ("", "[", "]"):
                    opened_array = opened_array or text == "["
                    continue
                if text == "{" and not parsed_any:
                    # a pretty-printed document (a single entity file): small by nature, parse it whole
                    whole = ("[" if opened_array else "") + text + fh.read()
                    try:
                        yield lineno, json.loads(whole), ""
                    except ValueError as exc:
                        yield lineno, None, f"not a JSON document: {exc}"
                    return
                parsed_any = True
                try:
                    yield lineno, json.loads(text[:-1] if text.endswith(",") else text), ""
                except ValueError as exc:
                    yield lineno, None, f"malformed JSON: {exc}"

    def add(self, data: Mapping[str, Any]) -> None:
        """Add (or replace) one entity given as entity JSON."""
        entity = Entity.from_json(data)  # validates
        slim = _slim_entity(data, self.languages, self.properties, qualifiers=False)
        for pid, statements in list(slim["claims"].items()):
            statements = [st for st in statements if st["rank"] != "deprecated" and st["mainsnak"].get("snaktype") == "value"]
            if statements:
                slim["claims"][pid] = statements
            else:
                del slim["claims"][pid]
        if entity.id in self._blobs:
            self._unindex(self.get([entity.id])[entity.id])
        self._blobs[entity.id] = json.dumps(slim, ensure_ascii=False, separators=(",", ":")).encode()
        self._index(Entity.from_json(slim))

    def _names(self, entity: Entity | None) -> Iterator[tuple[dict, tuple[str, str]]]:
        if entity is None:
            return
        for lang in self.languages:
            if entity.labels.get(lang):
                yield self._by_label, (lang, normalize_name(entity.labels[lang]))
            for alias in entity.aliases.get(lang, ()):
                yield self._by_alias, (lang, normalize_name(alias))

    def _index(self, entity: Entity) -> None:
        for table, key in self._names(entity):
            ids = table.setdefault(key, [])
            if entity.id not in ids:
                ids.append(entity.id)

    def _unindex(self, entity: Entity | None) -> None:
        for table, key in self._names(entity):
            ids = table.get(key, [])
            if entity.id in ids:
                ids.remove(entity.id)
            if not ids:
                table.pop(key, None)

    def __len__(self) -> int:
        return len(self._blobs)

    def __contains__(self, eid: object) -> bool:
        return eid in self._blobs

    def search(self, name: str, language: str = "en", limit: int = 7) -> list[SearchHit]:
        """Entities whose label (first) or alias (then) equals ``name`` once normalized."""
        if language not in self.languages:
            raise ValueError(f"language {language!r} was not loaded (store languages: {', '.join(self.languages)})")
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        key = (language, normalize_name(name))
        if not key[1]:
            return []
        hits: list[SearchHit] = []
        seen: set[str] = set()
        for table in (self._by_label, self._by_alias):
            for eid in table.get(key, ()):
                if eid in seen:
                    continue
                seen.add(eid)
                entity = self._entity(eid)
                matched = entity.label(language)
                if table is self._by_alias:
                    matched = next((a for a in entity.aliases.get(language, ()) if normalize_name(a) == key[1]), name)
                hits.append(SearchHit(eid, entity.label(language), entity.description(language), matched))
                if len(hits) == limit:
                    return hits
        return hits

    def get(self, ids: Sequence[str], language: str = "en") -> dict[str, Entity | None]:
        """Entities by id; None for an id not in the loaded files."""
        return {eid: self._entity(eid) if eid in self._blobs else None for eid in _check_ids(ids)}

    def _entity(self, eid: str) -> Entity:
        return Entity.from_json(json.loads(self._blobs[eid]))

