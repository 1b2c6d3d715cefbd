"""Run the harness over many architectures in a few worker processes; a native crash becomes a verdict.

Each worker runs its share of modules in one process (imports paid once), every variant of a module in turn
(harness.VARIANTS: the model and mlx-lm's reference made once for all), and is restarted after the module it
died on. A death before a variant's "reference-done" line is mlx-lm's own crash ("upstream-crash"); after it,
the engine's ("crash"); the module's variants not run yet get the same verdict.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.archs.configs import MLX_LM_CANNOT_RUN, has_config, text_modules
from tests.lowest_priority import at_lowest_priority

ROOT = Path(__file__).resolve().parents[2]
MODULE_TIMEOUT_S = 180
# At the lowest CPU priority (a sweep in the background of the suite, tests/archs/background.py) a module waits
# while the tests beside it use both cores: only a far longer silence means a hung process.
BACKGROUND_MODULE_TIMEOUT_S = 900


class Stop:
    """Ends a sweep early: kills the worker processes running now and starts no others (a test session that
    ends before the sweep's verdicts were needed)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._processes: set[subprocess.Popen] = set()
        self.requested = False

    def __call__(self) -> None:
        with self._lock:
            self.requested = True
            for proc in self._processes:
                proc.kill()

    def track(self, proc: subprocess.Popen) -> bool:
        """Track a started worker; False (and the worker killed) when the sweep was stopped."""
        with self._lock:
            if self.requested:
                proc.kill()
                return False
            self._processes.add(proc)
            return True

    def running(self) -> list[subprocess.Popen]:
        with self._lock:
            return list(self._processes)

    def forget(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self._processes.discard(proc)


def sweep(
    modules: list[str] | None = None,
    workers: int = 2,
    variants: tuple[str, ...] = ("cpu",),
    background: bool = False,
    stop: Stop | None = None,
) -> dict[str, dict[str, dict]]:
    """Verdicts by variant (harness.VARIANTS: "cpu", "cuda", "kv8"), then by module, for every text module of
    mlx_lm.models unless `modules` is given. `background` runs the workers at the lowest CPU priority (with
    BACKGROUND_MODULE_TIMEOUT_S); after `stop()` the verdicts are incomplete and not to be read."""
    run = _Runner(variants, background, stop or Stop())
    modules = modules or text_modules()
    settled = {
        m: {"module": m, "status": "cannot-run", "reason": MLX_LM_CANNOT_RUN[m]}
        for m in modules
        if m in MLX_LM_CANNOT_RUN
    }
    todo = [m for m in modules if m not in settled and has_config(m)]
    settled.update(
        {
            m: {"module": m, "status": "fail", "reason": "no tiny config in tests/archs/configs.json"}
            for m in modules
            if m not in settled and not has_config(m)
        }
    )
    verdicts = {v: {m: {**verdict, "variant": v} for m, verdict in settled.items()} for v in variants}
    shares = [todo[i::workers] for i in range(workers)]
    with ThreadPoolExecutor(workers) as pool:
        for share in pool.map(run.share, shares):
            for (module, variant), verdict in share.items():
                verdicts[variant][module] = verdict
    return {v: {m: verdicts[v][m] for m in modules if m in verdicts[v]} for v in variants}  # all, unless stopped


class _Runner:
    """Runs shares of modules in worker processes of one priority, restarting a worker after a module it died on."""

    def __init__(self, variants: tuple[str, ...], background: bool, stop: Stop):
        self.variants, self.background, self.stop = variants, background, stop
        self.module_timeout_s = BACKGROUND_MODULE_TIMEOUT_S if background else MODULE_TIMEOUT_S

    def share(self, modules: list[str]) -> dict[tuple[str, str], dict]:
        verdicts: dict[tuple[str, str], dict] = {}
        while len(verdicts) < len(modules) * len(self.variants) and not self.stop.requested:
            rest = [m for m in modules if any((m, v) not in verdicts for v in self.variants)]
            verdicts.update(self.process(rest))
        return verdicts

    def process(self, modules: list[str]) -> dict[tuple[str, str], dict]:
        """Run until the process ends; the variant it was on when it died gets a crash verdict, and so do the
        variants of that module after it."""
        variants = self.variants
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
        command = [sys.executable, "-m", "tests.archs.harness", "--variants", ",".join(variants)]
        if self.background:
            command = at_lowest_priority(command)
        proc = subprocess.Popen(
            [*command, *modules], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        if not self.stop.track(proc):
            proc.wait()
            return {}
        stderr: list[str] = []
        threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True).start()
        verdicts: dict[tuple[str, str], dict] = {}
        reference_done = False
        watchdog = _Watchdog(proc, self.module_timeout_s)
        for line in proc.stdout:
            if not line.startswith("{"):
                continue
            record = json.loads(line)
            watchdog.reset()
            if record.get("stage") == "reference-done":
                reference_done = True
            else:
                verdicts[(record["module"], record["variant"])] = record
                reference_done = False
        proc.wait()
        watchdog.cancel()
        self.stop.forget(proc)
        done = len(verdicts)
        if done < len(modules) * len(variants) and not self.stop.requested:
            module, first = modules[done // len(variants)], done % len(variants)
            crash = _crash(module, proc.returncode, reference_done, watchdog.timeout_s, watchdog.fired, "".join(stderr))
            for i, variant in enumerate(variants[first:]):
                where = "" if i == 0 else f" (not run: the process died in variant {variants[first]})"
                verdicts[(module, variant)] = {**crash, "variant": variant, "reason": crash["reason"] + where}
        return verdicts


def _crash(module: str, returncode: int, reference_done: bool, timeout_s: float, timed_out: bool, stderr: str) -> dict:
    """A dead process's verdict: "upstream-crash" when mlx-lm's own run had not finished, else "crash". Both fail
    the sweep's tests: a tiny config that crashes plain mlx-lm is a bad config (phi3small's vocab was smaller than
    the token ids its logits mask, an out-of-bounds write), to be fixed, not excused."""
    cause = f"timed out after {timeout_s:g} s" if timed_out else f"process died (exit code {returncode})"
    who = "the paged engine" if reference_done else "mlx-lm's own generate_step (before mlxpaged ran)"
    return {
        "module": module,
        "status": "crash" if reference_done else "upstream-crash",
        "reason": f"{cause} in {who}; stderr: {stderr.strip()[-200:]}",
    }


class _Watchdog:
    """Kills the process when one module takes longer than `timeout_s`."""

    def __init__(self, proc: subprocess.Popen, timeout_s: float):
        self.proc, self.timeout_s, self.fired, self._timer = proc, timeout_s, False, None
        self.reset()

    def reset(self) -> None:
        self.cancel()
        self._timer = threading.Timer(self.timeout_s, self._fire)
        self._timer.daemon = True
        self._timer.start()

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()

    def _fire(self) -> None:
        self.fired = True
        self.proc.kill()


if __name__ == "__main__":
    for verdict in sweep(sys.argv[1:] or None)["cpu"].values():
        print(json.dumps(verdict))
