"""The adapters an engine serves, by name, attached to its model: each is checked against the model's layers
(every layer it names exists, is linear or a mixture-of-experts switch layer, and has the widths and experts its
weights were trained on) before any layer is wrapped, so an adapter for another base model is refused whole, with
the layers that do not fit, at load; one whose layers fit but whose config names another model (base_model.py) is
refused too, naming both.

Attaching wraps each adapted layer once (layers.py `AdaptedLinear`), whatever number of adapters adapt it; a
request names its adapter and the runner tells the wrapped layers which rows use which (`rows`). Adapters may be
added and removed while the engine runs (`add`, `remove`), on the engine thread between steps (Engine.add_adapter):
a pass already built holds the arrays it read, and a layer wrapped later was the same base layer before.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from mlxpaged.adapters.base_model import names_model
from mlxpaged.adapters.files import AdapterFiles, read_adapter
from mlxpaged.adapters.layers import (
    AdaptedLinear,
    AdaptedSwitchLinear,
    LinearBase,
    LowRankUpdate,
    PassRows,
    SwitchBase,
    SwitchUpdate,
    linear_dims,
)
from mlxpaged.errors import AdapterError, UnknownAdapterError
from mlxpaged.loading.fused_projections import ProjectionSlice

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

AdapterSource = str | Path | AdapterFiles  # an adapter directory, or one read already (read_adapter)
BaseLayer = LinearBase | SwitchBase
AdaptedLayer = AdaptedLinear | AdaptedSwitchLinear
_SHOWN = 6  # problems listed in a refusal; the rest are counted


@dataclass(frozen=True)
class Adapter:
    """One served adapter: its name, what its files hold, and how many layers it adapts in this model."""

    name: str
    files: AdapterFiles

    @property
    def id(self) -> str:
        """What requests and the prefix cache know it by: its files' digest (a retrained adapter is another one)."""
        return self.files.digest

    def describe(self) -> dict:
        f = self.files
        return {
            "path": str(f.path),
            "fine_tune_type": f.kind,  # mlx-lm's name for it
            "rank": f.rank,
            "scale": f.scale,
            "layers": len(f.modules),
            "bytes": f.nbytes,
            "trained_on": f.base_model,
            "digest": f.digest,
        }


def read_adapters(adapters: Mapping[str, AdapterSource]) -> dict[str, AdapterFiles]:
    """Each adapter's files read and checked on their own (AdapterError naming the bad one)."""
    out = {}
    for name, source in adapters.items():
        if not isinstance(name, str) or not name.strip() or name != name.strip():
            raise AdapterError(f"adapter name {name!r}: a name is a non-empty string without surrounding spaces")
        out[name] = source if isinstance(source, AdapterFiles) else read_adapter(source)
    return out


class AdapterSet:
    """Adapters attached to one model's layers, by name."""

    def __init__(
        self,
        model: nn.Module,
        adapters: Mapping[str, AdapterSource] | None = None,
        model_names: Sequence[str] = (),
        model_path: Path | None = None,
    ):
        """`model_names` and `model_path`: what the model is known by (LoadedModel.names) and its directory, which an
        adapter's config must name if it names a base model; none given: adapters are taken on their shapes alone."""
        self.rows = PassRows()
        self._model = model
        self._names, self._path = list(model_names), model_path
        self._by_name: dict[str, Adapter] = {}
        chosen = [Adapter(name, files) for name, files in read_adapters(adapters or {}).items()]
        bases = [self._checked_layers(adapter) for adapter in chosen]  # every one checked before any is attached
        for adapter, layers in zip(chosen, bases, strict=True):
            self._attach(model, adapter, layers)

    def add(self, name: str, source: AdapterSource) -> Adapter:
        """Attach one more adapter (AdapterError if its name is taken or it does not fit: nothing changes then)."""
        adapter, layers = self._checked(name, source)
        self._attach(self._model, adapter, layers)
        return adapter

    def check(self, name: str, source: AdapterSource) -> Adapter:
        """The adapter `add` would attach, checked against the model without attaching it (AdapterError)."""
        return self._checked(name, source)[0]

    def _checked(self, name: str, source: AdapterSource) -> tuple[Adapter, dict[str, BaseLayer]]:
        if name in self._by_name:
            raise AdapterError(f"an adapter named {name!r} is served already")
        adapter = Adapter(name, read_adapters({name: source})[name])
        return adapter, self._checked_layers(adapter)

    def known_as(self, names: Sequence[str]) -> None:
        """More names adapters may give for the model (a server's aliases for it, a base its catalog matched)."""
        self._names.extend(n for n in names if n not in self._names)

    def _checked_layers(self, adapter: Adapter) -> dict[str, BaseLayer]:
        """The layers the adapter adapts, after its shapes and its base model's name are checked (AdapterError)."""
        layers = self._fitting_layers(self._model, adapter)
        base = adapter.files.base_model
        if base is not None and self._names and not names_model(base, self._names, self._path):
            raise AdapterError(
                f'adapter {adapter.name!r} ({adapter.files.path}) was trained on {base!r} ("model" in its '
                f"adapter_config.json), not on this model ({self._names[0]!r}); if that is this model under another "
                f'name, set its "model" to {self._names[0]!r}'
            )
        return layers

    def remove(self, name: str) -> Adapter:
        """Detach the adapter `name` (UnknownAdapterError if there is none); its layers stay wrapped, and compute
        the base model's output for rows without an adapter of theirs."""
        adapter = self.resolve(name)
        del self._by_name[name]
        if not any(other.id == adapter.id for other in self._by_name.values()):  # the same files under another name
            for module in self._model.modules():
                if isinstance(module, AdaptedLinear | AdaptedSwitchLinear):
                    module.updates.remove(adapter.id)
            self.rows.one_adapter_per_pass = self._adapts_switch_layers()
        return adapter

    def has_id(self, adapter_id: str) -> bool:
        return any(adapter.id == adapter_id for adapter in self._by_name.values())

    @property
    def names(self) -> list[str]:
        return list(self._by_name)

    @property
    def nbytes(self) -> int:
        return sum(a.files.nbytes for a in {a.id: a for a in self._by_name.values()}.values())

    def __len__(self) -> int:
        return len(self._by_name)

    def resolve(self, name: str) -> Adapter:
        """The adapter called `name`; UnknownAdapterError listing the ones there are."""
        adapter = self._by_name.get(name)
        if adapter is None:
            known = ", ".join(repr(n) for n in self._by_name) or "none"
            raise UnknownAdapterError(f"unknown adapter {name!r}; this engine serves: {known}")
        return adapter

    def describe(self) -> dict[str, dict]:
        return {name: adapter.describe() for name, adapter in self._by_name.items()}

    def _adapts_switch_layers(self) -> bool:
        return any(isinstance(m, AdaptedSwitchLinear) and m.updates for m in self._model.modules())

    def _fitting_layers(self, model: nn.Module, adapter: Adapter) -> dict[str, BaseLayer]:
        """The base layer of each module the adapter names; AdapterError listing those that do not fit."""
        files = adapter.files
        layers = dict(model.named_modules())
        bases: dict[str, BaseLayer] = {}
        problems = []
        for path, update in files.modules.items():
            layer = layers.get(path)
            base = layer.linear if isinstance(layer, AdaptedLinear | AdaptedSwitchLinear) else layer
            if layer is None:
                problems.append(f"{path}: this model has no such layer")
            elif isinstance(layer, ProjectionSlice):
                problems.append(
                    f"{path}: fused with its group's projections for speed on this GPU (loading/fused_projections.py); "
                    "give the adapter when the model loads (adapters=, serve --lora) and its group stays apart"
                )
            elif path.rsplit(".", 1)[-1] == "lm_head":  # it reads the sampled positions only, not the pass's rows
                problems.append(f"{path}: adapters of the LM head are not served yet")
            elif isinstance(base, SwitchLinear | QuantizedSwitchLinear):
                if update.experts is None:
                    problems.append(
                        f"{path}: a switch layer of {base.num_experts} experts, the adapter's is a linear's"
                    )
                elif (update.experts, *update.dims) != (base.num_experts, base.input_dims, base.output_dims):
                    ours = f"{base.num_experts} experts of {base.input_dims} inputs to {base.output_dims} outputs"
                    theirs = f"{update.experts} of {update.dims[0]} to {update.dims[1]}"
                    problems.append(f"{path}: {ours}, the adapter's {theirs}")
                bases[path] = base
            elif not isinstance(base, nn.Linear | nn.QuantizedLinear):
                problems.append(f"{path}: a {type(base).__name__}, not a linear or switch layer")
            elif update.experts is not None:
                problems.append(f"{path}: a linear layer, the adapter's update is a switch layer's ({update.experts})")
            else:
                width, out = linear_dims(base)
                got = update.dims
                if got != (width, out):
                    problems.append(f"{path}: takes {width} inputs to {out} outputs, the adapter {got[0]} to {got[1]}")
                bases[path] = base
        if problems:
            more = f"\n  ... and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
            named = f", trained on {files.base_model!r}" if files.base_model else ""
            raise AdapterError(
                f"adapter {adapter.name!r} ({files.path}{named}) does not fit this model:\n  "
                + "\n  ".join(problems[:_SHOWN])
                + more
            )
        return bases

    def _attach(self, model: nn.Module, adapter: Adapter, bases: dict[str, BaseLayer]) -> None:
        files, layers = adapter.files, dict(model.named_modules())
        wrapped: list[tuple[str, AdaptedLayer]] = []
        for path, base in bases.items():
            layer = layers[path]
            if isinstance(base, SwitchLinear | QuantizedSwitchLinear):
                switch = layer if isinstance(layer, AdaptedSwitchLinear) else AdaptedSwitchLinear(base, self.rows)
                if switch is not layer:
                    wrapped.append((path, switch))
                switch_update = SwitchUpdate(files.modules[path], files.scale)
                mx.eval(switch_update.arrays())
                switch.updates.add(adapter.id, switch_update)
                continue
            linear = layer if isinstance(layer, AdaptedLinear) else AdaptedLinear(base, self.rows)
            if linear is not layer:
                wrapped.append((path, linear))
            update = LowRankUpdate(files.modules[path], files.scale, files.kind == "dora", base)
            mx.eval(update.arrays())  # on the caller's thread, as the model's own weights are
            linear.updates.add(adapter.id, update)
        if wrapped:
            model.update_modules(tree_unflatten(wrapped))
        self._by_name[adapter.name] = adapter
        self.rows.one_adapter_per_pass = self._adapts_switch_layers()
