"""``tune_mode_a`` stage: the maps Mode A runs with, trained through the prefill skip.

    python -m ced_csa2.stages.tune_mode_a     # what `dvc repro tune_mode_a` runs

From the ridge maps (``models/ridge.pt``; with ``mode_a.train.head_width > 0`` each projector also
gets a zero-initialised residual MLP; with ``mode_a.train.rank > 0`` the projectors become one
:class:`~ced_csa2.projector.ProjectorBank`, the reduced-rank regression of the ridge maps on the
training prompts' ``H_split``), the source's and the extra sources' projectors and the
targets' adapters are trained together under Mode A itself, KL(plain ‖ Mode A) on the
continuation (:mod:`ced_csa2.train.mode_a_training` says how).  A plan that does not cover every
attention layer above the cut has no Mode A: the ridge maps are written untrained and
``covered`` is false.

With ``mode_a.sink: mean`` the first position's K/V above the cut are constants, the mean over
the training records' first positions (:func:`~ced_csa2.train.mode_a_training.mean_sink`), fixed
before the maps train under them.

Writes ``models/mode_a/{projector_k{s}v{s}.pt, projectors_extra.pt, adapters.pt}`` (the
main branch's formats, marked ``objective: mode_a``; with a bank ``projector_bank.pt`` in place of
the two projector files), ``models/mode_a/sink.pt`` (``sink: mean``),
``metrics/mode_a/train.json``
(steps, tokens, held-out KL before/after, protocol) and the curves
``metrics/curves/tune_mode_a.tsv`` (series ``mode_a``: ``train_loss`` per optimizer step, ``val_kl``
before and after).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import torch

from ..ced_runtime import CEDModeARuntime, save_parts
from ..config import Params, provenance, to_dict
from ..data.records import check_prepared
from ..maps.ridge import ridge_provenance
from ..model_utils import load_model_and_tokenizer, resolve_device
from ..pipeline.atomic_files import write_json
from ..pipeline.checkpoint import checkpoint_meta
from ..pipeline.map_roles import MODE_A
from ..pipeline.paths import MODE_A_CURVES, MODE_A_METRICS, MODE_A_MODELS, RIDGE_PATH, TRAIN_JSONL
from ..pipeline.stage_runner import run_stage, stage_arguments
from ..plan import load_plan
from ..projector import reduced_rank
from ..train.mode_a_training import OBJECTIVE, input_moments, input_stats, mean_sink, train, with_heads
from ..train.objectives import online_records, ridge_parts
from ..train.projector_training import ridge_projectors
from ..train.training import Curves, write_curves

log = logging.getLogger(__name__)

PROVENANCE = ("seed", "model", "plan", "split", "ridge", "data.name", "data.max_tokens", "data.revision",
              "train_adapters.width_mult", "train_adapters.activation", "train_adapters.input", "train.online",
              "eval_ppl.prefix_fraction", "mode_a.sink", "mode_a.train")  # of dvc.yaml's params for tune_mode_a


def run(params: Params, workdir: Path = Path("."), *, model_and_tok=None) -> dict:
    """Train (on a covering plan) and save the Mode A maps; returns ``metrics/mode_a/train.json``'s content."""
    workdir = Path(workdir)
    plan, geo = load_plan(params.plan, params.model)
    metrics: dict = {"objective": OBJECTIVE, "init": "ridge", "covered": not plan.uncovered(geo)}
    if metrics["covered"]:  # only a covering plan trains, on the training records
        check_prepared(params, workdir, TRAIN_JSONL)
    ridge = workdir / RIDGE_PATH
    parts = ridge_parts(params, plan, geo, ridge)
    parts.extra = ridge_projectors(ridge, list(plan.extra_sources), geo, params)
    curves: Curves = {}
    if metrics["covered"]:
        model, tok = model_and_tok or load_model_and_tokenizer(params.model, device=resolve_device("auto"))
        model.requires_grad_(False)
        device = next(model.parameters()).device
        for m in parts.maps():
            m.to(device)
        train_rows, val_rows = ([torch.tensor([r], device=device) for r in rows]
                                for rows in online_records(params, tok, workdir, params.mode_a.train.records))
        torch.manual_seed(params.seed)
        cfg = params.mode_a.train
        if params.mode_a.sink == "mean":
            parts.sink = mean_sink(model, plan, geo, train_rows)
        skip, fraction = CEDModeARuntime(model, plan, geo, parts, sink=params.mode_a.sink), params.eval_ppl.prefix_fraction
        if cfg.head_width:
            mean, std = input_stats(skip, train_rows, fraction)
            heads = with_heads({plan.source: parts.projector, **parts.extra}, cfg.head_width,
                               params.train_adapters.activation, mean, std)
            parts.projector, parts.extra = heads.pop(plan.source), heads
        if cfg.rank:
            mean, cov = input_moments(skip, train_rows, fraction)
            parts.bank = reduced_rank({plan.source: parts.projector, **parts.extra}, mean, cov, cfg.rank)
            parts.projector, parts.extra = None, {}
            metrics["rank"] = parts.bank.rank
            if parts.bank.rank < cfg.rank:
                log.warning("mode_a.train.rank %d is above the maps' own rank: the bank has rank %d and reproduces "
                            "the ridge maps exactly (at more multiply-adds than the maps themselves)",
                            cfg.rank, parts.bank.rank)
        summary, curves = train(model, parts, plan, geo, train_rows, val_rows, params)
        metrics |= summary
        metrics["protocol"] = {"model": params.model.name, "data": params.data.name,
                               "model_revision": params.model.revision, "data_revision": params.data.revision,
                               "dtype": str(model.dtype).removeprefix("torch."), "device": str(device),
                               "prefix_fraction": params.eval_ppl.prefix_fraction, "replay": 0,
                               "sink": params.mode_a.sink,
                               "records": len(train_rows), "val_records": len(val_rows),
                               "projector_head": projector_form(cfg, parts),
                               **to_dict(params.mode_a.train),
                               **{k: v for k, v in to_dict(params.train.online).items()
                                  if k in ("seq_len", "batch_size", "warmup_fraction", "weight_decay")}}
    made_from = {**ridge_provenance(ridge), **provenance(params, *PROVENANCE)}
    meta = checkpoint_meta(params, plan, geo, params.model, params.plan, params.split, params.ridge,
                           params.train.online, params.mode_a.train, role=MODE_A, provenance=made_from)
    save_parts(workdir / MODE_A_MODELS, parts, plan, meta)
    write_curves(workdir / MODE_A_CURVES, curves, x="step")
    write_json(workdir / MODE_A_METRICS, metrics)
    return metrics


def projector_form(cfg, parts) -> str:
    """The Mode A projectors' form, for the protocol."""
    if parts.bank is not None:
        return f"bank of rank {parts.bank.rank} (reduced-rank regression of the ridge maps, then trained)"
    return f"ridge + residual MLP {cfg.head_width}" if cfg.head_width else "linear"


def main(argv: Sequence[str] | None = None) -> None:
    run_stage(run, *stage_arguments(run, argv))


if __name__ == "__main__":
    main()
