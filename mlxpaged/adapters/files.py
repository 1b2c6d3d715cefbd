"""An adapter directory as `mlx_lm.lora` writes it: `adapter_config.json` and `adapters.safetensors`, read and
checked on their own (before any model is touched), the way mlx-lm's `load_adapters` reads them.

The config says the kind (`fine_tune_type`: "lora" or "dora"; a "full" fine-tune is a model, not an adapter), the
scale of the low-rank update (`lora_parameters.scale`) and, where mlx_lm.lora saved its arguments, the base model it
was trained on (`model`). The weights name the layers they adapt: `<module path>.lora_a` [in, r],
`<module path>.lora_b` [r, out] and, for DoRA, `<module path>.m` [out]; a mixture-of-experts switch layer
(mlx-lm's `LoRASwitchLinear`, LoRA only) has one update per expert: lora_a [experts, r, in], lora_b [experts, out, r].
Those names are what is adapted: mlx-lm wraps the layers its config picks and loads this file into them, so the file
and the wrapped layers agree.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from mlxpaged.errors import AdapterError

import mlx.core as mx

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapters.safetensors"
KINDS = ("lora", "dora")
_LEAVES = ("lora_a", "lora_b", "m")


@dataclass(frozen=True)
class ModuleUpdate:
    """One layer's low-rank update: lora_a [in, r], lora_b [r, out] and DoRA's magnitude m [out] (None: LoRA, or a
    DoRA layer the file has no magnitude for, which mlx-lm starts at the base weight's row norms). A switch layer's:
    lora_a [experts, r, in], lora_b [experts, out, r]."""

    lora_a: mx.array
    lora_b: mx.array
    m: mx.array | None = None

    @property
    def experts(self) -> int | None:
        """The experts of the switch layer it adapts; None for a linear layer."""
        return int(self.lora_a.shape[0]) if self.lora_a.ndim == 3 else None

    @property
    def dims(self) -> tuple[int, int]:
        """(input width, output width) of the layer it was trained on."""
        if self.experts is not None:
            return int(self.lora_a.shape[2]), int(self.lora_b.shape[1])
        return int(self.lora_a.shape[0]), int(self.lora_b.shape[1])

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[1] if self.experts is not None else self.lora_a.shape[-1])


@dataclass(frozen=True)
class AdapterFiles:
    """What one adapter directory holds, checked for its own consistency (not yet against a model)."""

    path: Path
    kind: str  # "lora" or "dora"
    scale: float
    base_model: str | None  # the model mlx_lm.lora was given, when its config says
    digest: str  # of both files: the adapter's identity in the prefix cache (and on disk, across restarts)
    modules: dict[str, ModuleUpdate]  # module path -> its update

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for u in self.modules.values() for a in (u.lora_a, u.lora_b, u.m) if a is not None)

    @property
    def rank(self) -> int:
        return max(u.rank for u in self.modules.values())


def read_adapter(path: str | Path) -> AdapterFiles:
    """Read and check an adapter directory; AdapterError saying what is wrong (missing, corrupt, a kind or layer
    mlxpaged does not serve)."""
    path = Path(path).expanduser()
    if not path.is_dir():
        raise AdapterError(f"adapter directory {str(path)!r} does not exist")
    missing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if not (path / name).is_file()]
    if missing:
        raise AdapterError(f"{path} is not an mlx-lm adapter directory: it has no {' or '.join(missing)}")
    config_bytes = (path / CONFIG_FILE).read_bytes()
    kind, scale, base = _read_config(path, config_bytes)
    try:
        weights = mx.load(str(path / WEIGHTS_FILE))
    except Exception as exc:  # MLX raises RuntimeError / ValueError for a truncated or foreign file
        raise AdapterError(f"{path / WEIGHTS_FILE} cannot be read as safetensors ({exc})") from None
    if not isinstance(weights, dict) or not weights:
        raise AdapterError(f"{path / WEIGHTS_FILE} holds no tensors")
    modules = _modules(path, weights, kind)
    mx.eval(list(weights.values()))  # read now, on this thread: an engine thread may attach it later, on its stream
    digest = hashlib.sha256(config_bytes)
    with open(path / WEIGHTS_FILE, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return AdapterFiles(path, kind, scale, base, digest.hexdigest()[:32], modules)


def _read_config(path: Path, raw: bytes) -> tuple[str, float, str | None]:
    try:
        config = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise AdapterError(f"{path / CONFIG_FILE} is not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{path / CONFIG_FILE} is not a JSON object")
    kind = config.get("fine_tune_type", "lora")
    if kind == "full":
        raise AdapterError(f"{path} is a full fine-tune, not an adapter: serve it as a model of its own")
    if kind not in KINDS:
        raise AdapterError(f"{path}: fine_tune_type {kind!r} is not one of {', '.join(KINDS)}")
    params = config.get("lora_parameters")
    if not isinstance(params, dict) or not isinstance(params.get("scale"), int | float):
        hint = (
            " (mlx-lm's LoRA config takes 'scale', not 'alpha')"
            if isinstance(params, dict) and "alpha" in params
            else ""
        )
        raise AdapterError(f"{path / CONFIG_FILE} has no lora_parameters.scale{hint}")
    base = config.get("model")
    return kind, float(params["scale"]), base if isinstance(base, str) else None


def _modules(path: Path, weights: dict[str, mx.array], kind: str) -> dict[str, ModuleUpdate]:
    leaves: dict[str, dict[str, mx.array]] = {}
    for name, array in weights.items():
        module, _, leaf = name.rpartition(".")
        if leaf not in _LEAVES or not module or (leaf == "m" and kind != "dora"):
            raise AdapterError(f"{path / WEIGHTS_FILE}: {name!r} is not a {kind.upper()} adapter tensor")
        leaves.setdefault(module, {})[leaf] = array
    modules = {}
    for module, parts in sorted(leaves.items()):
        a, b, m = parts.get("lora_a"), parts.get("lora_b"), parts.get("m")
        if a is None or b is None:
            raise AdapterError(f"{path / WEIGHTS_FILE}: {module} has {'lora_b' if a is None else 'lora_a'} only")
        if a.ndim not in (2, 3) or b.ndim != a.ndim:
            raise AdapterError(
                f"{path / WEIGHTS_FILE}: {module}'s lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)} are neither a "
                "linear layer's update (2-d) nor a switch layer's (3-d, one per expert)"
            )
        if a.ndim == 3 and kind == "dora":
            raise AdapterError(f"{path}: {module} is a switch (mixture-of-experts) layer, which DoRA does not adapt")
        agree = a.shape[1] == b.shape[0] if a.ndim == 2 else (a.shape[0] == b.shape[0] and a.shape[1] == b.shape[2])
        if not agree:
            raise AdapterError(
                f"{path / WEIGHTS_FILE}: {module}'s lora_a {tuple(a.shape)} and lora_b {tuple(b.shape)} disagree on "
                "the rank" + (" or the experts" if a.ndim == 3 else "")
            )
        if m is not None and tuple(m.shape) != (b.shape[1],):
            raise AdapterError(f"{path / WEIGHTS_FILE}: {module}'s m {tuple(m.shape)} is not [{b.shape[1]}]")
        modules[module] = ModuleUpdate(a, b, m)
    return modules
