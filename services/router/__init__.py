"""draftmesh.router"""
