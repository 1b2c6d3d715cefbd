"""KV cache sizing and wired memory, with injected device facts.

Working-set sizes are Apple's recommendedMaxWorkingSetSize as llama.cpp's Metal backend and
mx.device_info() report it: about 2/3 of RAM up to 32 GB (16 GB Mac: 11453.25 MB in llama.cpp
logs = 699,051 pages of 16 KiB; 32 GB: 21845.34 MiB) and 3/4 above (64 GB: 49152 MiB, 96 GB:
73728 MiB, 192 GB M2 Ultra: 144 GiB). The 8 GB value is the 2/3 rule rounded up to a 16 KiB page.
Newer macOS releases report more (up to ~0.84-0.875 of RAM); the plan reads whatever is reported.
"""

from __future__ import annotations

import math
import re

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.config import CacheConfig, SchedulerConfig
from mlxpaged.platform.memory import (
    DeviceFacts,
    InsufficientMemoryError,
    KVShape,
    MemoryPlan,
    ModelFacts,
    activation_bytes,
    model_weight_bytes,
    os_reserve_bytes,
    plan_memory,
    wired_limit,
)
from mlxpaged.platform.model_facts import context_length
from mlxpaged.units import parse_size
from tests.platform.mx_stand_ins import stand_in_mx, stand_in_psutil

import pytest

GiB = 2**30
MAC_8 = DeviceFacts("metal", 8 * GiB, 4_000_000_000, 5_726_633_984, "8 GB Mac")
MAC_16 = DeviceFacts("metal", 16 * GiB, 9_000_000_000, 11_453_251_584, "16 GB Mac")
MAC_64 = DeviceFacts("metal", 64 * GiB, 40_000_000_000, 48 * GiB, "64 GB Mac")
MAC_192 = DeviceFacts("metal", 192 * GiB, 150_000_000_000, 144 * GiB, "192 GB Mac")
# This Linux host (2 cores, 24 GiB) as psutil saw it with SmolLM2 loaded.
LINUX_HOST = DeviceFacts("cpu", 25_276_514_304, 24_732_446_720, None, "AMD EPYC")

# SmolLM2-135M in float32 (the CPU dtype): 30 layers, 3 KV heads of 64.
SMOL = ModelFacts(KVShape(30, 3, 64, 4), 538_000_000, 576, 49152, 8192)
# Llama-3-8B: 32 layers, 8 KV heads of 128, float16 KV; bf16 weights 16.06 GB, 4-bit ~4.52 GB.
LLAMA3_8B = ModelFacts(KVShape(32, 8, 128, 2), 16_060_522_496, 4096, 128256, 8192)
LLAMA3_8B_4BIT = ModelFacts(KVShape(32, 8, 128, 2), 4_520_000_000, 4096, 128256, 8192)

SMOL_ACTIVATIONS = 2048 * (576 + 49152) * 4 * 2  # 814,743,552
LLAMA_ACTIVATIONS = 2048 * (4096 + 128256) * 4 * 2  # 2,168,455,168


def assert_adds_up(plan: MemoryPlan) -> None:
    (_, limit), *parts = plan.breakdown
    assert sum(size for _, size in parts) == limit
    assert all(size >= 0 for _, size in parts)
    assert [label for label, _ in plan.breakdown][-2:] == ["KV cache", "left over"]
    assert plan.breakdown[-2][1] == plan.kv_bytes


# --- config -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("2GB", 2 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5G", 1_500_000_000),
        ("1.5GiB", 3 * 2**29),
        ("4096", 4096),
        (4096, 4096),
        ("2 gb", 2 * 10**9),
        ("100k", 100_000),
        ("1Ti", 2**40),
        (".5MB", 500_000),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "GB", "2XB", "-1GB", "1.2.3G", "2 G B", True, 2.5, None, -5])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_cache_config_defaults_and_validation():
    config, scheduling = CacheConfig(), SchedulerConfig()
    assert (config.block_size, scheduling.max_batch_tokens, scheduling.max_num_seqs) == (16, 2048, 16)
    assert config.kv_memory is None and config.memory_fraction is None and config.cache_tokens is None
    assert config.wire and config.enable_prefix_cache
    with pytest.raises(ValueError, match="only one of kv_memory"):
        CacheConfig(kv_memory=2 * 10**9, memory_fraction=0.5)
    for bad in [
        {"block_size": 0},
        {"block_size": True},
        {"cache_tokens": -1},
        {"kv_memory": 0},
        {"memory_fraction": 0.0},
        {"memory_fraction": 1.5},
        {"memory_fraction": float("nan")},
        {"wire": "no"},
    ]:
        with pytest.raises(ValueError):
            CacheConfig(**bad)
    for bad in [{"max_batch_tokens": 1.5}, {"max_num_seqs": 0}]:
        with pytest.raises(ValueError):
            SchedulerConfig(**bad)
    assert CacheConfig(memory_fraction=1).memory_fraction == 1


@pytest.mark.parametrize(
    "size, expected", [("2GB", 2 * 10**9), ("512MiB", 512 * 2**20), (4096, 4096), ("1.5 G", 1_500_000_000)]
)
def test_cache_config_takes_sizes_as_the_cli_does(size, expected):
    assert CacheConfig(kv_memory=size).kv_memory == expected == parse_size(size)


@pytest.mark.parametrize("size", ["2 parsecs", "0", 0, -1, 2.5, True, "GB"])
def test_cache_config_rejects_what_is_not_a_size(size):
    with pytest.raises(ValueError, match=f"kv_memory={size!r} (is not a size|must be more than 0 bytes)"):
        CacheConfig(kv_memory=size)


# --- shapes and facts -------------------------------------------------------------------


def test_bytes_per_token():
    assert SMOL.kv.bytes_per_token == 2 * 30 * 3 * 64 * 4 == 46_080
    assert LLAMA3_8B.kv.bytes_per_token == 131_072
    assert activation_bytes(SMOL, 2048) == SMOL_ACTIVATIONS == 814_743_552
    assert os_reserve_bytes(8 * GiB) == GiB  # the floor
    assert os_reserve_bytes(16 * GiB) == 1_717_986_918


def test_facts_validation():
    with pytest.raises(ValueError, match="sliding_windows has 2 entries for 30 layers"):
        KVShape(30, 3, 64, 4, (None, 4096))
    with pytest.raises(ValueError, match=r"backend must be one of .*, got 'rocm'"):
        DeviceFacts("rocm", GiB, GiB)
    with pytest.raises(ValueError, match="max_recommended_working_set_size"):
        DeviceFacts("metal", GiB, GiB)
    with pytest.raises(ValueError, match="head_dim"):
        KVShape(30, 3, 0, 4)


def test_context_length_reads_the_configs_spellings():
    assert context_length({"max_position_embeddings": 8192, "n_positions": 1024}) == 8192
    assert context_length({"n_positions": 1024}) == 1024  # gpt2
    assert context_length({"text_config": {"max_position_embeddings": 4096}, "n_ctx": 77}) == 4096  # a VLM
    assert context_length({"max_position_embeddings": None, "hidden_size": 64}) is None


def test_model_weight_bytes():
    import mlx.nn as nn

    assert model_weight_bytes(nn.Linear(8, 4)) == (8 * 4 + 4) * 4


# --- plans on Macs ----------------------------------------------------------------------


def test_16gb_mac_smollm2_capped_by_max_tokens():
    plan = plan_memory(MAC_16, SMOL, CacheConfig(cache_tokens=32768))
    left = 11_453_251_584 - 1_717_986_918 - 538_000_000 - SMOL_ACTIVATIONS
    assert left == 8_382_521_114
    assert int(left * 0.9) // 737_280 == 10_232  # what memory alone would allow
    assert plan.num_blocks == 32768 // 16 + 16 == 2064
    assert (plan.token_capacity, plan.bytes_per_token, plan.block_bytes) == (33_024, 46_080, 737_280)
    assert plan.kv_bytes == 2064 * 737_280 == 1_521_745_920
    assert plan.reason == "capped by --cache-tokens 32,768 (memory allows 10,232 blocks)"
    assert plan.wired_limit_bytes == 538_000_000 + 1_521_745_920
    assert plan.breakdown[-1] == ("left over", left - 1_521_745_920)
    assert_adds_up(plan)
    text = plan.describe()
    for figure in ("11.45 GB", "1.72 GB", "0.54 GB", "0.81 GB", "1.52 GB", "6.86 GB", "2,064 blocks", "33,024 tokens"):
        assert figure in text


def test_8gb_mac_smollm2_limited_by_memory():
    plan = plan_memory(MAC_8, SMOL, CacheConfig())
    left = 5_726_633_984 - GiB - 538_000_000 - SMOL_ACTIVATIONS
    assert plan.num_blocks == int(left * 0.9) // 737_280 == 4028
    assert plan.kv_bytes == 2_969_763_840
    assert plan.reason.startswith("limited by memory (default 90% of the 3.30 GB left)")
    assert "model context 8,192 x 16 sequences would need 8,192 blocks" in plan.reason
    assert_adds_up(plan)


def test_8gb_mac_llama3_8b_does_not_fit():
    with pytest.raises(InsufficientMemoryError) as info:
        plan_memory(MAC_8, LLAMA3_8B_4BIT, CacheConfig())
    message = str(info.value)
    for figure in ("1.07 GB", "4.52 GB", "2.17 GB", "7.76 GB", "5.73 GB", "smaller", "lower max_batch_tokens="):
        assert figure in message
    assert "lower --max-batch-tokens" in info.value.render("cli")
    assert info.value.param is None  # no setting makes the weights fit
    assert info.value.needed_bytes == GiB + 4_520_000_000 + LLAMA_ACTIVATIONS
    assert info.value.available_bytes == 5_726_633_984


def test_16gb_mac_bf16_llama3_8b_does_not_fit():
    with pytest.raises(
        InsufficientMemoryError, match=r"16\.06 GB .* exceed the Metal recommended working set of 11\.45 GB"
    ):
        plan_memory(MAC_16, LLAMA3_8B, CacheConfig(cache_tokens=4096))


def test_64gb_mac_llama3_8b_capped_by_context():
    plan = plan_memory(MAC_64, LLAMA3_8B, CacheConfig())
    left = 48 * GiB - 6_871_947_673 - 16_060_522_496 - LLAMA_ACTIVATIONS
    assert int(left * 0.9) // (131_072 * 16) == 11_346
    assert plan.num_blocks == 16 * 8192 // 16 == 8192
    assert plan.kv_bytes == 16 * GiB
    assert plan.reason == "capped by model context 8,192 x 16 sequences (memory allows 11,346 blocks)"
    assert plan.wired_limit_bytes == 16_060_522_496 + 16 * GiB
    assert_adds_up(plan)


def test_192gb_mac_llama3_8b_limited_by_memory_below_max_tokens():
    plan = plan_memory(MAC_192, LLAMA3_8B, CacheConfig(cache_tokens=1_000_000))
    left = 144 * GiB - 20_615_843_020 - 16_060_522_496 - LLAMA_ACTIVATIONS
    assert plan.num_blocks == int(left * 0.9) // 2_097_152 == 49_684
    assert plan.token_capacity == 794_944
    assert "--cache-tokens 1,000,000 would need 62,516 blocks" in plan.reason
    assert_adds_up(plan)


def test_wired_limit_never_above_working_set():
    # --kv-memory as big as it may be: weights + KV would pass the working set? It cannot:
    # the reserve and activations come out first, so the plan's wired limit stays below it.
    plan = plan_memory(MAC_16, SMOL, CacheConfig(memory_fraction=1.0))
    assert plan.wired_limit_bytes <= MAC_16.max_recommended_working_set_size
    assert plan_memory(MAC_16, SMOL, CacheConfig(wire=False)).wired_status == "off (--no-wire)"
    assert plan_memory(MAC_16, SMOL, CacheConfig(wire=False)).wired_limit_bytes is None


# --- the demand cap and the errors ------------------------------------------------------


def test_max_tokens_cap_is_one_partial_block_per_sequence():
    plan = plan_memory(MAC_64, SMOL, CacheConfig(cache_tokens=1000), SchedulerConfig(max_num_seqs=4))
    assert plan.num_blocks == math.ceil(1000 / 16) + 4 == 67
    plan = plan_memory(MAC_64, SMOL, CacheConfig(cache_tokens=1024, block_size=32), SchedulerConfig(max_num_seqs=1))
    assert plan.num_blocks == 33


def test_kv_memory_and_fraction():
    plan = plan_memory(MAC_64, LLAMA3_8B, CacheConfig(kv_memory=parse_size("2GB")))
    assert plan.num_blocks == 2 * 10**9 // 2_097_152 == 953
    assert plan.reason.startswith("limited by --kv-memory 2.00 GB; model context 8,192 x 16 sequences would need")
    left = 48 * GiB - 6_871_947_673 - 16_060_522_496 - LLAMA_ACTIVATIONS
    plan = plan_memory(MAC_64, LLAMA3_8B, CacheConfig(memory_fraction=0.25))
    assert plan.num_blocks == int(left * 0.25) // 2_097_152
    with pytest.raises(
        InsufficientMemoryError, match=re.escape("kv_memory=100.00 GB is more than the 26.44 GB left")
    ) as info:
        plan_memory(MAC_64, LLAMA3_8B, CacheConfig(kv_memory=100 * 10**9))
    assert info.value.render("cli").startswith("--kv-memory 100.00 GB is more than the 26.44 GB left")
    assert info.value.param == "kv_memory"


def test_error_when_one_sequence_cannot_fit():
    with pytest.raises(InsufficientMemoryError) as info:
        plan_memory(MAC_64, LLAMA3_8B, CacheConfig(kv_memory=100_000_000, cache_tokens=32768))
    message = str(info.value)
    # The longest sequence is the model's 8192-token context (less than --cache-tokens).
    assert "one 8,192-token sequence needs 1.07 GB of KV cache but only 0.10 GB" in message
    assert "use kv_memory=1.08GB or more, or cache_tokens=752 or less" in message  # 47 whole blocks of 16
    assert "use --kv-memory 1.08GB or more, or --cache-tokens 752 or less" in info.value.render("cli")
    assert info.value.param == "kv_memory"
    assert (info.value.needed_bytes, info.value.available_bytes) == (8192 * 131_072, 100_000_000)
    plan_memory(MAC_64, LLAMA3_8B, CacheConfig(kv_memory=100_000_000, cache_tokens=752))  # and that fits


# --- sliding windows --------------------------------------------------------------------


def test_hybrid_blocks_hold_one_layer_group_and_rings_stay_small():
    windows = (512, None) * 15  # half the layers slide over 512 tokens: two groups of 15 layers
    model = ModelFacts(KVShape(30, 3, 64, 4, windows), 538_000_000, 576, 49152, 8192)
    plan = plan_memory(MAC_64, model, CacheConfig(), SchedulerConfig(max_num_seqs=4))
    ring = 512 // 16 + 1  # 33 blocks per sequence in the window group
    assert plan.block_bytes == 15 * 2 * 3 * 16 * 64 * 4 == 368_640  # kv_cache.block_bytes: one group
    assert plan.num_blocks == 4 * (8192 // 16 + ring) == 2180  # 4 sequences of the whole context
    assert plan.kv_bytes == 2180 * 368_640
    assert plan.token_capacity == (2180 - ring) * 16 == 34_352  # one sequence: n + min(n, 33) blocks
    assert "one sequence up to 34,352 tokens" in plan.describe()
    assert_adds_up(plan)
    # On a tight budget the saved memory buys full-attention context.
    budget, four = CacheConfig(kv_memory=400_000_000), SchedulerConfig(max_num_seqs=4)
    dense = plan_memory(MAC_64, SMOL, budget, four)
    hybrid = plan_memory(MAC_64, model, budget, four)
    assert (dense.num_blocks, dense.token_capacity) == (400_000_000 // 737_280, 542 * 16) == (542, 8672)
    assert hybrid.num_blocks == 400_000_000 // 368_640 == 1085
    assert hybrid.token_capacity == (1085 - ring) * 16 == 16_832


def test_gemma3_1b_max_tokens_cap_counts_rings_per_sequence():
    # Gemma-3-1B: 26 layers, 22 sliding over 512 tokens and 4 full; 1 KV head of 256, bfloat16.
    windows = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(26))
    gemma = ModelFacts(KVShape(26, 1, 256, 2, windows), 2_000_000_000, 1152, 262144, 32768)
    plan = plan_memory(MAC_16, gemma, CacheConfig(cache_tokens=32768))
    assert plan.block_bytes == 2 * 2 * 256 * 16 * 2 == 32_768  # gcd(22, 4) = 2 layers per block id
    per_group = 32768 // 16 + 16  # 2 full groups, as for a dense model
    assert plan.num_blocks == 2 * per_group + 11 * 16 * 33 == 9936  # 11 window groups: 16 rings each
    assert plan.kv_bytes == 9936 * 32_768 == 325_582_848  # vs 879 MB with every layer paged in full
    assert plan.token_capacity == (9936 - 11 * 33) // 2 * 16 == 76_576
    assert plan.reason.startswith("capped by --cache-tokens 32,768")
    assert_adds_up(plan)


def test_hybrid_too_small_names_the_tokens_that_fit():
    windows = (512, None) * 15
    model = ModelFacts(KVShape(30, 3, 64, 4, windows), 538_000_000, 576, 49152, 8192)
    with pytest.raises(InsufficientMemoryError) as info:
        plan_memory(MAC_64, model, CacheConfig(kv_memory=100_000_000, cache_tokens=32768))
    need = (8192 // 16 + 33) * 368_640
    assert (info.value.needed_bytes, info.value.available_bytes) == (need, 100_000_000)
    fits = (100_000_000 // 368_640 - 33) * 16  # 271 blocks, 33 of them the ring
    assert f"cache_tokens={fits} or less" in str(info.value)
    assert f"--cache-tokens {fits} or less" in info.value.render("cli")
    plan_memory(MAC_64, model, CacheConfig(kv_memory=100_000_000, cache_tokens=fits))  # and that fits


# --- this Linux host --------------------------------------------------------------------


def test_linux_host_injected():
    plan = plan_memory(LINUX_HOST, SMOL, CacheConfig(), weights_resident=True)
    left = 24_732_446_720 - 2_527_651_430 - SMOL_ACTIVATIONS
    assert int(left * 0.5) // 737_280 == 14_506
    assert plan.num_blocks == 8192  # 16 sequences x 8192 context
    assert plan.kv_bytes == 6_039_797_760
    assert plan.wired_limit_bytes is None
    assert plan.wired_status.startswith("not applicable on CPU")
    assert plan.breakdown[2] == ("model weights (0.54 GB, already outside available)", 0)
    assert_adds_up(plan)
    # Read before loading, the weights come out of "available" too.
    whole, many = CacheConfig(memory_fraction=1.0), SchedulerConfig(max_num_seqs=64)
    counted = plan_memory(LINUX_HOST, SMOL, whole, many)
    resident = plan_memory(LINUX_HOST, SMOL, whole, many, weights_resident=True)
    assert resident.kv_bytes - counted.kv_bytes == pytest.approx(538_000_000, abs=737_280)


def test_linux_host_detected():
    facts = DeviceFacts.detect()
    assert facts.backend == "cpu" and facts.max_recommended_working_set_size is None
    assert 0 < facts.available_bytes <= facts.total_bytes
    plan = plan_memory(facts, SMOL, CacheConfig(cache_tokens=4096), weights_resident=True)
    assert plan.num_blocks == 4096 // 16 + 16
    assert_adds_up(plan)


def test_detect_reads_metal_and_cgroup(tmp_path):
    psutil = stand_in_psutil(total=17_179_869_184, available=9_000_000_000)
    metal = stand_in_mx(
        "metal",
        {"device_name": "Apple M2", "memory_size": 16 * GiB, "max_recommended_working_set_size": 11_453_251_584},
    )
    assert DeviceFacts.detect(metal, psutil) == MAC_16.__class__(
        "metal", 16 * GiB, 9_000_000_000, 11_453_251_584, "Apple M2"
    )
    cpu = stand_in_mx("cpu", {"device_name": "x86"})
    (tmp_path / "memory.max").write_text("4000000000\n")
    (tmp_path / "memory.current").write_text("1000000000\n")
    facts = DeviceFacts.detect(cpu, psutil, cgroup_dir=str(tmp_path))
    assert (facts.backend, facts.available_bytes) == ("cpu", 3_000_000_000)
    (tmp_path / "memory.max").write_text("max\n")
    assert DeviceFacts.detect(cpu, psutil, cgroup_dir=str(tmp_path)).available_bytes == 9_000_000_000


# --- wired memory -----------------------------------------------------------------------


class FakeMx:
    """Stands in for mlx.core on a Mac: records calls, rejects limits above the working set."""

    def __init__(self, working_set: int | None = 11_453_251_584, current: int = 0):
        self.working_set, self.limit, self.calls = working_set, current, []

    def device_info(self):
        info = {"device_name": "fake"}
        if self.working_set is not None:
            info["max_recommended_working_set_size"] = self.working_set
        return info

    def set_wired_limit(self, limit):
        if self.working_set is not None and limit > self.working_set:
            raise ValueError("[metal::set_wired_limit] Setting a wired limit larger than the maximum working set size")
        self.calls.append(("set", limit))
        previous, self.limit = self.limit, limit
        return previous

    def synchronize(self, stream=None):
        self.calls.append(("sync", stream))


def test_wired_limit_sets_and_restores():
    plan = plan_memory(MAC_16, SMOL, CacheConfig(cache_tokens=32768))
    mx = FakeMx(current=123)
    with wired_limit(plan, mx_module=mx) as limit:
        assert limit == mx.limit == 2_059_745_920
    assert mx.limit == 123
    assert mx.calls == [("set", 2_059_745_920), ("sync", None), ("set", 123)]


def test_wired_limit_clamps_to_working_set_and_syncs_streams():
    mx = FakeMx()
    with wired_limit(50 * 10**9, mx_module=mx, streams=["s1", "s2"]) as limit:
        assert limit == 11_453_251_584
    assert mx.calls == [("set", 11_453_251_584), ("sync", "s1"), ("sync", "s2"), ("set", 0)]


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_wired_limit_restores_on_exception_and_ctrl_c(error):
    mx = FakeMx(current=7)
    with pytest.raises(type(error)), wired_limit(10**9, mx_module=mx):
        raise error
    assert mx.limit == 7 and mx.calls[-2:] == [("sync", None), ("set", 7)]


def test_wired_limit_restores_even_if_synchronize_fails():
    mx = FakeMx(current=7)
    mx.synchronize = lambda stream=None: (_ for _ in ()).throw(RuntimeError("sync failed"))
    with pytest.raises(RuntimeError, match="sync failed"), wired_limit(10**9, mx_module=mx):
        pass
    assert mx.limit == 7


def test_wired_limit_off_and_cpu_are_no_ops():
    mx = FakeMx()
    with wired_limit(10**9, enabled=False, mx_module=mx) as limit:
        assert limit is None
    off = plan_memory(MAC_16, SMOL, CacheConfig(wire=False))
    with wired_limit(off, mx_module=mx) as limit:
        assert limit is None
    cpu_plan = plan_memory(LINUX_HOST, SMOL, CacheConfig(), weights_resident=True)
    with wired_limit(cpu_plan, mx_module=mx) as limit:
        assert limit is None
    with wired_limit(10**9, mx_module=FakeMx(working_set=None)) as limit:
        assert limit is None
    assert mx.calls == []


def test_wired_limit_with_real_mlx_on_this_host_does_nothing():
    with wired_limit(10**9) as limit:  # the CPU backend reports no working set
        assert limit is None


def test_cache_config_rejects_what_the_pool_and_scheduler_would_reject_later():
    with pytest.raises(ValueError, match="block_size=64 must be one of"):
        CacheConfig(block_size=64)
    with pytest.raises(ValueError, match="max_batch_tokens=8 must be >= max_num_seqs=16") as info:
        SchedulerConfig(max_batch_tokens=8, max_num_seqs=16)
    assert info.value.render("cli") == "--max-batch-tokens 8 must be >= --max-num-seqs 16"
