"""mlx-lm's SwiGLU routed to the CPU backend's (kernels/cpu_activations.py) while the engine builds its passes.

mlx-lm (and mlx-vlm) model modules import ``swiglu`` from their library's activations module by name, as they do
their attention (routing.py), so each module's binding, the activations module's own included (a model module
imported later binds the dispatcher), is replaced by a dispatcher. It takes the CPU variant only while this thread
builds one of the engine's passes (``engine_activations``: model_runner.py, and the prefills that score prompts and
calibrate quantized pages, which run the engine's numerics); every other caller (mlx-lm's own generate_step, the
benches' mlx-lm side, the MTP and DFlash drafters' own layers) gets the library's function. Routed only on the CPU
backend (``route_for_backend``, platform/backend.py ``Tuning.cpu_swiglu``). Models that write ``nn.silu(gate) * x``
themselves keep it.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from mlxpaged.kernels.cpu_activations import swiglu_cpu, swiglu_cpu_applies
from mlxpaged.platform import backend

import mlx.core as mx

_BUILDING = threading.local()  # `active` while this thread builds an engine pass
_DISPATCHERS: dict[str, Callable[..., mx.array]] = {}  # activations module -> the dispatcher for its swiglu


@contextmanager
def engine_activations() -> Iterator[None]:
    """Within the block, this thread's routed ``swiglu`` calls take the CPU variant."""
    previous = getattr(_BUILDING, "active", False)
    _BUILDING.active = True
    try:
        yield
    finally:
        _BUILDING.active = previous


def _dispatcher_for(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def swiglu(gate: mx.array, x: mx.array) -> mx.array:
        if getattr(_BUILDING, "active", False) and swiglu_cpu_applies(gate, x):
            return swiglu_cpu(gate, x)
        return original(gate, x)

    swiglu.original = original  # type: ignore[attr-defined]
    return swiglu


def route_cpu_activations() -> int:
    """Point every loaded mlx-lm (and mlx-vlm, when imported) module's ``swiglu`` at its library's dispatcher; returns
    how many modules are routed. Idempotent; call after loading a model (its module is imported lazily)."""
    import mlx_lm.models.activations  # noqa: F401  (mlx-vlm's is routed only once something imported it)

    routes: dict[Any, Callable[..., mx.array]] = {}  # a library's swiglu -> its dispatcher
    for name in ("mlx_lm.models.activations", "mlx_vlm.models.activations"):
        activations = sys.modules.get(name)
        if activations is None:
            continue
        if name not in _DISPATCHERS:
            _DISPATCHERS[name] = _dispatcher_for(activations.swiglu)
        dispatcher = _DISPATCHERS[name]
        routes[dispatcher.original] = dispatcher  # type: ignore[attr-defined]
    routed = 0
    loaded: list[tuple[str, Any]] = list(sys.modules.items())  # Any: modules get an attribute set
    for name, module in loaded:
        if not name.startswith(("mlx_lm.models.", "mlx_vlm.models.")):
            continue
        bound = getattr(module, "swiglu", None)
        if bound in routes:
            module.swiglu = routes[bound]
        routed += getattr(module, "swiglu", None) in _DISPATCHERS.values()
    return routed


def route_for_backend() -> None:
    """``route_cpu_activations`` where this backend takes the CPU variant (after loading a model)."""
    if backend.tuning().cpu_swiglu:
        route_cpu_activations()
