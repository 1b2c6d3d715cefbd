"""Sampling settings of the chat app and their translation into SamplingParams.

temperature / top_p left as None follow the model's recommended values (its generation_config.json,
mlxpaged.loading.generation_defaults), else SamplingParams' own defaults; a value the user gives wins.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mlxpaged.loading.generation_defaults import NO_DEFAULTS, GenerationDefaults
from mlxpaged.sampling_params import SamplingParams


@dataclass(frozen=True)
class ChatSettings:
    temperature: float | None = None  # None: the model's recommended value
    top_p: float | None = None
    max_tokens: int = 512
    seed: int | None = None

    def __post_init__(self) -> None:
        self.sampling_params()  # SamplingParams checks every field and names the bad one

    def chosen(self) -> dict:
        """The fields set (temperature / top_p left as None go to the model; a None seed is random)."""
        return {name: value for name, value in asdict(self).items() if value is not None}

    def sampling_params(self, defaults: GenerationDefaults = NO_DEFAULTS) -> SamplingParams:
        """What a reply samples with: the user's settings over the model's `defaults` (its top_k, min_p and
        repetition_penalty too; its max_new_tokens never: max_tokens is always the app's)."""
        return SamplingParams(**defaults.sampling_kwargs(self.chosen()))

    def describe(self, defaults: GenerationDefaults = NO_DEFAULTS) -> str:
        params = self.sampling_params(defaults)
        seed = "random" if self.seed is None else str(self.seed)
        return (
            f"temperature {params.temperature:g}{self._origin('temperature', defaults)} · "
            f"top_p {params.top_p:g}{self._origin('top_p', defaults)} · "
            f"max {self.max_tokens} tokens · seed {seed}"
        )

    def _origin(self, name: str, defaults: GenerationDefaults) -> str:
        return " (model)" if getattr(self, name) is None and name in defaults.values else ""

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> ChatSettings:
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    @classmethod
    def parse(cls, temperature: str, top_p: str, max_tokens: str, seed: str) -> ChatSettings:
        """Settings from the form's text fields (an empty temperature / top_p: the model's); ValueError
        names the field that is wrong."""
        return cls(
            temperature=_optional("temperature", temperature, float),
            top_p=_optional("top_p", top_p, float),
            max_tokens=_number("max tokens", max_tokens, int),
            seed=_optional("seed", seed, int),
        )


def _optional(name: str, text: str, kind: type):
    return None if not text.strip() else _number(name, text, kind)


def _number(name: str, text: str, kind: type):
    try:
        return kind(text.strip())
    except ValueError:
        wanted = "an integer" if kind is int else "a number"
        raise ValueError(f"{name} must be {wanted}, got {text.strip()!r}") from None
