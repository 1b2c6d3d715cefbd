"""Whether the base model an adapter's config names (`model`: what `mlx_lm.lora --model` was given) is the model an
engine runs, by name: an adapter whose layers fit but was trained on another model of the same shapes (an instruct
model's adapter on the base model, a 7B's on another 7B) would generate without an error, and wrongly.

mlx_lm.lora is given a Hugging Face id (`Qwen/Qwen3-4B`), a converted copy's id (`mlx-community/Qwen3-4B-4bit`) or a
local directory, and the same model is served under other such names and quantizations: a QLoRA adapter trained on
the 4-bit copy serves on the 8-bit one. So names are compared by their last path component, lower-cased, without
the suffixes that name a precision or a format (`-4bit`, `-bf16`, `-float32`, `-mlx`, `.Q4_1`, `.gguf`, ...); a path
to the model's own directory matches too. An adapter whose config names no model is taken on its shapes alone.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

_FORMAT = re.compile(
    r"[-_.](mlx|gguf|\d+-?bits?|bf16|fp16|f16|f32|fp32|float16|float32|bfloat16|dwq|mxfp4|nvfp4|awq|gptq|q\d(_k)?(_[a-z0-9]+)?)$"
)


def normalized(name: str) -> str:
    """A model name without its owner, directory, precision and format: `mlx-community/Qwen3-4B-4bit` -> `qwen3-4b`."""
    last = re.split(r"[/\\]", name.strip().rstrip("/\\"))[-1].lower()
    while True:
        shorter = _FORMAT.sub("", last)
        if shorter == last or not shorter:
            return last
        last = shorter


def names_model(named: str, names: Iterable[str], path: Path | None = None) -> bool:
    """True when `named` (an adapter config's `model`) is one of the model's `names` up to precision and format, or a
    path to the model's directory `path`."""
    wanted = normalized(named)
    if any(normalized(name) == wanted for name in names if name):
        return True
    if path is not None:
        try:
            return Path(named).expanduser().resolve() == path.resolve()
        except OSError:
            return False
    return False
