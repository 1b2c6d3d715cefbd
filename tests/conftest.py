"""Shared fixtures. The real default model is loaded once per session."""

from __future__ import annotations

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)

import pytest


@pytest.fixture(scope="session")
def default_loaded():
    """The embedded default model (SmolLM2-135M-Instruct) as a LoadedModel, provisioned if needed."""
    from mlxpaged.loading.loader import load_model

    return load_model()


@pytest.fixture(scope="session")
def default_model(default_loaded):
    """(model, tokenizer) of the embedded default model."""
    return default_loaded.model, default_loaded.tokenizer
