"""Unit tests of the chat app's plain parts: block map grouping, reply runs, settings, storage."""

from __future__ import annotations

import threading
import time

from mlxpaged_app.tui import generation
from mlxpaged_app.tui.app import ChatApp
from mlxpaged_app.tui.generation import ReplyRun, ReplyStats
from mlxpaged_app.tui.messages import (
    LoadFailed,
    LoadProgress,
    ModelLoaded,
    ReplyDelta,
    ReplyFailed,
    ReplyFinished,
    ReplyStarted,
)
from mlxpaged_app.tui.settings import ChatSettings
from mlxpaged_app.tui.store import Conversation, ConversationStore
from mlxpaged_app.tui.widgets.block_map import classify, group, group_size
from tests.app.tui.tui_support import FakeEngine

import pytest


def test_classify_marks_the_current_requests_blocks():
    states = ["owned", "owned", "shared", "cached", "free", "owned"]
    assert classify(states, [0, 1, 2]) == ["current", "current", "shared", "cached", "free", "other"]


def test_grouping_keeps_the_busiest_block_visible():
    classes = ["free", "free", "current", "cached", "free", "free", "free"]
    assert group(classes, 3) == ["current", "cached", "free"]
    assert group_size(2064, 46 * 8 * 2) == 3 and group_size(10, 100) == 1


class Recorder:
    """Stands in for the app's post_message: keeps each Message a run posts, says whether it was delivered."""

    def __init__(self, delivered: bool = True):
        self.messages, self.delivered = [], delivered

    def __call__(self, message) -> bool:
        self.messages.append(message)
        return self.delivered


class UnconfirmedAbortEngine(FakeEngine):
    """Takes the abort but never sends the final event (an engine that has hung)."""

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def reply_run(engine, post, messages=({"role": "user", "content": "hi"},)) -> ReplyRun:
    return ReplyRun(engine, list(messages), ChatSettings().sampling_params(), post)


def test_reply_run_streams_then_reports_usage():
    engine, posted = FakeEngine(), Recorder()
    run = reply_run(engine, posted)
    run.run()
    first, *deltas, last = posted.messages
    assert isinstance(first, ReplyStarted) and first.run is run and run.request_id == "fake-0"
    assert all(isinstance(m, ReplyDelta) for m in deltas) and isinstance(last, ReplyFinished)
    assert "".join(m.text for m in deltas) == run.text == "Hello **world**!"
    stats = last.stats
    assert (stats.prompt_tokens, stats.completion_tokens, stats.finish_reason) == (2, 3, "stop")
    assert stats.time_to_first_token is not None


def test_reply_run_stop_before_submit_aborts_right_after():
    engine, posted = FakeEngine(), Recorder()
    engine.gate = threading.Event()
    run = reply_run(engine, posted)
    run.stop()
    run.run()
    assert engine.aborted == ["fake-0"] and posted.messages[-1].stats.finish_reason == "abort"


def test_reply_run_reports_a_rejected_request():
    engine, posted = FakeEngine(), Recorder()
    engine.submit_error = ValueError("the prompt is empty")
    reply_run(engine, posted, messages=()).run()
    assert [(type(m), m.error, m.rejected) for m in posted.messages] == [(ReplyFailed, engine.submit_error, True)]


def test_a_run_nobody_reads_any_more_aborts_its_request():
    engine, posted = FakeEngine(), Recorder(delivered=False)
    engine.gate = threading.Event()  # without the abort, the stream would hang after its first piece
    run = reply_run(engine, posted)
    worker = threading.Thread(target=run.run, daemon=True)
    worker.start()
    worker.join(timeout=10)
    engine.gate.set()
    assert not worker.is_alive(), "the run kept streaming to nobody"
    assert engine.aborted == ["fake-0"] and run.stopping
    assert posted.messages[-1].stats.finish_reason == "abort"


def test_a_stop_the_engine_never_confirms_ends_the_reply_after_the_grace(monkeypatch):
    monkeypatch.setattr(generation, "STOP_GRACE_S", 0.3)
    engine, posted = UnconfirmedAbortEngine(), Recorder()
    engine.gate = threading.Event()
    run = reply_run(engine, posted)
    worker = threading.Thread(target=run.run, daemon=True)
    worker.start()
    deadline = time.monotonic() + 10
    while run.text != "Hello" and time.monotonic() < deadline:  # the drain now blocks on the queue
        time.sleep(0.01)
    stopped = time.perf_counter()
    run.stop()
    worker.join(timeout=10)
    waited = time.perf_counter() - stopped
    engine.gate.set()  # let the fake's stream thread end
    assert not worker.is_alive(), "stop() did not wake the drain"
    assert engine.aborted == ["fake-0"] and posted.messages[-1].stats.finish_reason == "abort"
    assert 0.3 <= waited < 5, waited


def test_every_message_a_worker_posts_has_a_handler_on_the_app():
    """Textual drops a message nobody handles without a word: a misnamed handler would lose it."""
    for message in (ReplyStarted, ReplyDelta, ReplyFinished, ReplyFailed, LoadProgress, ModelLoaded, LoadFailed):
        assert callable(getattr(ChatApp, message.handler_name, None)), message.handler_name


def test_stats_line():
    text = ReplyStats(412, 396, 57, 0.21, 17.25, "abort").describe()
    assert text == "TTFT 0.21 s · 17.2 tok/s · prompt 412 tok (396 cached) · 57 out · stopped"


def test_settings_parse_and_validate():
    assert ChatSettings.parse("0.2", "0.9", "100", "") == ChatSettings(0.2, 0.9, 100, None)
    assert ChatSettings.parse("0", "1", "5", " 7 ").seed == 7
    with pytest.raises(ValueError, match="max tokens must be an integer"):
        ChatSettings.parse("0.2", "0.9", "many", "")
    with pytest.raises(ValueError, match="top_p"):
        ChatSettings.parse("0.2", "1.5", "10", "")


def test_store_round_trip_and_latest(tmp_path):
    store = ConversationStore(tmp_path)
    assert store.list() == [] and store.latest() is None
    first = Conversation.new("m", "be brief")
    first.add("user", "hello there")
    store.save(first)
    second = Conversation.new("m")
    second.add("user", "x" * 100)
    store.save(second)
    (tmp_path / "broken.json").write_text("{not json")
    assert [c.id for c in store.list()] == [second.id, first.id]
    loaded = store.load(first.id)
    assert loaded.messages == first.messages and loaded.title == "hello there"
    assert loaded.chat_messages()[0] == {"role": "system", "content": "be brief"}
    assert store.latest().title.endswith("…") and len(store.latest().title) == 60


def test_default_store_honours_the_data_dir_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXPAGED_DATA_DIR", str(tmp_path))
    assert ConversationStore.default().root == tmp_path / "conversations"


def test_engine_panel_names_the_attention_path_when_the_engine_reports_it():
    from mlxpaged_app.tui.widgets.engine_panel import stats_text

    stats = FakeEngine().stats()
    assert "attention" not in stats_text(stats).plain
    stats["attention"] = {"path": "kernel (with reference fallback)", "reason": "two-pass failed", "variants": []}
    assert "kernel (with reference fallback)" in stats_text(stats).plain


def test_engine_panel_shows_speculation_acceptance_when_it_is_on():
    from mlxpaged_app.tui.widgets.engine_panel import stats_text

    stats = FakeEngine().stats()
    assert "speculative" not in stats_text(stats).plain
    stats.update(
        speculative="ngram", spec_draft_tokens_total=0, spec_accepted_tokens_total=0, spec_acceptance_rate=None
    )
    assert "ngram · no drafts yet" in stats_text(stats).plain
    stats.update(spec_draft_tokens_total=1200, spec_accepted_tokens_total=840, spec_acceptance_rate=0.7)
    assert "ngram · 70% of 1,200 drafts kept" in stats_text(stats).plain
    stats.update(speculative="draft", draft_model="/models/Qwen3-0.6B-4bit")
    assert "draft Qwen3-0.6B-4bit · 70% of 1,200 drafts kept" in stats_text(stats).plain


def test_engine_panel_rows_fit_the_panel_with_large_disk_tier_figures():
    """app.tcss gives #engine-panel 50 columns: 46 for text after its border, padding and scrollbar. A row longer
    than that wraps its last word to the start of the next line (seen by hand in tmux with the disk tier's row)."""
    from mlxpaged_app.tui.widgets.engine_panel import stats_text

    stats = FakeEngine().stats()
    stats |= {"ram_hit_tokens": 12_345_678, "disk_tier": True, "disk_hit_tokens": 12_345_678}
    stats |= {"disk_read_bytes": 999 * 2**30, "disk_used_bytes": 999 * 2**30, "disk_limit_bytes": 1000 * 2**30}
    stats |= {"disk_written_bytes": 9_999 * 2**30, "disk_state_hits": 99_999, "disk_state_written": 99_999}
    stats |= {"disk_state_written_bytes": 999 * 2**30}
    stats.update(speculative="ngram", spec_draft_tokens_total=99_999, spec_acceptance_rate=0.7)
    lines = stats_text(stats).plain.splitlines()
    assert any(line.startswith("disk tier") for line in lines)
    assert [line for line in lines if len(line) > 46] == []
