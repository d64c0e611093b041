"""One training objective's branch (``tune@<objective>``): its phases (ced, csa2, ced_csa2) from
the ridge maps, held-out losses, the optimizer of a phase, the maps saved as the main branch
saves them.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..ced_runtime import CEDParts
from ..config import Params
from ..csa2 import save_adapters
from ..data.records import batches
from ..model_utils import Geometry
from ..pipeline.checkpoint import checkpoint_meta
from ..pipeline.paths import projector_path
from ..pipeline.stage_runner import record_timing
from ..plan import LayerPlan
from ..projector import save_projector
from .objectives import (
    SAMPLE_STREAM,
    TeacherCache,
    attn_out_loss,
    distill_loss,
    kl_distill,
    objective_loss,
    student_logits,
    substituted_layers,
)
from .training import Curves, warmup_cosine

log = logging.getLogger(__name__)


def held_out(objective: str, model, parts: CEDParts, plan: LayerPlan, group: str, val: list[tuple],
             temperature: float, kv_weight: float, teachers: TeacherCache) -> dict:
    """Mean objective loss and KL (T = 1) of the ``group`` substitution over held-out batches.

    ``teachers``: the held-out batches' teacher passes, with logits (one per batch for every phase).
    """
    loss = kl = 0.0
    with torch.no_grad():
        for ids, mask in val:
            teacher = teachers(ids, mask)
            student = student_logits(model, parts, plan, group, ids, mask)
            kl += kl_distill(student, teacher["logits"], mask, 1.0).item()
            if objective == "attn_out":
                loss += attn_out_loss(model, parts, plan, group, teacher, mask).item()
            else:
                loss += distill_loss(model, parts, plan, group, teacher, ids, mask, temperature, kv_weight,
                                     student=student).item()
    return {"loss": loss / len(val), "kl": kl / len(val)}


def new_teachers(objective: str, model, plan: LayerPlan) -> tuple[TeacherCache, TeacherCache]:
    """Empty teacher caches for one branch: its training batches (logits only for ``distill``) and held-out ones."""
    return TeacherCache(model, plan, logits=objective == "distill"), TeacherCache(model, plan, logits=True)


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
                first_step: int = 0, teachers: tuple[TeacherCache, TeacherCache] | None = None) -> tuple[dict, Curves]:
    """Train the maps of ``parts`` that ``group`` substitutes; returns ``(summary, curves)``.

    ``curves`` are series ``group``'s ``train_loss`` (one point per optimizer step, numbered
    from ``first_step + 1``) and ``val_loss`` / ``val_kl`` (held out, at ``first_step`` before
    training and at the phase's last step after it).  ``teachers``: the teacher passes of the
    training and the held-out batches (:class:`~ced_csa2.train.objectives.TeacherCache`), shared
    by a branch's phases; new ones when not given.
    """
    cfg = params.train.online
    n_batches = -(-len(train_rows) // cfg.batch_size)
    steps = cfg.epochs * n_batches
    train_teachers, val_teachers = teachers or new_teachers(objective, model, plan)
    optimizer = phase_optimizer(parts, group, cfg)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps, cfg.warmup_fraction))
    before = held_out(objective, model, parts, plan, group, val, cfg.temperature, cfg.kv_weight, val_teachers)
    log.info("%s / %s phase (layers %s): held-out loss %.5f, KL %.5f before %d steps", objective, group,
             list(substituted_layers(plan, group)), before["loss"], before["kl"], steps)
    losses, tokens, t0 = [], 0, time.perf_counter()
    bar = tqdm(total=steps, desc=f"tune {objective}/{group}", unit="step")
    for epoch in range(cfg.epochs):
        order = np.random.default_rng([params.seed, SAMPLE_STREAM, epoch]).permutation(len(train_rows))
        for ids, mask in batches(train_rows, cfg.batch_size, pad_id, device, order):
            loss = objective_loss(objective, model, parts, plan, group, ids, mask, cfg.temperature, cfg.kv_weight,
                                  teacher=train_teachers(ids, mask))
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
    after = held_out(objective, model, parts, plan, group, val, cfg.temperature, cfg.kv_weight, val_teachers)
    log.info("%s / %s phase: held-out loss %.5f -> %.5f, KL %.5f -> %.5f (%.0f s, %.1f tok/s)", objective, group,
             before["loss"], after["loss"], before["kl"], after["kl"], seconds, tokens / seconds)
    record_timing(**{f"{group}_phase": {"wall_s": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 2)}})
    summary = {"layers": list(substituted_layers(plan, group)), "steps": steps, "tokens": tokens,
               "val_before": before, "val_after": after}
    last_step = first_step + len(losses)
    curves: Curves = {(group, "train_loss"): losses} if losses else {}
    for key in ("loss", "kl"):
        curves[group, f"val_{key}"] = [(first_step, before[key])] + ([(last_step, after[key])] if losses else [])
    return summary, curves


def save_parts(out: Path, objective: str, parts: CEDParts, params: Params, plan: LayerPlan,
               geo: Geometry, made_from: dict) -> None:
    """Both maps in folder ``out``, in the main branch's checkpoint formats, marked with their objective.

    The metadata is :func:`ced_csa2.pipeline.checkpoint.checkpoint_meta`'s (model, layers, geometry,
    plan, provenance: ``made_from``) plus ``objective``: what ``eval_objectives`` checks on loading.
    """
    # The ridge export does not depend on the online budget: same params, same bytes.
    meta = checkpoint_meta(params, plan, geo, params.model, params.plan, params.split, params.ridge,
                           *([params.train.online] if objective != "ridge" else []), provenance=made_from)
    save_projector(out / projector_path(plan.source).name, parts.projector.cpu(),
                   {**meta["projector"], "objective": objective})
    save_adapters(out / "adapters.pt", parts.adapters.cpu(), {**meta["adapters"], "objective": objective})
