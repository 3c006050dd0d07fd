"""draftmesh.draft: the source contract, the draft sources and text-to-token alignment."""

from draftmesh.draft.base import DraftContext, DraftSource, LearningSource, Proposal

__all__ = ["DraftContext", "DraftSource", "LearningSource", "Proposal"]
