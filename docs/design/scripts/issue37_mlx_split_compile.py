"""MLX 0.32: mx.compile fails with IndexError('_Map_base::at') on a function that lays out one computed array twice with
mx.split (mlx-vlm's MRoPE `_section_frequency_layout`, as GLM-4V's layers call it). MLX alone:

    python docs/design/scripts/issue37_mlx_split_compile.py      # prints "sum FAIL ..." and "tuple FAIL ..."
"""
import mlx.core as mx
def layout(v):
    parts = mx.split(v, [2, 3, 4, 6, 7], axis=-1)
    return mx.concatenate([p[i % 3] for i, p in enumerate(parts)], axis=-1)[:, None, :, :]
inv = mx.array([1.0, 0.5, 0.25, 0.125])
def rot(p):
    e = inv[None, None, :, None]
    e = mx.broadcast_to(e, (3, p.shape[1], 4, 1))
    pe = p[:, :, None, :].astype(mx.float32)
    freqs = (e @ pe).transpose(0, 1, 3, 2)
    emb = mx.concatenate((freqs, freqs), axis=-1)
    return mx.cos(emb) * 1.0
def f(p):
    c = rot(p)
    return layout(c) + layout(c)
def f2(p):
    c = rot(p)
    return layout(c), layout(c)
p = mx.broadcast_to(mx.arange(3)[None, None], (3, 1, 3))
for name, fn in (("sum", f), ("tuple", f2)):
    try: mx.eval(mx.compile(fn)(p)); print(name, "ok")
    except Exception as e: print(name, "FAIL", repr(e))
