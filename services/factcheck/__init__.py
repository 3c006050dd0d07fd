"""draftmesh.factcheck: annotates drafts and outputs (NER, Wikidata, dates, numeric rules).

The worker runs in its own environment (flair pins transformers < 5) and talks to the rest
of the mesh only through Redis Streams. The rest of draftmesh reaches this package through
``protocol`` (the stream contract), ``client`` (the producers' side) and ``processes`` (starting
workers) only; a contract test enforces it. Importing this package pulls in nothing heavy: NER
backends load spaCy or flair lazily.
"""
