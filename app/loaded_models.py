"""`mlxpaged models --server URL`: which models a running `mlxpaged serve` has loaded and the memory each holds,
read from its `/v1/models` (the `mlxpaged` field of each card). Asked only when the flag is given, so that
`mlxpaged models` stays offline and instant."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import httpx

DEFAULT_SERVER = "http://127.0.0.1:8000"
TIMEOUT_S = 3.0


class ServerQueryError(Exception):
    """The server could not be asked; the message says which URL and why."""


@dataclass(frozen=True)
class LoadedModel:
    name: str
    memory_bytes: int | None
    requests_in_flight: int
    pinned: bool


def loaded_on_server(url: str, api_key: str | None = None) -> dict[str, LoadedModel]:
    """The server's loaded models by name (and by their directory's base name, as the store lists them)."""
    key = api_key if api_key is not None else os.environ.get("MLXPAGED_API_KEY")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    target = url.rstrip("/").removesuffix("/v1") + "/v1/models"
    try:
        response = httpx.get(target, headers=headers, timeout=TIMEOUT_S)
        response.raise_for_status()
        cards = response.json()["data"]
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        raise ServerQueryError(f"cannot read {target}: {exc}") from None
    loaded = {}
    for card in cards:
        extra = card.get("mlxpaged") or {}
        if extra.get("loaded"):
            model = LoadedModel(
                card["id"], extra.get("memory_bytes"), extra.get("requests_in_flight", 0), extra.get("pinned", False)
            )
            loaded[card["id"]] = loaded[Path(card["id"]).name] = model
    return loaded


def find_loaded(loaded: dict[str, LoadedModel], name: str) -> LoadedModel | None:
    return loaded.get(name) or loaded.get(Path(name).name)
