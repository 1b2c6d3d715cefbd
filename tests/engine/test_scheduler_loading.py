"""The scheduler with a lower tier that reads in the background (plain Python): a request whose blocks are being
read waits apart and the requests behind it are admitted meanwhile; once read it is admitted with them as cached;
an aborted one's read is dropped."""

from __future__ import annotations

from mlxpaged.engine.request import Request, RequestStatus
from mlxpaged.engine.scheduler import Scheduler
from tests.cache.kv_sequences import BS, manager_for, prompt


class SlowTier:
    """Holds every block of `tokens`'s chain; a read is done only once the test says so."""

    def __init__(self, hashes):
        self.hashes, self.done, self.started, self.forgotten = set(hashes), set(), [], []

    def contains(self, block_hash):
        return block_hash in self.hashes

    def prefetch(self, key, block_hashes):
        if key not in self.started:
            self.started.append(key)
        return key in self.done

    def forget(self, key):
        self.forgotten.append(key)

    def read(self, block_hashes, key=None):
        assert key in self.done  # never read on the spot here: admission waited for the background read
        return [("page", h) for h in block_hashes]

    def write(self, block_ids, block_hashes, pages):
        pass


def chain(manager, tokens, n):
    hashes, parent = [], None
    for i in range(n):
        parent = manager.hash_fn(parent, tuple(tokens[i * BS : (i + 1) * BS]), manager.extra_key)
        hashes.append(parent)
    return hashes


def admitted(scheduler: Scheduler) -> list[str]:
    return [c.request.request_id for c in scheduler.schedule().chunks]


def test_a_request_loading_from_disk_waits_apart_and_the_others_pass_it():
    seen = prompt(5 * BS + 3)
    manager = manager_for(64, BS)
    tier = SlowTier(chain(manager, seen, 5))
    manager.lower_tier = tier
    scheduler = Scheduler(manager, max_batch_tokens=256, max_num_seqs=4, max_model_len=512)
    scheduler.add_request(Request("loaded", seen, 4))
    scheduler.add_request(Request("fresh", [7] * 20, 4))
    assert admitted(scheduler) == ["fresh"] and tier.started == ["loaded"]
    assert scheduler.get("loaded").status is RequestStatus.WAITING
    tier.done.add("loaded")
    out = scheduler.schedule()
    loaded = next(c for c in out.chunks if c.request.request_id == "loaded")
    assert loaded.start == 5 * BS and loaded.request.num_cached_tokens == 5 * BS  # from the tier, not prefilled


def test_an_aborted_request_drops_its_read():
    seen = prompt(3 * BS + 1)
    manager = manager_for(64, BS)
    manager.lower_tier = tier = SlowTier(chain(manager, seen, 3))
    scheduler = Scheduler(manager, max_batch_tokens=256, max_num_seqs=4, max_model_len=512)
    scheduler.add_request(Request("a", seen, 4))
    assert admitted(scheduler) == []
    scheduler.abort("a")
    assert tier.forgotten == ["a"] and not scheduler.has_unfinished
