"""Shared fixtures: tiny random-weight targets (fast, float64) and the real packaged model."""

from __future__ import annotations

import os

import pytest
import torch

from tiny_models import tiny_target

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Tiny models are fastest on one thread; OpenMP spinning on a busy 2-core box costs 20x.
torch.set_num_threads(int(os.environ.get("DRAFTMESH_TEST_THREADS", "1")))


@pytest.fixture(scope="session", params=["llama", "gemma3"])
def tiny(request):
    return tiny_target(request.param)


@pytest.fixture(scope="session")
def smollm2():
    from draftmesh.verify.backend import TorchTarget

    return TorchTarget.load("smollm2-135m")
