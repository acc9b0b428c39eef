"""How often noise makes the confirmation publish a winner that is not faster (and how often it
finds real ones), and how many rounds that costs: the decision rule under injected noise, no
kernels run.

Usage: python scripts/bench_confirm_noise.py [--trials 2000] [--candidates 1,3] [--seed 0]

Each trial confirms candidates of one true speed against the rule's pick (100 us) with a
scripted measurer. Noise models, each on top of 3% lognormal jitter per re-timing but the first:

- ``quiet``: 0.2% jitter alone (the H200's confirmation rounds agreed within about 0.1%).
- ``jitter``: the jitter alone.
- ``spikes``: the rule's pick 10-50x slower in a re-timing with probability 0.2 (another process
  on the core, as seen with vLLM's CPU kernel on a busy 2-core host).
- ``busy``: a host busy loop that comes and goes: it starts before a re-timing with probability
  0.15, stops with 0.35, and while it runs slows whatever is timed by a factor drawn per
  episode (1.1-3x), so it often hits one side of a round only.
- ``drift``: the machine's speed drifts +-10% (a clock cycle of 10-40 re-timings) and steps up
  15% at a random moment: shifts that a comparison across rounds would take for speedups.
- ``all``: spikes, busy loop and drift together.
- ``sustained``: load that hits one kind of kernel far more than another, in the search and in
  every round alike: the rule's pick (a loop of many small ops) 10-1000x slower (log-uniform,
  drawn per confirmation), as 2-3 concurrent tunes on a loaded 2-core host did. The rounds
  agree, so no round looks disturbed; what catches it is the rule's quiet time from the
  table's history (``reference_us``, 100 us here, given in every model).
- ``sustained-no-history``: the same without a quiet reference from the table (a first tune
  under that load): only the host probe can tell it from a real win.

In every model the confirmation reads a host probe beside each round (``tuner.load``; its
reading is its stream of small ops over its quiet cost). Its model: 1 + |N(0, 0.15)| on a quiet
host (1.0-1.3x as measured on a shared 2-core VM), times 1-4x in 10% of readings (an
interrupted stream, as measured there), times the noise model's disturbance where that hits
whatever runs (``spikes`` and ``busy`` as for the rule's pick, ``drift`` over its trough); in
the ``sustained`` models, also times the rule's pick's slowdown to a power drawn per
confirmation between 0.5 and 1 (a stream of the same kind of ops, slowed as much as the rule's
pick or only its square root).

Compared with the previous rule (5 rounds, a win in every round but one and in the median round,
decided on the first 5 rounds of the same trial). Prints Markdown.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import platform
import random
import statistics

from moetune.runtime.kernels.base import params_key
from moetune.runtime.platform import detect_sku
from moetune.runtime.problem import MoEProblem
from moetune.runtime.rules import rule_choice
from moetune.tuner.confirm import ALPHA, DISTURBED, HOST_SLOWED, MARGIN, SUSTAINED, confirm
from moetune.tuner.job import source_commit
from moetune.tuner.measure import Result, Status
from moetune.tuner.timing import Timing

PREVIOUS_ROUNDS = 5
MODELS = ("quiet", "jitter", "spikes", "busy", "drift", "all", "sustained",
          "sustained-no-history")
#: The rule's pick's quiet time, as the table's history records it (``confirm``'s reference).
QUIET_US = 100.0
SPEEDS = (0.95, 0.98, 0.99, 1.0, 1.02, 1.05, 1.10)  # the candidate's true speed over the rule's


@dataclasses.dataclass
class NoisyMeasurer:
    """Re-timings of the rule's pick and the candidates under one noise model."""

    true_us: dict[str, float]
    rule: str
    model: str
    rng: random.Random
    calls: int = 0
    busy: float = 1.0  # the busy loop's slowdown while it runs, 1.0 when it does not
    slowed: float = 1.0  # the rule's pick's sustained slowdown (``sustained`` models)
    #: The probe's own draws, apart from the re-timings' (which stay as without a probe).
    probe_rng: random.Random = dataclasses.field(default_factory=random.Random)

    def __post_init__(self) -> None:
        self.log: list[tuple[str, float]] = []
        self.period = self.rng.uniform(10, 40)
        self.phase = self.rng.uniform(0, 2 * math.pi)
        self.step_at = self.rng.randrange(0, 60)
        self.share = self.probe_rng.uniform(0.5, 1.0)  # of the sustained slowdown it sees

    def drift(self) -> float:
        """The machine's speed now under ``drift``: +-10% cycling, 15% up after a step."""
        cycle = 1 + 0.1 * math.sin(2 * math.pi * self.calls / self.period + self.phase)
        return cycle * (1.15 if self.calls >= self.step_at else 1.0)

    def probe(self) -> float:
        """The host probe's reading beside a round (the model in the module's docstring)."""
        rng, model = self.probe_rng, self.model
        reading = 1 + abs(rng.gauss(0, 0.15))
        if rng.random() < 0.1:
            reading *= rng.uniform(1, 4)
        if model in ("spikes", "all") and rng.random() < 0.2:
            reading *= rng.uniform(10, 50)
        if model in ("busy", "all"):
            reading *= self.busy
        if model in ("drift", "all"):
            reading *= self.drift() / 0.9
        return reading * self.slowed ** self.share

    def retime(self, kernel: str, params: dict, reps: int) -> Timing:
        rng, model = self.rng, self.model
        jitter = 0.002 if model == "quiet" else 0.03
        t = self.true_us[kernel] * rng.lognormvariate(0, jitter)
        if kernel == self.rule:
            t *= self.slowed
        if model in ("spikes", "all") and kernel == self.rule and rng.random() < 0.2:
            t *= rng.uniform(10, 50)
        if model in ("busy", "all"):
            if self.busy == 1.0 and rng.random() < 0.15:
                self.busy = rng.uniform(1.1, 3.0)
            elif self.busy != 1.0 and rng.random() < 0.35:
                self.busy = 1.0
            t *= self.busy
        if model in ("drift", "all"):
            t *= self.drift()
        self.calls += 1
        self.log.append((kernel, t))
        return Timing(t, t * (1 - jitter), t * (1 + jitter), reps, "scripted")  # its reps


def previous_rule(log: list[tuple[str, float]], kernels: list[str]) -> str:
    """The winner the previous rule would publish from the first rounds: the lowest median of
    round medians, if it beat the rule's pick (``kernels[0]``) in every round but one and in the
    median round."""
    per = {k: [t for name, t in log if name == k][:PREVIOUS_ROUNDS] for k in kernels}
    best = min(kernels, key=lambda k: statistics.median(per[k]))
    ratios = sorted(b / w for w, b in zip(per[best], per[kernels[0]]))
    wins = ratios[1] > 1.0 and statistics.median(ratios) > 1.0
    return best if best != kernels[0] and wins else kernels[0]


@dataclasses.dataclass
class Cell:
    published: int = 0  # a candidate was published
    previous: int = 0  # the previous rule would have published one
    rounds: list[int] = dataclasses.field(default_factory=list)
    retimes: int = 0
    disturbed: int = 0
    history: int = 0  # the rule kept for sustained load: by the table's history
    host: int = 0  # by the host probe


def run_cell(problem: MoEProblem, sku, model: str, speed: float, candidates: int, trials: int,
             seed: int) -> Cell:
    rng = random.Random(f"{seed}-{model}-{speed}-{candidates}")
    probe_rng = random.Random(f"{seed}-{model}-{speed}-{candidates}-probe")
    rule = rule_choice(problem, sku)
    names = [f"candidate{i}" for i in range(candidates)]
    results = {}
    for i, name in enumerate(names):  # the search's (lucky) timings rank them
        results[(name, "{}")] = Result(name, {}, Status.OK, Timing(1 + i, 1, 1, 1, "x"))
    cell = Cell()
    for _ in range(trials):
        slowed = math.exp(rng.uniform(math.log(10), math.log(1000))) \
            if model.startswith("sustained") else 1.0
        rule_us = QUIET_US * slowed  # the search timed it under the same load
        results[(rule.kernel, params_key(rule.params))] = Result(
            rule.kernel, rule.params, Status.OK,
            Timing(rule_us, 0.97 * rule_us, 1.03 * rule_us, 1, "x"))
        m = NoisyMeasurer({rule.kernel: QUIET_US, **{n: QUIET_US / speed for n in names}},
                          rule.kernel, model, rng, slowed=slowed, probe_rng=probe_rng)
        decision = confirm(problem, sku, m, dict(results), probe=m.probe,
                           reference_us=None if model == "sustained-no-history" else QUIET_US)
        cell.published += decision.winner.kernel != rule.kernel
        cell.previous += previous_rule(m.log, [rule.kernel] + names) != rule.kernel
        cell.rounds.append(decision.rounds)
        cell.retimes += decision.retimes
        cell.disturbed += decision.baseline.disturbed
        cell.history += decision.reason.startswith(f"sustained load: {rule.kernel} ran")
        cell.host += decision.reason.startswith("sustained load: the host")
    return cell


def _label(speed: float) -> str:
    if speed < 1:
        return f"{1 - speed:.0%} slower"
    return "equal" if speed == 1 else f"{speed - 1:.0%} faster"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=2000, help="confirmations per cell")
    parser.add_argument("--candidates", default="1,3",
                        help="comma-separated counts of equally fast candidates (the tuner "
                             "confirms its best 3)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    problem, sku = MoEProblem(24, 64, 96, 8, 2, dtype="float32"), detect_sku("cpu")
    print("# Confirmation under injected noise\n")
    print(f"- date {datetime.date.today()}, commit {source_commit()}, host {platform.node()} "
          f"({platform.machine()}); command: python scripts/bench_confirm_noise.py --trials "
          f"{args.trials} --candidates {args.candidates} --seed {args.seed}")
    print(f"- rule now: a win needs the ratio interval (Student t on the rounds' log ratios, "
          f"each bound wrong with probability {ALPHA:g}, at least as wide as the re-timings' "
          f"repetitions imply) above {1 + MARGIN:.2f}x; re-timings over {DISTURBED}x their "
          f"kernel's fastest (for the rule's pick, also its search timing) are left out; 5 "
          f"clean rounds at a time, at most 20 rounds; no winner where the rule's pick ran over "
          f"{SUSTAINED}x its quiet reference ({QUIET_US:g} us from the table's history) at its "
          f"fastest, nor where the host probe read over {HOST_SLOWED}x beside every round. "
          f"Previous rule: {PREVIOUS_ROUNDS} rounds, a win in every round but one and "
          f"in the median round.")
    print(f"- {args.trials} confirmations per cell; cells are 'now / previous'.\n")
    header = "| noise | " + " | ".join(_label(s) for s in SPEEDS) + " |"
    rule = "|---" * (len(SPEEDS) + 1) + "|"
    for count in (int(c) for c in args.candidates.split(",")):
        cells = {(m, s): run_cell(problem, sku, m, s, count, args.trials, args.seed)
                 for m in MODELS for s in SPEEDS}
        print(f"## {count} candidate{'s' if count > 1 else ''} of that speed against the rule's "
              f"pick\n")
        print("Published as winner (for slower or equal candidates: a false winner):\n")
        print(header + "\n" + rule)
        for m in MODELS:
            print(f"| {m} | " + " | ".join(
                f"{cells[m, s].published / args.trials:.2%} / "
                f"{cells[m, s].previous / args.trials:.1%}" for s in SPEEDS) + " |")
        print("\nRounds per confirmation, mean (max), and disturbed rounds left out per "
              "confirmation (rule's pick vs winner), mean:\n")
        print(header + "\n" + rule)
        for m in MODELS:
            print(f"| {m} | " + " | ".join(
                f"{statistics.fmean(cells[m, s].rounds):.1f} ({max(cells[m, s].rounds)}), "
                f"{cells[m, s].disturbed / args.trials:.1f}" for s in SPEEDS) + " |")
        previous = PREVIOUS_ROUNDS * (count + 1) * args.trials
        print(f"\nRe-timings relative to the previous rule ({PREVIOUS_ROUNDS} rounds x "
              f"{count + 1} finalists):\n")
        print(header + "\n" + rule)
        for m in MODELS:
            print(f"| {m} | " + " | ".join(f"{cells[m, s].retimes / previous:.2f}x"
                                           for s in SPEEDS) + " |")
        print("\nRule kept for sustained load, by the table's history / by the host probe:\n")
        print(header + "\n" + rule)
        for m in MODELS:
            print(f"| {m} | " + " | ".join(
                f"{cells[m, s].history / args.trials:.1%} / {cells[m, s].host / args.trials:.1%}"
                for s in SPEEDS) + " |")
        print()


if __name__ == "__main__":
    main()
