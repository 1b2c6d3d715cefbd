"""Linear layers that add, row by row of a batch, the low-rank update of the adapter that row's request asked for.

A pass over a batch whose rows use several adapters (and the base model) computes the base layer once for every
row, then each adapter's update on its own rows: the rows are grouped by adapter when the pass is built (the runner
knows each row's adapter then, `PassRows.building`), so each group is two small matmuls of mlx-lm's own shape and
order, and rows of the base model cost nothing more. No weight is ever merged, so any mix of adapters can share a pass.

The update is mlx-lm's, operation for operation (mlx_lm/tuner/lora.py `LoRALinear`, dora.py `DoRALinear`), so a row
computes what `load(base, adapter_path=...)` computes: LoRA `y + (scale * ((x @ A) @ B)).astype(x.dtype)`; DoRA
`(m / |W + scale * (A @ B).T|).astype(x.dtype) * (x @ W.T + scale * ((x @ A) @ B)) + bias`, whose norm depends on the
weights only and is computed once, when the adapter is attached.

A mixture-of-experts switch layer (`AdaptedSwitchLinear`) adds mlx-lm's `LoRASwitchLinear` update: each token's
expert's own lora_a and lora_b, gathered as the base layer gathers its experts. Its block sorts the pass's tokens by
expert before calling it, so it cannot tell which row a token came from: a model whose adapters adapt switch layers
runs one adapter per pass (`PassRows.one_adapter_per_pass`; the runner splits a step's rows by adapter).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Generic, TypeVar

from mlxpaged.adapters.files import ModuleUpdate

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

# A pass whose rows use at least this many different adapters of one layer applies them as one stacked update (two
# matmuls over every adapter's columns, each row masked to its own) instead of group by group (measured: see
# docs/design/issue40-adapters.md).
STACK_MIN_GROUPS = 3

LinearBase = nn.Linear | nn.QuantizedLinear
SwitchBase = SwitchLinear | QuantizedSwitchLinear


def linear_dims(linear: LinearBase) -> tuple[int, int]:
    """(input width, output width) of a linear layer, quantized or not (as mlx-lm's LoRALinear.from_base reads them)."""
    out, width = linear.weight.shape
    if isinstance(linear, nn.QuantizedLinear):
        width = width * 32 // linear.bits
    return int(width), int(out)


def _weight(linear: LinearBase) -> mx.array:
    """The layer's weight [out, in] in its dtype, dequantized if quantized (DoRALinear._dequantized_weight)."""
    if isinstance(linear, nn.QuantizedLinear):
        return mx.dequantize(
            linear.weight,
            linear.scales,
            linear.biases,
            group_size=linear.group_size,
            bits=linear.bits,
            mode=linear.mode,
        )
    return linear.weight


class LowRankUpdate:
    """One adapter's update of one layer (a plain object: its arrays are not the model's parameters)."""

    def __init__(self, update: ModuleUpdate, scale: float, dora: bool, linear: LinearBase):
        self.lora_a, self.lora_b, self.scale = update.lora_a, update.lora_b, scale
        self.norm_scale: mx.array | None = None  # DoRA: m / |adapted weight rows|
        if dora:
            weight = _weight(linear)
            m = update.m if update.m is not None else mx.linalg.norm(weight.astype(mx.float32), axis=1)
            adapted = weight + (scale * self.lora_b.T) @ self.lora_a.T
            self.norm_scale = m / mx.linalg.norm(adapted, axis=1)
        # y = linear(x) is already x @ W.T exactly when the layer is a plain Linear without a bias.
        self._reuses_base = isinstance(linear, nn.Linear) and "bias" not in linear

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.lora_a, self.lora_b, self.norm_scale) if a is not None]

    def __call__(self, x: mx.array, y: mx.array, linear: LinearBase) -> mx.array:
        """The adapted output of rows `x`, whose base output is `y`."""
        z = (x @ self.lora_a) @ self.lora_b
        if self.norm_scale is None:
            return y + (self.scale * z).astype(x.dtype)
        plain = y if self._reuses_base else x @ _weight(linear).T
        out = self.norm_scale.astype(x.dtype) * (plain + (self.scale * z).astype(x.dtype))
        return out + linear.bias if "bias" in linear else out


class SwitchUpdate:
    """One adapter's update of one switch layer: each expert's lora_a [E, r, in] and lora_b [E, out, r]."""

    norm_scale = None  # LoRA only (mlx-lm has no DoRA of switch layers)

    def __init__(self, update: ModuleUpdate, scale: float):
        self.lora_a, self.lora_b, self.scale = update.lora_a, update.lora_b, scale

    def arrays(self) -> list[mx.array]:
        return [self.lora_a, self.lora_b]

    def __call__(self, x: mx.array, y: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array:
        """mlx-lm's LoRASwitchLinear: the tokens' experts' updates, gathered as the base layer's weights are."""
        z = mx.gather_mm(x, self.lora_a.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
        z = mx.gather_mm(z, self.lora_b.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
        return y + (self.scale * z).astype(x.dtype)


class PassRows:
    """Which adapter each row of the pass being built uses, read by every adapted layer of one model while the
    runner builds that pass (the arrays then hold it; nothing here is read when the pass runs)."""

    def __init__(self) -> None:
        self.adapters: list[str | None] = []  # each row's adapter id, in batch order
        self.length = 0  # positions per row
        self.groups: list[tuple[str | None, mx.array | None]] | None = None  # (adapter id, its rows) per group
        self.inverse: mx.array | None = None  # the rows back in batch order after the groups are concatenated
        self._by_token: tuple[list[tuple[str | None, mx.array | None]], mx.array] | None = None
        self._masks: dict[tuple, mx.array] = {}  # the pass's column masks by stack layout (stacked_mask)
        # Set while an adapter of a switch layer is attached: every pass's rows then run one adapter (or none).
        self.one_adapter_per_pass = False

    @property
    def batch(self) -> int:
        return len(self.adapters)

    @contextmanager
    def building(self, adapters: Sequence[str | None], length: int) -> Iterator[None]:
        """Around building a pass of `length` positions per row whose row i uses adapter `adapters[i]` (None: the
        base model)."""
        if all(a is None for a in adapters):
            yield
            return
        self.adapters, self.length = list(adapters), length
        if len(set(adapters)) == 1:
            self.groups, self.inverse = [(adapters[0], None)], None
        else:
            self.groups, self.inverse = _grouped(self.adapters)
        try:
            yield
        finally:
            self.groups, self.inverse, self._by_token, self._masks = None, None, None, {}

    def stacked_mask(self, stack: StackedUpdates, flat: bool) -> mx.array:
        """Each row's scale on its own adapter's columns of `stack`, zero elsewhere: [B, 1, R], or [B * L, R] for a
        layer fed the pass flattened. One per stack layout and pass, shared by the layers of that layout."""
        key = (stack.layout, flat)
        mask = self._masks.get(key)
        if mask is None:
            rows = np.zeros((self.batch, stack.width), np.float32)
            for i, adapter in enumerate(self.adapters):
                if adapter in stack.columns:
                    start, stop, scale = stack.columns[adapter]
                    rows[i, start:stop] = scale
            if flat:
                rows = np.repeat(rows, self.length, axis=0)
            mask = self._masks[key] = mx.array(rows if flat else rows[:, None, :]).astype(stack.lora_a.dtype)
        return mask

    def tokens(self) -> tuple[list[tuple[str | None, mx.array | None]], mx.array]:
        """The groups and inverse order by position, for a layer that sees the pass flattened to [rows * length, D]
        (mixture-of-experts blocks do)."""
        if self._by_token is None:
            self._by_token = _grouped([a for a in self.adapters for _ in range(self.length)])
        return self._by_token


def _grouped(adapters: list[str | None]) -> tuple[list[tuple[str | None, mx.array | None]], mx.array]:
    """(adapter, its rows) for each distinct adapter, and the order that puts the groups' rows back."""
    distinct = list(dict.fromkeys(adapters))
    rows = [[i for i, a in enumerate(adapters) if a == adapter] for adapter in distinct]
    order = [i for group in rows for i in group]
    groups: list[tuple[str | None, mx.array | None]] = [(a, mx.array(r)) for a, r in zip(distinct, rows, strict=True)]
    return groups, mx.array(sorted(range(len(order)), key=order.__getitem__))


U = TypeVar("U", LowRankUpdate, SwitchUpdate)


class AdapterUpdates(Generic[U]):
    """Adapter id -> its update of one layer. A plain object, not a dict: MLX takes a module's dict attributes for
    children, and their arrays for the model's parameters."""

    def __init__(self) -> None:
        self._by_adapter: dict[str, U] = {}
        self.version = 0  # bumped on every change (what a layer's stacked updates were built from)

    @property
    def any_dora(self) -> bool:
        return any(u.norm_scale is not None for u in self._by_adapter.values())

    def items(self) -> list[tuple[str, U]]:
        return list(self._by_adapter.items())

    def __contains__(self, adapter: object) -> bool:
        return adapter in self._by_adapter

    def __bool__(self) -> bool:
        return bool(self._by_adapter)

    def get(self, adapter: str | None) -> U | None:
        return self._by_adapter.get(adapter) if adapter is not None else None

    def add(self, adapter: str, update: U) -> None:
        self._by_adapter[adapter] = update
        self.version += 1

    def remove(self, adapter: str) -> None:
        self._by_adapter.pop(adapter, None)
        self.version += 1


class AdaptedLinear(nn.Module):
    """A linear layer and the updates of the adapters that adapt it, applied to the rows that asked for them."""

    def __init__(self, linear: LinearBase, rows: PassRows):
        super().__init__()
        self.linear = linear
        self.rows = rows  # plain objects (not arrays, dicts or lists): neither is a parameter
        self.updates: AdapterUpdates[LowRankUpdate] = AdapterUpdates()
        self._stack: tuple[int, StackedUpdates] | None = None  # (updates.version it was built at, the stack)

    def __call__(self, x: mx.array) -> mx.array:
        y = self.linear(x)
        groups = self.rows.groups
        if groups is None or not any(adapter in self.updates for adapter, _ in groups):
            return y
        if len(groups) == 1:  # every row runs with this layer's one adapter (the check above)
            update = self.updates.get(groups[0][0])
            return y if update is None else update(x, y, self.linear)
        if sum(adapter in self.updates for adapter, _ in groups) >= STACK_MIN_GROUPS and not self.updates.any_dora:
            return self._stacked(x, y)
        inverse = self.rows.inverse
        if x.shape[0] != self.rows.batch:
            if x.shape[0] != self.rows.batch * self.rows.length:
                raise RuntimeError(f"an adapted layer got input {x.shape} in a pass of {self.rows.batch} rows")
            groups, inverse = self.rows.tokens()
        pieces = []
        for adapter, rows in groups:
            update = self.updates.get(adapter)
            pieces.append(y[rows] if update is None else update(x[rows], y[rows], self.linear))
        return mx.concatenate(pieces, axis=0)[inverse]

    def _stacked(self, x: mx.array, y: mx.array) -> mx.array:
        """Every row's LoRA update at once: x @ [A_1 .. A_n], each row's columns scaled by its adapter's scale and
        the others zeroed, @ [B_1 .. B_n]. Rows of the base model (or of an adapter not adapting this layer) get 0."""
        if self._stack is None or self._stack[0] != self.updates.version:
            self._stack = (self.updates.version, StackedUpdates(self.updates.items()))
        stack = self._stack[1]
        flat = x.shape[0] != self.rows.batch
        if flat and x.shape[0] != self.rows.batch * self.rows.length:
            raise RuntimeError(f"an adapted layer got input {x.shape} in a pass of {self.rows.batch} rows")
        z = (x @ stack.lora_a) * self.rows.stacked_mask(stack, flat)
        return y + (z @ stack.lora_b).astype(x.dtype)


class StackedUpdates:
    """The LoRA updates of one layer side by side: lora_a [in, R], lora_b [R, out], and each adapter's columns."""

    def __init__(self, updates: list[tuple[str, LowRankUpdate]]):
        self.columns: dict[str, tuple[int, int, float]] = {}  # adapter id -> (first column, past the last, scale)
        start = 0
        for adapter, update in updates:
            rank = int(update.lora_a.shape[1])
            self.columns[adapter] = (start, start + rank, update.scale)
            start += rank
        self.width = start
        self.layout = tuple(self.columns.items())  # what the pass's mask depends on
        self.lora_a = mx.concatenate([u.lora_a for _, u in updates], axis=1)
        self.lora_b = mx.concatenate([u.lora_b for _, u in updates], axis=0)


class AdaptedSwitchLinear(nn.Module):
    """A mixture-of-experts switch layer (mlx-lm's SwitchLinear, quantized or not) and its adapters' updates. It sees
    the pass's tokens sorted by expert, not by row, so the pass runs one adapter (PassRows.one_adapter_per_pass)."""

    def __init__(self, linear: SwitchBase, rows: PassRows):
        super().__init__()
        self.linear = linear
        self.rows = rows
        self.updates: AdapterUpdates[SwitchUpdate] = AdapterUpdates()

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        y = self.linear(x, indices, sorted_indices=sorted_indices)
        groups = self.rows.groups
        if groups is None or not any(adapter in self.updates for adapter, _ in groups):
            return y
        if len(groups) > 1:
            raise RuntimeError("a pass of several adapters reached an adapted switch layer (one adapter per pass)")
        update = self.updates.get(groups[0][0])
        return y if update is None else update(x, y, indices, sorted_indices)
