"""Usage: python docs/design/scripts/issue16_hit_chain.py SIZE HITS [stub] (from the repo root).

Follow-up turns after a SIZE-token prompt: the prefix cache is filled by marking the prompt's blocks
computed (garbage K/V: timing only), then HITS prompts each 8 tokens longer than the last are served;
prints the median and sorted wall times to the first token. `stub` replaces eager attention by a
no-op (and so never gathers the context): the pass without attention."""
import statistics
import sys

import mlxpaged  # noqa: F401  (OpenBLAS before mlx)
from mlxpaged.engine.engine import Engine
from mlxpaged.engine.request import Request
from mlxpaged.runner import routing
from mlxpaged_app.bench.prefill import engine_ttft, seeded_tokens

size, hits = int(sys.argv[1]), int(sys.argv[2])
if sys.argv[3:] == ["stub"]:
    routing.eager_sdpa = lambda q, k, v, scale, mask=None, sinks=None: q
    routing.paged_prefill_attention = lambda q, *args, **kwargs: q
eng = Engine.from_pretrained("models/smollm2-135m-float32", max_model_len=max(8192, size + 8 * hits + 64))
engine_ttft(eng, seeded_tokens(eng.tokenizer, 64, 0))
engine_ttft(eng, seeded_tokens(eng.tokenizer, 72, 0))
text = seeded_tokens(eng.tokenizer, size - 1 + 8 * hits, 7000 + size)
prompt = text[:size - 9]
request = Request("fill", prompt, 1)
eng.kv_manager.allocate(request)
request.num_computed_tokens = len(prompt)
eng.kv_manager.cache_blocks(request)
eng.kv_manager.free("fill")
times = [engine_ttft(eng, text[:size - 1 + 8 * i]) for i in range(hits)]
print(f"{size}: hit median {statistics.median(times):.4f} s", sorted(round(t, 3) for t in times), flush=True)
eng.close()
