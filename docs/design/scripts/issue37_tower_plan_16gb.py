"""The memory plan's arithmetic for a vision model on a 16 GB Mac (issue 37, session 27): which image size it plans
Qwen2.5-VL-7B's vision tower for. Nothing is loaded or measured: the tower's widths and the processor's maximum are
Qwen2.5-VL-7B's config (hidden 1280, intermediate 3420, 16 heads of 80, 14 px patches, max 12,845,056 px; a
square image keeps its pixels up to that maximum), the model 4.5 GB of 4-bit weights with 28 layers of 4 x 128 K/V,
the Mac a 11.46 GB recommended working set (16 GiB of RAM).

    python docs/design/scripts/issue37_tower_plan_16gb.py
"""

from mlxpaged.config import DEFAULT_MAX_IMAGE_PIXELS, CacheConfig, SchedulerConfig
from mlxpaged.platform.memory import DeviceFacts, KVShape, ModelFacts, TowerRung, plan_memory
from mlxpaged.vision.tower_memory import CANDIDATES, LargestImage, Tower

QWEN_MAX_PIXELS, PATCH_PIXELS, PATCH_VALUES = 12_845_056, 14 * 14, 3 * 2 * 14 * 14
GIB = 2**30

tower = Tower(hidden=1280, intermediate=3420, heads=16, patch_size=14)
rungs: list[TowerRung] = []
for k in range(CANDIDATES):
    pixels = DEFAULT_MAX_IMAGE_PIXELS >> k
    patches = min(pixels, QWEN_MAX_PIXELS) // PATCH_PIXELS
    cost = tower.activation_bytes(LargestImage(pixels, patches, patches * patches, patches * PATCH_VALUES), 2, "metal")
    if not rungs or rungs[-1].bytes != cost:
        rungs.append(TowerRung(pixels, patches, cost))
print("rungs (pixels, patches, GB):", [(r.pixels, r.patches, round(r.bytes / 1e9, 2)) for r in rungs])
mac = DeviceFacts("metal", 16 * GIB, 10 * GIB, max_recommended_working_set_size=int(10.67 * GIB))
kv = KVShape(num_layers=28, num_kv_heads=4, head_dim=128, dtype_bytes=2)
facts = ModelFacts(kv, int(4.5e9), 3584, 152064, 128000, takes_images=True, tower_rungs=tuple(rungs))
plan = plan_memory(mac, facts, CacheConfig(cache_tokens=32768), SchedulerConfig())
print(plan.describe())
print("images planned for, up to", f"{plan.image_pixels:,} px")
