"""memory.py: an embedding model that cannot fit is refused before its weights load, with the numbers."""

from __future__ import annotations

from mlxpaged.embedding.memory import activation_bytes_per_token, check_fits
from mlxpaged.errors import InsufficientMemoryError
from mlxpaged.platform.memory import DeviceFacts, os_reserve_bytes
from tests.embedding.tiny_embedding import tiny_embedding_config, write_tiny_embedding_dir

import pytest

GIB = 2**30


def test_weights_activations_and_reserve_against_the_limit(tmp_path):
    model_dir = write_tiny_embedding_dir(tmp_path / "m", "last")
    config = tiny_embedding_config()
    # The checkpoint's weights, but not its lm_head (load.py drops it): embed_tokens + layers + norm, float32.
    head = config["vocab_size"] * config["hidden_size"] * 4
    total_file = sum(p.stat().st_size for p in model_dir.glob("model*.safetensors"))
    roomy = DeviceFacts("cpu", 16 * GIB, 8 * GIB)
    needed = check_fits(model_dir, "cpu", 2048, roomy)
    activations = 2048 * activation_bytes_per_token(config, 4)
    assert 0 < needed - activations - os_reserve_bytes(16 * GIB) < total_file - head + 1  # header bytes aside
    tight = DeviceFacts("cpu", 16 * GIB, needed - 1)
    with pytest.raises(InsufficientMemoryError, match=r"model weights .* \+ activations of a 2,048-token pass") as err:
        check_fits(model_dir, "cpu", 2048, tight)
    assert (err.value.needed_bytes, err.value.available_bytes) == (needed, needed - 1)
    assert "--max-batch-tokens" in err.value.render("cli")


def test_activations_count_the_pass_kv_and_temporaries():
    config = tiny_embedding_config()  # 2 layers, 2 KV heads x 16, hidden 64, intermediate 128
    assert activation_bytes_per_token(config, 4) == 2 * 2 * 2 * 16 * 4 + (4 * 64 + 3 * 128) * 4
