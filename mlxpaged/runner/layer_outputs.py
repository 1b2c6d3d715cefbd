"""What chosen decoder layers of a model output during the runner's passes: DFlash drafts from several of the model's
layers at once (runner/dflash_drafter.py), which mlx-lm's models do not hand back.

Each chosen layer's class is swapped for a subclass whose `__call__` also records the layer's output while a pass is
recording: its parameters, their paths and every attribute the model's own code reads stay as they were, and outside
a recording (probes, the draft's passes) the layer runs as before.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn


class LayerOutputs:
    def __init__(self, layers: Sequence[nn.Module], layer_ids: Sequence[int]):
        if not layer_ids or min(layer_ids) < 0 or max(layer_ids) >= len(layers):
            raise ValueError(f"layers {list(layer_ids)} are not all among the model's {len(layers)}")
        self.layer_ids = tuple(layer_ids)
        self._outputs: dict[int, mx.array] | None = None  # while recording: layer id -> its output
        self._last: dict[int, mx.array] = {}  # the last recording's
        for index in set(layer_ids):
            _record_calls(layers[index], _Recorder(self, index))

    @contextmanager
    def recording(self) -> Iterator[None]:
        self._outputs = {}
        try:
            yield
        finally:
            self._last, self._outputs = self._outputs, None

    def stacked(self) -> mx.array:
        """The last recording's outputs of the chosen layers, in their order, along the last axis [B, L, n * H]."""
        return mx.concatenate([self._last[i] for i in self.layer_ids], axis=-1)

    def _keep(self, index: int, output) -> None:
        if self._outputs is not None:
            self._outputs[index] = output[0] if isinstance(output, tuple) else output


class _Recorder:
    """A plain attribute of the layer (not an array, list or module: nn.Module would take it for a child)."""

    def __init__(self, outputs: LayerOutputs, index: int):
        self.outputs, self.index = outputs, index


def _record_calls(layer: nn.Module, recorder: _Recorder) -> None:
    base = type(layer)
    if getattr(base, "_records_outputs", False):
        layer._mlxpaged_recorder = recorder  # swapped already (another engine on the same model): this one records
        return
    original = base.__call__

    def __call__(self, *args, **kwargs):
        output = original(self, *args, **kwargs)
        self._mlxpaged_recorder.outputs._keep(self._mlxpaged_recorder.index, output)
        return output

    layer.__class__ = type(base.__name__, (base,), {"__call__": __call__, "_records_outputs": True})
    layer._mlxpaged_recorder = recorder
