"""Usage: python issue16_cold_profile.py 8192 2048 (from the repo root). Where an 8k cold prefill's time goes, per 2048-token chunk (CPU seconds: the machine is shared)."""
import time, sys
import mlxpaged
import mlx.core as mx
from mlxpaged.loading.loader import load_local, locate_model
from mlxpaged.cache.kv_cache import PagedKVCache
from mlxpaged.cache.cache_view import paged_views
import mlxpaged.runner.routing as routing
routing.route_paged_attention()
ref, path = locate_model("models/smollm2-135m-float32")
model = load_local(ref, path).model
a = model.args; BS = 16; N = int(sys.argv[1]); C = int(sys.argv[2])
kv = PagedKVCache(len(model.layers), 32768 // BS, BS, a.num_key_value_heads, a.hidden_size // a.num_attention_heads,
                  mx.float32, [None] * len(model.layers))  # SmolLM2: full attention in every layer
table = list(range(N // BS))
tokens = mx.array([[(i * 7919) % 40000 + 100 for i in range(N)]])
real_sdpa = routing.sdpa
def run(start, stub):
    routing.sdpa = (lambda q, k, v, scale, mask, sinks=None: q) if stub else real_sdpa
    views = paged_views(kv, [[table]], [start], [C])
    h = model.model(tokens[:, start:start + C], cache=views)
    out = model.model.embed_tokens.as_linear(h[:, -1])
    c, w = time.process_time(), time.perf_counter()
    mx.eval(out, kv.keys, kv.values)
    return time.process_time() - c, time.perf_counter() - w
tot = [0, 0]
for start in range(0, N, C):
    full = run(start, False); stub = run(start, True)
    tot[0] += full[0]; tot[1] += stub[0]
    print(f"chunk at {start}: cpu full {full[0]:.2f} s, attention stubbed {stub[0]:.2f} s -> attention {full[0]-stub[0]:.2f} s "
          f"(wall {full[1]:.2f} / {stub[1]:.2f})", flush=True)
print(f"total cpu {tot[0]:.2f} s, without attention {tot[1]:.2f} s, attention {tot[0]-tot[1]:.2f} s ({(tot[0]-tot[1])/tot[0]:.0%})")
