"""How close ``python -m ced_csa2.estimate`` comes to a run's measured stage times, on this machine.

    python benchmarks/estimate_vs_measured.py                   # this checkout's params.yaml, data/ and timings/
    python benchmarks/estimate_vs_measured.py --workdir ../run  # another checkout's (read only)
    python benchmarks/estimate_vs_measured.py --probe           # measure this CPU's rate again first

Prints per stage the estimate at the fitted rates (the CPU they were fitted on), the estimate
calibrated to this CPU (:func:`ced_csa2.estimate.calibrated_rates`, as the command line uses) and
the wall seconds of the stage's last run in ``--workdir`` (``timings/<stage>.json``), with the
ratio calibrated / measured, then the totals over the stages both have.  The measured times are
those of whatever load the run had; the header prints the probe's.

Not part of the tests.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from ced_csa2 import estimate
from ced_csa2.config import load_params
from ced_csa2.pipeline.cli import ArgumentParser
from ced_csa2.pipeline.study_runner import run_main


def main(argv: list[str] | None = None) -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", type=Path, default=Path("."), help="the checkout whose run to compare (default: here)")
    ap.add_argument("--probe", action="store_true", help="measure this CPU's rate again (else the cached probe)")
    args = ap.parse_args(argv)
    params = load_params(args.workdir / "params.yaml")
    s = estimate.setup(params, "cpu", args.workdir)
    fitted = {e.stage: e.seconds for e in estimate.estimate(s)}
    rates = estimate.calibrated_rates(args.probe)
    here = {e.stage: e.seconds for e in estimate.estimate(dataclasses.replace(s, rates=rates))}
    measured = estimate.measured_seconds(args.workdir)
    print(f"rates: {rates.basis}")
    print(f"{'stage':<18} {'fitted':>8} {'here':>8} {'measured':>9} {'here/meas':>9}")
    totals = [0.0, 0.0, 0.0]
    for stage, seconds in here.items():
        if seconds is None:
            continue
        got = measured.get(stage)
        if got is not None:
            totals = [totals[0] + fitted[stage], totals[1] + seconds, totals[2] + got]
        ratio = "-" if got is None else f"{seconds / got:.2f}"
        print(f"{stage:<18} {fitted[stage]:>8.0f} {seconds:>8.0f} {'-' if got is None else f'{got:.0f}':>9} {ratio:>9}")
    print(f"{'total (both)':<18} {totals[0]:>8.0f} {totals[1]:>8.0f} {totals[2]:>9.0f} "
          f"{totals[1] / max(totals[2], 1e-9):>9.2f}")


if __name__ == "__main__":
    run_main(main)
