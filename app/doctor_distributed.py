"""`mlxpaged doctor` under `mlx.launch`: the backend, the ranks, and each rank's host and memory, gathered to
rank 0 over mx.distributed (one all_gather of a fixed-size record) and printed by rank 0 only.

    mlxpaged launch -n 2 -- doctor          # or: mlx.launch --backend ring -n 2 -- $(which mlxpaged) doctor

Each rank reports what its own memory plan starts from (platform.memory.DeviceFacts: total and available
memory, Metal's recommended working set) and the MLX wired limit, since every rank plans its own KV pools
and the engine cuts them all to the smallest (distributed/memory.py). Alone, one line says so.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import sys
from dataclasses import asdict, dataclass

import mlxpaged
from mlxpaged.distributed.launch import launched_backend
from mlxpaged.distributed.ranks import join, launched
from mlxpaged.units import format_size
from mlxpaged_app.doctor import OK, WARN, Check

RECORD_BYTES = 1024  # one rank's record, JSON padded with zeros: every rank sends the same shape
LABEL = "distributed"
ALONE = (
    "one process (run under mlx.launch to check several: `mlxpaged launch -n 2 -- doctor` on this machine, "
    "`mlxpaged launch --hostfile hosts.json -- doctor` across machines)"
)


@dataclass(frozen=True)
class RankRecord:
    """What one rank sees: where it runs and the memory its plan starts from."""

    rank: int
    host: str
    pid: int  # which process on its host (ranks sharing a host differ here)
    system: str  # "macOS 15.1 arm64", "Linux 6.8 x86_64"
    mlx: str
    mlxpaged: str
    device: str  # mx.default_device(), and the device's name where MLX gives one
    backend: str  # where MLX computes: metal, cuda or cpu (the memory plan's backend)
    total_bytes: int
    available_bytes: int
    working_set_bytes: int | None  # Metal's recommended working set: where the plan starts on a Mac
    wired_limit_bytes: int | None  # the MLX wired limit now (Metal); None where it does not apply


def local_record(rank: int) -> RankRecord:
    from mlxpaged.platform.memory import DeviceFacts

    import mlx.core as mx

    facts = DeviceFacts.detect()
    mac = platform.mac_ver()[0]
    system = f"macOS {mac}" if mac else f"{platform.system()} {platform.release()}"
    device = str(mx.default_device()) + (f" ({facts.name})" if facts.name else "")
    wired = None
    if facts.backend == "metal":
        wired = mx.set_wired_limit(0)  # returns the limit it replaces: put it back at once
        mx.set_wired_limit(wired)
    return RankRecord(
        rank,
        socket.gethostname(),
        os.getpid(),
        f"{system} {platform.machine()}",
        mx.__version__,
        mlxpaged.__version__,
        device,
        facts.backend,
        facts.total_bytes,
        facts.available_bytes,
        facts.max_recommended_working_set_size,
        wired,
    )


def encode(record: RankRecord) -> bytes:
    """The record as RECORD_BYTES bytes: JSON, then zeros (JSON text holds no zero byte)."""
    data = json.dumps(asdict(record), separators=(",", ":")).encode()
    if len(data) > RECORD_BYTES:
        raise ValueError(f"a rank's doctor record is {len(data)} bytes, more than the {RECORD_BYTES} sent")
    return data + bytes(RECORD_BYTES - len(data))


def decode(data: bytes) -> RankRecord:
    return RankRecord(**json.loads(data.rstrip(b"\0").decode()))


def gather_records(group) -> list[RankRecord]:
    """Every rank's record, in rank order, on every rank (one all_gather)."""
    import mlx.core as mx
    import numpy as np

    mine = np.frombuffer(encode(local_record(group.rank())), dtype=np.uint8)
    everyone = np.array(mx.distributed.all_gather(mx.array(mine)[None], group=group))
    return [decode(row.tobytes()) for row in everyone.reshape(group.size(), RECORD_BYTES)]


def distributed_checks() -> list[Check]:
    """Rank 0's lines: the setup, then one line per rank. Alone: one line."""
    ranks = join()
    if ranks is None:
        return [Check(OK, LABEL, ALONE if not launched() else "one process under mlx.launch (-n 1)")]
    return report(launched_backend() or "unknown", gather_records(ranks.group))


def follower_doctor() -> int:
    """A rank other than 0: send its record to rank 0 and print nothing (rank 0 prints the report)."""
    try:
        ranks = join()
        if ranks is not None:
            gather_records(ranks.group)
    except Exception as exc:  # one line saying why, not a traceback in the middle of rank 0's report
        print(f"mlxpaged doctor (rank {os.environ.get('MLX_RANK')}): {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


def report(backend: str, records: list[RankRecord]) -> list[Check]:
    hosts: dict[str, list[int]] = {}
    for r in records:
        hosts.setdefault(r.host, []).append(r.rank)
    detail = f"{backend} backend (mlx.launch), {len(records)} ranks on {len(hosts)} host{'s' * (len(hosts) > 1)}"
    problems = [mismatch(records, "mlx"), mismatch(records, "mlxpaged"), mismatch(records, "backend")]
    for host, ranks in hosts.items():
        if len(ranks) > 1:  # loopback: fine for trying; a real run puts one rank on each machine
            detail += (
                f"; ranks {', '.join(map(str, ranks))} share {host} and each plans its KV cache from a "
                f"1/{len(ranks)} share of its memory (unless each has a GPU of its own: CUDA)"
            )
    if len(hosts) > 1:
        detail += "; " + least_room(records)
    found = [p for p in problems if p]
    summary = Check(WARN if found else OK, LABEL, "; ".join([detail, *found]))
    return [summary, *(Check(OK, f"rank {r.rank}", describe(r)) for r in records)]


def least_room(records: list[RankRecord]) -> str:
    """Which rank's memory plan starts lowest: every rank's KV pool is cut to the smallest (distributed/memory.py)."""
    from mlxpaged.platform.memory import DeviceFacts

    def facts(r: RankRecord) -> DeviceFacts:
        return DeviceFacts(r.backend, r.total_bytes, r.available_bytes, r.working_set_bytes)

    low = min(records, key=lambda r: facts(r).limit_bytes)
    least = facts(low)
    return (
        f"the least room is rank {low.rank}'s ({least.limit_label} {format_size(least.limit_bytes)}): "
        "every rank's KV pool is cut to the smallest rank's plan"
    )


def mismatch(records: list[RankRecord], field: str) -> str:
    """'' when every rank has the same `field`, else which rank has which."""
    values = {getattr(r, field) for r in records}
    if len(values) == 1:
        return ""
    return f"the ranks differ in {field}: " + ", ".join(f"rank {r.rank} {getattr(r, field)}" for r in records)


def describe(r: RankRecord) -> str:
    memory = "unified memory" if r.backend == "metal" else "device memory" if r.backend == "cuda" else "RAM"
    line = (
        f"{r.host} pid {r.pid} ({r.system}): {r.device}, {r.backend} backend, {memory} {format_size(r.total_bytes)}, "
        f"available {format_size(r.available_bytes)}"
    )
    if r.working_set_bytes is not None:
        line += f", recommended working set {format_size(r.working_set_bytes)}"
    if r.wired_limit_bytes is not None:
        line += f", MLX wired limit {format_size(r.wired_limit_bytes)}"
    return line + f"; mlx {r.mlx}, mlxpaged {r.mlxpaged}"
