"""``--wait auto`` on learners whose learning curve is known: where the rule wins and loses.

The real streams (``adaptive_wait.py``) show one learner each; this shows the rule across the
range its curve spans, so the README can say where it loses and by how much.  Added after the
digits runs of ``adaptive_wait.py`` (not part of that protocol), with its settings fixed before
its first run here.

Protocol:

* Learner: a model trained on n mega-batches, the last stage on m of them, has the true
  test error e(n, m) = min(0.9, 0.9 (1 + m + rho (n - m))^-alpha) (0.9: chance on ten classes,
  the untrained model's), for rho in {1, 0.5, 0.2, 0} and alpha in {0.5, 0.3}.
* Measurement: at each arrival the current model's error is drawn as a binomial rate on the
  validation examples arrived so far, ``val`` per mega-batch, val in {3, 30} (3 is the digits
  stream's); the learner sees only that, through the real ``WaitDecisions`` / ``StreamPlan``
  path of ``--wait auto`` (no replay, no stage capacity: a vision learner).
* B = 50; fixed w in {1, 2, 4, 8, 16} and auto; seeds 0, 1, 2 (the draws).
* Metric: the anytime error (sum over arrivals 1 … B of the true error, in units of one
  arrival), mean over seeds; auto's excess over the best fixed w, in %.

Pure Python and seconds to run: ``python benchmarks/adaptive_wait_synthetic.py``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

from fairseq_alma.stream.progress import AUTO, StreamPlan
from fairseq_alma.stream.wait_decisions import WaitDecisions
from fairseq_alma.text_table import format_table

CHANCE = 0.9
FIXED_WAITS = (1, 2, 4, 8, 16)
REPO = Path(__file__).resolve().parent.parent


def true_error(trained: float, stage: float, retention: float, exponent: float) -> float:
    if trained == 0:
        return CHANCE
    effective = stage + retention * (trained - stage)
    return min(CHANCE, CHANCE * (1.0 + effective) ** -exponent)


def anytime_error(wait: int | str, retention: float, exponent: float, val: int,
                  num_megabatches: int, seed: int) -> float:
    """Sum of the true errors at arrivals 1 … B under a fixed ``wait`` or ``auto``."""
    rng = random.Random(seed)
    memory = WaitDecisions(rate=True)
    plan = StreamPlan(num_megabatches, AUTO)
    trained = stage = 0.0
    total = 0.0
    for arrival in range(1, num_megabatches + 1):
        pending = arrival - (plan.schedule[-1].arrival if plan.schedule else 0)
        error = true_error(trained, stage, retention, exponent)
        examples = val * arrival
        measured = sum(rng.random() < error for _ in range(examples)) / examples
        if wait == AUTO:
            plan = memory.decide(plan, measured, examples)
            train = plan.decisions[-1]
        else:
            train = pending >= wait
            plan = plan.with_decision(train)
        if train:
            trained, stage = trained + pending, float(pending)
        total += true_error(trained, stage, retention, exponent)
    return total


def run(num_megabatches: int, seeds: list[int], learners: list[tuple[float, float]],
        vals: list[int]) -> list[dict]:
    rows = []
    for retention, exponent in learners:
        for val in vals:
            def mean(wait: int | str) -> float:
                return statistics.mean(anytime_error(wait, retention, exponent, val,
                                                     num_megabatches, seed) for seed in seeds)
            fixed = {str(w): mean(w) for w in FIXED_WAITS if w <= num_megabatches}
            best = min(fixed, key=fixed.get)
            auto = mean(AUTO)
            rows.append({"retention": retention, "exponent": exponent, "val": val,
                         "fixed": fixed, "best_fixed": best, "auto": auto,
                         "excess_pct": 100.0 * (auto / fixed[best] - 1.0)})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "adaptive_wait"
                                             / "synthetic.json"))
    parser.add_argument("--quick", action="store_true", help="tiny run for the test suite")
    args = parser.parse_args(argv)
    if args.quick:
        rows = run(8, [0], [(1.0, 0.5), (0.0, 0.5)], [3])
    else:
        learners = [(r, a) for r in (1.0, 0.5, 0.2, 0.0) for a in (0.5, 0.3)]
        rows = run(50, [0, 1, 2], learners, [3, 30])
    header = ["rho", "alpha", "val", *[f"w={w}" for w in rows[0]["fixed"]], "auto", "best",
              "auto vs best"]
    table = [[f"{r['retention']:g}", f"{r['exponent']:g}", str(r["val"]),
              *[f"{v:.2f}" for v in r["fixed"].values()], f"{r['auto']:.2f}",
              f"w={r['best_fixed']}", f"{r['excess_pct']:+.1f}%"] for r in rows]
    print(format_table(header, table))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
