"""Training the maps Mode A runs with through the prefill skip (stage ``tune_mode_a``).

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
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
from tqdm import tqdm

from ..ced_runtime import CEDModeARuntime, CEDParts
from ..config import Params
from ..pipeline.stage_runner import record_timing
from .objectives import SAMPLE_STREAM, mode_a_kl
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


