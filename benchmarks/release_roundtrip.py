"""Check that ``release/`` scores what the pipeline scored: the release loaded in a fresh process, bit for bit.

    python benchmarks/release_roundtrip.py                       # from the repository root, after `dvc repro`
    python benchmarks/release_roundtrip.py --groups ced csa2     # a subset (default: every Mode B group that reads maps)

Loads the base model as the release's ``config.json`` says (``base_model_config``), the maps with
:func:`ced_csa2.release.load_release` (manifest, plan, geometry and base-model fingerprint checked), scores the
``eval_ppl`` held-out records of ``params.yaml`` with them exactly as the ``eval_ppl`` stage does
(:func:`ced_csa2.eval.perplexity.groups_ppl`, ``eval_ids``), and compares every figure of each group with
``metrics/ppl.json``: PPL, NLL per token, KL, top-1 and their intervals must be equal to the last digit (the
release stores the ``.pt`` files' FP16 values, read back into float32 exactly).  Exit status 1 and the first
difference when not.  Not a benchmark: it lives here with the other scripts a user runs by hand (it takes
about as long as ``eval_ppl``'s held-out part for the groups asked; ~4 min for the default on 2 cores).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from ced_csa2.config import load_params
from ced_csa2.eval.perplexity import eval_ids, groups_ppl
from ced_csa2.model_utils import load_model_and_tokenizer
from ced_csa2.pipeline.cli import ArgumentParser
from ced_csa2.pipeline.paths import PPL_METRICS
from ced_csa2.pipeline.study_runner import run_main
from ced_csa2.release import RELEASE, base_model_config, load_release, release_plan
from ced_csa2.groups import GROUPS


def main() -> int:
    ap = ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--release", type=Path, default=RELEASE)
    ap.add_argument("--groups", nargs="+", help="default: every eval_ppl group of params.yaml that has maps")
    args = ap.parse_args()
    params = load_params()
    scored = [g for g in params.eval_ppl.groups if GROUPS[g].uses_maps]
    groups = args.groups or scored
    if not set(groups) <= set(scored):
        ap.error(f"argument --groups: {sorted(set(groups) - set(scored))} not among params.yaml's eval_ppl "
                 f"groups with maps {scored}")
    committed = json.loads(PPL_METRICS.read_text(encoding="utf-8"))["groups"]

    model, tok = load_model_and_tokenizer(base_model_config(args.release))
    parts = load_release(args.release, model)
    plan = release_plan(args.release)
    rows = eval_ids(params, tok, Path("."))
    t0 = time.perf_counter()
    # The baseline is scored with them: KL and top-1 are against it, as in eval_ppl.
    got = groups_ppl(model, plan, ["baseline", *groups], parts, rows, params, tok.pad_token_id)
    print(f"scored {len(groups)} groups on {len(rows)} records in {time.perf_counter() - t0:.0f} s "
          f"from {args.release}")
    for group in groups:
        diff = [k for k in committed[group] if got[group].get(k) != committed[group][k]]
        if diff:
            k = diff[0]
            print(f"{group}: {k} is {got[group].get(k)!r} from the release, {committed[group][k]!r} in {PPL_METRICS}")
            return 1
        print(f"{group}: every figure of {PPL_METRICS} to the last digit (ΔPPL {got[group]['delta_pct']:+.4f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(run_main(main))
