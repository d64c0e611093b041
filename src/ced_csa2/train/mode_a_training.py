"""Training the maps Mode A runs with through the prefill skip (stage ``tune_mode_a``).

Mode A reads every attention layer above the cut from maps of ``H_split``: the source's
projector, the extra sources' projectors and the targets' adapters.  The K/V-MSE recipe
fits each map alone; here they start from the ridge maps (``models/ridge.pt``: the
closed-form ``proj_{l}`` maps, the adapters at their ridge bases with the MLPs at their
zero start) and are trained together *under Mode A itself*, as SwiftKV trains its
single-input K/V: per record of ``train.online``'s sample (the ridge stage's train split,
cropped to ``seq_len``) the prompt -- the first ``eval_ppl.prefix_fraction``, as
``eval_ppl`` cuts it -- is prefilled by the skip (the first position as ``mode_a.sink`` says,
with ``mean`` the constants of :func:`mean_sink` over the training records; no replay: the maps
serve every mapped position whatever ``mode_a.replay`` keeps), the continuation runs through
every layer, and the loss is KL(plain ‖ Mode A) on the continuation's next-token
distributions (:func:`ced_csa2.train.objectives.mode_a_kl`).  The plain model's pass over each
record (its ``H_split`` and final hidden states on the continuation, :func:`teachers`) runs once
before the first step and serves every epoch; below the cut the continuation is the plain
model's, so each step runs only the skip's prefill and the layers above the cut (measured on
the embedded default: ``benchmarks/mode_a_step.py``).  ``train.online.batch_size`` records
per AdamW step, those of one length in one forward (the skip prefill has no padding; records
cropped to ``seq_len`` mostly share it), each record weighing the same as when they ran one at a time
(``mode_a.train.projector_lr`` for the projectors' linear maps, ``head_lr`` for their residual
MLPs where ``head_width > 0``, ``adapters_lr`` for the adapters), warm-up + cosine over
``mode_a.train.epochs`` epochs; held-out KL on ``train.online.val_records`` records of the
validation split before and after.  Seeded.

With ``head_width > 0`` every Mode A projector is the ridge map plus a zero-initialised residual
MLP (:class:`~ced_csa2.projector.KVProjector`) reading ``H_split`` standardised by its per-channel
mean and std over the training records' prompts (:func:`input_stats`), so training starts at the
ridge maps exactly.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from .. import kv_hooks
from ..ced_runtime import CEDModeARuntime, CEDParts, SinkKV, prompt_tokens
from ..config import Params
from ..pipeline.progress import Progress
from ..projector import KVProjector
from ..pipeline.stage_runner import record_timing
from .objectives import SAMPLE_STREAM, ModeATeacher, mode_a_kl, mode_a_teacher
from .training import Curves, warmup_cosine

log = logging.getLogger(__name__)

OBJECTIVE = "mode_a"
SERIES = OBJECTIVE  # the one series of its curves


def held_out_kl(model, runtime: CEDModeARuntime, rows: list[torch.Tensor], fraction: float) -> float:
    """Mean per-record KL(plain ‖ Mode A) over ``rows``."""
    with torch.no_grad():
        return sum(mode_a_kl(model, runtime, row, fraction).item() for row in rows) / len(rows)


def optimizer_for(parts: CEDParts, params: Params) -> torch.optim.AdamW:
    cfg = params.mode_a.train
    projectors = [p for p in (parts.projector, *parts.extra.values()) if p is not None]
    linear = [w for p in projectors for w in p.proj.parameters()]
    linear += list(parts.bank.parameters()) if parts.bank is not None else []
    groups = [{"params": linear, "lr": cfg.projector_lr},
              {"params": list(parts.adapters.parameters()), "lr": cfg.adapters_lr}]
    heads = [w for p in projectors for w in p.mlp_parameters()]
    if heads:
        groups.append({"params": heads, "lr": cfg.head_lr})
    return torch.optim.AdamW(groups, weight_decay=params.train.online.weight_decay)


def with_heads(projectors: dict[int, KVProjector], width: int, activation: str, mean: torch.Tensor,
               std: torch.Tensor) -> dict[int, KVProjector]:
    """Each linear projector as the same map plus a zero-initialised residual MLP of ``width`` (> 0).

    ``mean``/``std`` ``(hidden,)``: the MLP's input standardisation (:func:`input_stats`).  Seeded by the
    caller (the MLPs' first layers take PyTorch's init).
    """
    out = {}
    for layer, linear in projectors.items():
        head = KVProjector(linear.hidden_size, linear.kv_dim, mlp_width=width, activation=activation)
        head.proj.load_state_dict(linear.proj.state_dict())
        head.set_input_stats(mean, std)
        out[layer] = head.to(linear.proj.weight.device)
    return out


@torch.no_grad()
def input_moments(runtime: CEDModeARuntime, rows: list[torch.Tensor], fraction: float
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean ``(hidden,)`` and covariance ``(hidden, hidden)`` of ``H_split`` over the positions the skip maps
    (float64 sums; float64 out).

    The first position is left out unless the maps serve it (``runtime.sink == "none"``).
    """
    total, products, n = 0.0, 0.0, 0
    first = int(runtime.sink != "none")
    for row in rows:
        h = runtime.split_hidden(row[:, :prompt_tokens(row.shape[1], fraction) - 1])
        h = h[:, first:].double().flatten(0, -2)
        total, products, n = total + h.sum(0), products + h.T @ h, n + h.shape[0]
    mean = total / n
    return mean, products / n - torch.outer(mean, mean)


def input_stats(runtime: CEDModeARuntime, rows: list[torch.Tensor], fraction: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel mean and std ``(hidden,)`` of ``H_split`` over the positions the skip maps (:func:`input_moments`)."""
    mean, cov = input_moments(runtime, rows, fraction)
    return mean.float(), cov.diagonal().clamp_min(0).sqrt().float().clamp_min(1e-3)


@torch.no_grad()
def mean_sink(model, plan, geo, rows: list[torch.Tensor]) -> SinkKV:
    """:class:`~ced_csa2.ced_runtime.SinkKV` of ``plan.kv_layers``: the mean K/V of the first position of ``rows``.

    The first position's K/V depend on the first token only, so one forward over the first
    tokens ``(R, 1)`` gives them all (float64 sums).
    """
    layers = plan.kv_layers
    with kv_hooks.capture(model, layers) as store:
        model.model(input_ids=torch.cat([row[:, :1] for row in rows]))
    sink = SinkKV(layers, geo.kv_dim)
    for i, layer in enumerate(layers):
        sink.k[i] = store["k"][layer][:, 0].double().mean(0).float()
        sink.v[i] = store["v"][layer][:, 0].double().mean(0).float()
    return sink


def length_groups(rows: list[torch.Tensor]) -> list[list[int]]:
    """Indices of ``rows`` ``(1, T_i)`` grouped by length, in order of first appearance."""
    groups: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(row.shape[1], []).append(i)
    return list(groups.values())


def teachers(model, plan, rows: list[torch.Tensor], fraction: float, batch_size: int) -> list[ModeATeacher]:
    """:func:`~ced_csa2.train.objectives.mode_a_teacher` of every row ``(1, T_i)``, kept on the CPU.

    ``batch_size`` records of one length per forward.  Kept per record:
    ``2 * C * hidden`` floats (the embedded default's 64 records: ~19 MB).
    """
    out: list[ModeATeacher | None] = [None] * len(rows)
    for group in Progress(length_groups(rows), desc="Mode A teacher", unit="length"):
        for s in range(0, len(group), batch_size):
            ix = group[s:s + batch_size]
            stacked = mode_a_teacher(model, plan, torch.cat([rows[i] for i in ix]), fraction)
            for i, t in zip(ix, stacked.to("cpu").split()):
                out[i] = t
    return out


def train(model, parts: CEDParts, plan, geo, train_rows: list[torch.Tensor], val_rows: list[torch.Tensor],
          params: Params) -> tuple[dict, Curves]:
    """Train ``parts`` in place under the skip (``mode_a.sink``, no replay); returns ``(summary, curves)``."""
    online, fraction = params.train.online, params.eval_ppl.prefix_fraction
    runtime = CEDModeARuntime(model, plan, geo, parts, sink=params.mode_a.sink)
    per_epoch = -(-len(train_rows) // online.batch_size)
    steps = params.mode_a.train.epochs * per_epoch
    optimizer = optimizer_for(parts, params)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps, online.warmup_fraction))
    before = held_out_kl(model, runtime, val_rows, fraction)
    log.info("Mode A maps: held-out KL %.5f before %d steps (%d records, %d per step)", before, steps,
             len(train_rows), online.batch_size)
    losses, tokens, t0 = [], 0, time.perf_counter()
    # The plain model is the teacher of every epoch: its pass over each record runs once.
    taught = teachers(model, plan, train_rows, fraction, online.batch_size)
    device = train_rows[0].device
    with Progress(total=steps, desc="tune_mode_a", unit="step") as bar:
        for epoch in range(params.mode_a.train.epochs):
            order = np.random.default_rng([params.seed, SAMPLE_STREAM, epoch]).permutation(len(train_rows))
            for s in range(0, len(order), online.batch_size):
                batch = [int(i) for i in order[s:s + online.batch_size]]
                optimizer.zero_grad(set_to_none=True)
                loss = 0.0
                for group in length_groups([train_rows[i] for i in batch]):  # no padding: one forward per length
                    ix = [batch[j] for j in group]
                    rows = torch.cat([train_rows[i] for i in ix])
                    teacher = ModeATeacher.stack([taught[i] for i in ix]).to(device)
                    # mode_a_kl is a per-token mean, and equal-length records have equal token counts,
                    # so each record weighs 1/len(batch), as one record per forward gave
                    part_loss = mode_a_kl(model, runtime, rows, fraction, teacher) * (rows.shape[0] / len(batch))
                    part_loss.backward()
                    loss += part_loss.item()
                    tokens += rows.numel()
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


