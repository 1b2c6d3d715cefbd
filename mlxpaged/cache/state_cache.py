"""Per-sequence state of state-space / linear-attention layers (mlx-lm ArraysCache leaves).

A fixed pool of `num_slots` slots; a running sequence holds one. Its state is kept as immutable
rows: per state leaf, the leaf's arrays as the model last wrote them, `[1, ...]` each (None: never
set, the model initialises it). Nothing is updated in place: in MLX `pool[slots] = f(take(pool,
slots))` copies the whole pool every step (design 14, finding 3), while rows cost no sync and make
n > 1 forks and prefix checkpoints share arrays instead of copying them.

One forward pass over some slots sees, per state leaf, a `StateView` (an ArraysCache, since
mamba.py writes back only `if isinstance(cache, ArraysCache)`): reads concatenate the slots' rows,
writes are kept for the pass. `StatePass.commit` moves them into the store only once the pass is
really used, so a pipelined pass that is thrown away leaves the state as it was.

`CheckpointTable`: snapshots of a sequence's rows at block boundaries, keyed by the block hash of
the prefix cache, so the next chat turn resumes from the last boundary of the previous one. With the
disk tier on, `StateCache.lower` (engine/state_tiering.py) holds them below the table too: every
published checkpoint is offered to it, and a resume point may be one found only there.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Protocol

from mlxpaged.cache.layout import Path, StateLeaf
from mlxpaged.cache.state_updates import StateUpdates

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

# One leaf's arrays of one sequence ([1, ...] each, None: unset); a snapshot: every leaf's, by path.
Row = list
Snapshot = dict


class NoFreeSlotsError(RuntimeError):
    def __init__(self, num_slots: int):
        super().__init__(f"all {num_slots} state slots are held by running sequences")
        self.num_slots = num_slots


class StateStore:
    """The state rows of every slot, by state leaf path."""

    def __init__(self, leaves: Sequence[StateLeaf], num_slots: int):
        if num_slots < 1:
            raise ValueError(f"a state store needs at least 1 slot, got {num_slots}")
        self.sizes = {leaf.path: len(leaf.arrays) for leaf in leaves}
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # popped from the end: slot 0 first
        self._rows: dict[int, dict[Path, Row]] = {}

    @property
    def paths(self) -> list[Path]:
        return list(self.sizes)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """A fresh slot (every array unset)."""
        if not self._free:
            raise NoFreeSlotsError(self.num_slots)
        slot = self._free.pop()
        self._rows[slot] = {path: [None] * n for path, n in self.sizes.items()}
        return slot

    def free(self, slot: int) -> None:
        self._check(slot)
        del self._rows[slot]
        self._free.append(slot)

    def fork(self, slot: int) -> int:
        """A new slot holding the same rows as `slot` (the arrays are shared: they are never mutated)."""
        self._check(slot)
        child = self.allocate()
        self._rows[child] = {path: list(row) for path, row in self._rows[slot].items()}
        return child

    def row(self, slot: int, path: Path) -> Row:
        self._check(slot)
        return self._rows[slot][path]

    def snapshot(self, slot: int) -> Snapshot:
        """The slot's rows as fresh arrays: a row sliced from a batch would pin the whole batch array."""
        self._check(slot)
        return {
            path: tuple(None if a is None else mx.contiguous(a) for a in row) for path, row in self._rows[slot].items()
        }

    def held(self, slot: int) -> Snapshot:
        """The slot's rows as they are now, shared (no copy: the arrays are never mutated, a pass replaces them),
        for `restore` after a pass that must not have happened (a speculative verify pass with rejected drafts)."""
        self._check(slot)
        return {path: tuple(row) for path, row in self._rows[slot].items()}

    def restore(self, slot: int, snapshot: Snapshot) -> None:
        """Set the slot's rows to a snapshot's (shared, immutable)."""
        self._check(slot)
        if set(snapshot) != set(self.sizes):
            raise ValueError(f"snapshot leaves {sorted(snapshot)} differ from the store's {sorted(self.sizes)}")
        self._rows[slot] = {path: list(arrays) for path, arrays in snapshot.items()}

    def _check(self, slot: int) -> None:
        if slot not in self._rows:
            raise KeyError(
                f"state slot {slot} is not allocated ({self.num_slots - self.num_free} of {self.num_slots} slots are)"
            )


class StateView(StateUpdates, ArraysCache):
    """The ArraysCache an mlx-lm state layer sees for one pass over `slots` (ArraysCache.__init__ is
    not called: there is no batch array of its own). `lengths` is set only for a ragged pass. mlx-vlm's
    layers write it through `StateUpdates` too."""

    def __init__(self, store: StateStore, path: Path, slots: Sequence[int], lengths: mx.array | None):
        self.store, self.path, self.slots = store, path, list(slots)
        self.lengths = lengths  # type: ignore[assignment]  # mlx-lm's ArraysCache declares it by `= None`
        self.left_padding = None
        self.written: dict[int, mx.array] = {}  # this pass's arrays [B, ...], by entry
        self._read: dict[int, mx.array | None] = {}  # the batch of stored rows, built once per entry

    def __getitem__(self, i: int) -> mx.array | None:
        if i in self.written:
            return self.written[i]
        if i not in self._read:
            self._read[i] = self._gather(i)
        return self._read[i]

    def _gather(self, i: int) -> mx.array | None:
        rows = [self.store.row(slot, self.path)[i] for slot in self.slots]
        if all(r is None for r in rows):
            return None  # every sequence fresh: the model initialises it, as with mlx-lm's own cache
        like = next(r for r in rows if r is not None)
        rows = [mx.zeros_like(like) if r is None else r for r in rows]  # mlx-lm's merge: zeros for an empty row
        return rows[0] if len(rows) == 1 else mx.concatenate(rows, axis=0)

    def __setitem__(self, i: int, value: mx.array) -> None:
        self.written[i] = value

    @property
    def cache(self) -> list:
        return [self[i] for i in range(self.store.sizes[self.path])]

    @cache.setter
    def cache(self, value: list) -> None:
        raise AttributeError("a StateView's arrays live in its StateStore")

    @property
    def state(self) -> list:
        return list(self.written.values())

    @state.setter
    def state(self, value: list) -> None:
        raise AttributeError("a StateView's arrays live in its StateStore")

    def advance(self, N: int) -> None:
        """No-op: `lengths` describe this pass only."""

    def empty(self) -> bool:
        return all(self.store.row(slot, self.path)[0] is None for slot in self.slots) and 0 not in self.written

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.written.values())


class StatePass:
    """The state views of one forward pass over `slots` (one per sequence row, in order), and the rows
    the pass wrote, which `commit` stores."""

    def __init__(self, store: StateStore, slots: Sequence[int], num_new: Sequence[int]):
        if len(slots) != len(num_new) or len(set(slots)) != len(slots):
            raise ValueError(
                f"a state pass needs distinct slots, one per row: slots {list(slots)}, num_new {list(num_new)}"
            )
        self.store, self.slots = store, list(slots)
        ragged = len(set(num_new)) > 1
        lengths = mx.array(list(num_new)) if ragged else None
        self.views = {path: StateView(store, path, self.slots, lengths) for path in store.paths}

    def new_arrays(self) -> list[mx.array]:
        """What the pass computed for the state (to evaluate with its logits: design rule c)."""
        return [a for view in self.views.values() for a in view.written.values()]

    def commit(self, rows: Sequence[int] | None = None) -> None:
        """Store the pass's arrays as the new rows of its slots (only `rows`, by index, when given)."""
        keep = range(len(self.slots)) if rows is None else rows
        single = len(self.slots) == 1
        for path, view in self.views.items():
            for i, value in view.written.items():
                for b in keep:
                    self.store.row(self.slots[b], path)[i] = value if single else value[b : b + 1]


class CheckpointTable:
    """Snapshots of sequences' state at block boundaries, by the hash of the block ending there;
    least recently used out first once `capacity` are held."""

    def __init__(self, capacity: int):
        if capacity < 0:
            raise ValueError(f"checkpoint capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._snapshots: OrderedDict[Hashable, Snapshot] = OrderedDict()

    def __len__(self) -> int:
        return len(self._snapshots)

    def __contains__(self, block_hash: Hashable) -> bool:
        return block_hash in self._snapshots

    def put(self, block_hash: Hashable, snapshot: Snapshot) -> None:
        if self.capacity == 0:
            return
        self._snapshots[block_hash] = snapshot
        self._snapshots.move_to_end(block_hash)
        while len(self._snapshots) > self.capacity:
            self._snapshots.popitem(last=False)

    def get(self, block_hash: Hashable) -> Snapshot:
        """The snapshot (now most recently used); KeyError when there is none."""
        snapshot = self._snapshots[block_hash]
        self._snapshots.move_to_end(block_hash)
        return snapshot

    def longest(self, block_hashes: Sequence[Hashable]) -> int:
        """How many leading blocks of a chain end at a checkpoint: the largest n with a snapshot for
        `block_hashes[n - 1]` (0: none)."""
        for n in range(len(block_hashes), 0, -1):
            if block_hashes[n - 1] in self._snapshots:
                return n
        return 0

    def clear(self) -> None:
        self._snapshots.clear()


class CheckpointTier(Protocol):
    """Checkpoints kept below the table, by block hash (the disk tier: engine/state_tiering.py)."""

    def contains(self, block_hash: Hashable) -> bool: ...

    def read(self, block_hash: Hashable) -> Snapshot | None:
        """The checkpoint, checked; None when it cannot be read (then `contains` answers False from now on)."""
        ...

    def offer(self, block_hash: Hashable, snapshot: Snapshot) -> None:
        """A checkpoint just published: keep it (later, off the step)."""
        ...


class StateCache:
    """What the scheduler drives (it imports no MLX and sees only these methods): slots for running
    sequences and checkpoints at block boundaries. `pending` keeps each sequence's newest decode
    checkpoint, published when it stops running, so a long reply does not flood the table."""

    def __init__(self, store: StateStore, checkpoints: CheckpointTable):
        self.store, self.checkpoints = store, checkpoints
        self._pending: dict[int, tuple[Hashable, Snapshot]] = {}  # by slot
        self.lower: CheckpointTier | None = None  # the disk tier's checkpoints, when on

    @property
    def num_slots(self) -> int:
        return self.store.num_slots

    @property
    def num_free(self) -> int:
        return self.store.num_free

    @property
    def checkpoints_enabled(self) -> bool:
        return self.checkpoints.capacity > 0

    def allocate(self) -> int:
        return self.store.allocate()

    def fork(self, slot: int) -> int:
        return self.store.fork(slot)

    def free(self, slot: int) -> None:
        """Release a slot, publishing its newest decode checkpoint."""
        pending = self._pending.pop(slot, None)
        if pending is not None:
            self._publish(*pending)
        self.store.free(slot)

    def usable_blocks(self, block_hashes: Sequence[Hashable]) -> int:
        """Leading cached blocks a new sequence can resume after (the KV manager's prefix filter): the last
        one ends at a checkpoint in the table or below it."""
        if not self.checkpoints_enabled:
            return 0
        for n in range(len(block_hashes), 0, -1):
            if block_hashes[n - 1] in self.checkpoints or (
                self.lower is not None and self.lower.contains(block_hashes[n - 1])
            ):
                return n
        return 0

    def prepare(self, block_hash: Hashable) -> bool:
        """Make the checkpoint after `block_hash` ready for `restore` (read into the table from below if it is
        only there); False when it cannot be (a file that fails its checks), so the caller resumes earlier."""
        if block_hash in self.checkpoints:
            return True
        snapshot = self.lower.read(block_hash) if self.lower is not None and self.checkpoints_enabled else None
        if snapshot is None:
            return False
        if set(snapshot) != set(self.store.sizes):
            return False  # another layout's: never restore it
        self.checkpoints.put(block_hash, snapshot)
        return True

    def restore(self, slot: int, block_hash: Hashable) -> None:
        self.store.restore(slot, self.checkpoints.get(block_hash))

    def hold(self, slot: int) -> Snapshot:
        """The slot's state before a speculative verify pass (StateStore.held)."""
        return self.store.held(slot)

    def roll_back(self, slot: int, held: Snapshot) -> None:
        """Back to the state `hold` kept: the pass consumed drafts that were rejected."""
        self.store.restore(slot, held)

    def checkpoint(self, slot: int, block_hash: Hashable, publish: bool) -> None:
        """Snapshot the slot's rows as the state after the block `block_hash` ends; into the table now
        (`publish`) or when the slot is freed, replacing its previous pending one."""
        snapshot = self.store.snapshot(slot)
        mx.async_eval([a for row in snapshot.values() for a in row if a is not None])
        if publish:
            self._publish(block_hash, snapshot)
        else:
            self._pending[slot] = (block_hash, snapshot)

    def _publish(self, block_hash: Hashable, snapshot: Snapshot) -> None:
        self.checkpoints.put(block_hash, snapshot)
        if self.lower is not None:
            self.lower.offer(block_hash, snapshot)

    def reset(self) -> None:
        """Forget every checkpoint (the prefix cache was reset)."""
        self.checkpoints.clear()
        self._pending.clear()
