"""Shared pytest configuration.

Tests that need an NVIDIA GPU carry `@pytest.mark.gpu`. On a machine without CUDA (CI, the
developers' machines) they are skipped rather than failed, so that `pytest` runs everything
this machine can check; `pytest -m gpu` on a GPU machine runs only them.
"""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is false)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
