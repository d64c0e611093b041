"""What the sparse CSA2 decode costs in quality, scored through the decode path itself.

    dvc repro studies/dvc.yaml       # runs: python studies/sparse_decode.py

:class:`ced_csa2.runtime.sparse_decode.SparseSharedKVCache` reads, at each decode step, the
local window plus the top-``k`` older entries (the oracle's, or a trained lightning
indexer's: ``studies/indexer``).  The layer-modes study scores selection teacher-forced in
one pass; this one runs the cache as generation does: per held-out sequence it prefills
the first ``prefill`` tokens (densely, as every cache does), then feeds the gold tokens one
at a time for ``steps`` decode steps and scores each step's next-token prediction.  Caches
(each its own pass over the same tokens):

* ``baseline`` -- the unchanged model with transformers' ``DynamicCache``;
* ``csa2`` -- the dense shared store (:class:`~ced_csa2.runtime.shared_kv.SharedKVCache`,
  the trained adapters): what the sparse reads approximate (both built by
  :func:`~ced_csa2.eval.generation.group_cache`, as the ``eval_generation`` stage builds them);
* ``csa2 sparse oracle@k`` and ``csa2 sparse {indexer}@k`` -- the sparse decode.

Per cache: PPL over the scored steps, ΔPPL % against ``baseline`` and against the dense
``csa2`` (paired bootstrap 95% CI over sequences), mean per-step KL(baseline ‖ cache) and
KL(csa2 ‖ cache), top-1 agreement with the baseline, and the K/V bytes per position at the
last step, averaged over sequences (:func:`~ced_csa2.runtime.shared_kv.cache_bytes`, indexer keys
and the targets' kept entries included): *used* (the entries written, what the accounting predicts)
and *allocated* (the tensors holding them, the bytes the cache holds: a store's reserve included).  Data:
the eval records joined in file order (``data/corpus/eval.jsonl``), the first ``sequences``
``context``-token pieces.  Model dtype: the root params' (float32 on the embedded default).

Writes ``studies/sparse_decode/metrics.json``, ``decode.md`` and ``quality_vs_k.png``.
Params: ``studies/sparse_decode.yaml`` and the root ``params.yaml``.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml

from ced_csa2.ced_runtime import load_parts
from ced_csa2.config import from_dict, load_params
from ced_csa2.data.joined import joined_sequences
from ced_csa2.data.records import check_prepared
from ced_csa2.eval.generation import group_cache
from ced_csa2.eval.stats import paired_bootstrap
from ced_csa2.maps.indexer import load_indexer
from ced_csa2.model_utils import attention, load_model_and_tokenizer, resolve_device, rope_fn
from ced_csa2.pipeline.atomic_files import atomic_write_text, write_json
from ced_csa2.pipeline.figures import write_png
from ced_csa2.pipeline.map_roles import MAIN
from ced_csa2.pipeline.paths import EVAL_JSONL, MODELS
from ced_csa2.pipeline.progress import Progress
from ced_csa2.pipeline.study_runner import run_study
from ced_csa2.plan import load_plan
from ced_csa2.runtime.shared_kv import cache_bytes
from ced_csa2.runtime.sparse_decode import SparseDecode, SparseSharedKVCache

STUDY_PARAMS = Path("studies/sparse_decode.yaml")
OUT = Path("studies/sparse_decode")
INDEXERS = Path("studies/indexer")
log = logging.getLogger("sparse_decode")


@dataclass(frozen=True)
class Study:
    context: int
    sequences: int
    prefill: int
    steps: int
    window: int
    k: list[int]
    indexers: list[str]


def load_study(path: Path = STUDY_PARAMS) -> Study:
    """The study's params, typed and checked (unknown or mistyped keys refused, naming them)."""
    study = from_dict(Study, yaml.safe_load(path.read_text()))
    if not 0 < study.prefill < study.prefill + study.steps <= study.context or study.sequences < 1 or not study.k:
        raise ValueError(f"{path}: need 0 < prefill, prefill + steps <= context, sequences >= 1 and some k; got {study}")
    if max(study.k) + study.window >= study.prefill:
        raise ValueError(f"{path}: k + window must stay below prefill ({study.prefill}) or the reads cover the "
                         f"context (the dense step); got k up to {max(study.k)}, window {study.window}")
    return study


@torch.inference_mode()
def teacher_forced(model, cache, feed, ids: torch.Tensor, prefill: int, steps: int) -> torch.Tensor:
    """Log-probabilities ``(steps, vocab)`` of tokens ``prefill + 1 ..`` from one decode step each (after the prefill)."""
    out = []
    with feed(cache):
        model(input_ids=ids[:, :prefill], cache=cache, use_cache=True, logits_to_keep=1)
        for t in range(prefill, prefill + steps):
            logits = model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits[0, -1]
            out.append(logits.float().log_softmax(-1))
    return torch.stack(out)


def run(params, study: Study, workdir: Path = Path("."), *, model_and_tok=None, parts=None, indexers=None) -> dict:
    plan, geo = load_plan(params.plan, params.model)
    t0 = time.perf_counter()
    device = resolve_device(params.eval_ppl.device)
    model, tok = model_and_tok or load_model_and_tokenizer(params.model, device=device)
    parts = parts or load_parts(workdir / MODELS, params, plan, geo, role=MAIN, device=device, extra_sources=False)
    if indexers is None:
        rope, model_id = rope_fn(attention(model, plan.source)), params.model.hf_id or params.model.name
        indexers = {name: load_indexer(workdir / INDEXERS / f"{name}.pt", rope,
                                       expect={"model_id": model_id, "layer": plan.source}) for name in study.indexers}
    seqs = joined_sequences(tok, workdir / EVAL_JSONL, study.context, study.sequences)

    def shared(cache):
        return cache.feed()

    def plain(cache):
        return contextlib.nullcontext()

    # The groups' own caches as the eval_generation stage builds them (group_cache); the sparse ones below are
    # this study's (no registry group reads sparsely).
    caches = {"baseline": (lambda: group_cache(model, plan, "baseline", parts, None).cache, plain),
              "csa2": (lambda: group_cache(model, plan, "csa2", parts, None).cache, shared)}
    for k in study.k:
        reads = SparseDecode(k=k, window=study.window)
        caches[f"csa2 sparse oracle@{k}"] = (lambda r=reads: SparseSharedKVCache(model, plan, "csa2", parts, reads=r),
                                             shared)
        for name, ix in indexers.items():
            caches[f"csa2 sparse {name}@{k}"] = (
                lambda r=reads, ix=ix: SparseSharedKVCache(model, plan, "csa2", parts, reads=r, indexer=ix), shared)
    nll = {g: [] for g in caches}
    kl = {g: {"baseline": [], "csa2": []} for g in caches}
    top1 = {g: [] for g in caches}
    used = {g: [] for g in caches}
    allocated = {g: [] for g in caches}
    for seq in Progress(seqs, desc="sparse decode", unit="seq"):
        ids = torch.tensor([seq], device=device)
        gold = ids[0, study.prefill + 1:study.prefill + study.steps + 1]
        logp = {}
        for g, (make, feed) in caches.items():
            cache = make()
            logp[g] = teacher_forced(model, cache, feed, ids, study.prefill, study.steps)[:len(gold)]
            nbytes, positions = cache_bytes(cache), cache.get_seq_length()
            used[g].append(nbytes.used / positions)
            allocated[g].append(nbytes.allocated / positions)
        for g, lp in logp.items():
            nll[g].append([-lp.gather(1, gold[:, None]).sum().item(), len(gold)])
            for ref in ("baseline", "csa2"):
                p = logp[ref]
                kl[g][ref].append((p.exp() * (p - lp)).sum(-1).mean().item())
            top1[g].append((lp.argmax(-1) == logp["baseline"].argmax(-1)).float().mean().item())
        log.info("sequence done, %.0f s", time.perf_counter() - t0)
    rows = {}
    for g in caches:
        v = np.array(nll[g])
        rows[g] = {"ppl": float(np.exp(v[:, 0].sum() / v[:, 1].sum())),
                   "kl_vs_baseline": float(np.mean(kl[g]["baseline"])), "kl_vs_csa2": float(np.mean(kl[g]["csa2"])),
                   "top1_vs_baseline_pct": 100 * float(np.mean(top1[g])),
                   "used_bytes_per_position": float(np.mean(used[g])),
                   "allocated_bytes_per_position": float(np.mean(allocated[g]))}
        for ref in ("baseline", "csa2"):
            if g != ref:
                d = paired_bootstrap(v, np.array(nll[ref]), "delta_ppl_pct", seed=params.seed)
                rows[g][f"delta_pct_vs_{ref}"], rows[g][f"delta_pct_vs_{ref}_ci95"] = d["value"], d["ci95"]
    return {"protocol": {"model": params.model.hf_id or params.model.name, "dtype": str(next(model.parameters()).dtype),
                         "data": str(EVAL_JSONL), "context": study.context, "sequences": study.sequences,
                         "prefill": study.prefill, "steps": study.steps, "scored_tokens": int(np.array(nll["baseline"])[:, 1].sum()),
                         "window": study.window, "k": study.k, "plan": {"source": plan.source, "targets": list(plan.targets)},
                         "ci": "paired bootstrap over sequences, 95%"},
            "groups": rows, "seconds": time.perf_counter() - t0}


def markdown(m: dict) -> str:
    p = m["protocol"]
    lines = [f"Sparse CSA2 decode, teacher-forced through the cache: {p['model']} ({p['dtype']}), {p['sequences']} "
             f"sequences of {p['data']} joined, {p['prefill']} tokens prefilled, {p['steps']} decode steps scored each "
             f"({p['scored_tokens']} tokens); window {p['window']}; CIs: {p['ci']}.",
             "",
             "| cache | PPL | ΔPPL % vs baseline | ΔPPL % vs dense csa2 | KL vs baseline | KL vs csa2 | top-1 % | "
             "bytes/position used | allocated |",
             "|---|---|---|---|---|---|---|---|---|"]

    def delta(r, ref):
        if f"delta_pct_vs_{ref}" not in r:
            return "—"
        lo, hi = r[f"delta_pct_vs_{ref}_ci95"]
        return f"{r[f'delta_pct_vs_{ref}']:+.2f} [{lo:+.2f}, {hi:+.2f}]"

    for g, r in m["groups"].items():
        lines.append(f"| {g} | {r['ppl']:.3f} | {delta(r, 'baseline')} | {delta(r, 'csa2')} | {r['kl_vs_baseline']:.4f} | "
                     f"{r['kl_vs_csa2']:.4f} | {r['top1_vs_baseline_pct']:.1f} | {r['used_bytes_per_position']:,.0f} | "
                     f"{r['allocated_bytes_per_position']:,.0f} |")
    return "\n".join(lines) + "\n"


def plot(m: dict, path: Path) -> None:
    """ΔPPL % vs the dense csa2 and KL(csa2 ‖ ·) against k, one line per selector."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    selectors = sorted({g.split()[-1].split("@")[0] for g in m["groups"] if "@" in g})
    for sel in selectors:
        rows = [(int(g.split("@")[1]), r) for g, r in m["groups"].items() if g.startswith(f"csa2 sparse {sel}@")]
        rows.sort()
        ks = [k for k, _ in rows]
        d = [r["delta_pct_vs_csa2"] for _, r in rows]
        err = [[r["delta_pct_vs_csa2"] - r["delta_pct_vs_csa2_ci95"][0] for _, r in rows],
               [r["delta_pct_vs_csa2_ci95"][1] - r["delta_pct_vs_csa2"] for _, r in rows]]
        axes[0].errorbar(ks, d, yerr=err, marker="o", capsize=3, label=sel)
        axes[1].plot(ks, [r["kl_vs_csa2"] for _, r in rows], marker="o", label=sel)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel(f"k (plus a window of {m['protocol']['window']})")
        ax.axhline(0.0, color="black", linewidth=0.8, linestyle=":")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("ΔPPL % vs the dense csa2 store [95% CI]")
    axes[1].set_ylabel("KL(dense csa2 ‖ sparse), nats/token")
    p = m["protocol"]
    fig.suptitle(f"Sparse CSA2 decode: {p['model']}, {p['sequences']} x {p['steps']} decode steps after "
                 f"{p['prefill']} tokens")
    write_png(fig, path)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    params = load_params(Path("params.yaml"))
    check_prepared(params, Path("."), EVAL_JSONL)
    metrics = run(params, load_study())
    write_json(OUT / "metrics.json", metrics)
    atomic_write_text(OUT / "decode.md", markdown(metrics))
    plot(metrics, OUT / "quality_vs_k.png")
    log.info("done in %.0f s:\n%s", metrics["seconds"], markdown(metrics))


if __name__ == "__main__":
    run_study(main)
