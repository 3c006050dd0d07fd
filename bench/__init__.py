"""draftmesh.bench: the benchmarks, side by side in one process (entry points; nothing imports them).

`draftmesh bench` (``cli`` for its flags, ``run`` for the run) compares methods on one workload:
after one short warm-up generation per method, items run in file order and, for each item,
every method in turn (the order changing from item to item, a Williams design: each method
runs right after every other equally often); the whole pass is repeated N
times and each (item, method) keeps its median time, so background noise hits all methods
alike. Each repeat starts every method from fresh state (new draft sources), so a source that
learns from finished requests only sees earlier items of the same pass. Greedy output of every
lossless method must equal ``plain`` token for token (``fidelity``); a mismatch is printed as
it happens, recorded with the first differing position and the model's top-2 gap there, and
makes the command exit 1. With ``--target mesh`` the mesh methods run through a served mesh,
interleaved with the in-process ones (``mesh``).

Modules: ``methods`` (the method grammar), ``workload`` and ``items`` (what is run),
``runners`` and ``mesh`` (one runner per method family), ``loop`` (the interleaved loop),
``fidelity``, ``summary`` (aggregates), ``engine_report`` (its tables, JSON and plot), and, shared
by every bench, ``stats``, ``report`` (tables, formatting, machine info, JSON) and
``arguments``. ``factcheck`` is `draftmesh factcheck-bench`; ``ab`` compares engine
configurations; ``tracing`` and ``otlp_receiver`` measure what tracing costs.
"""
