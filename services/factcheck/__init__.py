"""draftmesh.factcheck: the fact-check service (NER, Wikidata, dates, numeric rules) comes with its own issue."""
