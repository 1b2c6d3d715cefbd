"""Usage: python issue16_hit_time.py 2048,8192,16384 3 (from the repo root). Hit time vs cached context, cold prefill skipped: the prefix cache is filled by marking a request's
blocks computed (their K/V are garbage: timing only), then the engine serves prompt + 8 tokens."""
import sys, time, statistics
import mlxpaged
from mlxpaged.engine.engine import Engine
from mlxpaged.engine.request import Request
from mlxpaged_app.bench.prefill import seeded_tokens, engine_ttft
ctx = max(int(s) for s in sys.argv[1].split(","))
try:
    eng = Engine.from_pretrained("models/smollm2-135m-float32", max_model_len=max(8192, ctx + 64))
except Exception:  # main before the max_model_len setting: the model's own 8192
    eng = Engine.from_pretrained("models/smollm2-135m-float32")
engine_ttft(eng, seeded_tokens(eng.tokenizer, 32, 0))
for size in [int(s) for s in sys.argv[1].split(",")]:
    times, walls = [], []
    for run in range(int(sys.argv[2]) if len(sys.argv) > 2 else 3):
        text = seeded_tokens(eng.tokenizer, size - 1, 1000 * size + run)
        prompt = text[:-8]
        manager = eng.kv_manager
        request = Request(f"fill-{size}-{run}", prompt, 1)
        manager.allocate(request)
        request.num_computed_tokens = len(prompt)
        manager.cache_blocks(request)
        manager.free(request.request_id)
        c = time.process_time(); w = engine_ttft(eng, text); t = time.process_time() - c
        walls.append(w)
        times.append(t)
    print(f"{size}: hit cpu {statistics.median(times):.3f} s (runs {[round(x, 3) for x in times]}), wall {[round(x, 3) for x in walls]}", flush=True)
eng.close()
