"""One training objective's branch (``tune@<objective>``): its phases (ced, csa2, ced_csa2) from
the ridge maps, held-out losses, the optimizer of a phase.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import torch

from .. import kv_hooks
from ..ced_runtime import CEDParts
from ..config import Params, to_dict
from ..data.records import batches
from ..model_utils import Geometry
from ..pipeline.paths import RIDGE_PATH
from ..pipeline.progress import Progress
from ..pipeline.stage_runner import record_timing
from ..plan import LayerPlan
from .objective_registry import tune_objective
from .objectives import (
    PHASE_GROUPS,
    SAMPLE_STREAM,
    TeacherCache,
    kl_from_hidden,
    online_records,
    ridge_parts,
    student_final,
    substituted_layers,
)
from .mode_a_training import with_heads
from .training import Curves, warmup_cosine

log = logging.getLogger(__name__)


def held_out(objective: str, model, parts: CEDParts, plan: LayerPlan, group: str, val: list[tuple],
             temperature: float, kv_weight: float, teachers: TeacherCache, block_tokens: int) -> dict:
    """Mean objective loss (:meth:`~ced_csa2.train.objective_registry.TuneObjective.loss`) and KL (T = 1) of the
    ``group`` substitution over held-out batches.

    ``teachers``: the held-out batches' teacher passes, to the final hidden state (one per batch for
    every phase).  The KLs run the LM head on ``block_tokens`` positions at a time
    (:func:`~ced_csa2.train.objectives.kl_from_hidden`): no ``(B, T, vocab)`` tensor.
    """
    spec = tune_objective(objective)
    loss = kl = 0.0
    with torch.no_grad():
        for ids, mask in val:
            teacher = teachers(ids, mask)
            student = student_final(model, parts, plan, group, ids, mask)
            kl += kl_from_hidden(model, student, teacher["final"], mask, 1.0, block_tokens).item()
            loss += spec.loss(model, parts, plan, group, teacher, ids, mask, temperature, kv_weight,
                              student=student, block_tokens=block_tokens).item()
    return {"loss": loss / len(val), "kl": kl / len(val)}


def new_teachers(objective: str, model, plan: LayerPlan) -> tuple[TeacherCache, TeacherCache]:
    """Empty teacher caches for one branch: its training batches (to the final hidden state where its loss reads
    it: :attr:`~ced_csa2.train.objective_registry.TuneObjective.final_teacher`) and held-out ones."""
    final = tune_objective(objective).final_teacher
    return TeacherCache(model, plan, final=final), TeacherCache(model, plan, final=True)


def phase_optimizer(parts: CEDParts, group: str, cfg, head_lr: float | None = None) -> torch.optim.AdamW:
    """AdamW over the maps a phase trains, each kind at its own learning rate.

    ``ced``: the projector (``projector_lr``; its residual MLP, if it has one, at ``head_lr``:
    a zero-initialised MLP does not move at the linear map's 1e-6); ``csa2``: the adapters
    (``adapters_lr``); ``ced_csa2``: both, jointly.
    """
    groups = []
    if group != "csa2":
        groups.append({"params": list(parts.projector.proj.parameters()), "lr": cfg.projector_lr})
        if heads := parts.projector.mlp_parameters():
            if head_lr is None:
                raise ValueError("phase_optimizer: the projector has a residual MLP but no head_lr was given")
            groups.append({"params": heads, "lr": head_lr})
    if group != "ced":
        groups.append({"params": list(parts.adapters.parameters()), "lr": cfg.adapters_lr})
    return torch.optim.AdamW(groups, weight_decay=cfg.weight_decay)


def train_phase(objective: str, model, parts: CEDParts, plan: LayerPlan, group: str,
                train_rows: list[list[int]], val: list[tuple], params: Params, pad_id: int, device,
                first_step: int = 0, teachers: tuple[TeacherCache, TeacherCache] | None = None,
                head_lr: float | None = None) -> tuple[dict, Curves]:
    """Train the maps of ``parts`` that ``group`` substitutes; returns ``(summary, curves)``.

    ``curves`` are series ``group``'s ``train_loss`` (one point per optimizer step, numbered
    from ``first_step + 1``) and ``val_loss`` / ``val_kl`` (held out, at ``first_step`` before
    training and at the phase's last step after it).  ``teachers``: the teacher passes of the
    training and the held-out batches (:class:`~ced_csa2.train.objectives.TeacherCache`), shared
    by a branch's phases; new ones when not given.  ``head_lr``: the projector's residual MLP's
    learning rate (:func:`phase_optimizer`).
    """
    spec = tune_objective(objective)
    cfg = params.train.online
    n_batches = -(-len(train_rows) // cfg.batch_size)
    steps = cfg.epochs * n_batches
    train_teachers, val_teachers = teachers or new_teachers(objective, model, plan)
    optimizer = phase_optimizer(parts, group, cfg, head_lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps, cfg.warmup_fraction))
    before = held_out(objective, model, parts, plan, group, val, cfg.temperature, cfg.kv_weight, val_teachers,
                      params.eval_ppl.score_block_tokens)
    log.info("%s / %s phase (layers %s): held-out loss %.5f, KL %.5f before %d steps", objective, group,
             list(substituted_layers(plan, group)), before["loss"], before["kl"], steps)
    losses, tokens, t0 = [], 0, time.perf_counter()
    bar = Progress(total=steps, desc=f"tune {objective}/{group}", unit="step")
    for epoch in range(cfg.epochs):
        order = np.random.default_rng([params.seed, SAMPLE_STREAM, epoch]).permutation(len(train_rows))
        for ids, mask in batches(train_rows, cfg.batch_size, pad_id, device, order):
            loss = spec.batch_loss(model, parts, plan, group, ids, mask, cfg.temperature, cfg.kv_weight,
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
    after = held_out(objective, model, parts, plan, group, val, cfg.temperature, cfg.kv_weight, val_teachers,
                      params.eval_ppl.score_block_tokens)
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


def ridge_served(params: Params, plan: LayerPlan, geo: Geometry, workdir: Path) -> dict[str, CEDParts]:
    """The maps of a branch at the ridge start, by the group they serve (seeded, float32).

    ``"csa2"``: one projector and one set of adapters (fitted on the true source K/V, as ``csa2``
    reads them), trained by the ``ced`` and ``csa2`` phases; ``"ced_csa2"``: its own pair, its
    adapters from ``csa2``'s maps or (``train.ced_csa2_start: projected``) from those fitted on the
    projected source.
    """
    ridge = workdir / RIDGE_PATH
    return {"csa2": ridge_parts(params, plan, geo, ridge),
            "ced_csa2": ridge_parts(params, plan, geo, ridge, projected=params.train.ced_csa2_start == "projected")}


def with_projector_heads(served: dict[str, CEDParts], model, plan: LayerPlan, rows: list[list[int]], pad_id: int,
                         width: int, activation: str, batch_size: int) -> None:
    """Give every projector of ``served`` a zero-initialised residual MLP of ``width`` (in place).

    The MLP reads ``H_split`` standardised by its per-channel mean and std over every position of
    ``rows`` (the branch's training records; float64 sums): the projector serves them all, the
    first included.  The untrained head is its linear map bit for bit.
    """
    device = next(model.parameters()).device
    total = squares = 0.0
    n = 0
    with torch.no_grad(), kv_hooks.capture(model, hidden_layers=[plan.split]) as store:
        for ids, mask in batches(rows, batch_size, pad_id, device):
            model.model(input_ids=ids, attention_mask=mask)
            h = store["h"][plan.split][mask.bool()].double()
            total, squares, n = total + h.sum(0), squares + (h * h).sum(0), n + h.shape[0]
    mean = total / n
    std = (squares / n - mean * mean).clamp_min(0).sqrt().clamp_min(1e-3)
    for parts in served.values():
        parts.projector = with_heads({plan.source: parts.projector}, width, activation, mean.float(),
                                     std.float())[plan.source]


def train_branch(objective: str, params: Params, plan: LayerPlan, served: dict[str, CEDParts], model, tok,
                 workdir: Path, head_lr: float | None = None, phases: tuple[str, ...] = PHASE_GROUPS,
                 teachers: tuple[TeacherCache, TeacherCache] | None = None) -> tuple[dict, Curves, dict]:
    """Train ``served`` (:func:`ridge_served`) in place through ``phases`` (default ``ced``, ``csa2``, ``ced_csa2``).

    On ``train.online.records`` records of the train split and ``val_records`` held-out ones
    (:func:`~ced_csa2.train.objectives.online_records`), one teacher pass per batch for all
    phases (:class:`~ced_csa2.train.objectives.TeacherCache`).  Returns ``(summaries, curves,
    protocol)``: each phase's summary (:func:`train_phase`), the curves of all phases (one step
    counter across them) and what the run was measured on.  ``head_lr``: the learning rate of the
    projectors' residual MLPs, where they have them (:func:`with_projector_heads`).  ``phases``: a subset of
    :data:`~ced_csa2.train.objectives.PHASE_GROUPS` in its order, for a caller that serves only some groups
    (``studies/sharing.py``: no ``ced`` arm, so its projector is never trained).  ``teachers``: the training and
    held-out teacher caches (:func:`new_teachers`) to read, for a caller training several plans on the same
    records: caches made for a plan of the same split whose layers include this one's serve it (a pass records
    every layer its plan names), bit for bit; new ones when not given.
    """
    if list(phases) != [g for g in PHASE_GROUPS if g in phases]:
        raise ValueError(f"train_branch: phases must be a subset of {PHASE_GROUPS} in that order, got {phases}")
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
    summaries: dict = {}
    curves: Curves = {}
    step = 0  # one optimizer-step counter across the phases
    teachers = teachers or new_teachers(objective, model, plan)  # the frozen model's passes: one per batch
    # The joint phase starts from the ridge projector, not the ced phase's: the ced phase may
    # move the source K/V along what the source layer's attention cannot see (a shift
    # shared by all keys leaves its softmax unchanged), which the targets' adapters read.
    for group in phases:
        summaries[group], phase_curves = train_phase(objective, model, served.get(group, served["csa2"]), plan,
                                                     group, train_rows, val, params, tok.pad_token_id, device,
                                                     first_step=step, teachers=teachers, head_lr=head_lr)
        curves |= phase_curves
        step += len(phase_curves.get((group, "train_loss"), []))
    protocol = {"model": params.model.name, "data": params.data.name, "model_revision": params.model.revision,
                "data_revision": params.data.revision, "dtype": str(model.dtype).removeprefix("torch."),
                "device": str(device), **to_dict(params.train.online)}
    return summaries, curves, protocol
