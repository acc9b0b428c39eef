"""How often noise makes the confirmation publish a winner that is not faster (and how often it
finds real ones): the decision rule under injected noise, no kernels run.

Usage: python scripts/bench_confirm_noise.py [--trials 2000] [--spike-rate 0.2] [--seed 0]
Each trial confirms one candidate against the rule's pick with a scripted measurer: every
re-timing is the true time x lognormal jitter (3%), and with probability ``--spike-rate`` a
timing of the rule's pick is 10-50x slower (another process on the core, as seen with vLLM's CPU
kernel on a busy 2-core host). Compared with the pooled rule used before (winner's pooled median
below the baseline's pooled p20). Prints Markdown.
"""

from __future__ import annotations

import argparse
import datetime
import random

from moetune.runtime.kernels.base import params_key
from moetune.runtime.platform import detect_sku
from moetune.runtime.problem import MoEProblem
from moetune.runtime.rules import rule_choice
from moetune.tuner.job import source_commit
from moetune.tuner.measure import Result, Status
from moetune.tuner.study import _pooled, confirm
from moetune.tuner.timing import Timing

ROUNDS = 5


class NoisyMeasurer:
    """Re-timings of two kernels with jitter and occasional slow spikes of the baseline."""

    def __init__(self, true_us: dict[str, float], spike: str, rate: float, rng: random.Random):
        self.true_us, self.spike, self.rate, self.rng = true_us, spike, rate, rng
        self.log: dict[str, list[Timing]] = {k: [] for k in true_us}

    def retime(self, kernel: str, params: dict, reps: int) -> Timing:
        t = self.true_us[kernel] * self.rng.lognormvariate(0, 0.03)
        if kernel == self.spike and self.rng.random() < self.rate:
            t *= self.rng.uniform(10, 50)
        timing = Timing(t, t * 0.97, t * 1.03, reps, "scripted")
        self.log[kernel].append(timing)
        return timing


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=2000)
    parser.add_argument("--spike-rate", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    problem, sku = MoEProblem(24, 64, 96, 8, 2, dtype="float32"), detect_sku("cpu")
    rule = rule_choice(problem, sku)
    cand = "torch_grouped"
    print("# Confirmation under injected noise\n")
    print(f"- date {datetime.date.today()}, commit {source_commit()}; command: python "
          f"scripts/bench_confirm_noise.py --trials {args.trials} --spike-rate {args.spike_rate}")
    print(f"- {ROUNDS} interleaved rounds per confirmation (2 finalists: {2 * ROUNDS} re-timings); "
          f"jitter 3%; the rule's pick 10-50x slower in a round with probability "
          f"{args.spike_rate}\n")
    print("| candidate's true speed | published as winner: round ratios (now) | pooled p20 rule "
          "(before) |\n|---|---|---|")
    for speedup in (0.5, 0.9, 0.98, 1.0, 1.02, 1.05, 1.2):
        now = before = 0
        for _ in range(args.trials):
            m = NoisyMeasurer({rule.kernel: 100.0, cand: 100.0 / speedup}, rule.kernel,
                              args.spike_rate, rng)
            results = {(rule.kernel, params_key(rule.params)):
                       Result(rule.kernel, rule.params, Status.OK, Timing(100, 97, 103, 1, "x")),
                       (cand, "{}"): Result(cand, {}, Status.OK, Timing(1, 1, 1, 1, "x"))}
            decision = confirm(problem, sku, m, results, rounds=ROUNDS)
            now += decision.winner.kernel == cand
            base, win = _pooled(m.log[rule.kernel]), _pooled(m.log[cand])
            before += win.median_us < base.p20_us
        label = f"{speedup:.2f}x" + (" (slower)" if speedup < 1 else "")
        print(f"| {label} | {now / args.trials:.1%} | {before / args.trials:.1%} |")


if __name__ == "__main__":
    main()
