"""DeepSeek-V4.1's layer modes on the retrofitted model: Full / Reindex / Reuse, top-k sparse reads, HSI.

    dvc repro studies/dvc.yaml       # runs: python studies/layer_modes.py

A training-free ablation (seed 002, seed 003 §4.3/§4.7; docs/design.md §7): every
attention layer above the cut reads its last ``window`` positions plus ``k`` selected
entries (:mod:`ced_csa2.runtime.sparse_attention`), each group assigning the layers' modes as
V4.1's ``kv_source_layer_ids`` / ``index_source_layer_ids`` do
(:class:`ced_csa2.runtime.layer_modes.LayerModes`, validated before the model loads).  The KV comes
from the maps the pipeline trained (``models/``: ``csa2``'s adapters give the targets
``adapter(KV_source)``); nothing is trained here.

Two selectors (``selectors``): the **oracle** -- each selecting layer ranks entries by its own
exact attention logits summed over its heads: what selection *could* keep -- and, as
``{group}+trained``, the **trained** lightning indexers of ``studies/indexer/layers`` (one per
sparse layer, the indexer study's ``every_layer`` variant; their keys read back from MXFP4):
what a deployable selector keeps.

Data: the held-out eval records (whole held-out articles, ``data/corpus/eval.jsonl``) in
file order, joined with blank lines and cut into consecutive ``context``-token sequences
(the first ``sequences`` of them); positions ``>= score_from`` are scored, teacher-forced.
Per group and ``k``: corpus-level PPL, ΔPPL % against ``baseline`` (dense, unchanged
model) with a paired bootstrap 95% CI over sequences, mean per-token KL(baseline ‖ group)
and top-1 agreement (the same scoring as ``eval_ppl``,
:func:`ced_csa2.eval.scoring.multi_group_nll`); entries read and entries the indexers scored
per token (summed over the sparse layers, averaged over every position of a sequence)
next to the KV bytes stored per token; the share of entries consecutive sparse layers both
select (IndexCache's question) against its chance level; and, under HSI, the share of a
Reindex layer's unrestricted top-k its pool holds.

Writes ``studies/layer_modes/metrics.json``, ``modes.md`` (the modes and results tables)
and ``quality_vs_k.png``.  Params: ``studies/layer_modes.yaml`` (the study's) and the root
``params.yaml`` (model, plan, seed, kv_format, eval_ppl.device).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import yaml

from ced_csa2.ced_runtime import CEDModeBRuntime, load_parts
from ced_csa2.config import Params, from_dict, load_params
from ced_csa2.data.joined import joined_sequences
from ced_csa2.data.records import check_prepared
from ced_csa2.eval.perplexity import agreement
from ced_csa2.eval.scoring import multi_group_nll
from ced_csa2.eval.stats import paired_deltas
from ced_csa2.kv.kv_bytes import bytes_per_token, dense_entry_bytes, kv_copies
from ced_csa2.maps.indexer import LightningIndexer, load_indexer
from ced_csa2.model_utils import Geometry, attention, load_model_and_tokenizer, resolve_device, rope_fn
from ced_csa2.pipeline.atomic_files import atomic_write_text, write_json
from ced_csa2.pipeline.figures import write_png
from ced_csa2.pipeline.map_roles import MAIN
from ced_csa2.pipeline.paths import EVAL_JSONL, MODELS
from ced_csa2.pipeline.study_runner import run_study
from ced_csa2.plan import LayerPlan, load_plan
from ced_csa2.groups import GROUPS
from ced_csa2.runtime.layer_modes import LayerModes, sparse_layers
from ced_csa2.runtime.sparse_attention import HSI, SelectionStats, SparseAttention, SparseGroup, SparseReads

STUDY_PARAMS = Path("studies/layer_modes.yaml")
OUT = Path("studies/layer_modes")
INDEXERS = Path("studies/indexer/layers")  # <layer>.pt: the trained selectors (studies/indexer.py, every_layer)
SELECTORS = ("oracle", "trained")
DENSE = ("baseline", "csa2")  # the dense references: the unchanged model, and today's csa2
BF16 = 2
log = logging.getLogger("layer_modes")


@dataclass(frozen=True)
class GroupSpec:
    kv: str  # the Mode B group whose K/V the layers read (baseline | csa2 | ced_csa2 | share_plain)
    index_source_layer_ids: dict = field(default_factory=dict)  # {layer: index source}; others select their own
    hsi: bool = False


@dataclass(frozen=True)
class Study:
    context: int
    sequences: int
    score_from: int
    window: int
    k: list[int]
    hsi: HSI
    groups: dict  # {name: GroupSpec}
    selectors: list = field(default_factory=lambda: ["oracle"])  # of SELECTORS


def load_study(path: Path = STUDY_PARAMS) -> Study:
    """The study's params, typed and checked (unknown or mistyped keys refused, naming them)."""
    raw = yaml.safe_load(path.read_text())
    groups = {name: from_dict(GroupSpec, spec or {}, f"groups.{name}") for name, spec in raw.pop("groups").items()}
    study = from_dict(Study, {**raw, "groups": {}})
    if not 0 < study.score_from < study.context or study.sequences < 1 or not study.k:
        raise ValueError(f"{path}: need 0 < score_from < context, sequences >= 1 and some k, got {raw}")
    if not study.selectors or set(study.selectors) - set(SELECTORS):
        raise ValueError(f"{path}: selectors must list some of {SELECTORS}, got {study.selectors}")
    return dataclasses.replace(study, groups=groups)


def group_modes(study: Study, plan: LayerPlan, geo: Geometry) -> dict[str, LayerModes]:
    """Every group's validated modes (a :class:`~ced_csa2.runtime.layer_modes.ModeError` names the layer)."""
    return {name: LayerModes.build(plan, geo, spec.kv, spec.index_source_layer_ids)
            for name, spec in study.groups.items()}


def _ppl(v: np.ndarray) -> dict:
    total, n = v[:, :2].sum(0)
    return {"ppl": math.exp(total / n), "nll_per_token": total / n, "tokens": int(n)}


def stored_bytes(geo: Geometry, plan: LayerPlan, kv: str) -> dict:
    """KV bytes stored per token in bf16 (:mod:`ced_csa2.kv.kv_bytes`), on both bases."""
    return {basis: bytes_per_token(kv_copies(geo, plan, GROUPS[kv], basis, BF16))
            for basis in ("decoder_attention", "all_attention")}


def selection_figures(stats: SelectionStats, modes: LayerModes, geo: Geometry, macs_per_entry: int) -> dict:
    """Per-token reads and indexer work, and the consecutive layers' shared selections, from ``stats``.

    ``macs_per_entry``: multiply-adds the selector spends on one entry (the oracle: one
    ``kv_dim``-long dot product; a lightning indexer: ``heads`` dots of its key width, plus the offset).
    """
    own = [(a, b) for a, b in stats.pairs if modes.selecting(a) and modes.selecting(b)]
    shared, chance = stats.shared_fraction(own)
    vs_source, vs_source_chance = stats.shared_fraction(of=stats.source_pairs)
    hits = sum(stats.layer[la]["pool_hits"] for la in modes.layers)
    wanted = sum(stats.layer[la]["pool_wanted"] for la in modes.layers)
    entry = dense_entry_bytes(geo.kv_dim, BF16)  # K + V of one position, one layer
    read = stats.per_token("read")
    return {
        "entries_read_per_token": read, "entries_visible_per_token": stats.per_token("visible"),
        "bytes_read_per_token_bf16": read * 2 * entry,
        "indexer_entries_per_token": stats.per_token("scored"),
        "indexer_macs_per_token": stats.per_token("scored") * macs_per_entry,
        "shared_consecutive": shared, "shared_consecutive_chance": chance,
        "shared_by_pair": {f"{a}->{b}": p["shared"] / p["picked"] for (a, b), p in stats.pairs.items() if p["picked"]},
        "reindex_shares_with_kv_source": vs_source, "reindex_shares_with_kv_source_chance": vs_source_chance,
        "hsi_pool_recall": hits / wanted if wanted else None,
    }


def run(params: Params, study: Study, workdir: Path = Path("."), *, model_and_tok=None, parts=None) -> dict:
    plan, geo = load_plan(params.plan, params.model)
    modes = group_modes(study, plan, geo)  # before any heavy work
    t0 = time.perf_counter()
    device = resolve_device(params.eval_ppl.device)
    model, tok = model_and_tok or load_model_and_tokenizer(params.model, device=device)
    parts = parts or load_parts(workdir / MODELS, params, plan, geo, role=MAIN, device=device, extra_sources=False)
    seqs = joined_sequences(tok, workdir / EVAL_JSONL, study.context, study.sequences)
    trained = {}
    if "trained" in study.selectors:
        model_id = params.model.hf_id or params.model.name
        trained = {la: load_indexer(workdir / INDEXERS / f"{la}.pt", rope_fn(attention(model, la)),
                                    expect={"model_id": model_id, "layer": la}) for la in sparse_layers(plan, geo)}
    macs = {"oracle": geo.kv_dim, "trained": _indexer_macs(next(iter(trained.values()), None))}
    # One sparse group per (group, selector, k), each counting its own selections across the sequences.
    stats: dict[str, SelectionStats] = {}
    labels: dict[str, tuple[str, int, str]] = {}
    groups: dict[str, SparseGroup] = {}
    for name, spec in study.groups.items():
        for selector in study.selectors:
            indexers = None if selector == "oracle" else {
                la: trained[la] for la in modes[name].layers if modes[name].selecting(la)}
            for k in study.k:
                label = f"{name}@k{k}" if selector == "oracle" else f"{name}+{selector}@k{k}"
                labels[label], stats[label] = (name, k, selector), SelectionStats()
                reads = SparseReads(k=k, window=study.window, hsi=study.hsi if spec.hsi else None)
                groups[label] = SparseGroup(
                    CEDModeBRuntime(model, plan, spec.kv, parts, kv_format=params.kv_format),
                    SparseAttention(model, modes[name], reads, geo, stats=stats[label], indexers=indexers))
    rows: dict[str, list[np.ndarray]] = {}
    for i, seq in enumerate(seqs):  # one sequence per call: the trunk (layers 1..split) runs once per sequence
        nll = multi_group_nll(model, plan, list(DENSE), parts, [seq], [study.score_from], 1, tok.pad_token_id,
                              kv_format=params.kv_format, agreement=True, extra=groups,
                              block_tokens=params.eval_ppl.score_block_tokens)
        for g, v in nll.items():
            rows.setdefault(g, []).append(v.numpy())
        log.info("sequence %d/%d done, %.0f s", i + 1, len(seqs), time.perf_counter() - t0)
    per_seq = {g: np.concatenate(v) for g, v in rows.items()}
    sums = {g: v[:, :2] for g, v in per_seq.items()}
    deltas = {base: paired_deltas(sums, "delta_ppl_pct", params.seed, base=base) for base in DENSE}
    results = {}
    for g, v in per_seq.items():
        name, k, selector = labels.get(g, (g, None, None))
        kv = study.groups[name].kv if name in study.groups else g
        r = {"group": name, "selector": selector, "kv": kv, "k": k, **_ppl(v),
             "stored_bytes_per_token_bf16": stored_bytes(geo, plan, kv)}
        if g != "baseline":
            r.update(delta_pct=deltas["baseline"][g]["value"], delta_pct_ci95=deltas["baseline"][g]["ci95"],
                     **agreement(torch.from_numpy(v), params.seed))
        if k is not None and kv in DENSE:  # the cost of the sparse reads alone: against the same KV read densely
            d = deltas[kv][g]
            r.update(delta_vs_dense_kv_pct=d["value"], delta_vs_dense_kv_pct_ci95=d["ci95"])
        if g in stats:
            r.update(selection_figures(stats[g], modes[name], geo, macs[selector]))
        else:  # dense: every layer reads every visible position, no indexer
            visible = (study.context + 1) / 2 * len(sparse_layers(plan, geo))
            r.update(entries_read_per_token=visible, entries_visible_per_token=visible,
                     bytes_read_per_token_bf16=visible * 2 * dense_entry_bytes(geo.kv_dim, BF16),
                     indexer_entries_per_token=0.0, indexer_macs_per_token=0.0)
        results[g] = r
    metrics = {
        "protocol": {
            "model": params.model.name, "data": params.data.name, "sequences": len(seqs), "context": study.context,
            "score_from": study.score_from, "tokens_scored": results["baseline"]["tokens"],
            "text": f"eval records ({EVAL_JSONL}) in file order joined with blank lines, cut into consecutive "
                    f"{study.context}-token sequences; positions >= {study.score_from} scored, teacher-forced",
            "plan": {"split": plan.split, "source": plan.source, "targets": list(plan.targets)},
            "sparse_layers": list(sparse_layers(plan, geo)), "window": study.window, "k": study.k,
            "hsi": dataclasses.asdict(study.hsi), "dtype": str(model.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(),
            "indexer": "oracle: the selecting layer's exact attention logits summed over its heads (one selection "
                       "per query position for all heads); trained: each selecting layer's lightning indexer "
                       f"({INDEXERS}/<layer>.pt, keys read back from MXFP4)",
            "selectors": study.selectors,
            "per_token": "entries/bytes read and indexer entries: summed over the sparse layers, averaged over every "
                         "position of a sequence; bytes stored: kv_bytes accounting, bf16",
            "command": "dvc repro studies/dvc.yaml (python studies/layer_modes.py)",
        },
        "modes": {name: {"kv": study.groups[name].kv, "hsi": study.groups[name].hsi, "compact": m.compact(),
                         "layers": m.rows()} for name, m in modes.items()},
        "groups": results,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    return metrics


def _indexer_macs(indexer: LightningIndexer | None) -> int | None:
    """Multiply-adds a lightning indexer spends per scored entry: ``heads`` dots of its key width (+ the offset)."""
    return None if indexer is None else indexer.heads * (indexer.key_width + int(indexer.has_offset))


def _name(r: dict) -> str:
    return r["group"] if r.get("selector") in (None, "oracle") else f"{r['group']} ({r['selector']})"


def _ci(r: dict, key: str, fmt: str) -> str:
    low, high = r[f"{key}_ci95"]
    return f"{r[key]:{fmt}} [{low:{fmt}}, {high:{fmt}}]"


def ordered(metrics: dict) -> list[dict]:
    """The results, dense references first, then each group's in the modes' order by k (JSON sorts keys)."""
    names = list(metrics["modes"])
    selectors = list(SELECTORS)
    return sorted(metrics["groups"].values(),
                  key=lambda r: (r["k"] is not None, DENSE.index(r["group"]) if r["k"] is None else
                                 names.index(r["group"]), selectors.index(r.get("selector") or "oracle"), r["k"] or 0))


def markdown(metrics: dict) -> str:
    """The modes table and the results tables."""
    p = metrics["protocol"]
    lines = [f"# V4.1 layer modes on the retrofitted {p['model']}", "",
             f"`{p['command']}`: {p['sequences']} sequences x {p['context']} tokens of {p['data']} "
             f"({p['text']}); {p['tokens_scored']:,} tokens scored; window {p['window']}, HSI block "
             f"{p['hsi']['block']} x {p['hsi']['pool_blocks']} blocks; {p['dtype']}, {metrics['seconds']:.0f} s.",
             f"Indexer: {p['indexer']}.", "",
             f"## Modes (sparse layers {p['sparse_layers'][0]}–{p['sparse_layers'][-1]}; F Full, X Reindex, "
             "R(i) Reuse of layer i's selection)", "",
             "| group | KV | layers | Reindex searches |", "|---|---|---|---|"]
    for name, m in metrics["modes"].items():
        search = "HSI pool" if m["hsi"] else "every visible entry"
        lines.append(f"| {name} | {m['kv']} | {m['compact']} | {search if 'X' in m['compact'] else '—'} |")
    lines += ["", "## Quality against the dense baseline (ΔPPL with a paired bootstrap 95% CI over sequences)", "",
              "| group | KV | k | PPL | ΔPPL % [95% CI] | KL nats/token [95% CI] | top-1 % | ΔPPL % vs the same KV "
              "read densely [95% CI] |", "|---|---|---|---|---|---|---|---|"]
    for r in ordered(metrics):
        k = r["k"] if r["k"] is not None else "dense"
        if "delta_pct" not in r:
            lines.append(f"| {_name(r)} | {r['kv']} | {k} | {r['ppl']:.3f} | — | — | — | — |")
            continue
        alone = _ci(r, "delta_vs_dense_kv_pct", "+.2f") if "delta_vs_dense_kv_pct" in r else "—"
        lines.append(f"| {_name(r)} | {r['kv']} | {k} | {r['ppl']:.3f} | {_ci(r, 'delta_pct', '+.2f')} | "
                     f"{_ci(r, 'kl', '.4f')} | {r['top1_pct']:.1f} | {alone} |")
    lines += ["", f"## Selection and cost ({p['per_token']}; shares: of a layer's picks, also picked by the other "
              "layer, where both choose among more than k; chance: two random k-subsets)", "",
              "| group | k | entries read/token | indexer entries/token | indexer MACs/token | stored B/token "
              "(decoder attn., bf16) | consecutive layers share (chance) | Reindex shares with its KV source (chance) "
              "| HSI pool recall |", "|---|---|---|---|---|---|---|---|---|"]

    def share(r: dict, key: str) -> str:
        return f"{r[key]:.2f} ({r[key + '_chance']:.2f})" if r.get(key) is not None else "—"

    for r in ordered(metrics):
        recall = f"{r['hsi_pool_recall']:.2f}" if r.get("hsi_pool_recall") is not None else "—"
        lines.append(f"| {_name(r)} | {r['k'] if r['k'] is not None else 'dense'} | "
                     f"{r['entries_read_per_token']:,.0f} | {r['indexer_entries_per_token']:,.0f} | "
                     f"{r['indexer_macs_per_token']:,.0f} | "
                     f"{r['stored_bytes_per_token_bf16']['decoder_attention']:,.0f} | "
                     f"{share(r, 'shared_consecutive')} | {share(r, 'reindex_shares_with_kv_source')} | {recall} |")
    return "\n".join(lines) + "\n"


def plot(metrics: dict, path: Path) -> None:
    """ΔPPL %, KL and top-1 against k, one line per sparse group, the dense csa2 as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = metrics["groups"]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    names = list(metrics["modes"])
    for i, name in enumerate(names):
        for selector in metrics["protocol"].get("selectors", ["oracle"]):
            rows = sorted((r for r in groups.values() if r["group"] == name and r.get("selector", "oracle") == selector),
                          key=lambda r: r["k"])
            ks, label = [r["k"] for r in rows], name if selector == "oracle" else f"{name} ({selector})"
            style = {"color": f"C{i}", "linestyle": "-" if selector == "oracle" else "--"}
            axes[0].errorbar(ks, [r["delta_pct"] for r in rows], marker="o", capsize=3, label=label, **style,
                             yerr=[[r["delta_pct"] - r["delta_pct_ci95"][0] for r in rows],
                                   [r["delta_pct_ci95"][1] - r["delta_pct"] for r in rows]])
            axes[1].plot(ks, [r["kl"] for r in rows], marker="o", label=label, **style)
            axes[2].plot(ks, [r["top1_pct"] for r in rows], marker="o", label=label, **style)
    dense = groups["csa2"]
    for ax, key, base in zip(axes, ("delta_pct", "kl", "top1_pct"), (0.0, 0.0, 100.0)):
        ax.axhline(dense[key], color="gray", linestyle="--", label="csa2, dense")
        ax.axhline(base, color="black", linewidth=0.8, linestyle=":", label="baseline, dense")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"k (plus a window of {metrics['protocol']['window']})")
        ax.legend(fontsize=7)
    axes[0].set_ylabel("ΔPPL % vs dense baseline [95% CI]")
    axes[1].set_ylabel("KL(baseline ‖ group), nats/token")
    axes[2].set_ylabel("top-1 agreement with baseline, %")
    p = metrics["protocol"]
    fig.suptitle(f"V4.1 layer modes, {' and '.join(p.get('selectors', ['oracle']))} selection: {p['model']}, {p['sequences']} x {p['context']} tokens, "
                 f"positions >= {p['score_from']} scored")
    write_png(fig, path)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    params = load_params(Path("params.yaml"))
    check_prepared(params, Path("."), EVAL_JSONL)
    metrics = run(params, load_study())
    write_json(OUT / "metrics.json", metrics)
    atomic_write_text(OUT / "modes.md", markdown(metrics))
    plot(metrics, OUT / "quality_vs_k.png")
    log.info("done in %.0f s:\n%s", metrics["seconds"], markdown(metrics))


if __name__ == "__main__":
    run_study(main)
