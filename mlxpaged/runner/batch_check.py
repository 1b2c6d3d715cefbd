"""Load-time check that a model computes the same logits for a sequence in a ragged batch as alone.

A batched pass gives each row its K/V gathered by page (padded to whole blocks) and a mask; batch 1
gives exactly the sequence's keys. Most models only attend through the mask, but some read positions
off the keys (afm7's KV-reuse layers: RoPE offset = keys.shape[2] - L) or cannot take per-row offsets
at all (the probe's `batch_error`). Such a model runs serially (one sequence per pass): slower, exact,
and decided before the first request (design 14, D7), never discovered mid-request.
"""

from __future__ import annotations

from mlxpaged.cache.kv_cache import PagedKVCache
from mlxpaged.cache.layout import ModelLayout

import mlx.core as mx

PROMPTS = ([1, 2, 3], [4, 5, 6, 7, 8])  # ragged on purpose: 3 and 5 tokens, then one decode step each
TOLERANCE = {mx.float32: 1e-3}  # relative to the largest logit; half precision: HALF_TOLERANCE
HALF_TOLERANCE = 3e-2


def batch_mismatch(model, layout: ModelLayout, dtype: mx.Dtype, block_size: int) -> str | None:
    """None when two ragged rows (prefill, then one decode step) give the logits they give alone;
    else what differed, with the numbers."""
    from mlxpaged.runner.model_runner import Runner  # the runner imports this module's user
    from mlxpaged.runner.passes import StepInput

    groups = len(PagedKVCache.for_layout(layout, 1, block_size, dtype).groups)
    kv = PagedKVCache.for_layout(layout, 2 * groups + 1, block_size, dtype)
    runner = Runner(model, kv, layout, serial=False)
    runner.decoder = None  # rows through the paged views both ways; the compiled pass has its own warm-up check
    tables = [[[2 * g + row] for g in range(groups)] for row in range(2)]  # one block per group and row
    batched = _two_steps(runner, StepInput, tables, together=True)
    alone = _two_steps(runner, StepInput, tables, together=False)
    tolerance = TOLERANCE.get(dtype, HALF_TOLERANCE)
    for step, (got, want) in enumerate(zip(batched, alone, strict=True)):
        which = "prefill" if step == 0 else "decode"
        # Some models pin logits to -inf (phi3small masks its reserved token ids): equal infinities agree,
        # and inf - inf must not read as a difference. Any other non-finite value (NaN) fails.
        finite = mx.isfinite(got) & mx.isfinite(want)
        if bool(mx.any(~finite & (got != want))):
            return f"{which} logits differ where they are not finite (inf or NaN)"
        diff = float(mx.where(finite, mx.abs(got - want), 0.0).max())
        scale = max(1.0, float(mx.where(finite, mx.abs(want), 0.0).max()))
        if not diff <= tolerance * scale:
            return f"{which} logits differ by {diff:.3g} (scale {scale:.3g})"
    return None


def _two_steps(runner, step_input, tables, together: bool) -> list[mx.array]:
    """Logits [2, V] of the prompts' prefill and of one decode step, rows run together or one by one."""
    steps = [
        [step_input(p, 0, t, True) for p, t in zip(PROMPTS, tables, strict=True)],
        [step_input([9], len(p), t, True) for p, t in zip(PROMPTS, tables, strict=True)],
    ]
    out = []
    for inputs in steps:
        # One pass of both rows (step() might give prefill chunks of unequal length passes of their own).
        logits = runner._pass(inputs) if together else mx.concatenate([runner._pass([x]) for x in inputs])
        mx.eval(logits)
        out.append(logits)
    return out
