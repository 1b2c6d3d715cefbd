"""A step's plan as flat int32 values: what a follower needs to queue the very passes rank 0 queues.

One message is one of: a step (the runner's StepInputs: token ids, start position, block tables, whether the
row samples, its state slot, how many logits), block copies (a fork's copy-on-write), stop, or keep-alive (an
idle rank 0 is alive: a follower that hears nothing for too long knows rank 0 hangs, watchdog.py). Sampled tokens
need no message: they are the next step's token ids. Kept free of MLX so it can be checked on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mlxpaged.runner.passes import StepInput

STEP, COPY, STOP, KEEP_ALIVE = 1, 2, 3, 4
NO_SLOT = -1


@dataclass(frozen=True)
class Message:
    kind: int
    inputs: tuple[StepInput, ...] = ()
    copies: tuple[tuple[int, int], ...] = ()
    nap_ms: int = 0  # a keep-alive's: how long the followers sleep before their next collective


def encode_step(inputs: Sequence[StepInput]) -> list[int]:
    out = [STEP, len(inputs)]
    for x in inputs:
        slot = NO_SLOT if x.state_slot is None else x.state_slot
        out += [x.start, int(x.samples), slot, x.num_logits, len(x.token_ids), *x.token_ids, len(x.block_tables)]
        for table in x.block_tables:
            out += [len(table), *table]
    return out


def encode_copies(copies: Sequence[tuple[int, int]]) -> list[int]:
    return [COPY, len(copies), *(v for pair in copies for v in pair)]


def encode_stop() -> list[int]:
    return [STOP]


def encode_keep_alive(nap_ms: int = 0) -> list[int]:
    return [KEEP_ALIVE, nap_ms]


def decode(values: Sequence[int]) -> Message:
    """The message `values` encode (one of encode_*'s)."""
    it = iter(int(v) for v in values)
    kind = next(it)
    if kind == STOP:
        return Message(kind)
    if kind == KEEP_ALIVE:
        return Message(kind, nap_ms=next(it, 0))
    if kind == COPY:
        n = next(it)
        return Message(COPY, copies=tuple((next(it), next(it)) for _ in range(n)))
    if kind != STEP:
        raise ValueError(f"unknown plan message kind {kind}")
    inputs = []
    for _ in range(next(it)):
        start, samples, slot, num_logits = next(it), bool(next(it)), next(it), next(it)
        tokens = [next(it) for _ in range(next(it))]
        tables = [[next(it) for _ in range(next(it))] for _ in range(next(it))]
        state_slot = None if slot == NO_SLOT else slot
        inputs.append(StepInput(tokens, start, tables, samples, state_slot=state_slot, num_logits=num_logits))
    return Message(STEP, inputs=tuple(inputs))
