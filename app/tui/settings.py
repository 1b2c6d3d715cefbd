"""Sampling settings of the chat app and their translation into SamplingParams."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mlxpaged.runner.sampling import SamplingParams


@dataclass(frozen=True)
class ChatSettings:
    temperature: float = 0.7
    top_p: float = 1.0
    max_tokens: int = 512
    seed: int | None = None

    def __post_init__(self) -> None:
        self.sampling_params()  # SamplingParams checks every field and names the bad one

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature,
                              top_p=self.top_p, seed=self.seed)

    def describe(self) -> str:
        seed = "random" if self.seed is None else str(self.seed)
        return f"temperature {self.temperature:g} · top_p {self.top_p:g} · max {self.max_tokens} tokens · seed {seed}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "ChatSettings":
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    @classmethod
    def parse(cls, temperature: str, top_p: str, max_tokens: str, seed: str) -> "ChatSettings":
        """Settings from the form's text fields; ValueError names the field that is wrong."""
        return cls(temperature=_number("temperature", temperature, float),
                   top_p=_number("top_p", top_p, float),
                   max_tokens=_number("max tokens", max_tokens, int),
                   seed=None if not seed.strip() else _number("seed", seed, int))


def _number(name: str, text: str, kind: type):
    try:
        return kind(text.strip())
    except ValueError:
        wanted = "an integer" if kind is int else "a number"
        raise ValueError(f"{name} must be {wanted}, got {text.strip()!r}") from None
