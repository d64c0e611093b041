"""Teacher-forced perplexity of a Mode B group, and Mode A's prefix perplexity.

Protocol.  The records of ``data/corpus/eval.jsonl``, each truncated to
``data.max_tokens``, are scored teacher-forced.  Perplexity is corpus-level:
``exp(sum NLL / sum scored tokens)`` over all records, every token after the first
scored once.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch
from tqdm import tqdm

from .ced_runtime import CEDModeARuntime, CEDModeBRuntime, CEDParts
from .config import Params
from .paths import EVAL_JSONL
from .records import read_records, seeded_subset
from .scoring import multi_group_nll, sequence_nll
from .stats import paired_deltas

log = logging.getLogger(__name__)

EVAL_SAMPLE_STREAM = 7  # numpy seed-sequence tag (dump.py uses 6)


ZERO_STATE_NOTE = ("Mode A: prompt tokens run through layers 1..split only; attention layers above the cut get "
                   "K/V from the projector/adapters; non-attention layers above the cut start from a zero state "
                   "(an approximation; none on an all-attention model).")


def _ppl(nll_and_count: torch.Tensor) -> dict:
    total, n = nll_and_count.sum(0).tolist()
    return {"ppl": math.exp(total / n), "nll_per_token": total / n, "tokens": int(n)}


def delta_pct(value: float, base: float) -> float:
    return 100.0 * (value - base) / base


def group_ppl(model, plan, group: str, parts: CEDParts, ids: list[list[int]], params: Params, pad_id: int) -> dict:
    """Corpus-level perplexity of ``ids`` (every token after the first) under one Mode B group."""
    with CEDModeBRuntime(model, plan, group, parts, kv_format=params.kv_format):
        out = _ppl(sequence_nll(model, ids, [0] * len(ids), params.eval_ppl.batch_size, pad_id))
    log.info("%s: ppl %.4f", group, out["ppl"])
    return out


def groups_ppl(model, plan, groups: list[str], parts: CEDParts | None, ids: list[list[int]], params: Params,
               pad_id: int) -> dict[str, dict]:
    """:func:`group_ppl` of every group, bit for bit, with one shared trunk per batch (:func:`multi_group_nll`).

    When ``baseline`` is among ``groups`` every other group also gets ``delta_pct`` (ΔPPL %)
    and ``delta_pct_ci95``: the paired bootstrap 95% interval over records (seed ``seed``).
    """
    nll = multi_group_nll(model, plan, groups, parts, ids, [0] * len(ids), params.eval_ppl.batch_size, pad_id,
                          kv_format=params.kv_format)
    out = {group: _ppl(v) for group, v in nll.items()}
    for group, d in paired_deltas({g: v.numpy() for g, v in nll.items()}, "delta_ppl_pct", params.seed).items():
        out[group].update(delta_pct=d["value"], delta_pct_ci95=d["ci95"])
    for group, v in out.items():
        log.info("%s: ppl %.4f (ΔPPL %s)", group, v["ppl"],
                 f"{v['delta_pct']:+.2f}% [{v['delta_pct_ci95'][0]:+.2f}, {v['delta_pct_ci95'][1]:+.2f}]"
                 if "delta_pct" in v else "-")
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
            "delta_pct": delta_pct(ced["ppl"], base["ppl"]), "note": ZERO_STATE_NOTE}


def eval_ids(params: Params, tok, workdir: Path) -> list[list[int]]:
    """Token ids of the eval records (a seeded sample of ``eval_ppl.records``; 0 = all), truncated to ``data.max_tokens``."""
    records = read_records(workdir / EVAL_JSONL)
    records = [records[i] for i in seeded_subset(len(records), params.eval_ppl.records, params.seed, EVAL_SAMPLE_STREAM)]
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

