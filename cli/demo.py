"""`draftmesh demo`: one grounded request, streamed, then plain vs speculative side by side."""

from __future__ import annotations

import statistics
import sys
import time

from draftmesh.config import DraftmeshConfig
from draftmesh.io_struct import GenerationRequest
from draftmesh.prompts import encode_messages
from draftmesh.verify.engine import build_decoder, decoder_from_config, load_target

DEMO_CODE = '''def parse_line(line):
    parts = line.strip().split(",")
    name = parts[0]
    score = int(parts[1])
    return {"name": name, "score": score}


def load_scores(path):
    scores = []
    with open(path) as handle:
        for line in handle:
            scores.append(parse_line(line))
    return scores
'''

DEMO_MESSAGES = [
    {
        "role": "user",
        "content": "In this code, rename the variable scores to results. Return the whole code."
        "\n\n```python\n" + DEMO_CODE + "```",
    }
]


def run_demo(cfg: DraftmeshConfig, repeats: int = 3, max_new_tokens: int = 160, out=sys.stdout) -> dict:
    t0 = time.perf_counter()
    target = load_target(cfg.engine)
    print(f"loaded {cfg.engine.model} in {time.perf_counter() - t0:.1f}s", file=out)
    curve = target.measure_cost_curve()
    print("verify cost curve (forward of k tokens / 1 token): "
          + ", ".join(f"{k}:{v:.2f}" for k, v in curve.items()), file=out)

    def fresh_speculative():
        """A decoder with no memory of earlier requests, so the figure is the prompt's own."""
        return decoder_from_config(target, cfg)

    plain = build_decoder(target, [])
    prompt = encode_messages(target.tokenizer, DEMO_MESSAGES)
    req = GenerationRequest(tuple(prompt), max_new_tokens=max_new_tokens)

    print("\n--- prompt ---\n" + DEMO_MESSAGES[0]["content"] + "\n--- speculative generation (streamed) ---", file=out)
    for event in fresh_speculative().stream(req):
        if hasattr(event, "record"):
            out.write(event.text)
            out.flush()
    print("\n---", file=out)

    times: dict[str, list[float]] = {"plain": [], "speculative": []}
    results = {}
    for _ in range(repeats):  # interleaved so noise hits both alike
        for name, decoder in (("plain", plain), ("speculative", fresh_speculative())):
            res = decoder.generate(req)
            times[name].append(res.seconds)
            results[name] = res
    p, s = results["plain"], results["speculative"]
    tps = {k: len(results[k].token_ids) / statistics.median(v) for k, v in times.items()}
    identical = p.token_ids == s.token_ids
    remembered = fresh_speculative()
    remembered.generate(req)
    again = remembered.generate(req)  # the same question again: the answer store drafts it
    summary = {
        "plain_tokens_per_s": tps["plain"],
        "speculative_tokens_per_s": tps["speculative"],
        "speedup": tps["speculative"] / tps["plain"],
        "mean_accepted_per_step": s.mean_accepted_per_step,
        "identical": identical,
        "new_tokens": len(p.token_ids),
        "repeat_tokens_per_s": again.tokens_per_s,
        "repeat_identical": again.token_ids == p.token_ids,
    }
    print(f"plain greedy:       {tps['plain']:6.1f} tok/s  ({len(p.token_ids)} tokens, {len(p.steps)} forwards)", file=out)
    print(f"speculative greedy: {tps['speculative']:6.1f} tok/s  ({len(s.token_ids)} tokens, {len(s.steps)} forwards)", file=out)
    print(f"speedup {summary['speedup']:.2f}x, mean accepted tokens per step {s.mean_accepted_per_step:.2f}, "
          f"outputs identical: {'yes' if identical else 'NO (see README: near-tie argmax flips)'}", file=out)
    print(f"(median of {repeats} interleaved runs, {cfg.engine.threads or 'default'} threads, sources: "
          f"{', '.join(src.name for src in remembered.sources)}; each speculative run starts with no memory)", file=out)
    print(f"asked again, the answer store drafts the earlier answer: {again.tokens_per_s:.1f} tok/s, "
          f"{again.mean_accepted_per_step:.2f} tokens per step, identical: "
          f"{'yes' if summary['repeat_identical'] else 'NO'} (one run)", file=out)
    return summary
