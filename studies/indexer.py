"""A trained lightning indexer for CSA2's source layer: how well it finds what the oracle would read.

    dvc repro studies/dvc.yaml       # runs: python studies/indexer.py

The sparse decode (:mod:`ced_csa2.runtime.sparse_decode`) reads, at each step, the local
window plus the top-``k`` older entries its selector picks.  The layer-modes study's
selector is an oracle (the layer's own attention logits, summed over heads), which needs
every position's full post-RoPE keys; V4.1's lightning indexer scores narrow keys it keeps
itself (:mod:`ced_csa2.maps.indexer`).  This study trains one for the plan's source layer on
the frozen model's attention over the training records (KL to the head-averaged attention
over the entries older than the window, :func:`ced_csa2.train.indexer_training.fit`) and
measures, on the layer-modes study's held-out sequences:

* held-out KL before (random init, or the oracle start) and after training;
* recall@k: the share of the oracle's top-``k`` (among the entries older than the window)
  the indexer's top-``k`` holds, per ``k`` -- the goal is >= 0.9 at 128;
* recall@k against the attention's own top-``k`` (head-averaged): the selection that keeps
  the most attention, and what the indexer is trained to imitate -- the logit-sum oracle is
  scored against it too, since the two rankings differ;
* mass@k: the share of the layer's attention over those entries that the top-``k`` holds
  (what a sparse read keeps), beside the oracle's own and the attention top-``k``'s (the most
  any selection keeps);
* what it costs: parameters, training tokens and wall time, key bytes per token (MXFP4)
  against the KV bytes per token the shared store holds;

for each variant of ``studies/indexer.yaml``: V4.1's one narrow key and keys as wide as the
layer's, from a random start; and the oracle's own algebra as a start (queries summed per KV
head, the layer's keys, an offset inside the ReLU), keys stored plain (V4.1) or
Hadamard-rotated (V4).  Every indexer is scored with its keys read back from MXFP4, as the
sparse decode stores them.

Every figure is computed from the saved checkpoint (FP16 weights) reloaded, so it is what
the sparse decode gets.  Writes ``studies/indexer/{variant}.pt``, ``metrics.json``
and ``indexer.md``.  Params: ``studies/indexer.yaml`` and the root ``params.yaml`` (model, plan, seed).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml

from ced_csa2.config import from_dict, load_params, provenance
from ced_csa2.data.joined import joined_sequences
from ced_csa2.data.records import check_prepared
from ced_csa2.kv.kv_bytes import bytes_per_token, kv_copies
from ced_csa2.maps.indexer import IndexerConfig, key_bytes, load_indexer, save_indexer
from ced_csa2.model_utils import attention, load_model_and_tokenizer, rope_fn
from ced_csa2.pipeline.atomic_files import atomic_write_text, write_json
from ced_csa2.pipeline.paths import EVAL_JSONL, TRAIN_JSONL
from ced_csa2.pipeline.study_runner import run_study
from ced_csa2.plan import load_plan
from ced_csa2.groups import GROUPS
from ced_csa2.runtime.layer_modes import sparse_layers
from ced_csa2.train import indexer_training as it

STUDY_PARAMS = Path("studies/indexer.yaml")
OUT = Path("studies/indexer")
log = logging.getLogger("indexer")


@dataclass(frozen=True)
class Sequences:
    context: int
    sequences: int
    rows: int
    first_row: int


@dataclass(frozen=True)
class Study:
    train: Sequences
    held_out: Sequences
    window: int
    k: list[int]
    variants: dict  # {name: IndexerConfig}
    every_layer: str | None = None  # a variant also trained for every sparse layer (the layer-modes study's)


def load_study(path: Path = STUDY_PARAMS) -> Study:
    """The study's params, typed and checked (unknown or mistyped keys refused, naming them)."""
    raw = yaml.safe_load(path.read_text())
    variants = {name: from_dict(IndexerConfig, spec or {}, f"variants.{name}") for name, spec in raw.pop("variants").items()}
    study = dataclasses.replace(from_dict(Study, {**raw, "variants": {}}), variants=variants)
    for name in ("train", "held_out"):
        s = getattr(study, name)
        if not 0 <= s.first_row < s.context - study.window or min(s.sequences, s.rows) < 1:
            raise ValueError(f"{path}: {name} needs 0 <= first_row < context - window and sequences, rows >= 1; "
                             f"got {s} with window {study.window}")
    if not study.k or min(study.k) < 1:
        raise ValueError(f"{path}: k must list values >= 1, got {study.k}")
    if study.every_layer is not None and study.every_layer not in study.variants:
        raise ValueError(f"{path}: every_layer names variant {study.every_layer!r}, not one of {sorted(study.variants)}")
    return study


def _fit_and_score(model, params, study: Study, layer: int, indexer, cfg: IndexerConfig, train, held,
                   path: Path) -> dict:
    """Start (offsets for an oracle start), score, train, save to ``path``, reload and score again."""
    model_id = params.model.hf_id or params.model.name
    if cfg.init == "attention":
        it.lift_offsets(indexer, train, study.window)
    before = {"kl": it.held_out_kl(indexer, held, study.window), **it.selection(indexer, held, study.k, study.window)}
    t_fit = time.perf_counter()
    losses = it.fit(indexer, train, cfg, study.window, params.seed)
    fit_seconds = time.perf_counter() - t_fit
    save_indexer(path, indexer, {"model_id": model_id, "layer": layer, "seed": params.seed,
                                 "provenance": provenance(params, "seed", "model", "plan"),
                                 "recipe": dataclasses.asdict(cfg)})
    saved = load_indexer(path, rope_fn(attention(model, layer)), expect={"model_id": model_id, "layer": layer})
    after = {"kl": it.held_out_kl(saved, held, study.window), **it.selection(saved, held, study.k, study.window)}
    log.info("layer %d, %s: held-out KL %.3f -> %.3f, recall %s -> %s, %.0f s", layer, path.name, before["kl"],
             after["kl"], before["recall"], after["recall"], fit_seconds)
    return {"recipe": dataclasses.asdict(cfg), "before": before, "after": after,
            "train_loss": {"first_10": float(np.mean(losses[:10])), "last_10": float(np.mean(losses[-10:]))},
            "parameters": sum(p.numel() for p in saved.parameters()), "fit_seconds": fit_seconds,
            "key_width": saved.key_width, "key_bytes_per_token": key_bytes(saved.key_width)}


def run(params, study: Study, workdir: Path = Path("."), *, model_and_tok=None) -> dict:
    plan, geo = load_plan(params.plan, params.model)
    layer = plan.source
    every = sparse_layers(plan, geo) if study.every_layer is not None else ()
    t0 = time.perf_counter()
    model, tok = model_and_tok or load_model_and_tokenizer(params.model)
    # Every indexer built first: a recipe the model cannot take (an oracle start on gated attention) is
    # refused before the samples are drawn.
    indexers = {name: it.new_indexer(model, geo, layer, cfg, params.seed) for name, cfg in study.variants.items()}
    per_layer = {la: it.new_indexer(model, geo, la, study.variants[study.every_layer], params.seed) for la in every}
    train_seqs = joined_sequences(tok, workdir / TRAIN_JSONL, study.train.context, study.train.sequences)
    held_seqs = joined_sequences(tok, workdir / EVAL_JSONL, study.held_out.context, study.held_out.sequences)
    layers = sorted({layer, *every})  # one pass samples them all (the same rows for every layer)
    train = it.attention_samples(model, geo, layers, train_seqs, study.train.rows, study.train.first_row,
                                 seed=params.seed)
    held = it.attention_samples(model, geo, layers, held_seqs, study.held_out.rows, study.held_out.first_row, seed=None)
    results = {name: _fit_and_score(model, params, study, layer, indexers[name], cfg, train[layer], held[layer],
                                    workdir / OUT / f"{name}.pt") for name, cfg in study.variants.items()}
    every_layer = {}
    for la in every:
        every_layer[la] = _fit_and_score(model, params, study, la, per_layer[la], study.variants[study.every_layer],
                                         train[la], held[la], workdir / OUT / "layers" / f"{la}.pt")
        every_layer[la]["oracle_mass"] = it.selection(None, held[la], study.k, study.window)["mass"]
        every_layer[la]["attention_top_k_mass"] = it.selection(None, held[la], study.k, study.window,
                                                               by_attention=True)["mass"]
    return {
        "protocol": {
            "model": params.model.hf_id or params.model.name, "layer": layer, "window": study.window, "k": study.k,
            "dtype": "float32 (trained in fp32; saved in fp16 and scored from the saved file, keys through MXFP4)",
            "oracle": "the layer's attention logits summed over its heads",
            "attention_top_k": "the top-k of the layer's head-averaged attention itself: the most attention any "
                               "selection keeps, and what the indexer is trained to imitate",
            "mass": "share of the layer's head-averaged attention over the entries older than the window "
                    "that the top-k holds (mean over query rows)",
            "train": {**dataclasses.asdict(study.train), "data": str(TRAIN_JSONL),
                      "query_rows": int(train[layer].rows.numel()),
                      "tokens": study.train.context * study.train.sequences},
            "held_out": {**dataclasses.asdict(study.held_out), "data": str(EVAL_JSONL),
                         "query_rows": int(held[layer].rows.numel())},
            "every_layer": study.every_layer},
        "oracle": it.selection(None, held[layer], study.k, study.window),
        "attention_top_k": it.selection(None, held[layer], study.k, study.window, by_attention=True),
        "variants": results,
        "every_layer": every_layer,
        "csa2_kv_bytes_per_token_bf16_all_attention": bytes_per_token(kv_copies(geo, plan, GROUPS["csa2"],
                                                                                "all_attention", 2)),
        "seconds": time.perf_counter() - t0,
    }


def markdown(m: dict) -> str:
    p, ks = m["protocol"], m["protocol"]["k"]
    lines = [f"Lightning indexers for layer {p['layer']} of {p['model']}, trained on {p['train']['tokens']:,} tokens "
             f"({p['train']['sequences']} x {p['train']['context']} of {p['train']['data']}, "
             f"{p['train']['query_rows']:,} query rows); held-out: {p['held_out']['sequences']} x "
             f"{p['held_out']['context']} tokens of {p['held_out']['data']}, {p['held_out']['query_rows']} query rows "
             f"at positions >= {p['held_out']['first_row']}. Recall@k: share of the oracle's top-k ({p['oracle']}) "
             f"among the entries older than the {p['window']}-position window; recall@k (attn): the same against "
             f"the attention top-k ({p['attention_top_k']}); mass@k: {p['mass']}. {p['dtype']}.",
             "",
             "| indexer | start | key bytes/token | parameters | fit s | held-out KL | "
             + " | ".join(f"recall@{k}" for k in ks) + " | " + " | ".join(f"recall@{k} (attn)" for k in ks) + " | "
             + " | ".join(f"mass@{k}" for k in ks) + " |",
             "|---|---|---|---|---|---|" + "---|" * 3 * len(ks)]

    def cells(r: dict) -> str:
        return (" | ".join(f"{r['recall'][k]:.3f}" for k in ks) + " | "
                + " | ".join(f"{r['recall_attention'][k]:.3f}" for k in ks) + " | "
                + " | ".join(f"{r['mass'][k]:.4f}" for k in ks) + " |")
    lines += [f"| oracle (logit sum) | – | – | – | – | – | {cells(m['oracle'])}",
              f"| attention top-k | – | – | – | – | – | {cells(m['attention_top_k'])}"]
    for name, v in m["variants"].items():
        for when in ("before", "after"):
            r = v[when]
            anchor = f", anchor {v['recipe']['anchor']:g}" if v["recipe"]["anchor"] else ""
            start = v["recipe"]["init"] if when == "before" else f"trained{anchor}"
            lines.append(f"| {name} | {start} | {v['key_bytes_per_token']} | {v['parameters']:,} | "
                         + (f"{v['fit_seconds']:.0f}" if when == "after" else "") + f" | {r['kl']:.3f} | {cells(r)}")
    if m["every_layer"]:
        lines += ["", f"`{p['every_layer']}` trained for every sparse layer (`studies/indexer/layers/<layer>.pt`: the "
                  "layer-modes study's trained selection); after training, against each layer's oracle and attention "
                  "top-k:", "",
                  "| layer | held-out KL start → trained | " + " | ".join(f"recall@{k}" for k in ks) + " | "
                  + " | ".join(f"recall@{k} (attn)" for k in ks) + " | "
                  + " | ".join(f"mass@{k} (oracle / attention top-k)" for k in ks) + " |",
                  "|---|---|" + "---|" * 3 * len(ks)]
        for la, v in m["every_layer"].items():
            a = v["after"]
            lines.append(f"| {la} | {v['before']['kl']:.3f} → {a['kl']:.3f} | "
                         + " | ".join(f"{a['recall'][k]:.3f}" for k in ks) + " | "
                         + " | ".join(f"{a['recall_attention'][k]:.3f}" for k in ks) + " | "
                         + " | ".join(f"{a['mass'][k]:.4f} ({v['oracle_mass'][k]:.4f} / "
                                      f"{v['attention_top_k_mass'][k]:.4f})" for k in ks) + " |")
    lines += ["", f"The csa2 cache holds {m['csa2_kv_bytes_per_token_bf16_all_attention']:,g} bytes of K/V per token "
              "(bf16, every attention layer); an indexer adds its key bytes per token."]
    return "\n".join(lines) + "\n"


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.manual_seed(0)
    params = load_params(Path("params.yaml"))
    check_prepared(params, Path("."), TRAIN_JSONL, EVAL_JSONL)
    metrics = run(params, load_study())
    write_json(OUT / "metrics.json", metrics)
    atomic_write_text(OUT / "indexer.md", markdown(metrics))
    log.info("done in %.0f s:\n%s", metrics["seconds"], markdown(metrics))


if __name__ == "__main__":
    run_study(main)
