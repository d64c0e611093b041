"""Wall time of each data-parallel stage with ``distributed.nproc: 2`` against ``1``, on the tiny profile.

    python benchmarks/distributed_overhead.py              # tiny profile, default tiny budget
    python benchmarks/distributed_overhead.py --repeats 5  # median of 5 per stage and nproc

In a temporary folder: compose the tiny profile for ``nproc`` 1 and 2, run ``prepare`` once,
then each data-parallel stage (``dump``, ``ridge``, ``train_projector``, ``train_adapters``,
``eval_ppl``; ``extra_projectors`` once, untimed, for eval_ppl's maps) as ``python -m
ced_csa2.stages.<stage>`` with each params file, timing the whole command: Python start-up,
torchrun's start-up and rendezvous, both processes loading the model, the stage, the merge
of the dump's shards.  One process runs twice, with torch's default threads and with
``OMP_NUM_THREADS=1`` as torchrun gives each of its processes: on a busy machine a 2-thread
process can lose far more to oversubscription than to anything data-parallel, and the
1-thread column separates the two.  Per stage the three commands go through
:func:`ced_csa2.pipeline.timing.paired_seconds`: one untimed run of each (the page cache holds the
stage's inputs and the Python files afterwards), then ``--repeats`` (>= 3) rounds of the
three, their order rotated each round, per-command median.  Prints a Markdown table of the walls and their ratios
(with the machine's load average, since other jobs move them) and writes it to
``benchmarks/results/distributed_overhead.md``.

On a machine whose cores are fewer than 2 × the threads one process uses (this repository's
2-core CPU), two processes share the cores one process already had: the ratio measures the
overhead of running data-parallel, not a speed-up.  A speed-up needs one device per process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from ced_csa2.pipeline.cli import ArgumentParser  # noqa: E402
from ced_csa2.pipeline.study_runner import run_main  # noqa: E402
from ced_csa2.pipeline.timing import PROTOCOL, paired_seconds  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STAGES = ["dump", "ridge", "train_projector", "train_adapters", "eval_ppl"]
OVERRIDES = ["model=tiny_qwen3_5", "data=tiny", "plan=qwen3_5", "eval_ppl.groups=[baseline,ced,csa2]"]
NOTE = ("On this machine's {cores} cores the 2 processes share the cores 1 process already uses "
        "(torchrun gives each process OMP_NUM_THREADS=1): the ratio is the overhead of running data-parallel "
        "(start-up, rendezvous, a model load per process, the dump's shard merge, collectives), not a speed-up; "
        "'ratio 2 / 1 thread' compares processes of equal threads, the 2-thread single process also pays for "
        "oversubscription when other jobs load the machine.")


def run(workdir: Path, stage: str, nproc: int, threads: str | None = None) -> float:
    """Seconds of ``python -m ced_csa2.stages.<stage>`` in ``workdir`` with ``distributed.nproc: nproc``
    (``threads``: its ``OMP_NUM_THREADS``)."""
    shutil.copy(workdir / f"params{nproc}.yaml", workdir / "params.yaml")
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), **({"OMP_NUM_THREADS": threads} if threads else {}))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", f"ced_csa2.stages.{stage}"], cwd=workdir, env=env,
                          capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{stage} (nproc {nproc}) failed:\n{proc.stderr[-3000:]}")
    return seconds


def main() -> None:
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3, help="median of this many runs per stage and nproc")
    args = parser.parse_args()
    from ced_csa2.compose import compose

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for n in (1, 2):
            (workdir / f"params{n}.yaml").write_text(compose([*OVERRIDES, f"distributed.nproc={n}"]))
        run(workdir, "prepare", 1)
        for stage in STAGES:
            if stage == "eval_ppl":
                run(workdir, "extra_projectors", 1)
            # Whichever command runs last, the next stage reads what it wrote: nproc 2 writes what nproc 1
            # writes (tests/pipeline/test_distributed.py).
            arms = {(n, threads): (lambda n=n, threads=threads: run(workdir, stage, n, threads))
                    for n, threads in ((1, None), (1, "1"), (2, None))}
            walls = list(paired_seconds(arms, args.repeats).seconds.values())
            rows.append((stage, *walls))
            print(f"{stage}: " + " / ".join(f"{w:.1f} s" for w in walls), file=sys.stderr)
    table = ["| stage | nproc 1 wall s | nproc 1, 1 thread wall s | nproc 2 wall s | ratio 2 / 1 | ratio 2 / 1 thread |",
             "|---|---|---|---|---|---|"]
    table += [f"| {stage} | {one:.1f} | {single:.1f} | {two:.1f} | {two / one:.2f} | {two / single:.2f} |"
              for stage, one, single, two in rows]
    load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    text = "\n".join([f"Data-parallel stages on the tiny profile ({' '.join(OVERRIDES)}), whole command timed, "
                      f"{PROTOCOL.format(repeats=args.repeats)}, gloo on CPU; load average at the end {load} (1 / 5 / 15 min):",
                      "", *table, "", NOTE.format(cores=os.cpu_count())]) + "\n"
    print(text)
    out = ROOT / "benchmarks" / "results" / "distributed_overhead.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)


if __name__ == "__main__":
    run_main(main)
