"""Errors in Ollama's shape: `{"error": "<message>"}` with the HTTP status, nothing else.

The server raises one APIError everywhere; the path decides the shape (server/errors.py), so a bad key, a body
too large, a full queue or an unknown route under /api/ reads as Ollama's clients expect: the `ollama` Python
client raises `ResponseError(error, status_code)` from it. Ollama's statuses: 400 for bad input (invalid JSON,
a bad option, a prompt too long), 404 for an unknown model, 500 for a failure of its own. Where Ollama answers
500 for a client's mistake (an option of the wrong type), this server answers 400.
"""

from __future__ import annotations

PREFIX = "/api/"


def is_ollama_path(path: str) -> bool:
    """Ollama's routes, and `/` (which clients probe for "Ollama is running")."""
    return path == "/" or path.startswith(PREFIX)


def error_body(message: str) -> dict:
    return {"error": message}
