"""``eval_ppl`` stage: perplexity of every runtime group, and Mode A's prefix perplexity.

    python -m ced_csa2.eval_ppl          # what `dvc repro eval_ppl` runs

Protocol.  The records of ``data/corpus/eval.jsonl`` (held-out articles on the embedded
default, WikiText-2 test lines on the full profile), each truncated to
``data.max_tokens``, are scored teacher-forced.  Perplexity is corpus-level:
``exp(sum NLL / sum scored tokens)`` over all records, every token after the first
scored once.

* Mode B: one figure per group in ``eval_ppl.groups`` and its change against baseline.
* Mode A: prompt = first ``prefix_fraction`` of each record, scored on the rest, for the
  plain model and for the prefill skip (non-attention layers above the cut start from
  a zero state).  Needs a covering plan; otherwise an explicit "not covered" entry
  names the uncovered attention layers.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
from tqdm import tqdm

from .ced_runtime import CEDModeARuntime, CEDModeBRuntime, CEDParts, load_parts
from .config import Params, run_stage
from .dump import read_records
from .io_utils import write_json
from .model_utils import load_model_and_tokenizer, resolve_device
from .plan import load_plan
from .scoring import sequence_nll

log = logging.getLogger(__name__)

EVAL_JSONL = Path("data/corpus/eval.jsonl")
METRICS_PATH = Path("metrics/ppl.json")
ZERO_STATE_NOTE = ("Mode A: prompt tokens run through layers 1..split only; attention layers above the cut get "
                   "K/V from the projector/adapters; non-attention layers above the cut start from a zero state "
                   "(an approximation; none on an all-attention model).")


def _ppl(nll_and_count: torch.Tensor) -> dict:
    total, n = nll_and_count.sum(0).tolist()
    return {"ppl": math.exp(total / n), "nll_per_token": total / n, "tokens": int(n)}


def _delta_pct(value: float, base: float) -> float:
    return 100.0 * (value - base) / base


def group_ppl(model, plan, group: str, parts: CEDParts, ids: list[list[int]], params: Params, pad_id: int) -> dict:
    """Corpus-level perplexity of ``ids`` (every token after the first) under one Mode B group."""
    with CEDModeBRuntime(model, plan, group, parts, kv_format=params.kv_format):
        out = _ppl(sequence_nll(model, ids, [0] * len(ids), params.eval_ppl.batch_size, pad_id))
    log.info("%s: ppl %.4f", group, out["ppl"])
    return out


def mode_a_prefix(model, plan, geo, parts: CEDParts, ids: list[list[int]], fraction: float, batch_size: int,
                  pad_id: int) -> dict:
    """Prefix-conditioned perplexity of the plain model vs the prefill skip."""
    missing = plan.uncovered(geo)
    if missing:
        return {"covered": False, "uncovered_attention_layers": missing,
                "note": f"plan {plan} does not cover every attention layer above the cut; Mode A not run"}
    cut = [max(2, int(len(r) * fraction)) for r in ids]
    plain = sequence_nll(model, ids, cut, batch_size, pad_id)
    runtime = CEDModeARuntime(model, plan, geo, parts)
    skip = torch.zeros(len(ids), 2, dtype=torch.float64)
    for i, (row, c) in enumerate(tqdm(list(zip(ids, cut)), desc="mode A", unit="record")):
        # One record at a time: the skip prefill has no padding support.
        x = torch.tensor([row], device=next(model.parameters()).device)
        logits = runtime.continuation_logits(x[:, :c], x[:, c:]).float()
        nll = torch.nn.functional.cross_entropy(logits[0], x[0, c:], reduction="sum")
        skip[i] = torch.tensor([nll.item(), len(row) - c], dtype=torch.float64)
    base, ced = _ppl(plain), _ppl(skip)
    return {"covered": True, "prefix_fraction": fraction, "baseline": base, "mode_a": ced,
            "delta_pct": _delta_pct(ced["ppl"], base["ppl"]), "note": ZERO_STATE_NOTE}


def eval_ids(params: Params, tok, workdir: Path) -> list[list[int]]:
    """Token ids of the eval records, truncated to ``data.max_tokens``."""
    records = read_records(workdir / EVAL_JSONL)
    return tok([r["text"] for r in records], truncation=True, max_length=params.data.max_tokens)["input_ids"]


def protocol(params: Params, model, plan, ids: list[list[int]], tokens_scored: int) -> dict:
    """What a perplexity figure was measured on (stored next to it)."""
    return {
        "model": params.model.name, "data": params.data.name, "records": len(ids), "tokens_scored": tokens_scored,
        "max_tokens": params.data.max_tokens, "dtype": str(model.dtype).removeprefix("torch."),
        "device": str(model.device), "threads": torch.get_num_threads(),
        "basis": "token-level, teacher-forced, corpus-level exp(sum NLL / scored tokens); Mode B substitution",
        "plan": {"split": plan.split, "source": plan.source, "targets": list(plan.targets)},
        "kv_format": params.kv_format,
    }


def run(params: Params, workdir: Path = Path("."), *, parts: CEDParts | None = None,
        model_and_tok=None) -> dict:
    """Score every group; ``parts``/``model_and_tok`` override loading (tests)."""
    workdir, cfg = Path(workdir), params.eval_ppl
    plan, geo = load_plan(params.plan, params.model)
    device = resolve_device(cfg.device)
    model, tok = model_and_tok or load_model_and_tokenizer(params.model, device=device)
    if parts is None:
        parts = load_parts(workdir / "models", plan, device=device, expect={"model": params.model.name})
    ids = eval_ids(params, tok, workdir)
    groups, t0 = {}, time.perf_counter()
    for group in tqdm(cfg.groups, desc="eval_ppl groups"):
        groups[group] = group_ppl(model, plan, group, parts, ids, params, tok.pad_token_id)
    if "baseline" in groups:
        for g in groups.values():
            g["delta_pct"] = _delta_pct(g["ppl"], groups["baseline"]["ppl"])
    mode_a = mode_a_prefix(model, plan, geo, parts, ids, cfg.prefix_fraction, cfg.batch_size, tok.pad_token_id)
    metrics = {
        "protocol": protocol(params, model, plan, ids, groups[cfg.groups[0]]["tokens"]),
        "groups": groups,
        "mode_a": mode_a,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    write_json(workdir / METRICS_PATH, metrics)
    return metrics


def main() -> None:
    run_stage(run)


if __name__ == "__main__":
    main()
