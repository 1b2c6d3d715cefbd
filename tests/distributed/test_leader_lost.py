"""A follower whose rank 0 dies stops with LeaderLostError instead of waiting forever (ring backend)."""

from __future__ import annotations

from pathlib import Path

from tests.distributed.launch import run_script
from tests.tiny_models import write_tiny_llama_dir


def test_followers_stop_when_rank_0_dies(tmp_path):
    model_dir = write_tiny_llama_dir(tmp_path / "model", dtype="float32")
    done = run_script(Path(__file__).with_name("leader_dies.py"), [str(model_dir)], 2)
    assert "RANK 0 DIES" in done.stdout, done.stderr[-3000:]
    assert "LEADER LOST: rank 0 stopped answering after" in done.stdout, (done.stdout[-2000:], done.stderr[-3000:])
