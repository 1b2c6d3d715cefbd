"""Issue 40, session 24: batch-1 decode tok/s of the engine and of mlx-lm generate_step, each with and without one
random LoRA adapter (mlxpaged bench lora's), 4 interleaved rounds; the first round is a warm-up (left out of the medians).

    MALLOC_MMAP_THRESHOLD_=2000000000 MALLOC_TRIM_THRESHOLD_=4000000000 python docs/design/scripts/issue40_batch1_ab.py
"""
import statistics, tempfile, time
from pathlib import Path
import mlxpaged
from mlxpaged.engine.engine import Engine
from mlxpaged_app.bench.lora import write_adapter, engine_decode, mlx_lm_decode
from mlxpaged_app.bench.batch import random_prompts
import mlx.core as mx
from mlx_lm import load
tmp = tempfile.mkdtemp()
e = Engine.from_pretrained(None)
path = write_adapter(e.model, Path(tmp)/"a", seed=0)
mpath = e.loaded.path; V = e.loaded.config["vocab_size"]; e.close()
e = Engine.from_pretrained(None, adapters={"a": path})
prompt = random_prompts(1, 256, 512, V)[0]
ref_a, _ = load(str(mpath), adapter_path=str(path)); ref_a.set_dtype(mx.float32)
ref_b, _ = load(str(mpath)); ref_b.set_dtype(mx.float32)
res = {k: [] for k in ("ours-base","ours-lora","mlx-base","mlx-lora")}
for r in range(4):
    res["ours-base"].append(engine_decode(e, prompt, None, 64))
    res["ours-lora"].append(engine_decode(e, prompt, "a", 64))
    res["mlx-base"].append(mlx_lm_decode(ref_b, prompt, 64))
    res["mlx-lora"].append(mlx_lm_decode(ref_a, prompt, 64))
for k, v in res.items(): print(k, [round(x,1) for x in v], "median", round(statistics.median(v[1:]),2))
print("compiled adapters:", e.core.runner.decoder.compiled_adapters if e.core.runner.decoder else None)
