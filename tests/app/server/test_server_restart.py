"""A restarted `mlxpaged serve` answers a long earlier conversation from the prefix cache's disk tier: the second
process reports the first conversation's blocks as cached (read from disk, not prefilled) and /metrics says so."""

from __future__ import annotations

from tests.app.server.test_server_live import KEY, serving

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

SYSTEM = " ".join(
    f"Rule {i}: the harbour of Vell{i % 7} keeps {i * 3} boats and opens at {6 + i % 5}." for i in range(40)
)


def ask(server, messages: list[dict]):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, timeout=300, max_retries=0)
    return client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=8, temperature=0.0)


def test_a_restarted_server_answers_an_earlier_conversation_from_disk(tmp_path):
    disk = ("--kv-disk", str(tmp_path / "kv"))
    turn = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which harbour keeps 30 boats?"}]
    (tmp_path / "one").mkdir()
    with serving(tmp_path / "one", *disk) as server:
        first = ask(server, turn)
    assert first.usage.prompt_tokens > 400
    follow_up = [
        *turn,
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And which opens at 8?"},
    ]
    (tmp_path / "two").mkdir()
    with serving(tmp_path / "two", *disk) as server:  # a new process: its RAM prefix cache starts empty
        second = ask(server, follow_up)
        metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached >= (first.usage.prompt_tokens - 1) // 16 * 16
    tier_hits = 'mlxpaged_prefix_cache_tier_hit_tokens_total{model="%s",tier="%s"} %d'  # samples carry their model
    assert tier_hits % (second.model, "disk", cached) in metrics
    assert tier_hits % (second.model, "ram", 0) in metrics
