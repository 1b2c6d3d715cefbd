"""Unit tests of the chat app's plain parts: block map grouping, reply runs, settings, storage."""

from __future__ import annotations

import threading

import pytest

from mlxpaged_app.tui.widgets.block_map import classify, group, group_size
from mlxpaged_app.tui.generation import ReplyRun, ReplyStats
from mlxpaged_app.tui.settings import ChatSettings
from mlxpaged_app.tui.store import Conversation, ConversationStore
from tests.test_tui_support import FakeEngine


def test_classify_marks_the_current_requests_blocks():
    states = ["owned", "owned", "shared", "cached", "free", "owned"]
    assert classify(states, [0, 1, 2]) == ["current", "current", "shared", "cached", "free", "other"]


def test_grouping_keeps_the_busiest_block_visible():
    classes = ["free", "free", "current", "cached", "free", "free", "free"]
    assert group(classes, 3) == ["current", "cached", "free"]
    assert group_size(2064, 46 * 8 * 2) == 3 and group_size(10, 100) == 1


class Recorder:
    def __init__(self):
        self.events, self.done = [], threading.Event()

    def reply_started(self, run):
        self.events.append(("started", run.request_id))

    def reply_text(self, run, text):
        self.events.append(("text", text))

    def reply_finished(self, run, stats):
        self.events.append(("finished", stats))
        self.done.set()

    def reply_failed(self, run, error, rejected):
        self.events.append(("failed", error, rejected))
        self.done.set()


def test_reply_run_streams_then_reports_usage():
    engine, listener = FakeEngine(), Recorder()
    run = ReplyRun(engine, [{"role": "user", "content": "hi"}], ChatSettings().sampling_params())
    run.run(listener)
    assert run.text == "Hello **world**!" and listener.events[0] == ("started", "fake-0")
    stats = listener.events[-1][1]
    assert (stats.prompt_tokens, stats.completion_tokens, stats.finish_reason) == (2, 3, "stop")
    assert stats.time_to_first_token is not None


def test_reply_run_stop_before_submit_aborts_right_after():
    engine, listener = FakeEngine(), Recorder()
    engine.gate = threading.Event()
    run = ReplyRun(engine, [{"role": "user", "content": "hi"}], ChatSettings().sampling_params())
    run.stop()
    run.run(listener)
    assert engine.aborted == ["fake-0"] and listener.events[-1][1].finish_reason == "abort"


def test_reply_run_reports_a_rejected_request():
    engine, listener = FakeEngine(), Recorder()
    engine.submit_error = ValueError("the prompt is empty")
    ReplyRun(engine, [], ChatSettings().sampling_params()).run(listener)
    assert listener.events == [("failed", engine.submit_error, True)]


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
