"""What a model directory says about embeddings: the sentence-transformers files, read into an EmbeddingSpec.

The rule for "is this an embedding model": its directory holds a sentence-transformers pooling configuration
(`modules.json` naming a `Pooling` module, or `1_Pooling/config.json` without a modules.json), or its preset in
presets.toml says how it pools (`pooling = "lasttoken"`, for converted copies that lost those files). Nothing else
counts: a generative model's hidden states were never trained to be compared, so one is refused rather than
answered with vectors that look plausible and mean little. config.json's `architectures` does not tell either way
(Qwen3-Embedding's says `Qwen3ForCausalLM`).

What is read, and the defaults when a file or key is absent:
  modules.json                     the pipeline: Transformer, then Pooling, then optional Normalize. No
                                   modules.json: Transformer + the pooling folder `1_Pooling`, no Normalize.
                                   A module of another kind (Dense, LayerNorm, ...) is refused: its weights would
                                   be skipped and the vectors wrong.
  <pooling folder>/config.json     exactly one of pooling_mode_lasttoken / pooling_mode_mean_tokens /
                                   pooling_mode_cls_token; none set: mean (sentence-transformers' default).
                                   Other modes (max, weighted mean, several at once) and include_prompt false
                                   are refused, naming the key.
  Normalize module                 vectors L2-normalized; absent: returned as pooled.
  config_sentence_transformers.json  `prompts` (name -> text put before an input) and `default_prompt_name`;
                                   absent: no prompts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from mlxpaged.errors import NotAnEmbeddingModelError, UnsupportedModelError

POOLING_MODES = {  # sentence-transformers' key -> our name
    "pooling_mode_lasttoken": "last",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
}
PRESET_POOLING = {"lasttoken": "last", "last": "last", "mean": "mean", "cls": "cls"}
_ST = "sentence_transformers.models."
_KNOWN_MODULES = {"Transformer", "Pooling", "Normalize"}
_OTHER_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class EmbeddingSpec:
    """How one model turns hidden states into an embedding."""

    pooling: str  # "last" (the last real token), "mean" (over real tokens) or "cls" (the first token)
    normalize: bool  # L2-normalize the pooled vector (a Normalize module)
    prompts: dict[str, str] = field(default_factory=dict)  # prompt name -> text put before the input
    default_prompt_name: str | None = None
    source: str = ""  # where the spec came from, for messages

    def describe(self) -> str:
        norm = "L2-normalized" if self.normalize else "not normalized"
        return f"{self.pooling} pooling, {norm} (from {self.source})"


def embedding_spec(model_dir: Path, preset_options: dict | None = None) -> EmbeddingSpec:
    """The model's EmbeddingSpec; NotAnEmbeddingModelError (saying why) when it is not an embedding model,
    UnsupportedModelError when its pipeline has parts this package does not run."""
    modules = _read_json(model_dir / "modules.json")
    if modules is not None:
        spec = _from_modules(model_dir, modules)
    elif (model_dir / "1_Pooling" / "config.json").exists():
        spec = EmbeddingSpec(_pooling(model_dir / "1_Pooling" / "config.json"), False, source="1_Pooling/config.json")
    elif preset_options and "pooling" in preset_options:
        spec = _from_preset(preset_options)
    else:
        raise NotAnEmbeddingModelError(
            f"{model_dir.name} is not an embedding model: its directory has no sentence-transformers pooling "
            "configuration (modules.json naming a Pooling module, or 1_Pooling/config.json), so nothing says how its "
            "hidden states become one vector; a generative model's hidden states are not trained as embeddings"
        )
    prompts, default = _prompts(model_dir)
    return EmbeddingSpec(spec.pooling, spec.normalize, prompts, default, spec.source)


def is_embedding_model(model_dir: Path, preset_options: dict | None = None) -> bool:
    """Whether `model_dir` is an embedding model by the rule above (its pipeline may still be refused at load)."""
    try:
        embedding_spec(model_dir, preset_options)
    except NotAnEmbeddingModelError:
        return False
    except UnsupportedModelError:
        return True
    return True


def refuse_generation(model_dir: Path, name: str, preset_options: dict | None = None) -> None:
    """UnsupportedModelError when `model_dir` is an embedding model: its hidden states are trained to be pooled,
    not to predict tokens, so the Engine refuses it at load rather than generate text that means nothing."""
    if is_embedding_model(model_dir, preset_options):
        raise UnsupportedModelError(
            f"{name} is an embedding model (its sentence-transformers files say how it pools), not a generative one: "
            "`mlxpaged serve` answers /v1/embeddings and /api/embed with it, or load it with mlxpaged.Embedder"
        )


def _from_modules(model_dir: Path, modules: object) -> EmbeddingSpec:
    if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
        raise UnsupportedModelError(f"{model_dir / 'modules.json'} is not a list of modules")
    kinds = [str(m.get("type", "")).removeprefix(_ST) for m in modules]
    unknown = [kind for kind in kinds if kind not in _KNOWN_MODULES]
    if unknown:
        raise UnsupportedModelError(
            f"{model_dir.name}'s sentence-transformers pipeline has modules this server does not run: "
            f"{', '.join(unknown)} (supported: Transformer, Pooling, Normalize)"
        )
    pooling = [m for m, kind in zip(modules, kinds, strict=True) if kind == "Pooling"]
    if not pooling:
        raise NotAnEmbeddingModelError(
            f"{model_dir.name} is not an embedding model: its modules.json names no Pooling module"
        )
    config = model_dir / str(pooling[0].get("path", "1_Pooling")) / "config.json"
    return EmbeddingSpec(_pooling(config), "Normalize" in kinds, source="modules.json")


def _pooling(config_path: Path) -> str:
    config = _read_json(config_path) or {}  # an absent config.json: the Pooling module's defaults
    if not isinstance(config, dict):
        raise UnsupportedModelError(f"{config_path} is not a JSON object")
    other = [key for key in _OTHER_MODES if config.get(key)]
    modes = [name for key, name in POOLING_MODES.items() if config.get(key)]
    if other or len(modes) > 1:
        raise UnsupportedModelError(
            f"{config_path}: pooling {', '.join([*other, *(k for k in POOLING_MODES if config.get(k))])} is not "
            "supported (one of pooling_mode_lasttoken, pooling_mode_mean_tokens, pooling_mode_cls_token)"
        )
    if config.get("include_prompt") is False:
        raise UnsupportedModelError(f"{config_path}: include_prompt false (prompt tokens left out) is not supported")
    return modes[0] if modes else "mean"


def _from_preset(options: dict) -> EmbeddingSpec:
    pooling = PRESET_POOLING.get(str(options["pooling"]))
    if pooling is None:
        raise UnsupportedModelError(
            f"preset pooling {options['pooling']!r} is not one of {', '.join(sorted(PRESET_POOLING))}"
        )
    return EmbeddingSpec(pooling, bool(options.get("normalize", False)), source="presets.toml")


def _prompts(model_dir: Path) -> tuple[dict[str, str], str | None]:
    config = _read_json(model_dir / "config_sentence_transformers.json")
    if not isinstance(config, dict):
        return {}, None
    prompts = config.get("prompts") or {}
    prompts = {str(k): str(v) for k, v in prompts.items()} if isinstance(prompts, dict) else {}
    default = config.get("default_prompt_name")
    return prompts, default if isinstance(default, str) and default in prompts else None


def _read_json(path: Path) -> object | None:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UnsupportedModelError(f"{path} cannot be read as JSON: {exc}") from None
