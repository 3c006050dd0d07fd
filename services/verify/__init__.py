"""draftmesh.verify"""
