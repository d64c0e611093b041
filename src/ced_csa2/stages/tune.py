"""``tune@<objective>`` stages: the maps trained with another objective, from the ridge solution.

    python -m ced_csa2.stages.tune distill     # what `dvc repro tune@distill` runs

One pipeline branch per entry of ``train.objectives`` (``dvc.yaml`` loops over it), each
starting from the closed-form maps of ``models/ridge.pt``: the projector's ``proj_{source}``
map and the adapters' ``k_{t}`` / ``v_{t}`` bases (MLPs at their zero start).

Each group is served by maps trained for it: ``ced`` and ``csa2`` by one projector and
one set of adapters (fitted on the true source K/V, as ``csa2`` reads them), ``ced_csa2``
by its own pair from the ridge start -- its adapters from ``csa2``'s maps or
(``train.ced_csa2_start: projected``) from the maps fitted on the *projected* source (the
ridge stage's ``ced_{k,v}_{t}*`` maps).

* ``ridge``: the start itself, untrained -- the reference every objective must beat.
* ``attn_out`` / ``distill`` (:mod:`ced_csa2.train.objectives`): three phases through the frozen
  model, on ``train.online.records`` records of the train split (the ridge stage's split),
  cropped to ``seq_len`` tokens: the projector under the ``ced`` substitution, the
  adapters under ``csa2`` (true source K/V), then ``ced_csa2``'s projector and adapters
  jointly under ``ced_csa2``.  AdamW (``projector_lr`` /
  ``adapters_lr`` per kind of map) with warm-up + cosine; held-out objective loss and KL
  (T = 1) on ``val_records`` records of the validation split before and after each phase.

Writes ``models/objectives/<objective>/{projector_k{s}v{s}.pt, adapters.pt}`` and the same
pair in ``.../ced_csa2/`` (the main branch's formats, so
:func:`ced_csa2.ced_runtime.load_parts` reads them),
``metrics/objectives/<objective>/train.json`` (per phase: steps, tokens, wall time,
tokens/s, held-out losses) and, for the objectives that train, its curves
``metrics/curves/tune/<objective>/<phase>_{loss,val_loss,val_kl}.tsv``: one series per
file, x = the optimizer step counted across the phases (each phase's steps continue
after the previous one's); ``loss`` per step, ``val_*`` the held-out values at
the phase's first and last step.  ``ridge`` trains nothing: its curve dir is empty.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..ced_runtime import CEDParts
from ..config import Params, require_listed, to_dict
from ..csa2 import save_adapters
from ..data.records import batches
from ..model_utils import Geometry, load_model_and_tokenizer, resolve_device
from ..pipeline.checkpoint import checkpoint_meta
from ..pipeline.entry import objective_arg, record_timing, run_stage
from ..pipeline.io_utils import write_json
from ..pipeline.paths import RIDGE_PATH, objective_curves, objective_metrics, objective_models, projector_path
from ..plan import LayerPlan, load_plan
from ..projector import save_projector
from ..train.objectives import (
    PHASE_GROUPS,
    SAMPLE_STREAM,
    attn_out_loss,
    distill_loss,
    kl_distill,
    objective_loss,
    online_records,
    ridge_parts,
    student_logits,
    substituted_layers,
    teacher_pass,
)
from ..train.training import warmup_cosine, write_curves

log = logging.getLogger(__name__)


def held_out(objective: str, model, parts: CEDParts, plan: LayerPlan, group: str, val: list[tuple],
             temperature: float, kv_weight: float) -> dict:
    """Mean objective loss and KL (T = 1) of the ``group`` substitution over held-out batches."""
    loss = kl = 0.0
    with torch.no_grad():
        for ids, mask in val:
            teacher = teacher_pass(model, plan, group, ids, mask)
            student = student_logits(model, parts, plan, group, ids, mask)
            kl += kl_distill(student, teacher["logits"], mask, 1.0).item()
            if objective == "attn_out":
                loss += attn_out_loss(model, parts, plan, group, teacher, mask).item()
            else:
                loss += distill_loss(model, parts, plan, group, teacher, ids, mask, temperature, kv_weight,
                                     student=student).item()
    return {"loss": loss / len(val), "kl": kl / len(val)}


def phase_optimizer(parts: CEDParts, group: str, cfg) -> torch.optim.AdamW:
    """AdamW over the maps a phase trains, each kind at its own learning rate.

    ``ced``: the projector (``projector_lr``); ``csa2``: the adapters (``adapters_lr``);
    ``ced_csa2``: both, jointly.
    """
    groups = []
    if group != "csa2":
        groups.append({"params": list(parts.projector.parameters()), "lr": cfg.projector_lr})
    if group != "ced":
        groups.append({"params": list(parts.adapters.parameters()), "lr": cfg.adapters_lr})
    return torch.optim.AdamW(groups, weight_decay=cfg.weight_decay)


def train_phase(objective: str, model, parts: CEDParts, plan: LayerPlan, group: str,
                train_rows: list[list[int]], val: list[tuple], params: Params, pad_id: int, device,
                first_step: int = 0) -> tuple[dict, dict[str, list[tuple[int, float]]]]:
    """Train the maps of ``parts`` that ``group`` substitutes; returns ``(summary, curves)``.

    ``curves`` are ``<group>_loss`` (one point per optimizer step, numbered from
    ``first_step + 1``) and ``<group>_val_loss`` / ``<group>_val_kl`` (held out, at
    ``first_step`` before training and at the phase's last step after it).
    """
    cfg = params.train.online
    n_batches = -(-len(train_rows) // cfg.batch_size)
    steps = cfg.epochs * n_batches
    optimizer = phase_optimizer(parts, group, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps, cfg.warmup_fraction))
    before = held_out(objective, model, parts, plan, group, val, cfg.temperature, cfg.kv_weight)
    log.info("%s / %s phase (layers %s): held-out loss %.5f, KL %.5f before %d steps", objective, group,
             list(substituted_layers(plan, group)), before["loss"], before["kl"], steps)
    losses, tokens, t0 = [], 0, time.perf_counter()
    bar = tqdm(total=steps, desc=f"tune {objective}/{group}", unit="step")
    for epoch in range(cfg.epochs):
        order = np.random.default_rng([params.seed, SAMPLE_STREAM, epoch]).permutation(len(train_rows))
        for ids, mask in batches(train_rows, cfg.batch_size, pad_id, device, order):
            loss = objective_loss(objective, model, parts, plan, group, ids, mask, cfg.temperature, cfg.kv_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            tokens += int(mask.sum())
            losses.append((first_step + len(losses) + 1, loss.item()))
            bar.update()
            bar.set_postfix(loss=f"{loss.item():.4g}")
    bar.close()
    seconds = time.perf_counter() - t0
    after = held_out(objective, model, parts, plan, group, val, cfg.temperature, cfg.kv_weight)
    log.info("%s / %s phase: held-out loss %.5f -> %.5f, KL %.5f -> %.5f (%.0f s, %.1f tok/s)", objective, group,
             before["loss"], after["loss"], before["kl"], after["kl"], seconds, tokens / seconds)
    record_timing(**{f"{group}_phase": {"wall_s": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 2)}})
    summary = {"layers": list(substituted_layers(plan, group)), "steps": steps, "tokens": tokens,
               "val_before": before, "val_after": after}
    last_step = first_step + len(losses)
    curves = {f"{group}_loss": losses} if losses else {}
    for key in ("loss", "kl"):
        curves[f"{group}_val_{key}"] = [(first_step, before[key])] + ([(last_step, after[key])] if losses else [])
    return summary, curves


def save_parts(out: Path, objective: str, parts: CEDParts, params: Params, plan: LayerPlan,
               geo: Geometry) -> None:
    """Both maps in folder ``out``, in the main branch's checkpoint formats, marked with their objective.

    The metadata is :func:`ced_csa2.pipeline.checkpoint.checkpoint_meta`'s (model, layers, geometry,
    plan, provenance) plus ``objective``: what ``eval_objectives`` checks on loading.
    """
    # The ridge export does not depend on the online budget: same params, same bytes.
    meta = checkpoint_meta(params, plan, geo, params.model, params.plan, params.split, params.ridge,
                           *([params.train.online] if objective != "ridge" else []))
    save_projector(out / projector_path(plan.source).name, parts.projector.cpu(),
                   {**meta["projector"], "objective": objective})
    save_adapters(out / "adapters.pt", parts.adapters.cpu(), {**meta["adapters"], "objective": objective})


def run(params: Params, objective: str, workdir: Path = Path("."), *, model_and_tok=None) -> dict:
    """Build (and for attn_out/distill train) one objective's maps; returns ``train.json``'s content."""
    workdir = Path(workdir)
    require_listed(params, objective)
    plan, geo = load_plan(params.plan, params.model)
    # The maps of ced and csa2, and ced_csa2's own pair, each trained under the group it serves.
    served = {"csa2": ridge_parts(params, plan, geo, workdir / RIDGE_PATH),
              "ced_csa2": ridge_parts(params, plan, geo, workdir / RIDGE_PATH,
                                      projected=params.train.ced_csa2_start == "projected")}
    parts = served["csa2"]
    metrics: dict = {"objective": objective, "init": "ridge", "phases": {}}
    curves: dict[str, list[tuple[int, float]]] = {}
    if objective != "ridge":
        model, tok = model_and_tok or load_model_and_tokenizer(params.model, device=resolve_device("auto"))
        model.requires_grad_(False)
        device = next(model.parameters()).device
        for p in served.values():
            p.projector.to(device)
            p.adapters.to(device)
        train_rows, val_rows = online_records(params, tok, workdir)
        val = batches(val_rows, params.train.online.batch_size, tok.pad_token_id, device)
        log.info("%s: %d train records (%d tokens), %d held-out records, model %s in %s on %s", objective,
                 len(train_rows), sum(map(len, train_rows)), len(val_rows), params.model.name,
                 str(model.dtype).removeprefix("torch."), device)
        torch.manual_seed(params.seed)
        step = 0  # one optimizer-step counter across the phases
        # The joint phase starts from the ridge projector, not the ced phase's: the ced phase may
        # move the source K/V along what the source layer's attention cannot see (a shift
        # shared by all keys leaves its softmax unchanged), which the targets' adapters read.
        for group in PHASE_GROUPS:
            summary, phase_curves = train_phase(objective, model, served.get(group, parts), plan, group,
                                                train_rows, val, params, tok.pad_token_id, device, first_step=step)
            metrics["phases"][group] = summary
            curves |= phase_curves
            step += len(phase_curves.get(f"{group}_loss", []))
        metrics["protocol"] = {"model": params.model.name, "data": params.data.name,
                               "model_revision": params.model.revision, "data_revision": params.data.revision,
                               "dtype": str(model.dtype).removeprefix("torch."), "device": str(device),
                               **to_dict(params.train.online)}
    out = workdir / objective_models(objective)
    save_parts(out, objective, parts, params, plan, geo)
    save_parts(out / "ced_csa2", objective, served["ced_csa2"], params, plan, geo)
    # ridge trains nothing: its (declared) curve dir is left empty, not given a flat line
    write_curves(workdir / objective_curves(objective), curves, x="step")
    write_json(workdir / objective_metrics(objective) / "train.json", metrics)
    return metrics



def main() -> None:
    run_stage(run, objective_arg("tune"))


if __name__ == "__main__":
    main()
