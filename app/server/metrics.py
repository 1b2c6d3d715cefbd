"""`GET /metrics` in the Prometheus text format (version 0.0.4), written by hand: a few counters,
three histograms and gauges read from `engine.stats()` at scrape time (the attention path among them)
need no client library."""

from __future__ import annotations

import bisect
from collections import Counter

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
PREFIX = "mlxpaged"


class Histogram:
    def __init__(self, name: str, help_text: str, buckets: tuple[float, ...]) -> None:
        self.name, self.help, self.buckets = name, help_text, buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} histogram"]
        total = 0
        for bound, count in zip((*self.buckets, float("inf")), self.counts, strict=True):
            total += count
            label = "+Inf" if bound == float("inf") else repr(bound)
            lines.append(f'{self.name}_bucket{{le="{label}"}} {total}')
        lines += [f"{self.name}_sum {self.sum:.6f}", f"{self.name}_count {total}"]
        return lines


def _metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> list[str]:
    """`samples` are (label set such as '{state="free"}' or '', value)."""
    full = f"{PREFIX}_{name}"
    return [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"] + [
        f"{full}{labels} {_number(value)}" for labels, value in samples
    ]


def _label(value: str) -> str:
    """A label value, escaped as the text format requires."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else f"{value:.6g}"


class ServerMetrics:
    """What the HTTP layer observes; engine gauges are added at render time."""

    def __init__(self) -> None:
        self.requests: Counter = Counter()  # (route, status code) -> count
        self.abandoned: Counter = Counter()  # route -> requests whose client left before the reply ended
        self.prompt_tokens = self.cached_tokens = self.generated_tokens = 0
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds", "Request arrival to its first generated token.", TTFT_BUCKETS
        )
        self.token_latency = Histogram(
            f"{PREFIX}_time_per_output_token_seconds", "Time between consecutive tokens of one sequence.", TOKEN_BUCKETS
        )
        self.e2e = Histogram(f"{PREFIX}_request_duration_seconds", "Request arrival to its last token.", E2E_BUCKETS)

    def count_request(self, route: str, status: int) -> None:
        self.requests[(route, status)] += 1

    def count_usage(self, prompt: int, cached: int, generated: int) -> None:
        self.prompt_tokens += prompt
        self.cached_tokens += cached
        self.generated_tokens += generated

    def render_requests(self) -> list[str]:
        """The HTTP counters (the server's own ServerMetrics: one for every model)."""
        return _metric(
            "requests_total",
            "counter",
            "HTTP requests by route and status code.",
            [(f'{{route="{route}",status="{status}"}}', n) for (route, status), n in sorted(self.requests.items())],
        )

    def render(self, stats: dict | None, in_flight: int, capacity: int) -> list[str]:
        """One model's token counts, latencies and engine gauges (a served model's own ServerMetrics); `stats` is
        the engine's (None for an embedding model)."""
        lines = _metric(
            "prompt_tokens_total",
            "counter",
            "Prompt tokens of finished requests, and of those their clients left.",
            [("", self.prompt_tokens)],
        )
        lines += _metric(
            "requests_abandoned_total",
            "counter",
            "Requests whose client left before the reply ended (their work was withdrawn).",
            [(f'{{route="{_label(route)}"}}', n) for route, n in sorted(self.abandoned.items())],
        )
        lines += _metric(
            "cached_prompt_tokens_total",
            "counter",
            "Prompt tokens served from the prefix cache.",
            [("", self.cached_tokens)],
        )
        lines += _metric(
            "generation_tokens_total",
            "counter",
            "Generated tokens of finished requests, and of those their clients left.",
            [("", self.generated_tokens)],
        )
        lines += self.ttft.render() + self.token_latency.render() + self.e2e.render()
        if stats is None:  # an embedding model: no engine gauges
            lines += _metric("requests_in_flight", "gauge", IN_FLIGHT_HELP, [("", in_flight)])
            lines += _capacity(capacity)
            return lines
        lines += _engine_gauges(stats, in_flight, capacity) + _memory_gauges(stats["memory_plan"])
        return lines + _attention_gauges(stats["attention"])


IN_FLIGHT_HELP = "Requests the HTTP layer has admitted and not finished."


def _capacity(capacity: int) -> list[str]:
    return _metric(
        "requests_capacity", "gauge", "Admission limit: engine batch plus queue; beyond it 429.", [("", capacity)]
    )


def _engine_gauges(stats: dict, in_flight: int, capacity: int) -> list[str]:
    lines = _metric("requests_in_flight", "gauge", IN_FLIGHT_HELP, [("", in_flight)]) + _capacity(capacity)
    lines += _metric(
        "queue_depth", "gauge", "Engine requests waiting to be scheduled.", [("", stats["requests_waiting"])]
    )
    lines += _metric(
        "requests_running", "gauge", "Engine requests being decoded or prefilled.", [("", stats["requests_running"])]
    )
    lines += _metric(
        "kv_blocks",
        "gauge",
        "KV cache blocks by state (free includes cached).",
        [(f'{{state="{s}"}}', stats[f"blocks_{s}"]) for s in ("total", "free", "used", "cached")],
    )
    lines += _metric(
        "prefix_cache_hit_rate",
        "gauge",
        "Fraction of looked-up prompt tokens found cached.",
        [("", stats["prefix_hit_rate"])],
    )
    lines += _metric(
        "prefix_cache_hit_tokens_total",
        "counter",
        "Prompt tokens found in the prefix cache.",
        [("", stats["prefix_hit_tokens"])],
    )
    lines += _prefix_tier_metrics(stats)
    lines += _metric(
        "preemptions_total", "counter", "Requests preempted for lack of blocks.", [("", stats["preemptions"])]
    )
    lines += _metric(
        "generation_tokens_per_second",
        "gauge",
        "Engine decode throughput, last 10 s.",
        [("", stats["generation_tokens_per_s"])],
    )
    return lines + _speculation_metrics(stats)


def _prefix_tier_metrics(stats: dict) -> list[str]:
    """The prefix cache by tier (RAM: the block pool; disk: engine/kv_tiering.py), when the engine reports them."""
    if "ram_hit_tokens" not in stats:
        return []
    hits = [('{tier="ram"}', stats["ram_hit_tokens"]), ('{tier="disk"}', stats.get("disk_hit_tokens", 0))]
    lines = _metric(
        "prefix_cache_tier_hit_tokens_total", "counter", "Prompt tokens served from each tier (not prefilled).", hits
    )
    if not stats.get("disk_tier"):
        return lines
    lines += _metric(
        "kv_disk_bytes",
        "gauge",
        "The prefix cache's disk tier: bytes used (this process's estimate) and its limit.",
        [('{kind="used"}', stats["disk_used_bytes"]), ('{kind="limit"}', stats["disk_limit_bytes"])],
    )
    lines += _metric(
        "kv_disk_written_bytes_total",
        "counter",
        "KV bytes written to the disk tier.",
        [("", stats["disk_written_bytes"])],
    )
    lines += _metric(
        "kv_disk_read_bytes_total",
        "counter",
        "KV bytes read back from the disk tier.",
        [("", stats["disk_read_bytes"])],
    )
    lines += _metric(
        "kv_disk_read_seconds_total",
        "counter",
        "Time admissions spent reading blocks from disk into the pool.",
        [("", stats["disk_read_seconds"])],
    )
    if "disk_state_hits" in stats:  # a state model's checkpoints, kept beside its blocks (state_tiering.py)
        lines += _metric(
            "kv_disk_state_checkpoints_total",
            "counter",
            "State-layer checkpoints written to the disk tier, and requests resumed from one read back.",
            [('{kind="written"}', stats["disk_state_written"]), ('{kind="resumed"}', stats["disk_state_hits"])],
        )
        lines += _metric(
            "kv_disk_state_written_bytes_total",
            "counter",
            "State-layer checkpoint bytes written to the disk tier (apart from the KV bytes).",
            [("", stats["disk_state_written_bytes"])],
        )
    return lines + _metric(
        "kv_disk_problems_total",
        "counter",
        "Disk tier blocks not kept: writes dropped (queue full) or failed, files skipped (corrupt or foreign).",
        [
            ('{kind="dropped_write"}', stats["disk_dropped_writes"]),
            ('{kind="failed_write"}', stats["disk_failed_writes"]),
            ('{kind="skipped_file"}', stats["disk_skipped_files"]),
        ],
    )


def _speculation_metrics(stats: dict) -> list[str]:
    """Speculative decoding's drafts and how many the model kept (zeros when it is off)."""
    lines = _metric(
        "spec_draft_tokens_total",
        "counter",
        "Speculative tokens drafted and verified.",
        [("", stats["spec_draft_tokens_total"])],
    )
    lines += _metric(
        "spec_accepted_tokens_total",
        "counter",
        "Speculative tokens the model kept.",
        [("", stats["spec_accepted_tokens_total"])],
    )
    rate = stats["spec_acceptance_rate"]
    return lines + _metric(
        "spec_acceptance_rate", "gauge", "Fraction of drafted tokens kept (0 before any draft).", [("", rate or 0.0)]
    )


def _memory_gauges(plan) -> list[str]:
    (_, limit), *_ = plan.breakdown
    samples = [('{kind="kv_cache"}', plan.kv_bytes), ('{kind="device_limit"}', limit)]
    if plan.wired_limit_bytes is not None:
        samples.append(('{kind="wired_limit"}', plan.wired_limit_bytes))
    lines = _metric("memory_bytes", "gauge", "Memory: KV cache size, device limit, wired limit.", samples)
    return lines + _metric("kv_block_bytes", "gauge", "Bytes of one KV block (all layers).", [("", plan.block_bytes)])


def _attention_gauges(status: dict) -> list[str]:
    """Which decode attention path is in use and why (mlxpaged.kernels.attention.attention_status)."""
    lines = _metric(
        "attention_path",
        "gauge",
        "Decode attention path in use (value 1), with the reason.",
        [(f'{{path="{_label(status["path"])}",reason="{_label(status["reason"])}"}}', 1)],
    )
    checks = [
        (f'{{variant="{_label(c.variant.describe())}",reason="{_label(c.reason or "")}"}}', int(c.ok))
        for c in status["variants"]
    ]
    if not checks:
        return lines
    return lines + _metric(
        "kernel_self_check_passed",
        "gauge",
        "Metal kernel self-check per variant: 1 passed (kernel used), 0 failed (reference used).",
        checks,
    )
