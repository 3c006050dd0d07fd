"""draftmesh.factcheck"""
