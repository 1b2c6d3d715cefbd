"""`mlxpaged serve` under `mlx.launch` (2 processes, ring backend on loopback): the official openai client
streams what a one-process server streams, and stopping rank 0's server (SIGINT, as `kill -INT`) stops every
rank: the launcher exits 0. (Ctrl-C in the launcher's terminal also signals mlx.launch itself, which then dies
of its own KeyboardInterrupt without waiting for the ranks; the ranks still stop as here.)"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.distributed.launch import free_port_run, launcher_path
from tests.tiny_models import write_tiny_llama_dir

import openai

READY_TIMEOUT_S = 120
STOP_TIMEOUT_S = 30
PROMPT = "Hello there, how"


def test_openai_client_streams_from_two_processes_and_stopping_rank_0_stops_all(tmp_path):
    model_dir = write_tiny_llama_dir(tmp_path / "model", dtype="float32")
    one, one_out = serve_and_ask(model_dir, 1)
    two, two_out = serve_and_ask(model_dir, 2)
    assert "tensor parallel" not in one_out and "tensor parallel over 2 processes" in two_out
    assert two == one and len(two) > 0


def serve_and_ask(model_dir: Path, processes: int) -> tuple[str, str]:
    """Start the server, stream one greedy completion with the openai client, stop it by SIGINT to rank 0;
    the streamed text and everything the server printed (it must have exited 0)."""
    command = [str(Path(sys.executable).with_name("mlxpaged")), "serve", "--model", str(model_dir), "--port", "0"]
    command += ["--cache-tokens", "1024", "--no-kv-disk"]
    if processes > 1:
        launcher = [launcher_path(), "--backend", "ring", "-n", str(processes)]
        command = [*launcher, "--starting-port", str(free_port_run(processes)), "--", *command]
    server = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        url, rank0, seen = _wait_ready(server)
        client = openai.OpenAI(base_url=url, api_key="unused")
        stream = client.completions.create(
            model=str(model_dir), prompt=PROMPT, max_tokens=10, temperature=0, stream=True
        )
        text = "".join(chunk.choices[0].text for chunk in stream)
        os.kill(rank0, signal.SIGINT)
        output, _ = server.communicate(timeout=STOP_TIMEOUT_S)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    output = seen + output
    assert server.returncode == 0, output[-3000:]
    assert "mlxpaged serve: stopped" in output
    return text, output


def _wait_ready(server: subprocess.Popen) -> tuple[str, int, str]:
    """The URL rank 0 prints once uvicorn accepts connections, rank 0's process id (uvicorn prints it), and
    the output so far."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    assert server.stdout is not None
    seen: list[str] = []
    pid, url = None, None  # in either order: uvicorn logs to stderr, rank 0 prints "ready" to stdout
    while time.monotonic() < deadline:
        line = server.stdout.readline()
        if not line and server.poll() is not None:
            break
        seen.append(line)
        started = re.search(r"Started server process \[(\d+)\]", line)
        pid = int(started.group(1)) if started else pid
        ready = re.search(r"ready at (http://\S+/v1)", line)
        url = ready.group(1) if ready else url
        if url is not None and pid is not None:
            return url, pid, "".join(seen)
    raise AssertionError("the server did not get ready:\n" + "".join(seen)[-3000:])


def test_a_model_that_cannot_be_split_is_refused_at_load_on_every_rank(tmp_path):
    # 2 KV heads: not over 4 ranks by heads, and mlx-lm has no pipeline for llama
    model_dir = write_tiny_llama_dir(tmp_path / "model", dtype="float32")
    command = [str(Path(sys.executable).with_name("mlxpaged")), "serve", "--model", str(model_dir), "--port", "0"]
    launcher = [launcher_path(), "--backend", "ring", "-n", "4", "--starting-port", str(free_port_run(4))]
    done = subprocess.run([*launcher, "--", *command], capture_output=True, text=True, timeout=READY_TIMEOUT_S)
    reason = (
        "cannot run this model over 4 processes: tensor parallel: its num_key_value_heads (2) is not divisible by "
        "the 4 ranks; pipeline parallel: mlx-lm has no pipeline parallelism (a pipeline() method) for model type "
        "'llama'"
    )
    assert f"mlxpaged serve: {reason}" in done.stderr, done.stderr[-3000:]
    assert all(f"mlxpaged serve (follower rank {rank}): {reason}" in done.stderr for rank in (1, 2, 3))
    assert "ready at" not in done.stdout
