"""Issue 38's target "a hang-up during a long prefill: the engine idle within 2 s", on a live `mlxpaged serve` (the
embedded model, its defaults) through the official openai client.

    MALLOC_MMAP_THRESHOLD_=2000000000 MALLOC_TRIM_THRESHOLD_=4000000000 PYTHONPATH=app \
        .venv/bin/python docs/design/scripts/issue38_hang_up.py

Each run streams a ~6,500-token prompt of its own (no prefix hit) and gives up `after` seconds in, mid prefill: the
client's read timeout (the stream is silent while the prompt prefills), after which it closes the connection. Then
/health is polled every 100 ms (so a figure is up to 0.1 s late) until no request runs or waits and no block is owned. The server's own "client left"
lines are printed last: when it noticed.
"""

from __future__ import annotations

import time

from mlxpaged_app.bench.server import free_port, start_server, stop_server

import httpx
import openai

LINE = "The quick brown fox jumps over the lazy dog while the committee reviews chapter {i} of the report. "
HANG_UPS_S = (4.0, 8.0, 12.0, 16.0, 20.0, 23.0)  # the prompt takes ~25 s to prefill on a 2-core CPU


def idle(base: str) -> bool:
    health = httpx.get(f"{base}/health").json()
    return not (health.get("requests_running") or health.get("requests_waiting") or health.get("blocks_used"))


def main() -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    server = start_server([".venv/bin/mlxpaged", "serve", "--port", str(port)], f"{base}/health")
    try:
        for run, after in enumerate(HANG_UPS_S):
            text = f"Run {run} {time.time()}: " + "".join(LINE.format(i=i) for i in range(300))
            client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", timeout=after, max_retries=0)
            tokens = 0
            try:
                stream = client.chat.completions.create(
                    model="smollm2-135m", messages=[{"role": "user", "content": text}], max_tokens=32, stream=True
                )
                for chunk in stream:
                    tokens += bool(chunk.choices and chunk.choices[0].delta.content)  # the role chunk comes at once
            except openai.APITimeoutError:
                pass
            closed = time.monotonic()
            client.close()
            if tokens:
                print(f"run {run}: the reply began before {after:.0f} s; not a hang-up during the prefill")
                continue
            while not idle(base):
                time.sleep(0.1)  # a 50 Hz poll took enough CPU on 2 cores to slow the steps it timed
            waited = time.monotonic() - closed
            print(f"run {run}: hung up {after:.0f} s into the prefill; engine idle {waited:.2f} s later")
            time.sleep(1)
    finally:
        server.log.seek(0)
        log = server.log.read().decode(errors="replace").splitlines()
        print("\n".join(line for line in log if "client left" in line))
        stop_server(server)


if __name__ == "__main__":
    main()
