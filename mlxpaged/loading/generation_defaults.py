"""The model's own sampling defaults, read from its generation_config.json (and its preset).

As vLLM's `--generation-config auto`: only repetition_penalty, temperature, top_k, top_p, min_p and
max_new_tokens (as max_tokens) are taken; every other key (do_sample, eos_token_id, ...) is ignored, and
do_sample is not honoured (vLLM ignores it too). Precedence, everywhere: a field the caller sets > the
model's default > SamplingParams' own default (the plain API default). `SamplingParams()` alone never
reads these: `Engine.default_sampling_params()` does.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlxpaged.errors import GenerationConfigError
from mlxpaged.sampling_params import SamplingParams

if TYPE_CHECKING:
    from mlxpaged.loading.model_store import Preset

GENERATION_CONFIG = "generation_config.json"
# generation_config.json key -> SamplingParams field
KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass(frozen=True)
class GenerationDefaults:
    values: dict = field(default_factory=dict)  # SamplingParams field -> value
    source: str = "none"  # "generation_config.json", "preset NAME", both joined by " + ", or "none"

    def sampling_kwargs(self, explicit: Mapping[str, object]) -> dict:
        """SamplingParams keyword arguments: each field in `explicit` (what the caller set), else the model's
        default; fields in neither are left out, so SamplingParams' own defaults apply."""
        return {**self.values, **explicit}

    def describe(self) -> str:
        """'temperature 0.2, top_p 0.9 (from preset smollm2-135m)', or what applies when there are none."""
        if not self.values:
            return "none: the API defaults apply" + (f" ({self.source})" if self.source != "none" else "")
        shown = ", ".join(
            f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}"
            for name, value in self.values.items()
        )
        return f"{shown} (from {self.source})"


NO_DEFAULTS = GenerationDefaults()


def parse_generation_config(data: object, where: str) -> dict:
    """The sampling defaults in a generation_config.json object, as SamplingParams fields; `where` names
    the file in errors. Unknown keys and nulls are ignored; a value SamplingParams refuses is an error."""
    if not isinstance(data, dict):
        raise GenerationConfigError(f"{where}: expected a JSON object, got a JSON {type(data).__name__}")
    values: dict[str, Any] = {}  # JSON values; SamplingParams checks each
    for key, name in KEYS.items():
        value: Any = data.get(key)  # any JSON value: SamplingParams checks it
        if value is None:
            continue
        if name == "top_k" and value == -1 and not isinstance(value, bool):
            value = 0  # vLLM and HF spell "off" -1 or 0; SamplingParams spells it 0
        try:
            SamplingParams(**{name: value})
        except ValueError as exc:  # its message starts with the field's name: show the file's key
            raise GenerationConfigError(f"{where}: {str(exc).replace(name, key, 1)}") from None
        values[name] = value
    return values


def read_generation_config(model_dir: Path) -> dict | None:
    """The defaults in `model_dir`/generation_config.json, or None when the file does not exist."""
    path = Path(model_dir) / GENERATION_CONFIG
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise GenerationConfigError(f"cannot read {path}: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise GenerationConfigError(
            f"{path} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from None
    return parse_generation_config(data, str(path))


def load_defaults(model_dir: Path | None, preset: Preset | None = None) -> GenerationDefaults:
    """The model's sampling defaults: its generation_config.json, with keys it lacks filled from the preset's
    `generation` table (models/presets.toml; directories converted before the table existed need this)."""
    from_file = read_generation_config(model_dir) if model_dir is not None else None
    from_preset = {}
    if preset is not None and preset.generation:
        from_preset = parse_generation_config(preset.generation, f"presets.toml [presets.{preset.name!r}.generation]")
    file_values = from_file or {}
    filled = {k: v for k, v in from_preset.items() if k not in file_values}
    sources = ([GENERATION_CONFIG] if file_values else []) + ([f"preset {preset.name}"] if filled and preset else [])
    return GenerationDefaults({**file_values, **filled}, " + ".join(sources) or "none")
