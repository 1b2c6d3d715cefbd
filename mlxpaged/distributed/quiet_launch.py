"""MLX's `mlx.launch`, run without its busy wait: `python -m mlxpaged.distributed.quiet_launch ARGS` takes
mlx.launch's arguments and runs its own `main`.

mlx.launch (mlx 0.32) watches each rank in a thread that selects on the rank's output pipes and on its stdin
pipe, which is always writable, so the select returns at once and the thread never sleeps: with two ranks idle
(`serve` waiting for requests, or ranks asleep) the launcher holds 1.3 cores (`top`, this 2-core machine), for as
long as the ranks live. Here that select waits on the reads alone, up to mlx.launch's own timeout (1 s), then
reports the stdin pipe writable as before, so input typed to the launcher still reaches the ranks, at most that
timeout late; output wakes it at once. Its main loop spins too once its own stdin ends (/dev/null under a service
manager, a closed pipe: select says readable, the read gives nothing, again), so its stdin becomes a pipe fed
from the real one and kept open after it ends. Everything else is mlx.launch's code. Should a later mlx lay its
module out otherwise, mlx.launch runs as it is.
"""

from __future__ import annotations

import os
import select as _select_module
import threading
from collections.abc import Sequence


def _wait_for_reads(rlist: Sequence, wlist: Sequence, xlist: Sequence, timeout: float | None = None):
    """mlx.launch's `select` for its rank threads: sleep until a read is ready (or the timeout), not until the
    always-writable stdin pipe is (at once)."""
    if not wlist:
        return _select_module.select(rlist, wlist, xlist, timeout)
    readable, _, errors = _select_module.select(rlist, [], xlist, timeout)
    return readable, list(wlist), errors


def quiet(launch_module) -> bool:
    """Replace mlx.launch's `select` by one that sleeps; False (nothing changed) if its module differs."""
    if getattr(launch_module, "select", None) is not _select_module.select or not callable(
        getattr(launch_module, "main", None)
    ):
        return False
    launch_module.select = _wait_for_reads
    return True


def stdin_that_never_ends() -> None:
    """Make file descriptor 0 a pipe that a thread fills from the real stdin and that stays open after it ends."""
    real = os.dup(0)
    read_end, write_end = os.pipe()
    os.dup2(read_end, 0)
    os.close(read_end)

    def pump() -> None:
        while chunk := os.read(real, 65536):
            os.write(write_end, chunk)
        os.close(real)  # `write_end` stays open: an end of input would set mlx.launch's main loop spinning

    threading.Thread(target=pump, name="stdin", daemon=True).start()


def main() -> None:
    from mlx._distributed_utils import launch

    if quiet(launch):
        stdin_that_never_ends()
    launch.main()


if __name__ == "__main__":
    main()
