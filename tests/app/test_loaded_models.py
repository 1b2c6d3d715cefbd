"""`mlxpaged models --server`: what a running server reports as loaded, read from its /v1/models."""

from __future__ import annotations

from mlxpaged_app import cli
from mlxpaged_app.loaded_models import ServerQueryError, loaded_on_server

import httpx
import pytest

CARDS = {
    "object": "list",
    "data": [
        {"id": "tiny-a", "object": "model", "mlxpaged": {"loaded": True, "memory_bytes": 820_000_000, "pinned": True}},
        {"id": "tiny-b", "object": "model", "mlxpaged": {"loaded": False}},
    ],
}


def fake_get(status: int, body: dict, seen: list):
    def get(url, headers=None, timeout=None):
        seen.append((url, headers))
        return httpx.Response(status, json=body, request=httpx.Request("GET", url))

    return get


def test_loaded_models_by_name_and_directory(monkeypatch):
    seen: list = []
    monkeypatch.setattr(httpx, "get", fake_get(200, CARDS, seen))
    loaded = loaded_on_server("http://127.0.0.1:8000/v1", api_key="k")
    assert seen == [("http://127.0.0.1:8000/v1/models", {"Authorization": "Bearer k"})]
    assert set(loaded) == {"tiny-a"} and loaded["tiny-a"].memory_bytes == 820_000_000
    assert cli.loaded_column(loaded, "/some/store/tiny-a") == "yes, 0.82 GB (pinned)"
    assert cli.loaded_column(loaded, "tiny-b") == "-"


def test_an_unreachable_or_refusing_server_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(httpx, "get", fake_get(401, {"error": {"message": "missing API key"}}, []))
    with pytest.raises(ServerQueryError, match="cannot read http://h:1/v1/models"):
        loaded_on_server("http://h:1", api_key="")
