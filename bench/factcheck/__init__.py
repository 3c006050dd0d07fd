"""The fact-check bench, `draftmesh factcheck-bench`: how fast the fact-check service annotates, and what it costs generation.

Three measurements, each on a private ``redis-server`` (``EmbeddedRedis``) and real worker
processes (``WorkerProcesses``, in the fact-check environment's interpreter unless
``--worker-python`` says otherwise), each on a fresh stream prefix:

1. Latency per span, per NER backend: one worker, idle; spans are submitted one at a time
   and each is timed from the XADD to ``FactCheckClient.wait`` returning its annotation
   (end to end), next to the worker's own annotate time (``Annotation.latency_ms``).
   Spans: draft-like windows of 4-12 words and whole sentences of
   ``services/factcheck/data/ner_corpus.txt`` (what the verifier sends per step), and long
   outputs made of consecutive sentences (what it sends per request). Reported per kind as
   p50/p95 in milliseconds.
2. Throughput per worker, per backend: N further draft spans (the same window/sentence mix)
   submitted at once to the same single worker, timed until every annotation is readable:
   spans/s end to end, and spans/s of annotate time alone; the worker's CPU time per span.
3. Effect on generation: SmolLM2 in this process (the config's ``engine`` section: ``--model``, ``--threads``), a few
   prompts of ``bench/public.jsonl`` (the first item of each kind, then the second, ...),
   with a lossy policy (``typical``: the ``FactCheckLink`` is called at every step) and
   with exact acceptance (the link is never called per step; only the output is annotated
   after the result). Each policy runs with the link (a worker running) and without,
   interleaved item by item with the arm order rotating, after one warm-up generation per
   arm; before every timed generation the worker is drained (nothing pending), so a run
   never pays for the previous run's spans. Each repeat starts from fresh decoders, links
   and annotations (the annotation keys are deleted), like ``draftmesh bench``. Per item
   the median tokens/s over the repeats is kept; the headline is the geometric mean over
   items of the with/without ratio, with the per-repeat pooled ratios as a noise gauge.
   Also measured: the link's own time per step, and the time ``annotate_output`` adds
   after the result (sending the output and waiting up to ``--output-wait-s`` for it).

The flair backend needs a trained tagger: ``--flair-model PATH``, else one is trained for the
run with ``python -m draftmesh.factcheck.flair_train`` (``--flair-epochs``, default 12) in the
worker's environment; when that environment has no flair, flair is skipped with a message.

Speed is measured here, never asserted: the command exits 0 unless a backend could not be
measured (1) or the arguments are wrong (2). The printed header carries the exact command.
"""

