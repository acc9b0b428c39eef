"""One bucket's confirmation: the best few of the search re-timed interleaved with the rule's
pick, and a winner published only when the confidence interval of its speedup lies above a
margin."""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any, Iterable

from moetune.db import BaselineRecord, Candidate
from moetune.errors import TuningError
from moetune.runtime.kernels.base import params_key
from moetune.runtime.platform import SKU
from moetune.runtime.problem import MoEProblem
from moetune.runtime.rules import rule_variants
from moetune.tuner.load import HostProbe
from moetune.tuner.measure import CandidateMeasurer, Key, Result, Status
from moetune.tuner.timing import RatioInterval, Timing, median_error, ratio_interval

#: A winner is faster than the rule's pick by at least this fraction, at the lower bound of its
#: speedup's interval; a closer call keeps the rule's pick (what serving runs without a row).
MARGIN = 0.01
#: Each bound of a ratio interval is wrong with this probability (``ratio_interval``).
ALPHA = 1e-4
#: Confirmation stops early, keeping the rule's pick, once an interval this loose lies below
#: ``1 + MARGIN`` (keeping the rule needs no strong evidence).
FUTILE_ALPHA = 0.2
#: A re-timing this many times its kernel's fastest round is disturbed (another process on the
#: core, a busy host) and left out with its round; ordinary jitter stays far below.
DISTURBED = 1.3
#: The rule's pick at its fastest in this bucket's search and confirmation this many times its
#: quiet reference (its fastest time in the table's history) is slowed by load that lasts: on a
#: busy host one kernel (a loop of many small ops) can run 1000x slower in every round alike,
#: so the rounds agree and no round looks disturbed. No winner is published then.
SUSTAINED = 3.0
#: Without such history: the host probe (``tuner.load``) read beside every round of the
#: confirmation, at its quietest, over this many times its quiet cost. Quiet readings on a
#: shared 2-core VM were 1.0-1.3x (at most 2.0x at the quietest of 5); load that slows the
#: rule's loop 10x or more slows the probe's stream of the same kind of ops past this.
HOST_SLOWED = 2.5


@dataclasses.dataclass(frozen=True)
class Baseline:
    """One rule variant timed beside the winner: its pooled timing and the winner's speedup
    over it, taken round by round over ``rounds`` rounds clean for both (``disturbed`` more were
    left out): ``ratio_lo``-``ratio_hi`` is its confidence interval (``ratio_interval`` at
    ``ALPHA``; ``None`` for both where it says nothing: ``readable_bounds``). ``beaten``: the
    interval lies above ``1 + MARGIN`` (decided on the unrounded bounds). ``vllm`` and
    ``configs``: the vLLM and configs file the variant stands for (``RuleChoice``)."""

    kernel: str
    params: dict[str, Any]
    timing: Timing
    rounds: int
    ratio_lo: float | None
    ratio_hi: float | None
    beaten: bool
    disturbed: int = 0
    vllm: str | None = None
    configs: str | None = None

    def to_row(self) -> BaselineRecord:
        """The form a winner row stores (``WinnerRecord.baselines``)."""
        t = self.timing
        return BaselineRecord(Candidate(self.kernel, self.params), self.vllm, self.configs,
                              t.median_us, t.p20_us, t.p80_us, self.rounds, self.ratio_lo,
                              self.ratio_hi, self.beaten, self.disturbed)


@dataclasses.dataclass(frozen=True)
class Decision:
    """A bucket's outcome: the winner and every rule variant as timed side by side in
    confirmation (``baselines[0]`` is the rule where the bucket was tuned). Confirmation took
    ``rounds`` rounds (deciding) and ``retimes`` re-timings of its ``finalists`` in all."""

    winner: Result
    winner_timing: Timing
    baselines: tuple[Baseline, ...]
    reason: str
    results: tuple[Result, ...]
    rounds: int = 0
    retimes: int = 0
    finalists: int = 0

    @property
    def baseline(self) -> Baseline:
        return self.baselines[0]

    @property
    def baseline_timing(self) -> Timing:
        return self.baselines[0].timing

    @property
    def speedup(self) -> float:
        return self.baseline_timing.median_us / self.winner_timing.median_us


def confirm(problem: MoEProblem, sku: SKU, measurer: CandidateMeasurer, results: dict[Key, Result], *,
            top: int = 3, rounds: int = 5, reps: int = 10,
            max_rounds: int | None = None, reference_us: float | None = None,
            probe: HostProbe | None = None) -> Decision:
    """Re-time the rule variants and the best ``top`` candidates interleaved, and decide.

    Each round re-times its finalists once, in alternating order, so a speedup is taken within
    a round: a slow phase of the machine slows both sides. A re-timing more than ``DISTURBED``
    times its kernel's fastest (in any round; for a rule variant, also in the search) is left
    out, with its round, of that kernel's comparisons. With
    several candidates, ``rounds`` rounds of every finalist choose the contender (the best mean
    ratio over the rule's pick, ``rule_variants(...)[0]``); the decision is on fresh rounds of
    the contender and the variants, so the luck that made it look best does not count twice.
    The contender wins only if the confidence interval of its speedup (``ratio_interval`` at
    ``ALPHA``) lies above ``1 + MARGIN``, looked at each time ``rounds`` more rounds are clean.
    Rounds are added until it does, or until even a loose interval (``FUTILE_ALPHA``) lies
    below (or the contender's fastest time is ``DISTURBED`` times the rule's: a far slower
    contender on a busy host), or ``max_rounds`` deciding rounds (default ``4 * rounds``) have
    been timed; then the rule's pick is kept: a near-tie is noise, and the rule needs no table
    row to be right.
    Every variant is recorded with the winner's ratio interval over it.

    ``reference_us`` is the rule's pick's quiet time from before (the fastest the table has
    recorded for it in this bucket). If its fastest time here is over ``SUSTAINED`` times that,
    load slowed it in every round alike, which no comparison within a round can see: the
    rule's pick is kept (re-tune on a quiet host), and the reason says so.

    ``probe`` is read after every round; where even its quietest reading is over
    ``HOST_SLOWED``, load lasted through the whole confirmation and the rule's pick is kept
    likewise: the quiet reference of a bucket with no history.

    Raises:
        TuningError: the rule's pick failed or was wrong (nothing trustworthy to compare to).
        WorkerDiedError: an isolated measurer died re-timing a finalist.
    """
    max_rounds = 4 * rounds if max_rounds is None else max(max_rounds, rounds)
    variants = rule_variants(problem, sku)
    keys = [(v.kernel, params_key(v.params)) for v in variants]
    pairs = [(v, results[k]) for i, (v, k) in enumerate(zip(variants, keys))
             if i == 0 or k in results]
    first = pairs[0][1]
    if first.status is not Status.OK:
        raise TuningError(f"{problem.describe()}: baseline {first.kernel} "
                          f"{first.status.value}: {first.reason}")
    pairs = [(v, r) for v, r in pairs if r.status is Status.OK]  # one failing here is no rule
    bases = [r for _, r in pairs]
    ok = sorted((r for r in results.values() if r.status is Status.OK), key=lambda r: r.median_us)
    finalists = bases + [r for r in ok[:top] if all(r is not b for b in bases)]
    timed = _Rounds(measurer, finalists, reps, [b.median_us for b in bases], probe)
    contender = 1 if len(finalists) > 1 else 0  # 0: nothing but the rule's pick to time
    if len(finalists) > 2:
        timed.add(range(len(finalists)), rounds)
        contender = max(range(1, len(finalists)), key=lambda i: timed.interval(i, 0, ALPHA).ratio)
        timed.since = rounds  # the decision's rounds start here
    who = list(range(len(bases))) + ([contender] if contender >= len(bases) else [])
    timed.add(who, rounds)
    look = rounds
    while contender and timed.deciding < max_rounds:
        if (timed.interval(contender, 0, FUTILE_ALPHA).below(1 + MARGIN)
                or timed.fastest(contender) > DISTURBED * timed.fastest(0)):
            break  # not faster at a loose confidence, or even at its best (a busy host)
        verdict = timed.interval(contender, 0, ALPHA)
        if verdict.rounds >= look:
            if verdict.above(1 + MARGIN):
                break
            look += rounds
        timed.add(who, 1)
    verdict = timed.interval(contender, 0, ALPHA)
    best = contender if verdict.above(1 + MARGIN) else 0
    evidence = f"({verdict.text()})"
    slowed = timed.fastest(0) / reference_us if reference_us else 1.0
    host = min(timed.host, default=1.0)
    if best and (slowed > SUSTAINED or host > HOST_SLOWED):
        best = 0
        what = (f"{bases[0].kernel} ran {slowed:.1f}x its quiet {reference_us:.1f}us"
                if slowed > SUSTAINED else
                f"the host ran a stream of small ops {host:.1f}x its quiet cost")
        reason = (f"sustained load: {what} in every round, so {finalists[contender].kernel}'s "
                  f"{verdict.ratio:.2f}x {evidence} is not evidence; kept the rule, re-tune on "
                  "a quiet host")
    elif best:
        reason = f"{verdict.ratio:.2f}x over baseline {evidence}"
    elif contender:
        ratio = f"{verdict.ratio:.3f}x " if verdict.rounds else ""  # no round: no ratio
        reason = (f"{'near-tie' if verdict.ratio > 1 else 'not faster'}: "
                  f"{finalists[contender].kernel} {ratio}{evidence}")
    else:
        reason = "baseline kept"
    baselines = []
    for i, (rule, b) in enumerate(pairs):
        v = timed.interval(best, i, ALPHA)
        lo, hi = v.bounds() or (None, None)
        baselines.append(Baseline(b.kernel, b.params, timed.pooled(i), v.rounds, lo, hi,
                                  i != best and v.above(1 + MARGIN),
                                  timed.shared(best, i) - v.rounds, rule.vllm, rule.configs))
    return Decision(finalists[best], timed.pooled(best), tuple(baselines), reason,
                    tuple(results.values()), timed.deciding, timed.retimes, len(finalists))


class _Rounds:
    """The finalists' re-timings by round, in alternating order within a round (a machine
    drifting within a round favours neither side). A re-timing over ``DISTURBED`` times its
    kernel's fastest is disturbed; the fastest counts every round and, for the rule variants,
    their search timing (``floors``): leaving out rounds where a baseline is slow is the safe
    direction. Intervals and pooled timings use the rounds from ``since`` on. ``host``: the
    probe's reading after each round, if there is a probe."""

    def __init__(self, measurer: CandidateMeasurer, finalists: list[Result], reps: int,
                 floors: list[float], probe: HostProbe | None) -> None:
        self.measurer, self.finalists, self.reps, self.probe = measurer, finalists, reps, probe
        self.host: list[float] = []
        self.floors = floors + [math.inf] * (len(finalists) - len(floors))
        self.log: list[dict[int, Timing]] = [{} for _ in finalists]
        self.since = 0
        self.retimes = 0

    @property
    def deciding(self) -> int:
        return len(self.log[0]) - self.since

    def add(self, who: Iterable[int], n: int) -> None:
        who = list(who)
        for _ in range(n):
            r = max(len(t) for t in self.log)
            for i in who if r % 2 == 0 else who[::-1]:
                f = self.finalists[i]
                self.log[i][r] = self.measurer.retime(f.kernel, f.params, self.reps)
                self.retimes += 1
            if self.probe is not None:
                self.host.append(self.probe())

    def fastest(self, i: int) -> float:
        """Finalist ``i``'s fastest time: noise only ever adds time, so this is the reference."""
        return min(min(t.median_us for t in self.log[i].values()), self.floors[i])

    def medians(self, i: int, clean: bool = True) -> dict[int, float]:
        """Finalist ``i``'s medians by deciding round, the disturbed ones left out if ``clean``."""
        fastest = self.fastest(i)
        return {r: t.median_us for r, t in self.log[i].items() if r >= self.since
                and (not clean or t.median_us <= DISTURBED * fastest)}

    def interval(self, winner: int, baseline: int, alpha: float) -> RatioInterval:
        """``winner``'s speedup over ``baseline`` from the deciding rounds clean for both, its
        spread at least what each re-timing's repetitions imply."""
        w, b = self.medians(winner), self.medians(baseline)
        rounds = sorted(w.keys() & b.keys())
        errors = [median_error(self.log[i][r]) ** 2 for r in rounds for i in (winner, baseline)]
        return ratio_interval([b[r] / w[r] for r in rounds], alpha,
                              math.sqrt(sum(errors) / len(rounds)) if rounds else 0.0)

    def shared(self, a: int, b: int) -> int:
        """Deciding rounds that timed both ``a`` and ``b``."""
        return len([r for r in self.log[a].keys() & self.log[b].keys() if r >= self.since])

    def pooled(self, i: int) -> Timing:
        """Median of the clean deciding rounds' medians, with their typical p20/p80 offsets
        around it, so a disturbed round moves neither (the fastest when all are disturbed)."""
        clean = self.medians(i)
        if not clean:  # every deciding round slower than its search timing: the fastest one
            every = self.medians(i, clean=False)
            clean = {min(every, key=every.__getitem__): 0.0}
        rounds = [self.log[i][r] for r in clean]
        median = statistics.median(t.median_us for t in rounds)
        below = statistics.median(t.median_us - t.p20_us for t in rounds)
        above = statistics.median(t.p80_us - t.median_us for t in rounds)
        return Timing(median, median - below, median + above, sum(t.samples for t in rounds),
                      "confirm")
