"""Whether speculation pays at this batch size: it steps aside when a batch is large enough that its verify passes
cost more than their kept drafts save.

A verify pass feeds k + 1 tokens per drafting row. Where a step is bound by reading the weights (a GPU, a small batch)
the extra tokens are nearly free; where it is bound by compute (the CPU at larger batches, a GPU at large ones) they
cost nearly what they would as decode steps, and with a draft model the draft passes come on top. Where that
crossing lies depends on the backend, the model, the drafter and what the replies are, so it is measured as the
engine runs rather than assumed: the tokens per second of steps that only decode, with drafts and without, per
number of decoding rows. Each way is measured at the first batch size before choosing (drafting first); a batch size
not measured both ways follows the nearest one that is (a batch draining one request per step sees a new size every
step: measuring drafting first at each would draft the whole drain, and a draft model would catch up every time).
Then the better way runs, with EXPLORE_STEPS steps the other way every EXPLORE_EVERY steps (after FIRST_TRY at a
batch size that follows another's choice) so a change (longer contexts, drafts that start to fail) is seen; each try
that confirms the choice doubles the wait before the next (up to EXPLORE_MAX), and a clear choice (CLEAR) waits
EXPLORE_MAX at once, as a try costs: a draft model catches up with every token decoded without it (at 16 rows of
the embedded model drafting for itself, a try after 32 plain steps took 2.6 s against 0.11 s for a plain step).
The first step after a switch is not measured: it pays for the switch (that catch-up, a pipeline starting again),
not for the way it runs.
Plain Python, no MLX (tests drive it with made-up times).
"""

from __future__ import annotations

SMOOTHING = 0.3  # the weight of the newest step's rate: steps are noisy, the load and the replies drift
EXPLORE_EVERY = 32  # steps of the chosen way at one batch size before trying the other
EXPLORE_STEPS = 2  # steps the other way when trying it: the first pays for the switch, the second is measured
EXPLORE_MAX = 256  # steps between tries at most, once tries keep confirming the choice
FIRST_TRY = 3  # steps at a batch size that follows a nearer one's choice before the other way is tried there
CLEAR = 1.5  # one way at least this many times the other's tokens per second: its tries wait EXPLORE_MAX steps


class SpeculationGate:
    def __init__(self) -> None:
        self._rates: dict[tuple[int, bool], float] = {}  # (decoding rows, drafted) -> tokens per second
        self._last: dict[int, bool] = {}  # decoding rows -> whether the last step of that many drafted
        self._streak: dict[int, int] = {}  # decoding rows -> steps the chosen way since the other was tried
        self._trying: dict[int, int] = {}  # decoding rows -> steps left of trying the other way
        self._every: dict[
            int, int
        ] = {}  # decoding rows -> steps between tries (EXPLORE_EVERY, doubled while confirmed)
        self._probing: dict[int, bool] = {}  # decoding rows -> the way chosen when a try began, until it is measured

    def leaning(self, rows: int) -> bool:
        """Whether a step of `rows` decoding rows would draft, without counting it (the pipeline's guess)."""
        drafted, plain = self._rates.get((rows, True)), self._rates.get((rows, False))
        if drafted is not None and plain is not None:
            return drafted >= plain
        near = self._nearest(rows)
        if near is not None:  # the nearest batch size measured both ways: its choice
            return self.leaning(near)
        return drafted is None  # nothing measured both ways yet: measure drafting first, then plain decoding

    def _nearest(self, rows: int) -> int | None:
        """The batch size nearest `rows` measured both ways (the smaller of two as near), or None."""
        both = [r for (r, drafted) in self._rates if drafted and (r, False) in self._rates]
        return min(both, key=lambda r: (abs(r - rows), r)) if both else None

    def decide(self, rows: int) -> bool:
        """Whether this step of `rows` decoding rows drafts (counted: every EXPLORE_EVERY steps, EXPLORE_STEPS steps
        go the other way, also at a batch size that follows a nearer one's choice: that measures it)."""
        choice = self.leaning(rows)
        measured = (rows, True) in self._rates and (rows, False) in self._rates
        if not measured and self._nearest(rows) is None:
            return choice  # the first measurements
        if self._trying.get(rows):
            self._trying[rows] -= 1
            return not choice
        self._streak[rows] = self._streak.get(rows, 0) + 1
        if self._streak[rows] >= self._every.get(rows, EXPLORE_EVERY if measured else FIRST_TRY):
            self._streak[rows], self._trying[rows], self._probing[rows] = 0, EXPLORE_STEPS - 1, choice
            return not choice
        return choice

    def record(self, rows: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A step of `rows` decoding rows (nothing else) made `tokens` tokens in `seconds`, with drafts or not."""
        switched = self._last.get(rows, drafted) != drafted
        self._last[rows] = drafted
        if rows <= 0 or seconds <= 0 or switched:
            return
        rate = tokens / seconds
        old = self._rates.get((rows, drafted))
        self._rates[(rows, drafted)] = rate if old is None else (1 - SMOOTHING) * old + SMOOTHING * rate
        probing = self._probing.get(rows)
        tried = probing is not None and drafted != probing  # a try measured
        if tried:  # wait longer next time if it changed nothing
            del self._probing[rows]
            every = self._every.get(rows, EXPLORE_EVERY)
            self._every[rows] = min(2 * every, EXPLORE_MAX) if self.leaning(rows) == probing else EXPLORE_EVERY
        fast, slow = sorted((self._rates.get((rows, True)) or 0.0, self._rates.get((rows, False)) or 0.0))[::-1]
        if slow and fast >= CLEAR * slow and (tried or rows not in self._every):
            self._every[rows] = EXPLORE_MAX  # a clear choice: tries (each maybe a draft model's catch-up) wait longest

    def rates(self, rows: int) -> tuple[float | None, float | None]:
        """(tokens per second with drafts, without) measured at `rows` decoding rows."""
        return self._rates.get((rows, True)), self._rates.get((rows, False))
