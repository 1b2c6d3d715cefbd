"""Projections that read the same input computed as one matmul (q/k/v; gate/up), where kernels cost to launch.

On a GPU a decode step is bounded by launching its kernels, not by their work: on an H200 (MLX's CUDA backend,
SmolLM2-1.7B's shape, bf16) mlx-lm's own step spends 5.3 of 5.5 ms at batch 1, and 10.2 of 10.2 ms at batch 16,
building and encoding it, where a matmul of more than one row is a cuBLAS call captured into a CUDA graph. A Llama
layer makes seven of them; with q/k/v as one and gate/up as one it makes four, as vLLM's QKVParallelLinear and
MergedColumnParallelLinear do.

Each projection keeps its name and its meaning: `attn.k_proj(x)` is still `x @ W_k.T + b_k`, whatever the model's
code does with it. The group's weights are concatenated once (registered on the parent as `fused_<names>`, so the
parameters are counted once); the first projection called on an input computes the whole group, and the others
called on that same array take their slice. A projection called on another input computes the group again (right,
only slower), and the slices are let go once each was taken, so no activation outlives its layer.

Only exact `nn.Linear` / `nn.QuantizedLinear` groups of one input width and one quantization are fused (a sharded or
adapted linear is a subclass and is left alone). Not always bitwise the same: a wider matmul may be computed in
another order (on MLX's CPU backend gate/up of a 64-wide model differ by 5e-7), so it is a GPU-only choice
(platform/backend.py `Tuning.fused_projections`) checked against mlx-lm like every GPU path.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_ARRAYS = ("weight", "scales", "biases", "bias")  # a (quantized) linear's arrays, each split along its output rows
_SETTINGS = ("group_size", "bits", "mode")


class _Shared:
    """The group's outputs for its last input, until each projection has taken its slice. A plain object, not a
    Module: the parameters live once, on the parent, not under every projection."""

    def __init__(self, linear: nn.Module, sizes: list[int]):
        self.linear = linear
        self.cuts = [sum(sizes[: i + 1]) for i in range(len(sizes) - 1)]
        self.count = len(sizes)
        self._input: mx.array | None = None
        self._outputs: list[mx.array] = []
        self._waiting: set[int] = set()

    def output(self, x: mx.array, index: int) -> mx.array:
        if x is not self._input or index not in self._waiting:
            self._outputs = list(mx.split(self.linear(x), self.cuts, axis=-1))
            self._input, self._waiting = x, set(range(self.count))
        self._waiting.discard(index)
        out = self._outputs[index]
        if not self._waiting:
            self._input, self._outputs = None, []
        return out


class ProjectionSlice(nn.Module):
    """One projection of a fused group: its slice of the group's output."""

    def __init__(self, shared: _Shared, index: int):
        super().__init__()
        self.shared = shared  # a plain attribute (not a Module or array): no parameters of its own
        self.index = index

    def __call__(self, x: mx.array) -> mx.array:
        return self.shared.output(x, self.index)


def fuse_projections(model: nn.Module) -> int:
    """Fuse every group of GROUPS found on one module of `model`, in place; returns how many groups were fused.
    A model fused before has none left to fuse."""
    fused = 0
    for _, module in list(model.named_modules()):
        for names in GROUPS:
            parts = [module.get(name) for name in names] if isinstance(module, dict) else []
            linear = _concatenated(parts) if len(parts) == len(names) else None
            if linear is None:
                continue
            mx.eval(linear.parameters())  # the new arrays exist before the old ones are let go
            shared = _Shared(linear, [p["weight"].shape[0] for p in parts if p is not None])
            module["fused_" + "_".join(names)] = linear
            for index, name in enumerate(names):
                module[name] = ProjectionSlice(shared, index)
            fused += 1
    return fused


def _concatenated(parts: list) -> nn.Module | None:
    """One linear computing every part's output side by side, or None when the parts cannot be one."""
    kind: type[nn.Linear] | type[nn.QuantizedLinear]
    if all(type(p) is nn.Linear for p in parts):
        kind = nn.Linear
    elif all(type(p) is nn.QuantizedLinear for p in parts):
        kind = nn.QuantizedLinear
    else:
        return None
    arrays = [name for name in _ARRAYS if isinstance(parts[0].get(name), mx.array)]
    if any([name for name in _ARRAYS if isinstance(p.get(name), mx.array)] != arrays for p in parts):
        return None
    if any(set(p.keys()) - set(_ARRAYS) for p in parts):
        return None  # an array this module does not know how to join
    if any(p.weight.shape[1:] != parts[0].weight.shape[1:] or p.weight.dtype != parts[0].weight.dtype for p in parts):
        return None
    settings = {name: getattr(parts[0], name) for name in _SETTINGS if hasattr(parts[0], name)}
    if any({name: getattr(p, name, None) for name in settings} != settings for p in parts):
        return None
    # Built bare (no random initial weights to make and drop), then given the joined arrays and the settings.
    linear = dict.__new__(kind)
    nn.Module.__init__(linear)
    for name, value in settings.items():
        setattr(linear, name, value)
    for name in arrays:
        linear[name] = mx.concatenate([p[name] for p in parts], axis=0)
    if kind is nn.QuantizedLinear:
        linear.freeze()  # as mlx's own: its arrays are not trained
    return linear
