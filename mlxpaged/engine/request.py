"""A request: the one owner of a sequence's token ids and of how many of them have KV in the cache.

The scheduler writes it (admission, computed tokens, sampled tokens, preemption); the cache manager
and the sampler read the tokens through it and keep no copies. Plain Python (no MLX).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)


@dataclass(frozen=True)
class ImageSpan:
    """One image's tokens in a prompt: where they start, how many, and the image's content digest (what the
    prefix cache tells images apart by: the same tokens with another image are other blocks)."""

    start: int
    length: int
    digest: str

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose KV is written in the cache
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served at first admission
    # Of the tokens computed at the latest admission, those whose blocks were in the pool already (not read back from
    # disk): a draft model's pages hold them too (runner/model_drafter.py); the disk tier keeps the model's only.
    num_pool_hit_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    state_slot: int | None = None  # its state slot while running, for models with state layers
    images: tuple[ImageSpan, ...] = ()  # the prompt's images, in order (vision-language models)
    # What the runner feeds for the prompt's image positions (vision/embedding.py); opaque to the scheduler.
    multimodal: object | None = None
    # The id of the adapter it runs with (adapters/adapter_set.py; None: the base model): its blocks hash it too.
    adapter: str | None = None
    # Spans [start, end) of prompt positions whose tokens attend each other both ways (each of Gemma 4's larger
    # models' images; PaliGemma's whole prompt): a token's keys and values there depend on the span's tokens after
    # it, so a span is prefilled in one chunk (scheduler.py `_chunk`) under a mask that lets them
    # (cache/cache_view.py `paged_views`).
    both_ways: tuple[tuple[int, int], ...] = ()

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without copying the whole sequence."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    def block_images(self, index: int, block_size: int) -> tuple[str, ...]:
        """Digests of the images whose first token lies in block `index`: part of that block's hash, so the
        chain of every block from there on names the image too."""
        start = index * block_size
        return tuple(image.digest for image in self.images if start <= image.start < start + block_size)

    def both_ways_between(self, start: int, end: int) -> tuple[tuple[int, int], ...]:
        """The spans attended both ways that positions [start, end) reach into."""
        return tuple((s, e) for s, e in self.both_ways if s < end and start < e)

    def images_start_between(self, start: int, end: int) -> bool:
        """True when an image's first token lies in positions [start, end)."""
        return any(start <= image.start < end for image in self.images)
