"""`dvc repro` of the committed pipeline from a fresh clone with an empty asset cache, timed.

    python benchmarks/repro_e2e.py                       # the embedded default (what `make repro` runs)
    python benchmarks/repro_e2e.py -S budget=cpu_full    # another composition (python -m ced_csa2.compose)

Clones this repository's HEAD into a temporary folder, points the asset cache
(``CED_CSA2_CACHE``) at an empty folder, and runs ``dvc repro`` there with this
environment's Python (the install is not timed: ``make`` does it once).  Every stage
writes its own wall time and peak resident set to ``timings/<stage>.json`` (a stage's module
imports before its entry point, a few seconds, are not in its figure); the total is the
whole ``dvc repro``, DVC's own hashing and Python start-ups included.  Prints a Markdown
table and writes it to ``benchmarks/results/repro_e2e[_<overrides>].md``; ``--keep DIR``
keeps the clone (its dvc.lock, metrics and reports are the run's results).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ced_csa2.pipeline.cli import ArgumentParser
from ced_csa2.pipeline.study_runner import run_main

ROOT = Path(__file__).resolve().parents[1]


def cpu_summary() -> str:
    """The CPU's model name and the flags that decide fast paths (AMX, AVX512-BF16, AVX512, AVX2), from lscpu."""
    info = dict(line.split(":", 1) for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout
                .splitlines() if ":" in line)
    flags = set(info.get("Flags", "").split())
    shown = [f for f in ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f", "avx2") if f in flags]
    return f"{info.get('Model name', '?').strip()} ({', '.join(shown) or 'none of amx/avx512/avx2'})"


def main() -> None:
    ap = ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-S", dest="overrides", action="append", default=[], help="a Hydra override (repeatable)")
    ap.add_argument("--keep", type=Path, help="clone here (kept) instead of a temporary folder")
    ap.add_argument("--name", default="repro_e2e", help="results file benchmarks/results/<name>[_<overrides>].md")
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="ced_csa2_repro_"))
    repo, cache = work / "repo", work / "asset-cache"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(repo)], check=True)
    env = dict(os.environ, CED_CSA2_CACHE=str(cache), DVC_NO_ANALYTICS="1",
               PYTHONPATH=str(repo / "src"), PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    if args.overrides:
        subprocess.run([sys.executable, "-m", "ced_csa2.compose", *args.overrides], cwd=repo, env=env, check=True)
    t0 = time.perf_counter()
    with open(work / "repro.log", "w") as log:
        subprocess.run(["dvc", "repro"], cwd=repo, env=env, check=True, stdout=log, stderr=subprocess.STDOUT)
    total = time.perf_counter() - t0
    order = re.findall(r"Running stage '([^']+)'", (work / "repro.log").read_text())
    rows = [(s, json.loads((repo / "timings" / f"{s}.json").read_text())) for s in order]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                            text=True).stdout.strip()
    head = (f"`dvc repro` of {commit} from a fresh clone, empty asset cache, "
            f"{os.cpu_count()} CPU cores, {cpu_summary()}"
            f"{', ' + ' '.join(args.overrides) if args.overrides else ' (embedded default)'}:")
    lines = [head, "", "| stage | wall s | peak RSS MiB |", "|---|---|---|"]
    lines += [f"| {s} | {p['wall_s']:.1f} | {p['peak_rss_mib']:,.0f} |" for s, p in rows]
    peak = max(p["peak_rss_mib"] for _, p in rows)
    lines.append(f"| **total `dvc repro`** | **{total:.0f}** ({total / 60:.1f} min) | **{peak:,.0f}** (max) |")
    text = "\n".join(lines) + "\n"
    print(text)
    name = args.name + "".join(f"_{re.sub(r'[^A-Za-z0-9]+', '-', o)}" for o in args.overrides)
    out = ROOT / "benchmarks" / "results" / f"{name}.md"
    out.parent.mkdir(exist_ok=True)
    out.write_text(text)
    if not args.keep:
        shutil.rmtree(work)


if __name__ == "__main__":
    run_main(main)
