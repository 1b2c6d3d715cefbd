"""The engine on the kernel path with the CPU harness as its launcher: a correct kernel is kept and
decodes; a broken one (wrong numbers, or a source that does not compile) is replaced by the reference
with one warning, and generation still matches mlx-lm token for token."""

import warnings
from contextlib import contextmanager

import mlxpaged  # noqa: F401
from mlxpaged.kernels import attention
from mlxpaged.sampling_params import SamplingParams
from tests.engine.test_engine import reference_tokens, tiny_engine
from tests.kernels.test_kernel_self_check import NOT_COMPILING, WRONG_REDUCE, WRONG_SCALE, mutate  # noqa: F401 (fixture)
from tests.msl.harness import Emulator
from tests.msl.oracle import make_decode_case, max_error
from tests.tiny_models import random_tokens, tiny_llama

import mlx.core as mx
import pytest


class CountingEmulator(Emulator):
    """The CPU harness, counting the kernel launches it runs."""

    calls = 0

    def __call__(self, kernel, **call):
        self.calls += 1
        return super().__call__(kernel, **call)


@contextmanager
def kernel_path(launcher):
    """The "kernel" attention backend, its kernels run by `launcher`."""
    with attention.kernel_launcher(launcher), attention.attention_backend("kernel"):
        yield


def self_check_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "self-check" in str(w.message)]


@pytest.fixture(scope="module")
def tokenizer(default_loaded):
    return default_loaded.tokenizer


@pytest.fixture(scope="module")
def model():
    """Llama with 4 query heads of 32 dims over 2 KV heads: kernel variants float32 D=32 BS=8 G=2."""
    return tiny_llama(head_dim=32)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def test_a_correct_kernel_is_kept_and_decodes_through_it(model, tokenizer):
    launcher, prompt, steps = CountingEmulator(), random_tokens(11, seed=3), 4
    with kernel_path(launcher), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with tiny_engine(model, tokenizer) as engine:
            status = engine.stats()["attention"]
            checked = launcher.calls
            got = engine.generate([prompt], greedy(steps))[0]
    assert self_check_warnings(record) == []
    assert status["path"] == "kernel" and "self-check passed" in status["reason"]
    assert [(c.variant.describe(), c.ok) for c in status["variants"]] == [
        ("float32 D=32 BS=8 G=2 one-pass", True),
        ("float32 D=32 BS=8 G=2 two-pass", True),
    ]
    # The self-check: one launch for one pass, two (partials + merge) for two passes; then the load-time
    # batch check's decode step (runner/batch_check.py): both rows together, then each alone, 3 layers each.
    assert checked == 3 + 3 * 3
    assert launcher.calls - checked == 3 * (steps - 1)  # every layer of every decode step ran the kernel
    assert got.token_ids == reference_tokens(model, prompt, steps)


@pytest.mark.parametrize(
    "mutation,reason",
    [(WRONG_SCALE, "mismatch: max error"), (NOT_COMPILING, "compile error:")],
    ids=["wrong_numbers", "does_not_compile"],
)
def test_a_broken_kernel_falls_back_to_the_reference(model, tokenizer, mutate, mutation, reason):
    mutate(mutation)
    launcher = CountingEmulator()
    prompts = [random_tokens(13, seed=1), random_tokens(30, seed=2)]
    with kernel_path(launcher), warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with tiny_engine(model, tokenizer) as engine:
            status = engine.stats()["attention"]
            checked = launcher.calls
            got = engine.generate(prompts, greedy(12))
        with tiny_engine(model, tokenizer):
            pass  # a second engine in the process: no second warning
    (message,) = self_check_warnings(record)
    assert f"float32 D=32 BS=8 G=2 one-pass ({reason}" in message
    assert f"float32 D=32 BS=8 G=2 two-pass ({reason}" in message
    assert "reference path attends for them instead" in message
    assert status["path"] == "reference" and reason in status["reason"]
    assert [c.ok for c in status["variants"]] == [False, False]
    assert launcher.calls == checked  # decoding never launched the broken kernel
    assert [c.token_ids for c in got] == [reference_tokens(model, p, 12) for p in prompts]


def test_only_the_failing_variant_falls_back(mutate):
    mutate(WRONG_REDUCE)  # the two-pass merge is wrong, one pass is right
    launcher = CountingEmulator()
    with kernel_path(launcher), pytest.warns(RuntimeWarning) as record:
        status = attention.prepare_attention(mx.float32, 64, 16, 2, 1).status()
        checked = launcher.calls
        short = make_decode_case(4, [5, 40], 2, 1, 64, 16)  # one pass
        short_out = attention.paged_attention(*short.args())
        long = make_decode_case(5, [2100], 2, 1, 64, 16)  # 1 sequence x 1 KV head over 2100 tokens: two passes
        long_out = attention.paged_attention(*long.args())
    (message,) = self_check_warnings(record)
    assert "two-pass (mismatch" in message and "one-pass" not in message
    assert status["path"] == "kernel (with reference fallback)"
    assert "float32 D=64 BS=16 G=2 two-pass: mismatch" in status["reason"]
    assert launcher.calls == checked + 1  # the short case ran the kernel, the long one the reference
    assert max_error(short_out, short.expected()) < short.tolerance
    assert max_error(long_out, long.expected()) < long.tolerance


def test_the_cpu_backend_keeps_the_compiled_cpu_path(model, tokenizer, monkeypatch):
    monkeypatch.delenv(attention.ENV_VAR, raising=False)
    with tiny_engine(model, tokenizer) as engine:
        status = engine.stats()["attention"]
        assert engine.runner.decoder is not None  # compiled decode pass (decode_pass.py)
    assert status == {"path": "cpu", "reason": "MLX's CPU backend: pages read in place", "variants": []}
    with attention.attention_backend("cpu"):
        status = attention.prepare_attention(mx.float16, 64, 16, 4, 2).status()
    assert status["path"] == "reference" and "takes float32 K/V, this model's are float16" in status["reason"]


def test_shapes_the_kernel_cannot_take_use_the_reference_without_a_check():
    launcher = CountingEmulator()
    with kernel_path(launcher), warnings.catch_warnings():
        warnings.simplefilter("error")
        status = attention.prepare_attention(mx.float32, 16, 8, 4, 2).status()
    assert status["path"] == "reference" and "head dim 16" in status["reason"]
    assert status["variants"] == [] and launcher.calls == 0


def test_kernel_without_a_gpu_needs_a_launcher(monkeypatch):
    monkeypatch.setattr(attention, "gpu_kernel_available", lambda: False)
    with attention.attention_backend("kernel"):
        with pytest.raises(RuntimeError, match="no Metal GPU"):
            attention.resolved_backend()
        with attention.kernel_launcher(Emulator()):
            assert attention.resolved_backend() == "kernel"
