"""The proto side of results: a decode step as a ``GenerateDelta``, the end as a ``GenerateResult``."""

from __future__ import annotations

from draftmesh.io_struct import FactCheckReport, ServedResult, StepEvent
from draftmesh.v1 import generation_pb2


def step_to_proto(step_index: int, event: StepEvent) -> generation_pb2.GenerateResponse:
    """One streamed delta: its steps' text and tokens with their StepStats (``step_index``: the last step's)."""
    rec = event.record
    stats = generation_pb2.StepStats(
        step=step_index,
        steps=event.steps,
        tree_nodes=rec.tree_size,
        accepted=rec.accepted,
        emitted=rec.emitted,
        draft_ms=rec.draft_s * 1000.0,
        verify_ms=rec.verify_s * 1000.0,
        accepted_by_source={name: int(n) for name, n in rec.accepted_by_source.items()},
        failed_sources=list(rec.failed_sources),
    )
    delta = generation_pb2.GenerateDelta(text=event.text, token_ids=list(event.token_ids), stats=stats)
    return generation_pb2.GenerateResponse(delta=delta)


def result_to_proto(served: ServedResult, request_id: str) -> generation_pb2.GenerateResult:
    """The final result: text, usage, per-source stats (sorted by name), the policy verdict, the
    replica that served it and the output's fact-check."""
    result = served.result
    usage = generation_pb2.Usage(
        prompt_tokens=result.prompt_tokens,
        completion_tokens=len(result.token_ids),
        cached_prompt_tokens=result.reused_tokens,
        steps=len(result.steps),
    )
    sources = [
        generation_pb2.SourceStats(
            source=name,
            nodes=int(stats.get("nodes", 0)),
            accepted_tokens=int(stats.get("accepted", 0)),
            acceptance=float(stats.get("acceptance", 0.0)),
            failed_steps=int(stats.get("failed_steps", 0)),
        )
        for name, stats in sorted(result.source_stats().items())
    ]
    return generation_pb2.GenerateResult(
        request_id=request_id,
        text=result.text,
        token_ids=list(result.token_ids),
        finish_reason=result.finish_reason,
        usage=usage,
        sources=sources,
        mean_accepted_per_step=result.mean_accepted_per_step,
        policy=result.policy,
        lossless=result.lossless,
        lenient_tokens=result.lenient_tokens,
        seconds=result.seconds,
        first_token_ms=result.first_token_s * 1000.0,
        replica=served.replica,
        factcheck=report_to_proto(served.factcheck_report) if served.factcheck_report is not None else None,
    )


def report_to_proto(report: FactCheckReport) -> generation_pb2.FactCheckReport:
    """A fact-check report with its findings as ``Annotation`` messages."""
    return generation_pb2.FactCheckReport(
        status=report.status,
        annotation_id=report.annotation_id,
        annotations=[
            generation_pb2.Annotation(
                check=f.check, start=f.start, end=f.end, text=f.text, verdict=f.verdict, flagged=f.flagged,
                label=f.label, rule=f.rule, entity_id=f.entity_id, evidence=f.evidence,
            )
            for f in report.findings
        ],
        error=report.error,
        drafts_submitted=report.drafts_submitted,
        drafts_skipped=report.drafts_skipped,
        flagged_steps=report.flagged_steps,
    )
