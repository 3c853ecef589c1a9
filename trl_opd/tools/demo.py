"""`make demo`'s last step, shipped with the package: how one demo run compares with the range the demo ended in over
five seeds on a machine of this kind.

    trl-opd make-tiny-task artifacts/tiny_task
    accelerate launch --config_file $(trl-opd config-path cpu) -m trl_opd --config addition_cpu
    trl-opd compare-demo outputs/addition

The range is `trl_opd/recipes/addition_cpu.seeds.json`, measured by `benchmarks/demo_seeds.py` (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

SWEEP = Path(__file__).resolve().parents[1] / "recipes" / "addition_cpu.seeds.json"
# accuracy, and the reverse KL on the student's held-out samples (logged whatever the recipe's divergence)
METRICS = {"accuracy": ("held-out accuracy", ".4f"), "reverse_kl_sampled": ("held-out reverse KL", ".4f")}


def spread(runs: list[dict], name: str) -> tuple[float, float, float]:
    """Mean, lowest and highest final value of metric `name` over the sweep's runs."""
    values = [run[name] for run in runs]
    return statistics.mean(values), min(values), max(values)


def compare(output_dir: Path, sweep: dict) -> str:
    """One line per metric: the run's final value against the range of the seed sweep (inside, above, below)."""
    curve = Path(output_dir) / "heldout_curve.json"
    if not curve.exists():
        raise SystemExit(f"{curve} does not exist: give the output_dir of a finished demo run (the addition_cpu "
                         "recipe writes outputs/addition/heldout_curve.json).")
    final = json.loads(curve.read_text())[-1]
    runs = sweep["runs"]
    lines = []
    for name, (label, spec) in METRICS.items():
        mean, low, high = spread(runs, name)
        value = final[name]
        where = "inside" if low <= value <= high else "above" if value > high else "below"
        lines.append(f"{label} {value:{spec}}: {where} the range measured for `make demo` over {len(runs)} seeds "
                     f"({low:{spec}}-{high:{spec}}, mean {mean:{spec}}; {sweep['machine']}, {sweep['date']})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trl-opd compare-demo", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("output_dir", type=Path, nargs="?", default=Path("outputs/addition"),
                        help="the demo run's output_dir (default: outputs/addition, the recipe's)")
    parser.add_argument("--sweep", type=Path, default=SWEEP, help="the seed sweep to compare with")
    args = parser.parse_args(argv)
    print(compare(args.output_dir, json.loads(args.sweep.read_text())))
