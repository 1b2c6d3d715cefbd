"""`mlxpaged bench vision`: images on the paged engine beside mlx-vlm's own generate, on one vision-language model.

Three workloads, each run once untimed by both sides and then `--runs` times (medians):

- cold: time to first token of one image and a question, the prefix cache emptied first; mlx-vlm's
  `stream_generate` on the same prompt text and image.
- next turn: the conversation's second question with the same image, the first turn (and its reply) in the
  prefix cache; against the engine's own cold time for that prompt, nothing cached (issue 37's target: at most 10%
  of it), its prefill alone (the image kept encoded, the prefix cache empty) and mlx-vlm's, which encodes and
  prefills it whole again (its generate keeps no cache between calls).
- 8 concurrent: eight questions about eight images at once, `--tokens` each: the engine's batch against mlx-vlm's
  `batch_generate`, the whole batch's wall time and its generated tokens per second.

Greedy both sides, the images random pixels of one size (seeded). Measured, never asserted: a figure on this
machine's CPU says nothing of a GPU's.
"""

from __future__ import annotations

import statistics
import time
from argparse import Namespace

from mlxpaged_app.bench.timing import after_warm_up

QUESTION = "What is in this picture?"
FOLLOW_UP = "And what colour is it mostly?"
CONCURRENT = 8
IMAGE_SIZE = (320, 240)


def pictures(count: int, seed: int = 0) -> list:
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    width, height = IMAGE_SIZE
    return [Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)) for _ in range(count)]


def ask(image, question: str = QUESTION) -> dict:
    return {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": question}]}


def first_token_s(engine, messages: list[dict], max_tokens: int = 1) -> tuple[float, str]:
    """The engine's time to first token of `messages` (and its text of `max_tokens` greedy tokens)."""
    from mlxpaged.sampling_params import SamplingParams

    start, first, text = time.perf_counter(), None, ""
    prompt = engine.chat_prompt(messages)
    for delta in engine.stream(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens)):
        first = time.perf_counter() - start if first is None else first
        text += delta.text
    assert first is not None
    return first, text


class MlxVlm:
    """mlx-vlm's own model and processor for the same directory, and its generate calls."""

    def __init__(self, path: str):
        from mlx_vlm import load

        self.model, self.processor = load(path)

    def prompt(self, messages: list[dict]) -> str:
        """The messages through the checkpoint's template, as mlx-vlm's own server renders them."""
        from mlxpaged.vision.images import image_parts, placeholders

        from mlx_vlm.prompt_utils import apply_chat_template

        template = [placeholders(message) for message in messages]
        return apply_chat_template(self.processor, self.model.config, template, num_images=len(image_parts(messages)))

    def first_token_s(self, messages: list[dict], images: list) -> float:
        from mlx_vlm.generate.dispatch import stream_generate

        start = time.perf_counter()
        for _ in stream_generate(self.model, self.processor, self.prompt(messages), image=images, max_tokens=1):
            return time.perf_counter() - start
        raise RuntimeError("mlx-vlm generated nothing")

    def batch_s(self, images: list, max_tokens: int) -> tuple[float, int]:
        from mlx_vlm.generate.ar import batch_generate

        start = time.perf_counter()  # batch_generate applies the chat template to each question itself
        out = batch_generate(
            self.model, self.processor, images=images, prompts=[QUESTION] * len(images), max_tokens=max_tokens
        )
        return time.perf_counter() - start, out.stats.generation_tokens


def engine_batch_s(engine, images: list, max_tokens: int) -> tuple[float, int]:
    """The batch from nothing cached, as mlx-vlm's batch_generate runs it: the warm-up's run of the same images left
    their blocks in the prefix cache and their encodings kept."""
    from mlxpaged.sampling_params import SamplingParams

    engine.pool.reset_prefix_cache()
    engine.forget_encoded_images()
    prompts = [engine.chat_prompt([ask(image)]) for image in images]
    start = time.perf_counter()
    completions = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    return time.perf_counter() - start, sum(len(c.token_ids) for c in completions)


def bench_vision(args: Namespace) -> int:
    from mlxpaged.engine.engine import Engine

    if not args.model:
        print("bench vision: give a vision-language model with --model (a local directory: mlx-vlm reads it too)")
        return 2
    engine = Engine.from_pretrained(args.model)
    reference = MlxVlm(engine.loaded.path.as_posix())
    images = pictures(CONCURRENT + args.runs + 1)
    print(f"bench vision: {engine.loaded.name}, images {IMAGE_SIZE[0]}x{IMAGE_SIZE[1]}, {args.runs} runs (medians)")
    try:
        cold, turn, turn_cold, turn_prefill, theirs_cold, theirs_turn = [], [], [], [], [], []
        fresh = iter(images[CONCURRENT:])

        def conversation() -> None:
            image = next(fresh)
            engine.pool.reset_prefix_cache()
            first = [ask(image)]
            took, reply = first_token_s(engine, first, max_tokens=args.tokens)
            follow = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": FOLLOW_UP}]
            cached, _ = first_token_s(engine, follow)
            engine.pool.reset_prefix_cache()
            prefill_only, _ = first_token_s(engine, follow)  # the image still kept encoded
            engine.pool.reset_prefix_cache()
            engine.forget_encoded_images()
            uncached, _ = first_token_s(engine, follow)
            cold.append(took), turn.append(cached), turn_cold.append(uncached), turn_prefill.append(prefill_only)
            theirs_cold.append(reference.first_token_s(first, [image]))
            theirs_turn.append(reference.first_token_s(follow, [image]))

        after_warm_up(conversation, args.runs)
        for series in (cold, turn, turn_cold, turn_prefill, theirs_cold, theirs_turn):
            del series[0]  # the warm-up's figures
        c, t, tc = statistics.median(cold), statistics.median(turn), statistics.median(turn_cold)
        tp = statistics.median(turn_prefill)
        mc, mt = statistics.median(theirs_cold), statistics.median(theirs_turn)
        print(f"cold time to first token      mlxpaged {c:7.3f} s   mlx-vlm {mc:7.3f} s   ratio {mc / c:5.2f}x")
        print(f"next turn, same image         mlxpaged {t:7.3f} s   mlx-vlm {mt:7.3f} s   ratio {mt / t:5.2f}x")
        print(f"next turn / its cold time     {t / tc:6.1%}   (mlxpaged cold {tc:.3f} s; the target is 10% or less)")
        print(f"next turn / its prefill alone {t / tp:6.1%}   (mlxpaged {tp:.3f} s with the image kept encoded)")

        batch = images[:CONCURRENT]
        ours = after_warm_up(lambda: engine_batch_s(engine, batch, args.tokens), args.runs)
        theirs = after_warm_up(lambda: reference.batch_s(batch, args.tokens), args.runs)
        ow, mw = statistics.median(w for w, _ in ours), statistics.median(w for w, _ in theirs)
        otps, mtps = statistics.median(n / w for w, n in ours), statistics.median(n / w for w, n in theirs)
        print(
            f"{CONCURRENT} concurrent, {args.tokens} tokens  mlxpaged {ow:7.3f} s ({otps:6.1f} tok/s)   "
            f"mlx-vlm batch_generate {mw:7.3f} s ({mtps:6.1f} tok/s)   ratio {mw / ow:5.2f}x"
        )
    finally:
        engine.close()
    return 0
