"""``tune_mode_a`` stage: the maps Mode A runs with, trained through the prefill skip.

    python -m ced_csa2.stages.tune_mode_a     # what `dvc repro tune_mode_a` runs

Mode A reads every attention layer above the cut from maps of ``H_split``: the source's
projector, the extra sources' projectors and the targets' adapters.  The K/V-MSE recipe
fits each map alone; here they start from the ridge maps (``models/ridge.pt``: the
closed-form ``proj_{l}`` maps, the adapters at their ridge bases with the MLPs at their
zero start) and are trained together *under Mode A itself*, as SwiftKV trains its
single-input K/V: per record of ``train.online``'s sample (the ridge stage's train split,
cropped to ``seq_len``) the prompt -- the first ``eval_ppl.prefix_fraction``, as
``eval_ppl`` cuts it -- is prefilled by the skip (pure skip, no replay: the maps serve
every mapped position whatever ``mode_a.replay`` keeps), the continuation runs through
every layer, and the loss is KL(plain ‖ Mode A) on the continuation's next-token
distributions (:func:`ced_csa2.train.objectives.mode_a_kl`).  One record per forward (the skip
prefill has no padding), gradients accumulated over ``train.online.batch_size`` records
per AdamW step (``mode_a.train.projector_lr`` for the projectors, ``mode_a.train.adapters_lr`` for the
adapters), warm-up + cosine over ``mode_a.train.epochs`` epochs; held-out KL on
``train.online.val_records`` records of the validation split before and after.  Seeded.

A plan that does not cover every attention layer above the cut has no Mode A: the ridge
maps are written untrained and ``covered`` is false.

Writes ``models/mode_a/{projector_k{s}v{s}.pt, projectors_extra.pt, adapters.pt}`` (the
main branch's formats, marked ``objective: mode_a``), ``metrics/mode_a/train.json``
(steps, tokens, held-out KL before/after, protocol) and the curves
``metrics/curves/tune_mode_a.tsv`` (series ``mode_a``: ``train_loss`` per optimizer step, ``val_kl``
before and after).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..ced_runtime import CEDModeARuntime, CEDParts
from ..config import Params, to_dict
from ..csa2 import save_adapters
from ..model_utils import load_model_and_tokenizer, resolve_device
from ..pipeline.checkpoint import checkpoint_meta
from ..pipeline.entry import record_timing, run_stage
from ..pipeline.io_utils import write_json
from ..pipeline.paths import MODE_A_CURVES, MODE_A_METRICS, MODE_A_MODELS, RIDGE_PATH, projector_path
from ..plan import load_plan
from ..projector import save_projector, save_projectors
from ..train.objectives import SAMPLE_STREAM, mode_a_kl, online_records, ridge_parts
from ..train.projector_training import ridge_projectors
from ..train.training import Curves, warmup_cosine, write_curves

log = logging.getLogger(__name__)

OBJECTIVE = "mode_a"
SERIES = OBJECTIVE  # the one series of its curves


def held_out_kl(model, runtime: CEDModeARuntime, rows: list[torch.Tensor], fraction: float) -> float:
    """Mean per-record KL(plain ‖ Mode A) over ``rows``."""
    with torch.no_grad():
        return sum(mode_a_kl(model, runtime, row, fraction).item() for row in rows) / len(rows)


def optimizer_for(parts: CEDParts, params: Params) -> torch.optim.AdamW:
    cfg = params.mode_a.train
    projectors = [w for p in (parts.projector, *parts.extra.values()) for w in p.parameters()]
    return torch.optim.AdamW([{"params": projectors, "lr": cfg.projector_lr},
                              {"params": list(parts.adapters.parameters()), "lr": cfg.adapters_lr}],
                             weight_decay=params.train.online.weight_decay)


def train(model, parts: CEDParts, plan, geo, train_rows: list[torch.Tensor], val_rows: list[torch.Tensor],
          params: Params) -> tuple[dict, Curves]:
    """Train ``parts`` in place under the pure skip; returns ``(summary, curves)``."""
    online, fraction = params.train.online, params.eval_ppl.prefix_fraction
    runtime = CEDModeARuntime(model, plan, geo, parts)
    per_epoch = -(-len(train_rows) // online.batch_size)
    steps = params.mode_a.train.epochs * per_epoch
    optimizer = optimizer_for(parts, params)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps, online.warmup_fraction))
    before = held_out_kl(model, runtime, val_rows, fraction)
    log.info("Mode A maps: held-out KL %.5f before %d steps (%d records, %d per step)", before, steps,
             len(train_rows), online.batch_size)
    losses, tokens, t0 = [], 0, time.perf_counter()
    with tqdm(total=steps, desc="tune_mode_a", unit="step") as bar:
        for epoch in range(params.mode_a.train.epochs):
            order = np.random.default_rng([params.seed, SAMPLE_STREAM, epoch]).permutation(len(train_rows))
            for s in range(0, len(order), online.batch_size):
                batch = [train_rows[i] for i in order[s:s + online.batch_size]]
                optimizer.zero_grad(set_to_none=True)
                loss = 0.0
                for row in batch:  # one record per forward: the skip prefill has no padding
                    record_loss = mode_a_kl(model, runtime, row, fraction) / len(batch)
                    record_loss.backward()
                    loss += record_loss.item()
                    tokens += row.shape[1]
                optimizer.step()
                scheduler.step()
                losses.append((len(losses) + 1, loss))
                bar.update()
                bar.set_postfix(kl=f"{loss:.4g}")
    seconds = time.perf_counter() - t0
    after = held_out_kl(model, runtime, val_rows, fraction)
    log.info("Mode A maps: held-out KL %.5f -> %.5f (%d steps, %.0f s)", before, after, steps, seconds)
    record_timing(train_s=round(seconds, 1), tokens_per_s=round(tokens / seconds, 1))
    summary = {"steps": steps, "tokens": tokens, "val_before": {"kl": before}, "val_after": {"kl": after}}
    return summary, {(SERIES, "train_loss"): losses, (SERIES, "val_kl"): [(0, before), (steps, after)]}


def run(params: Params, workdir: Path = Path("."), *, model_and_tok=None) -> dict:
    """Train (on a covering plan) and save the Mode A maps; returns ``metrics/mode_a/train.json``'s content."""
    workdir = Path(workdir)
    plan, geo = load_plan(params.plan, params.model)
    ridge = workdir / RIDGE_PATH
    parts = ridge_parts(params, plan, geo, ridge)
    parts.extra = ridge_projectors(ridge, list(plan.extra_sources), geo)
    metrics: dict = {"objective": OBJECTIVE, "init": "ridge", "covered": not plan.uncovered(geo)}
    curves: Curves = {}
    if metrics["covered"]:
        model, tok = model_and_tok or load_model_and_tokenizer(params.model, device=resolve_device("auto"))
        model.requires_grad_(False)
        device = next(model.parameters()).device
        for m in (parts.projector, parts.adapters, *parts.extra.values()):
            m.to(device)
        train_rows, val_rows = ([torch.tensor([r], device=device) for r in rows]
                                for rows in online_records(params, tok, workdir))
        torch.manual_seed(params.seed)
        summary, curves = train(model, parts, plan, geo, train_rows, val_rows, params)
        metrics |= summary
        metrics["protocol"] = {"model": params.model.name, "data": params.data.name,
                               "model_revision": params.model.revision, "data_revision": params.data.revision,
                               "dtype": str(model.dtype).removeprefix("torch."), "device": str(device),
                               "prefix_fraction": params.eval_ppl.prefix_fraction, "replay": 0,
                               "records": len(train_rows), "val_records": len(val_rows),
                               **to_dict(params.mode_a.train),
                               **{k: v for k, v in to_dict(params.train.online).items()
                                  if k in ("seq_len", "batch_size", "warmup_fraction", "weight_decay")}}
    meta = checkpoint_meta(params, plan, geo, params.model, params.plan, params.split, params.ridge,
                           params.train.online, params.mode_a.train)
    out, mark = workdir / MODE_A_MODELS, {"objective": OBJECTIVE}
    save_projector(out / projector_path(plan.source).name, parts.projector.cpu(), {**meta["projector"], **mark})
    save_projectors(out / "projectors_extra.pt", {l: p.cpu() for l, p in parts.extra.items()},
                    {**meta["projectors"], **mark})
    save_adapters(out / "adapters.pt", parts.adapters.cpu(), {**meta["adapters"], **mark})
    write_curves(workdir / MODE_A_CURVES, curves, x="step")
    write_json(workdir / MODE_A_METRICS, metrics)
    return metrics


def main() -> None:
    run_stage(run)


if __name__ == "__main__":
    main()
