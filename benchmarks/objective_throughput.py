"""Training cost of the online objectives against a plain forward of the same batch.

    python benchmarks/objective_throughput.py                  # params.yaml model, ridge maps
    python benchmarks/objective_throughput.py --batch 4 --seq-len 256 --repeats 2

For one batch of ``--batch`` train records cropped to ``--seq-len`` tokens, times

* ``forward``: the frozen model's plain no-grad forward (the baseline);
* one optimizer step of each objective that trains (``attn_out``, ``distill``:
  :data:`ced_csa2.train.objective_registry.OBJECTIVES`) in each phase (projector under
  ``ced``, adapters under ``csa2``): teacher pass, loss, backward, AdamW step;

and prints tokens/s and the step time as a multiple of the plain forward (an objective's
``step_cost``; all arms through
:func:`ced_csa2.pipeline.timing.paired_seconds`: one untimed warm-up of each, their order rotated
over ``--repeats`` >= 3 rounds, per-arm median, the device synchronised at each reading).
No bound is claimed: a step's teacher pass and backward are not a fixed multiple of a forward.
The maps start at the ridge solution (``models/ridge.pt``); speed does not depend on their values.
"""

from __future__ import annotations

import argparse

import torch

from ced_csa2.config import load_params
from ced_csa2.data.records import batches
from ced_csa2.model_utils import load_model_and_tokenizer, resolve_device
from ced_csa2.pipeline.cli import ArgumentParser
from ced_csa2.pipeline.paths import RIDGE_PATH
from ced_csa2.pipeline.study_runner import run_main
from ced_csa2.pipeline.timing import paired_seconds
from ced_csa2.plan import load_plan
from ced_csa2.train.objective_registry import OBJECTIVES
from ced_csa2.train.objectives import online_records, ridge_parts


def main() -> None:
    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    params = load_params()
    plan, geo = load_plan(params.plan, params.model)
    model, tok = load_model_and_tokenizer(params.model, device=resolve_device("auto"))
    model.requires_grad_(False)
    device = next(model.parameters()).device
    parts = ridge_parts(params, plan, geo, RIDGE_PATH)
    parts.projector.to(device)
    parts.adapters.to(device)
    rows = [r[:args.seq_len] for r in online_records(params, tok, ".")[0][:args.batch]]
    ((ids, mask),) = batches(rows, args.batch, tok.pad_token_id, device)
    tokens = int(mask.sum())
    cfg = params.train.online

    def forward():
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, use_cache=False)

    def step_of(objective, group, module):
        opt = torch.optim.AdamW(module.parameters(), lr=0.0)  # lr 0: time the step, keep the maps

        def step():
            loss = objective.batch_loss(model, parts, plan, group, ids, mask, cfg.temperature, cfg.kv_weight)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return step

    arms = {"forward (baseline)": forward}
    for objective in (o for o in OBJECTIVES.values() if o.trains):
        for group, module in (("ced", parts.projector), ("csa2", parts.adapters)):
            arms[f"{objective.name} step, {group}"] = step_of(objective, group, module)
    seconds = paired_seconds(arms, args.repeats, device=device).seconds
    base = seconds["forward (baseline)"]
    print(f"{params.model.name} ({str(model.dtype).removeprefix('torch.')}, {device}, "
          f"{torch.get_num_threads()} threads), batch {tuple(ids.shape)}, {tokens} tokens, median of {args.repeats}")
    for name, t in seconds.items():
        print(f"{name:28s} {tokens / t:9.1f} tok/s   {t / base:.2f}x the forward")


if __name__ == "__main__":
    run_main(main)
