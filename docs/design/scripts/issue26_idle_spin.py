"""Issue 26 (session 11): what an idle `mlxpaged serve` over 2 ranks costs in CPU, per rank, and how long a
one-token request takes after 1 s of idling (it may wait for the followers' nap: distributed/leader.py).

    python docs/design/scripts/issue26_idle_spin.py
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

from mlxpaged.distributed.launch import free_port_run, launcher_path
from tests.tiny_models import write_tiny_llama_dir

import psutil

IDLE_S = 5.0


def main() -> None:
    model = write_tiny_llama_dir(Path(tempfile.mkdtemp()) / "model", dtype="float32")
    serve = [str(Path(sys.executable).with_name("mlxpaged")), "serve", "--model", str(model), "--port", "0"]
    launcher = [launcher_path(), "--backend", "ring", "-n", "2", "--starting-port", str(free_port_run(2))]
    proc = subprocess.Popen(
        [*launcher, "--", *serve, "--no-kv-disk"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        url = next(line.split("ready at ")[1].split()[0] for line in proc.stdout if "ready at" in line)
        time.sleep(2)
        ranks = [c for c in psutil.Process(proc.pid).children(recursive=True) if "serve" in " ".join(c.cmdline())]
        before = {c.pid: c.cpu_times() for c in ranks}
        time.sleep(IDLE_S)
        for c in ranks:
            a, b = before[c.pid], c.cpu_times()
            rank = c.environ().get("MLX_RANK")
            user, system = b.user - a.user, b.system - a.system
            print(f"rank {rank}: CPU over {IDLE_S:g} s idle: user {user:.2f} s, sys {system:.2f} s")
        with urllib.request.urlopen(f"{url}/models") as reply:
            name = json.load(reply)["data"][0]["id"]
        body = json.dumps({"model": name, "prompt": "Hello", "max_tokens": 1}).encode()
        for _ in range(3):
            time.sleep(1.0)
            start = time.perf_counter()
            request = urllib.request.Request(f"{url}/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request) as reply:
                reply.read()
            print(f"a one-token request after 1 s idle: {time.perf_counter() - start:.3f} s")
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(30)


if __name__ == "__main__":
    main()
