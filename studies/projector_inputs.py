"""What a CED projector gains from more of what the model has computed at the cut.

    dvc repro studies/dvc.yaml       # runs: python studies/projector_inputs.py

The seed's projector reads ``H_split`` alone.  At the cut the model has computed more, for free:
the attention input of layer ``split`` (its pre-attention RMSNorm of ``H_{split-1}``, what
``q_proj``/``k_proj``/``v_proj`` read) and that layer's own K/V (``k_proj``/``v_proj``
outputs, pre-k_norm and pre-RoPE; layer 16 of Qwen3.5-4B is a full-attention layer, every layer
of SmolLM2 is).  Mode A can read them too: all are computed below the cut.  For each input set
of ``studies/projector_inputs.yaml`` a closed-form ridge map ``[inputs] -> [K_source ‖ V_source]``
(``ridge.lambda``, unpenalised bias, float64 statistics: :class:`~ced_csa2.maps.ridge.RidgeAccumulator`)
is fitted on the same rows -- every position of ``records`` train records (the online objectives'
records, :func:`~ced_csa2.train.objectives.online_records`) -- and reported with:

* held-out R² of K and V (:class:`~ced_csa2.maps.fit_metrics.FitStats`) on the online held-out records;
* its prefill cost: multiply-adds per token and what must be kept from the cut to the source layer
  (nothing more is stored per token in the cache);
* ``ced`` scored as ``eval_ppl`` scores it (its records, shared trunk, paired bootstrap 95%
  intervals against one baseline pass), as the pipeline serves it (``sink: none``) and with the
  attention sink's constants (``sink: mean``, ``studies/sink.py``).

Writes ``studies/projector_inputs/inputs.tsv`` and ``inputs.md``.  Params:
``studies/projector_inputs.yaml`` and the root ``params.yaml``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from torch import nn

from ced_csa2 import kv_hooks
from ced_csa2.ced_runtime import CEDModeBRuntime, CEDParts, load_sink
from ced_csa2.config import from_dict, load_params
from ced_csa2.data.records import batches, check_prepared
from ced_csa2.eval.perplexity import eval_ids, groups_ppl
from ced_csa2.maps.fit_metrics import FitStats
from ced_csa2.maps.ridge import RidgeAccumulator
from ced_csa2.model_utils import attention, load_model_and_tokenizer, resolve_device
from ced_csa2.pipeline.atomic_files import atomic_write_text, write_tsv
from ced_csa2.pipeline.checkpoint import check_meta_provenance, expected_meta
from ced_csa2.pipeline.map_roles import MODE_A
from ced_csa2.pipeline.paths import EVAL_JSONL, MODE_A_SINK, TRAIN_JSONL
from ced_csa2.pipeline.progress import Progress
from ced_csa2.pipeline.study_runner import run_study
from ced_csa2.plan import load_plan
from ced_csa2.runtime.sink import SinkGroup
from ced_csa2.train.objectives import online_records

STUDY_PARAMS = Path("studies/projector_inputs.yaml")
OUT = Path("studies/projector_inputs")
# What each input is; "h_split" is the seed's and must come first in every set.
PARTS = {"h_split": "H_split (the seed's input)",
         "attn_in": "layer split's attention input (its pre-attention RMSNorm of H_split-1)",
         "kv_split": "layer split's own K ‖ V (pre-k_norm, pre-RoPE)"}
log = logging.getLogger("projector_inputs")


@dataclass(frozen=True)
class Study:
    inputs: list[list[str]]  # each a set of PARTS, H_split first
    records: int  # train records the maps are fitted on (every position of each)
    batch_size: int


def load_study(path: Path = STUDY_PARAMS) -> Study:
    """The study's params, typed and checked (unknown or mistyped keys refused, naming them)."""
    study = from_dict(Study, yaml.safe_load(path.read_text()))
    if not study.inputs:
        raise ValueError(f"{path}: inputs must list at least one input set")
    for i, parts in enumerate(study.inputs):
        if not parts or parts[0] != "h_split" or len(set(parts)) != len(parts) or not set(parts) <= set(PARTS):
            raise ValueError(f"{path}: inputs[{i}] must start with h_split and name distinct parts of "
                             f"{list(PARTS)}, got {parts}")
    if study.records < 1 or study.batch_size < 1:
        raise ValueError(f"{path}: records and batch_size must be >= 1, got {study.records} and {study.batch_size}")
    return study


def label(parts: list[str]) -> str:
    return "+".join(parts)


def part_widths(geo) -> dict[str, int]:
    return {"h_split": geo.hidden_size, "attn_in": geo.hidden_size, "kv_split": 2 * geo.kv_dim}


@contextmanager
def cut_features(model, split: int) -> Iterator[dict]:
    """Hooks that keep, at each forward, layer ``split``'s attention input and its K ‖ V (``(B, T, ·)``).

    Yields ``{"attn_in": ..., "kv_split": ...}``, refilled by every forward that runs layer
    ``split`` (the shared trunk's, when scoring); hooks always removed.
    """
    attn, store, got = attention(model, split), {}, {}

    def keep(name):
        return lambda mod, inp, out: got.__setitem__(name, out)

    def join(mod, inp, out):  # v_proj runs after k_proj: the layer's K ‖ V are both here
        store["kv_split"] = torch.cat([got.pop("k"), out], dim=-1)

    with ExitStack() as stack:
        for handle in (attn.q_proj.register_forward_hook(lambda mod, inp, out: store.__setitem__("attn_in", inp[0])),
                       attn.k_proj.register_forward_hook(keep("k")), attn.v_proj.register_forward_hook(join)):
            stack.callback(handle.remove)
        yield store


class CutProjector(nn.Module):
    """``ced``'s projector reading ``H_split`` and, through :func:`cut_features`, the cut's extras.

    ``forward(h)`` ``(B, T, hidden)`` -> ``(k, v)``, each ``(B, T, kv_dim)``: ``[h ‖ extras] @ W + b``
    with ``W`` ``(d_in, 2 kv_dim)`` and ``b`` the ridge map's.
    """

    def __init__(self, W: torch.Tensor, b: torch.Tensor, kv_dim: int, parts: list[str], features: dict):
        super().__init__()
        self.proj = nn.Linear(W.shape[0], W.shape[1])
        with torch.no_grad():
            self.proj.weight.copy_(W.T)
            self.proj.bias.copy_(b)
        self.kv_dim, self.parts, self.features = kv_dim, parts, features

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([h, *(self.features[p] for p in self.parts[1:])], dim=-1)
        k, v = self.proj(x).split(self.kv_dim, dim=-1)
        return k, v


def batch_rows(model, plan, rows: list[list[int]], batch_size: int, pad_id: int, desc: str
               ) -> Iterator[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """Per batch of ``rows``: every part of :data:`PARTS` and the source's ``K ‖ V`` at its real positions ``(n, ·)``.

    Each forward stops before the layer after the source (nothing above it is needed).
    """
    device = next(model.parameters()).device
    stop = plan.source + 1 if plan.source < len(model.model.layers) else None
    for ids, mask in Progress(batches(rows, batch_size, pad_id, device), desc=desc, unit="batch"):
        with torch.no_grad(), cut_features(model, plan.split) as cut, \
                kv_hooks.capture(model, kv_layers=[plan.source], hidden_layers=[plan.split]) as kv, \
                kv_hooks.layer_calls(model, stop=stop):
            try:
                model.model(input_ids=ids, attention_mask=mask)
            except kv_hooks.StopLayers:
                pass
        real = mask.bool()
        parts = {"h_split": kv["h"][plan.split][real], **{p: cut[p][real] for p in ("attn_in", "kv_split")}}
        yield parts, torch.cat([kv["k"][plan.source], kv["v"][plan.source]], dim=-1)[real]


def fit_maps(model, plan, geo, study: Study, rows, val_rows, lam: float, pad_id: int) -> dict[str, dict]:
    """The ridge map of each input set on ``rows`` and its held-out K and V fit on ``val_rows``."""
    widths = part_widths(geo)
    acc = {label(p): RidgeAccumulator(sum(widths[x] for x in p), 2 * geo.kv_dim, label(p)) for p in study.inputs}
    for parts, y in batch_rows(model, plan, rows, study.batch_size, pad_id, "features (fit)"):
        for p in study.inputs:
            acc[label(p)].update(torch.cat([parts[x] for x in p], dim=-1), y)
    maps = {}
    for p in study.inputs:
        W, b = acc[label(p)].solve(lam)
        maps[label(p)] = {"W": W.float(), "b": b.float(), "rows": acc[label(p)].n, "fit": {"k": FitStats(), "v": FitStats()}}
    for parts, y in batch_rows(model, plan, val_rows, study.batch_size, pad_id, "features (held out)"):
        for p in study.inputs:
            m = maps[label(p)]
            pred = torch.cat([parts[x] for x in p], dim=-1) @ m["W"] + m["b"]
            for i, kind in enumerate("kv"):
                half = slice(i * geo.kv_dim, (i + 1) * geo.kv_dim)
                m["fit"][kind].update(pred[:, half], y[:, half])
    return maps


def table(rows: list[dict], params) -> str:
    """``inputs.md``: per input set its cost, held-out fit and ``ced`` ΔPPL % [95% CI] without and with the sink."""
    lines = [f"CED projector inputs for layer {rows[0]['source']} (cut after layer {rows[0]['split']}) on "
             f"{params.model.name} ({params.model.dtype}): ridge maps on {rows[0]['fit_rows']:,} rows, "
             f"{rows[0]['eval_records']} eval records, {rows[0]['tokens']:,} scored tokens; not a Qwen3.5-4B result.",
             "", "| inputs | input width | MACs / prefill token | held-out R² K / V | ced ΔPPL % (sink: none) | "
             "ced ΔPPL % (sink: mean) |", "|---|---:|---:|---|---|---|"]
    for r in (r for r in rows if r["sink"] == "none"):
        kept = next(x for x in rows if x["sink"] == "mean" and x["inputs"] == r["inputs"])
        lines.append(f"| {r['inputs']} | {r['input_width']:,} | {r['macs_per_token']:,} | {r['r2_k']:.4f} / "
                     f"{r['r2_v']:.4f} | {r['dppl_pct']:+.2f} [{r['dppl_ci_low']:+.2f}, {r['dppl_ci_high']:+.2f}] | "
                     f"{kept['dppl_pct']:+.2f} [{kept['dppl_ci_low']:+.2f}, {kept['dppl_ci_high']:+.2f}] |")
    lines += ["", "Parts: " + "; ".join(f"`{k}`: {v}" for k, v in PARTS.items()) + ". Every part is computed below "
              "the cut, so Mode A can read it too; what the projector reads is held from the cut to the source "
              "layer, nothing more is stored per token."]
    return "\n".join(lines) + "\n"


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    params = load_params(Path("params.yaml"))
    check_prepared(params, Path("."), TRAIN_JSONL, EVAL_JSONL)
    study = load_study()
    plan, geo = load_plan(params.plan, params.model)
    model, tok = load_model_and_tokenizer(params.model, device=resolve_device(params.eval_ppl.device))
    model.requires_grad_(False)
    attention(model, plan.split)  # a clear error when the cut's layer has no softmax attention (no K/V there)
    constants, meta = load_sink(MODE_A_SINK, expected_meta(params, plan, geo)["sink"])
    check_meta_provenance(MODE_A_SINK, meta, params, MODE_A)
    rows, val_rows = online_records(params, tok, Path("."), study.records)
    t0 = time.perf_counter()
    maps = fit_maps(model, plan, geo, study, rows, val_rows, params.ridge.lam, tok.pad_token_id)
    log.info("%d input sets fitted in %.0f s", len(maps), time.perf_counter() - t0)
    ids = eval_ids(params, tok, Path("."))
    with cut_features(model, plan.split) as features:
        arms = {}
        for p in study.inputs:
            parts = CEDParts(projector=CutProjector(maps[label(p)]["W"], maps[label(p)]["b"], geo.kv_dim, p, features))
            plain, kept = (CEDModeBRuntime(model, plan, "ced", parts, kv_format=params.kv_format) for _ in range(2))
            arms[f"{label(p)}/none"], arms[f"{label(p)}/mean"] = plain, SinkGroup(kept, "mean", constants)
        scores = groups_ppl(model, plan, ["baseline"], None, ids, params, tok.pad_token_id, extra=arms)
    widths, out = part_widths(geo), []
    for p in study.inputs:
        m, width = maps[label(p)], sum(widths[x] for x in p)
        for sink in ("none", "mean"):
            s = scores[f"{label(p)}/{sink}"]
            log.info("%s, sink %s: ΔPPL %+.2f%% [%+.2f, %+.2f]", label(p), sink, s["delta_pct"], *s["delta_pct_ci95"])
            out.append({"inputs": label(p), "sink": sink, "split": plan.split, "source": plan.source,
                        "input_width": width, "macs_per_token": width * 2 * geo.kv_dim, "fit_rows": m["rows"],
                        "r2_k": m["fit"]["k"].result()["r2"], "r2_v": m["fit"]["v"].result()["r2"],
                        "dppl_pct": s["delta_pct"], "dppl_ci_low": s["delta_pct_ci95"][0],
                        "dppl_ci_high": s["delta_pct_ci95"][1], "kl": s["kl"], "top1_pct": s["top1_pct"],
                        "eval_records": len(ids), "tokens": s["tokens"]})
    write_tsv(OUT / "inputs.tsv", out)
    atomic_write_text(OUT / "inputs.md", table(out, params))


if __name__ == "__main__":
    run_study(main)
