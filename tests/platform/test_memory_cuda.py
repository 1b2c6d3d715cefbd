"""The KV plan on MLX's CUDA backend, from injected device facts: the device's total memory is the
limit, the weights always count against it, no wired limit; and DeviceFacts.detect on each backend."""

from __future__ import annotations

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.config import CacheConfig, SchedulerConfig
from mlxpaged.platform.memory import DeviceFacts, InsufficientMemoryError, KVShape, ModelFacts, plan_memory
from mlxpaged.units import format_size
from tests.platform.mx_stand_ins import CUDA_INFO, GiB, stand_in_mx, stand_in_psutil

import pytest

# An H200 as mx.device_info() reports it: 140.4 GiB in total, 139.2 GiB free before loading.
H200 = DeviceFacts("cuda", 150_754_820_096, 149_512_257_536, None, "NVIDIA H200")
# A 16 GB card (T4, V100-16GB): total_memory as cudaMemGetInfo reports it.
GPU_16GB = DeviceFacts("cuda", 15_828_320_256, 15_500_000_000, None, "Tesla T4")
# Llama-3-8B in bfloat16, kept so on a GPU: 32 layers, 8 KV heads of 128, 2-byte K/V; 16.06 GB of weights.
LLAMA3_8B = ModelFacts(KVShape(32, 8, 128, 2), 16_060_522_496, 4096, 128256, 8192)
LLAMA_ACTIVATIONS = 2048 * (4096 + 128256) * 4 * 2  # 2,168,455,168
BLOCK_BYTES = 32 * 8 * 128 * 2 * 2 * 16  # layers x heads x dim x (K, V) x 2 B x 16 tokens = 2 MiB


def test_h200_plan_starts_from_total_memory_and_counts_the_weights():
    plan = plan_memory(H200, LLAMA3_8B, CacheConfig(cache_tokens=1_000_000))
    reserve = 15_075_482_009  # 10% of total device memory
    left = 150_754_820_096 - reserve - 16_060_522_496 - LLAMA_ACTIVATIONS
    assert left == 117_450_360_423
    assert plan.num_blocks == int(left * 0.9) // BLOCK_BYTES == 50_404  # default 90% on CUDA
    assert plan.reason == (
        "limited by memory (default 90% of the 117.45 GB left); --cache-tokens 1,000,000 would need 62,516 blocks"
    )
    assert plan.breakdown[:4] == (
        ("CUDA device memory", 150_754_820_096),
        ("device reserve (10% of 150.75 GB device memory, min 1 GiB)", reserve),
        ("model weights", 16_060_522_496),
        ("activations (2048 tok x 132,352 x 4 B x 2)", LLAMA_ACTIVATIONS),
    )
    (_, limit), *parts = plan.breakdown
    assert sum(size for _, size in parts) == limit
    assert (plan.wired_limit_bytes, plan.wired_status) == (
        None,
        "not applicable on CUDA (wired memory, mx.set_wired_limit, is Metal's)",
    )
    assert plan.describe().startswith("KV cache plan (cuda)\n  CUDA device memory")


def test_weights_count_on_cuda_even_when_read_after_loading():
    """The CPU skips resident weights (psutil's available no longer holds them); the device's total
    memory still does, so the plan made after loading is the plan made before."""
    cache = CacheConfig(cache_tokens=1_000_000)
    after = plan_memory(H200, LLAMA3_8B, cache, weights_resident=True)
    assert after.breakdown[2] == ("model weights", 16_060_522_496)
    assert after.num_blocks == plan_memory(H200, LLAMA3_8B, cache).num_blocks == 50_404


def test_h200_default_settings_are_capped_by_demand():
    plan = plan_memory(H200, LLAMA3_8B, CacheConfig(), SchedulerConfig())
    assert plan.num_blocks == 16 * 8192 // 16  # 16 sequences of the model's 8,192-token context
    assert plan.reason.startswith("capped by model context 8,192 x 16 sequences (memory allows 50,404 blocks)")


def test_a_16gb_card_cannot_hold_bf16_llama3_8b():
    with pytest.raises(InsufficientMemoryError) as info:
        plan_memory(GPU_16GB, LLAMA3_8B, CacheConfig())
    message = str(info.value)
    assert message.startswith(
        "device reserve 1.58 GB + model weights 16.06 GB + activations 2.17 GB = 19.81 GB "
        "exceed the CUDA device memory of 15.83 GB"
    )
    assert info.value.available_bytes == 15_828_320_256


def test_kv_memory_beyond_what_is_left_names_the_numbers():
    with pytest.raises(InsufficientMemoryError, match=r"kv_memory=200\.00 GB.* is more than the 117\.45 GB left"):
        plan_memory(H200, LLAMA3_8B, CacheConfig(kv_memory=200 * 10**9))


# --- DeviceFacts.detect with stand-ins for each backend --------------------------------------------


def refusing_psutil():
    """On CUDA the plan reads the device, never host memory."""

    def refuse():
        raise AssertionError("psutil read on CUDA")

    return type("NoPsutil", (), {"virtual_memory": staticmethod(refuse)})


def test_detect_on_cuda_reads_the_devices_memory():
    facts = DeviceFacts.detect(stand_in_mx("cuda"), refusing_psutil())
    assert facts == DeviceFacts("cuda", CUDA_INFO["total_memory"], CUDA_INFO["free_memory"], None, "NVIDIA H200")
    assert facts.limit_bytes == CUDA_INFO["total_memory"] and facts.limit_label == "CUDA device memory"


def test_detect_on_metal_reads_the_working_set():
    facts = DeviceFacts.detect(stand_in_mx("metal"), stand_in_psutil(available=9_000_000_000))
    assert facts == DeviceFacts("metal", 16 * GiB, 9_000_000_000, 11_453_251_584, "Apple M2")
    assert facts.limit_bytes == 11_453_251_584


def test_detect_on_cpu_reads_host_memory(tmp_path):
    facts = DeviceFacts.detect(stand_in_mx("cpu"), stand_in_psutil(25 * GiB, 20 * GiB), cgroup_dir=str(tmp_path))
    assert facts == DeviceFacts("cpu", 25 * GiB, 20 * GiB, None, "AMD EPYC")
    assert facts.limit_bytes == 20 * GiB and facts.limit_label == "available host memory"


def test_detect_follows_the_default_device_not_the_build(tmp_path):
    """A CUDA build whose default device was set to the CPU computes, and allocates, on the host."""
    facts = DeviceFacts.detect(
        stand_in_mx("cuda", default_device="cpu"), stand_in_psutil(25 * GiB, 20 * GiB), cgroup_dir=str(tmp_path)
    )
    assert (facts.backend, facts.available_bytes) == ("cpu", 20 * GiB)


def test_the_kv_budget_a_pool_capped_by_demand_leaves_is_spare_for_decode_buffers():
    """MemoryPlan.spare_bytes: what runner/decode_buffers.py may copy the running rows' K/V into."""
    capped = plan_memory(H200, LLAMA3_8B, CacheConfig(), SchedulerConfig())
    left = 150_754_820_096 - 15_075_482_009 - 16_060_522_496 - LLAMA_ACTIVATIONS
    assert capped.spare_bytes == int(left * 0.9) - capped.kv_bytes == int(left * 0.9) - 8192 * BLOCK_BYTES
    assert f"decode buffers: up to {format_size(capped.spare_bytes)} of the left over" in capped.describe()
    full = plan_memory(H200, LLAMA3_8B, CacheConfig(cache_tokens=1_000_000))  # limited by memory: no spare
    assert 0 <= full.spare_bytes < BLOCK_BYTES
