"""Runtime costs on the active model, each against a baseline measured in the same run.

    python benchmarks/runtime_speed.py                         # params.yaml model
    python benchmarks/runtime_speed.py --prompts 512 2048 --repeats 3

1. Mode B overhead: teacher-forced tokens/s of every group in ``eval_ppl.groups`` vs
   ``baseline`` over the same batch of eval records.
2. Mode A prefill speed-up: time to prefill a prompt of each ``--prompts`` length with
   the prefill skip (layers ``1..split`` + K/V of every attention layer above the cut
   from the maps) vs the plain model's prefill, on a covering plan built for the active
   model (the source, the targets and one extra projector per remaining attention layer
   above the cut).  Its bound is ``n_layers / split`` (2x for a cut at half depth;
   :func:`ced_csa2.eval.perplexity.prefill_bound`: embedding and maps left out, so the
   reachable speed-up is lower); a speed-up above it stops the run.

Maps: the trained ones from ``models/`` when they match the plan, else random maps
of the right shapes (speed does not depend on the weights); the output says which.
Every comparison goes through :func:`ced_csa2.pipeline.timing.paired_seconds`: per shape one untimed
warm-up of each arm, the arms alternated over ``--repeats`` (>= 3) rounds, per-arm median,
the device synchronised at each reading (on CUDA the work, not its launch).
"""

from __future__ import annotations

import argparse
import json

import torch

from ced_csa2.ced_runtime import CEDModeARuntime, CEDModeBRuntime, CEDParts, load_parts
from ced_csa2.config import load_params
from ced_csa2.csa2 import CSA2Adapters
from ced_csa2.data.records import read_records
from ced_csa2.eval.perplexity import prefill_bound
from ced_csa2.model_utils import load_model_and_tokenizer, resolve_device
from ced_csa2.pipeline.cli import ArgumentParser
from ced_csa2.pipeline.map_roles import MAIN
from ced_csa2.pipeline.paths import EVAL_JSONL
from ced_csa2.pipeline.study_runner import run_main
from ced_csa2.pipeline.timing import PROTOCOL, check_bound, paired_seconds
from ced_csa2.plan import LayerPlan, load_plan
from ced_csa2.projector import KVProjector
from ced_csa2.groups import GROUPS


def random_parts(geo, plan: LayerPlan) -> CEDParts:
    torch.manual_seed(0)
    return CEDParts(KVProjector(geo.hidden_size, geo.kv_dim), CSA2Adapters(plan.targets, geo.kv_dim),
                    {e: KVProjector(geo.hidden_size, geo.kv_dim) for e in plan.extra_sources})


def main() -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=8)
    ap.add_argument("--prompts", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    params = load_params()
    plan, geo = load_plan(params.plan, params.model)
    device = resolve_device(params.eval_ppl.device)
    model, tok = load_model_and_tokenizer(params.model, device=device)
    try:
        parts, source = load_parts("models", params, plan, geo, role=MAIN, device=device, low_rank=True), "trained"
    except (OSError, ValueError):
        parts, source = random_parts(geo, plan), "random"
    texts = [r["text"] for r in read_records(EVAL_JSONL)[: args.records]]
    batch = tok(texts, truncation=True, max_length=params.data.max_tokens, padding=True, return_tensors="pt")
    n_tokens = int(batch["attention_mask"].sum())

    def forward():
        with torch.inference_mode():
            model(**{k: v.to(device) for k, v in batch.items()})

    def under(group):
        def run():  # the hooks' install and removal are in the figure: microseconds against a forward
            with CEDModeBRuntime(model, plan, group, parts, kv_format=params.kv_format):
                forward()
        return run

    # random maps hold no xKV bases (stage fit_xkv): those groups are timed with trained maps only
    groups = [g for g in dict.fromkeys(["baseline", *params.eval_ppl.groups])
              if source == "trained" or not GROUPS[g].low_rank]
    timed = paired_seconds({g: under(g) for g in groups}, args.repeats, device=device)
    mode_b = {g: n_tokens / s for g, s in timed.seconds.items()}
    overhead = {g: {"tokens_per_s": round(v, 1), "vs_baseline": round(v / mode_b["baseline"], 3)}
                for g, v in mode_b.items()}

    covering = LayerPlan(plan.split, plan.source, plan.targets,
                         tuple(layer for layer in plan.uncovered(geo)) + plan.extra_sources).validate(geo)
    mode_a = CEDModeARuntime(model, covering, geo, random_parts(geo, covering))
    bound = prefill_bound(geo, covering)

    @torch.inference_mode()
    def plain_forward(ids):
        model(input_ids=ids, use_cache=True, logits_to_keep=1)

    prefill = {}
    for n in args.prompts:
        ids = torch.randint(0, len(tok), (1, n), device=device)
        t = paired_seconds({"plain": lambda: plain_forward(ids), "mode_a": lambda: mode_a.prefill(ids)},
                           args.repeats, device=device)
        speedup = check_bound(t.ratio("plain", "mode_a"), bound, f"Mode A prefill, {n} tokens", t.seconds)
        prefill[str(n)] = {"plain_s": round(t.seconds["plain"], 3), "mode_a_s": round(t.seconds["mode_a"], 3),
                           "speedup": round(speedup, 3)}
    print(json.dumps({
        "model": params.model.name, "dtype": str(model.dtype), "device": str(device),
        "threads": torch.get_num_threads(), "maps": source, "eval_tokens": n_tokens,
        "timing": PROTOCOL.format(repeats=args.repeats),
        "mode_b_overhead": overhead,
        "mode_a_prefill": {"plan": {"split": covering.split, "covered_layers": list(covering.kv_layers)},
                           "bound": round(bound, 3), "by_prompt_tokens": prefill},
    }, indent=2))


if __name__ == "__main__":
    run_main(main)
