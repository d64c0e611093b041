"""Shared-trunk scoring vs one pass per group, same records, same run.

    OMP_NUM_THREADS=1 python benchmarks/shared_trunk.py                 # tiny Qwen3.5, then SmolLM2
    python benchmarks/shared_trunk.py --models tiny --records 32 --repeats 3

Times scoring every group of :data:`ced_csa2.groups.GROUP_NAMES` teacher-forced on the
same records, (a) one :func:`~ced_csa2.eval.scoring.sequence_nll` pass per group under its
:class:`~ced_csa2.ced_runtime.CEDModeBRuntime` (what ``eval_ppl`` did), (b) one
:func:`~ced_csa2.eval.scoring.multi_group_nll` call (the layers below each group's first
changed layer run once per batch), and prints ``shared / separate`` (goal <= 0.65) and
whether every group's per-record NLL sums are bit-identical.  Its bound is the ratio of
decoder-layer runs per batch (``layer_runs_ratio``: the shared trunk's layers once plus
every group's branch, over one full pass per group), counting a layer below a group's
branch point as the same work in both (it is the unmodified layer); a ratio below it
stops the run.

Models: ``tiny`` -- the tiny Qwen3.5 profile (random init, 32 layers, attention every 4th;
plan 16/20/24,28,32; synthetic records, ``data=tiny``); ``smollm2`` -- the embedded default
(``params.yaml`` as committed: SmolLM2-135M, plan 15/18/22,26,30, eval records of
``data/corpus/eval.jsonl``, or the same held-out Wikipedia records built from the
pinned gensim sample when that file is absent).  Maps are random (speed does not depend on
the weights).  Timing: :func:`ced_csa2.pipeline.timing.paired_seconds` (one untimed warm-up of
each, the two alternated over ``--repeats`` >= 3 rounds, per-arm median).
"""

from __future__ import annotations

import argparse
import json

import torch
import yaml

from ced_csa2.ced_runtime import CEDModeBRuntime, CEDParts
from ced_csa2.compose import compose
from ced_csa2.config import Params, from_dict
from ced_csa2.csa2 import CSA2Adapters
from ced_csa2.data.records import read_records
from ced_csa2.eval.scoring import branch_point, multi_group_nll, sequence_nll
from ced_csa2.model_utils import load_model_and_tokenizer
from ced_csa2.pipeline.cli import ArgumentParser
from ced_csa2.pipeline.paths import EVAL_JSONL
from ced_csa2.pipeline.study_runner import run_main
from ced_csa2.pipeline.timing import check_bound, paired_seconds
from ced_csa2.plan import load_plan
from ced_csa2.groups import GROUP_NAMES

PROFILES = {"tiny": ["model=tiny_qwen3_5", "data=tiny", "plan=qwen3_5"], "smollm2": []}


def random_parts(geo, plan) -> CEDParts:
    from ced_csa2.projector import KVProjector

    torch.manual_seed(0)
    return CEDParts(KVProjector(geo.hidden_size, geo.kv_dim), CSA2Adapters(plan.targets, geo.kv_dim))


def eval_texts(params: Params, tok, n: int) -> tuple[list[str], str]:
    """``n`` eval texts of the profile, and where they came from."""
    if EVAL_JSONL.is_file() and params.data.kind != "tiny":
        return [r["text"] for r in read_records(EVAL_JSONL)[:n]], str(EVAL_JSONL)
    from ced_csa2.data.corpus import CORPORA, TokenBudget

    _, eval_ = CORPORA[params.data.kind](params.data, TokenBudget(tok, params.data.min_tokens,
                                                                   params.data.max_tokens))
    return [r.text for r in eval_[:n]], f"prepare's {params.data.name} eval records (built in memory)"


def bench(name: str, records: int, repeats: int) -> dict:
    params = from_dict(Params, yaml.safe_load(compose(PROFILES[name])))
    plan, geo = load_plan(params.plan, params.model)
    model, tok = load_model_and_tokenizer(params.model, dtype=torch.float32)
    texts, source = eval_texts(params, tok, records)
    ids = tok(texts, truncation=True, max_length=params.data.max_tokens)["input_ids"]
    cut, batch, pad = [0] * len(ids), params.eval_ppl.batch_size, tok.pad_token_id
    parts, kv_format = random_parts(geo, plan), params.kv_format
    groups = list(GROUP_NAMES)

    def separate():
        out = {}
        for g in groups:
            with CEDModeBRuntime(model, plan, g, parts, kv_format=kv_format):
                out[g] = sequence_nll(model, ids, cut, batch, pad)
        return out

    def shared():
        return multi_group_nll(model, plan, groups, parts, ids, cut, batch, pad, kv_format=kv_format)

    results = {}
    t = paired_seconds({"separate": lambda: results.update(separate=separate()),
                        "shared": lambda: results.update(shared=shared())}, repeats)
    best = t.seconds
    n_layers = geo.n_layers
    branches = {g: branch_point(CEDModeBRuntime(model, plan, g, parts, kv_format=kv_format), n_layers)
                for g in groups}
    # decoder-layer runs per batch: the trunk (to the end, baseline is a group) + each branch
    layer_runs = n_layers + sum(n_layers + 1 - b for b in branches.values() if b <= n_layers)
    bound = n_layers * len(groups) / layer_runs  # most the shared trunk can gain: separate / shared
    check_bound(t.ratio("separate", "shared"), bound, f"{name}: separate / shared", best)
    return {
        "model": params.model.name, "plan": {"split": plan.split, "source": plan.source, "targets": list(plan.targets)},
        "records": len(ids), "tokens": sum(map(len, ids)), "batch_size": batch, "records_from": source,
        "threads": torch.get_num_threads(), "groups": groups, "branch_points": branches,
        "layer_runs_ratio": round(layer_runs / (n_layers * len(groups)), 3),
        "separate_s": round(best["separate"], 2), "shared_s": round(best["shared"], 2),
        "ratio": round(best["shared"] / best["separate"], 3), "repeats": repeats,
        "bit_identical": all(torch.equal(results["shared"][g], results["separate"][g]) for g in groups),
    }


def main() -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", choices=list(PROFILES), default=list(PROFILES))
    ap.add_argument("--records", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    for name in args.models:
        try:
            out = bench(name, args.records, args.repeats)
        except (OSError, RuntimeError) as exc:  # the embedded model needs its wheel (PyPI, once)
            out = {"model": name, "skipped": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(out), flush=True)
        if "ratio" in out:
            print(f"{name}: shared trunk / separate passes = {out['ratio']:.3f}x, bound "
                  f"{out['layer_runs_ratio']:.3f}x (layer runs) ({out['shared_s']} s vs {out['separate_s']} s, "
                  f"medians of {out['repeats']}; bit-identical: {out['bit_identical']})",
                  flush=True)


if __name__ == "__main__":
    run_main(main)
