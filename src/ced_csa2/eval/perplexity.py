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
from typing import Mapping, Sequence

import torch

from ..ced_runtime import (CEDModeARuntime, CEDModeBRuntime, CEDParts, continue_hidden, plain_prefill,
                           prompt_tokens)
from ..config import Params
from ..data.records import read_records, seeded_subset
from ..pipeline import distributed
from ..pipeline.paths import EVAL_JSONL, domain_jsonl
from ..pipeline.progress import Progress
from ..pipeline.timing import MIN_REPEATS, PROTOCOL, BoundExceeded, check_bound, paired_seconds
from ..runtime.group_runtime import GroupRuntime
from .scoring import BLOCK_TOKENS, multi_group_nll, score_hidden, sequence_nll
from .stats import paired_bootstrap, paired_deltas, ratio_bootstrap

log = logging.getLogger(__name__)

EVAL_SAMPLE_STREAM = 7  # numpy seed-sequence tag (dump.py uses 6)
TIMING_SAMPLE_STREAM = 8  # the records mode_a_prefix times
MIN_RECORD_TOKENS = 3  # mode_a_prefix: a prompt of max(2, ...) tokens, then at least one scored




def _ppl(nll_and_count: torch.Tensor) -> dict:
    total, n = nll_and_count.sum(0).tolist()
    return {"ppl": math.exp(total / n), "nll_per_token": total / n, "tokens": int(n)}


def delta_pct(value: float, base: float) -> float:
    return 100.0 * (value - base) / base


def by_length(ids: list[list[int]]) -> tuple[list[list[int]], torch.Tensor]:
    """``ids`` sorted by length (less right-padding per batch) and the permutation back to record order."""
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    return [ids[i] for i in order], torch.argsort(torch.tensor(order, dtype=torch.long))


def group_ppl(model, plan, group: str, parts: CEDParts, ids: list[list[int]], params: Params, pad_id: int) -> dict:
    """Corpus-level perplexity of ``ids`` (every token after the first) under one Mode B group."""
    sorted_ids, back = by_length(ids)
    with CEDModeBRuntime(model, plan, group, parts, kv_format=params.kv_format):
        out = _ppl(sequence_nll(model, sorted_ids, [0] * len(ids), params.eval_ppl.batch_size, pad_id,
                                block_tokens=params.eval_ppl.score_block_tokens)[back])
    log.info("%s: ppl %.4f", group, out["ppl"])
    return out


def groups_ppl(model, plan, groups: list[str], parts: CEDParts | Mapping[str, CEDParts] | None, ids: list[list[int]],
               params: Params, pad_id: int, *, extra: Mapping[str, GroupRuntime] | None = None) -> dict[str, dict]:
    """:func:`group_ppl` of every group, bit for bit, with one shared trunk per batch (:func:`multi_group_nll`).

    When ``baseline`` is among ``groups`` every other group also gets, each with its paired
    bootstrap 95% interval over records (seed ``seed``: the same resampled records for all):
    ``delta_pct`` (ΔPPL %), ``kl`` (mean per-token KL(baseline ‖ group), nats) and
    ``top1_pct`` (% of scored tokens whose argmax is the baseline's).

    ``extra`` adds runtimes (:class:`~ced_csa2.runtime.group_runtime.GroupRuntime`) by label, scored like
    groups (:func:`multi_group_nll`).  Under a process group each rank scores a contiguous run of the
    single-process batches and the per-record sums are assembled on every rank, so the figures and their
    bootstrap intervals are the single-process ones.
    """
    # Scored in order of length (fewer padded positions: docs/costs.md), reported in record
    # order (the bootstrap's unit).
    sorted_ids, back = by_length(ids)
    lo, hi = distributed.batch_bounds(len(ids), params.eval_ppl.batch_size)
    nll = multi_group_nll(model, plan, groups, parts, sorted_ids[lo:hi], [0] * (hi - lo), params.eval_ppl.batch_size,
                          pad_id, kv_format=params.kv_format, agreement="baseline" in groups, extra=extra,
                          block_tokens=params.eval_ppl.score_block_tokens)
    nll = {g: distributed.assemble(v, lo, len(ids))[back] for g, v in nll.items()}
    out = {group: _ppl(v[:, :2]) for group, v in nll.items()}
    for group, d in paired_deltas({g: v[:, :2].numpy() for g, v in nll.items()}, "delta_ppl_pct",
                                  params.seed).items():
        out[group].update(delta_pct=d["value"], delta_pct_ci95=d["ci95"], **agreement(nll[group], params.seed))
    for group, v in out.items():
        log.info("%s: ppl %.4f%s", group, v["ppl"], f" (ΔPPL {_ci(v, 'delta_pct')}%, KL {_ci(v, 'kl')}, "
                 f"top-1 {_ci(v, 'top1_pct')}%)" if "kl" in v else "")
    return out


def agreement(scores: torch.Tensor, seed: int) -> dict:
    """``kl``/``top1_pct`` and their 95% intervals from :func:`multi_group_nll`'s agreement columns, ``(R, 4)``."""
    s = scores.numpy()
    kl, top1 = ratio_bootstrap(s[:, 2], s[:, 1], seed=seed), ratio_bootstrap(s[:, 3], s[:, 1], scale=100, seed=seed)
    return {"kl": kl["value"], "kl_ci95": kl["ci95"], "top1_pct": top1["value"], "top1_pct_ci95": top1["ci95"]}


def _ci(v: dict, key: str) -> str:
    low, high = v[f"{key}_ci95"]
    return f"{v[key]:+.4g} [{low:+.4g}, {high:+.4g}]"


def mode_a_prefix(model, plan, geo, parts: CEDParts, ids: list[list[int]], fraction: float, seed: int,
                  timing_records: int | None = 8, timing_repeats: int = MIN_REPEATS, *, block_tokens: int = BLOCK_TOKENS,
                  replay: int = 0, sink: str = "none") -> dict:
    """Prefix-conditioned perplexity, KL and top-1 of the prefill skip against the plain prefill, and its speed-up.

    Each record's first ``fraction`` is the prompt and the rest is scored.  Both arms run the
    same continuation through all layers from a cache holding the prompt (but its last
    token): the plain model's own prefill, or Mode A's (:class:`CEDModeARuntime`).  One
    record at a time (the skip prefill has no padding support).  ``delta_pct``, ``kl`` and
    ``top1_pct`` carry paired bootstrap 95% intervals over records.

    Timing (``"timing"``) is kept apart from the quality figures, which it never changes:
    on a seeded sample of ``timing_records`` records (0 = all; ``None``: none, and no ``"timing"`` key),
    right after the two scoring prefills of a record (which are that prompt shape's warm-up of each arm), the two
    prefills are timed by :func:`ced_csa2.pipeline.timing.paired_seconds` (arms alternated,
    ``timing_repeats`` rounds, per-arm median).  ``plain_s``/``mode_a_s`` are the sums
    over the timed records of the per-record medians, ``speedup`` their ratio.  It is
    checked against ``bound`` = decoder-layer passes of the plain prefill / of Mode A's over
    the timed prompts (:func:`prefill_bound`: ``n_layers / split`` without ``replay`` and ``sink``,
    :class:`~ced_csa2.ced_runtime.CEDModeARuntime`'s bounded replay and exact sink); a speed-up above it is refused,
    never reported: ``speedup`` is ``None`` and ``refused`` holds the
    :class:`~ced_csa2.pipeline.timing.BoundExceeded` message (logged as an error), while the quality
    figures, which the timing cannot change, stand.

    Under a process group each rank takes a contiguous share of the records; the per-record
    sums are added up on every rank.  Each rank times the sampled records of its own share
    (the sample is drawn over all records, so the same records are timed at any world
    size) and the per-record medians are summed over the ranks; on a shared CPU the ranks
    run concurrently, so both arms are timed under the same load.  Both continuations are
    scored ``block_tokens`` positions at a time (:func:`~ced_csa2.eval.scoring.score_hidden`).

    Returns
    -------
    dict
        Not covered: ``{"covered": False, "uncovered_attention_layers", "note"}``.  Covered:
        ``{"covered": True, "prefix_fraction", "replay", "sink", "records", "baseline", "mode_a", "delta_pct",
        "delta_pct_ci95", "kl", "kl_ci95", "top1_pct", "top1_pct_ci95", "prefill_speedup_bound" (over all
        records), "note", "timing"}``
        with ``"timing"`` = ``{"records", "repeats", "plain_s", "mode_a_s", "speedup",
        "bound", "protocol"}``.
    """
    missing = plan.uncovered(geo)
    if missing:
        return {"covered": False, "uncovered_attention_layers": missing,
                "note": f"plan {plan} does not cover every attention layer above the cut; Mode A not run"}
    runtime = CEDModeARuntime(model, plan, geo, parts, replay=replay, sink=sink)
    device = next(model.parameters()).device
    plain, skip = torch.zeros(len(ids), 4, dtype=torch.float64), torch.zeros(len(ids), 4, dtype=torch.float64)
    timed = set() if timing_records is None else set(seeded_subset(len(ids), timing_records, seed,
                                                                    TIMING_SAMPLE_STREAM))
    seconds = torch.zeros(3, dtype=torch.float64)  # summed medians: plain, Mode A; records timed
    timed_lengths = torch.zeros(len(ids), dtype=torch.float64)  # prefilled tokens of each timed record
    # Both timed arms under inference mode (Mode A's prefill is decorated with it).
    timed_plain = torch.inference_mode()(plain_prefill)
    lo, hi = distributed.bounds(len(ids))
    for i in Progress(range(lo, hi), desc="mode A", unit="record", disable=not distributed.is_main()):
        row = ids[i]
        x, cut = torch.tensor([row], device=device), prompt_tokens(len(row), fraction)
        prompt, cont = x[:, :cut], x[:, cut:]
        head = prompt[:, :-1]
        caches = {"plain": plain_prefill(model, head), "mode_a": runtime.prefill(head)}
        if i in timed:  # the scoring prefills above were this shape's warm-up of both arms
            t = paired_seconds({"plain": lambda: timed_plain(model, head), "mode_a": lambda: runtime.prefill(head)},
                               timing_repeats, warmup=False, device=device)
            seconds += torch.tensor([t.seconds["plain"], t.seconds["mode_a"], 1.0], dtype=torch.float64)
            timed_lengths[i] = head.shape[1]
        keep = torch.ones_like(cont, dtype=torch.bool)
        hidden = {arm: continue_hidden(model, caches[arm], prompt, cont) for arm in ("plain", "mode_a")}
        score_hidden(model, {"plain": plain, "mode_a": skip}, i, hidden, cont, keep, block_tokens, reference="plain")
    distributed.all_reduce_sum(plain, skip, seconds, timed_lengths)
    base, ced = _ppl(plain[:, :2]), _ppl(skip[:, :2])
    delta = paired_bootstrap(skip[:, :2].numpy(), plain[:, :2].numpy(), "delta_ppl_pct", seed=seed)
    prefilled = [prompt_tokens(len(row), fraction) - 1 for row in ids]
    timed = [int(t) for t in timed_lengths.tolist() if t]
    exact = runtime.exact_tokens
    timed_bound = prefill_bound(geo, plan, replay, timed or prefilled, exact)
    out = {"covered": True, "prefix_fraction": fraction, "replay": replay, "sink": sink, "records": len(ids),
           "baseline": base, "mode_a": ced, "delta_pct": delta["value"], "delta_pct_ci95": delta["ci95"],
           **agreement(skip, seed), "prefill_speedup_bound": prefill_bound(geo, plan, replay, prefilled, exact),
           "note": mode_a_note(replay, sink)}
    if timing_records is not None:
        out["timing"] = _prefill_timing(seconds, timing_repeats, timed_bound)
    return out


def prefill_bound(geo, plan, replay: int = 0, prefilled: Sequence[int] = (), sink: int = 0) -> float:
    """Most Mode A's prefill can gain: decoder-layer x token passes of the plain prefill / of the skip.

    ``n_layers / split`` without replay and exact sink; with them the skip also runs the layers
    above the cut on the first ``sink`` (the exact sink's token) and the last ``replay`` of each
    prompt's ``prefilled`` tokens,
    so the bound is ``Σ n·T / Σ (split·T + (n - split)·min(sink + replay, T))`` over them.  Every
    decoder layer counts as the same work per token (the layers above and below the cut are
    alike on the models run here; attention's share, quadratic in T, is left out).  It leaves
    out the embedding (both arms), the maps and the cache writes of the layers above the cut
    (Mode A only), so the reachable speed-up is lower.
    """
    n, split = geo.n_layers, plan.split
    if not replay and not sink:
        return n / split
    if not prefilled:
        raise ValueError("prefill_bound: with replay or sink the bound depends on the prefilled lengths; none given")
    return sum(n * t for t in prefilled) / sum(split * t + (n - split) * min(sink + replay, t) for t in prefilled)


def mode_a_note(replay: int, sink: str) -> str:
    """What a Mode A figure approximates, for its protocol: the mapped positions, the sink, the replayed tail."""
    exact = ["the first (the attention sink)"] if sink == "exact" else []
    exact += [f"the last {replay}"] if replay else []
    note = ("Mode A: prompt tokens run through layers 1..split; attention layers above the cut get K/V from the "
            "projector/adapters")
    if sink == "mean":
        note += (" (the first position, the attention sink: constants, the mean of the training records' first "
                 "positions)")
    if not exact:
        return (f"{note}; non-attention layers above the cut start from a zero state (an approximation; none on an "
                "all-attention model).")
    return (f"{note} for all prefilled tokens but {' and '.join(exact)}, which run through every layer (their own "
            "K/V above the cut; non-attention layers above the cut build their state from these tokens only).")


def _prefill_timing(seconds: torch.Tensor, repeats: int, bound: float) -> dict:
    plain_s, mode_a_s, n = seconds.tolist()
    out = {"records": int(n), "repeats": repeats, "plain_s": plain_s, "mode_a_s": mode_a_s,
           "speedup": None, "bound": bound,
           "protocol": f"{PROTOCOL.format(repeats=repeats)}; the scoring prefill of each record is its warm-up; "
                       "seconds summed over the timed records"}
    if n:
        try:
            out["speedup"] = check_bound(plain_s / mode_a_s, bound, f"Mode A prefill speed-up over {int(n)} records",
                                         {"plain": plain_s, "mode_a": mode_a_s})
        except BoundExceeded as exc:
            # Not a result: the stage's quality figures stand, the timing is refused (on a loaded
            # machine arms of milliseconds can be timed wrong even when alternated).
            log.error("%s", exc)
            out["refused"] = str(exc)
    return out


def eval_ids(params: Params, tok, workdir: Path, domain: str | None = None) -> list[list[int]]:
    """Token ids of the eval records, truncated to ``data.max_tokens``: of ``data/corpus/eval.jsonl`` (a seeded
    sample of ``eval_ppl.records``; 0 = all), or of the other domain ``domain``'s records (``data.domains``,
    a seeded sample of ``eval_ppl.domain_records``)."""
    path = workdir / (EVAL_JSONL if domain is None else domain_jsonl(domain))
    records = read_records(path)
    n = params.eval_ppl.records if domain is None else params.eval_ppl.domain_records
    records = [records[i] for i in seeded_subset(len(records), n, params.seed, EVAL_SAMPLE_STREAM)]
    if len(records) < 2:
        raise ValueError(f"{path}: {len(records)} eval record(s); the paired intervals are bootstrapped over "
                         "records and need at least 2")
    ids = tok([r["text"] for r in records], truncation=True, max_length=params.data.max_tokens)["input_ids"]
    for rec, row in zip(records, ids):
        if len(row) < MIN_RECORD_TOKENS:
            raise ValueError(f"{path}: record {rec['id']!r} is {len(row)} token(s) long; each eval record needs at "
                             f"least {MIN_RECORD_TOKENS} (Mode A prefills a prompt of at least 2 and scores the rest)")
    return ids


def protocol(params: Params, model, plan, ids: list[list[int]], tokens_scored: int, domain: str | None = None) -> dict:
    """What a perplexity figure was measured on (stored next to it); ``domain``: the other domain's name
    (``data.domains``), ``None`` for the held-out records of ``data.name``, the domain the maps were fitted on."""
    return {
        "model": params.model.name, "data": params.data.name, "domain": domain or params.data.name,
        "fitted_on": params.data.fitted_on(),
        # whether the maps' training records include this domain's (never its evaluation records)
        "trained_on_domain": (domain or params.data.name) in ({e.domain for e in params.data.mix} or {params.data.name}), "records": len(ids), "tokens_scored": tokens_scored,
        # hub commits asked for (null: the default branch when the run fetched it)
        "model_revision": params.model.revision, "data_revision": params.data.revision,
        "max_tokens": params.data.max_tokens, "dtype": str(model.dtype).removeprefix("torch."),
        "device": str(model.device),
        "basis": "token-level, teacher-forced, corpus-level exp(sum NLL / scored tokens); Mode B substitution",
        "plan": {"split": plan.split, "source": plan.source, "targets": list(plan.targets)},
        "kv_format": params.kv_format,
    }

