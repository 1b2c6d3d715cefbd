"""The server's own log lines (refused requests, dropped tools, grammar warnings), beside uvicorn's and in its
layout ("WARNING:  ..."), at `mlxpaged serve --log-level`. Each line names the endpoint and the request."""

from __future__ import annotations

import logging

log = logging.getLogger("mlxpaged.server")


def configure(level: str) -> None:
    """Called once by the launcher; without it (tests, embedding) Python's last-resort handler shows warnings."""
    from uvicorn.logging import DefaultFormatter

    handler = logging.StreamHandler()
    handler.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s", use_colors=False))
    log.handlers[:] = [handler]
    log.setLevel(level.upper())
    log.propagate = False
