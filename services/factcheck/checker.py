"""All the checks over one text: NER once, then entity, date and numeric checks on its spans.

NER decides what the other checks look at: entity mentions go to Wikidata (when configured),
DATE mentions to the calendar check, and the numeric rules run over the whole text (their
patterns carry their own context, e.g. "basis points"). The worker builds one checker per
process (``build_annotator``) and calls it per stream entry.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Sequence

from draftmesh.config import FactCheckConfig
from draftmesh.factcheck.dates import check_dates, find_date_spans
from draftmesh.factcheck.ner import NerBackend, make_ner
from draftmesh.factcheck.numeric import NumericRule, check_numbers, load_rules
from draftmesh.io_struct import Finding

log = logging.getLogger(__name__)


class FactChecker:
    def __init__(self, ner: NerBackend, rules: Sequence[NumericRule] = (), entities: Any = None) -> None:
        self.ner = ner
        self.rules = list(rules)
        self.entities = entities
        """An ``EntityChecker`` (Wikidata), or None when entity checks are off."""

    def check(self, text: str) -> list[Finding]:
        return self.check_many([text])[0]

    def check_many(self, texts: Sequence[str]) -> list[list[Finding]]:
        """Findings per text, sorted by position (one batched NER call for all texts)."""
        out = []
        for text, mentions in zip(texts, self.ner(list(texts))):
            if not getattr(self.ner, "emits_dates", True):
                mentions = [*mentions, *find_date_spans(text)]
            findings = list(check_dates(text, mentions))
            findings += check_numbers(text, self.rules)
            if self.entities is not None:
                for mention in mentions:
                    findings += self.entities.check(text, mention, mentions)
            out.append(sorted(findings, key=lambda f: (f.start, f.end, f.check, f.rule)))
        return out


def build_checker(config: FactCheckConfig, redis: Any = None) -> FactChecker:
    """The checker a worker runs, from its config; ``redis`` caches live Wikidata answers."""
    ner = make_ner(config.ner, config.ner_model)
    rules = load_rules(config.numeric_rules)
    entities = None
    if config.wikidata != "off":
        # lazy: the entity checks (and their dump files or HTTP client) only when they are on
        from draftmesh.factcheck.entity_check import EntityChecker
        from draftmesh.factcheck.wikidata import OfflineEntityStore, WikidataClient

        if config.wikidata == "offline":
            lookup = OfflineEntityStore.from_dump(config.wikidata_dump or [])
            log.info("offline Wikidata store: %d entities from %s", len(lookup), ", ".join(config.wikidata_dump or []))
        else:
            agent = {"user_agent": config.wikidata_user_agent} if config.wikidata_user_agent else {}
            lookup = WikidataClient(config.wikidata_api, timeout_s=config.wikidata_timeout_s, cache=redis,
                                    cache_ttl_s=config.wikidata_cache_ttl_s, **agent)
        entities = EntityChecker(lookup)
    return FactChecker(ner, rules, entities)


def build_annotator(config: FactCheckConfig) -> Callable[[Any], list[Finding]]:
    """The worker's default annotator: findings of an entry's text that overlap its span."""
    redis = None
    if config.wikidata == "live" and config.redis_url:
        import redis as redis_lib

        redis = redis_lib.Redis.from_url(config.redis_url, socket_timeout=1.0)
    checker = build_checker(config, redis)
    checker.check("Warm-up: Ada Lovelace was born on 10 December 1815 in London.")  # load lazily-built parts now

    def annotate(entry) -> list[Finding]:
        findings = checker.check(entry.text)
        start, end = entry.start, entry.end or len(entry.text)
        return [f for f in findings if f.start < end and start < f.end]

    return annotate
