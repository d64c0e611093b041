"""KV formats beyond NVFP4's per-token blocks: per-channel keys, more bits for K (FP6), rotation as a switch.

    dvc repro studies/dvc.yaml       # runs: python studies/kv_formats.py

Every attention layer's K and V, at the injection point (pre-k_norm, pre-RoPE), is read back
from a block-scaled format (:class:`ced_csa2.kv.formats.KVFormat`, one :class:`~ced_csa2.kv.formats.StreamFormat`
per stream) while the model scores the pipeline's held-out eval records, teacher-forced, as
``eval_ppl`` scores ``baseline_fp4``.  The formats (``studies/kv_formats.yaml``) vary what a
block scale runs along (a token's channels, as NVFP4; or a channel's tokens, as KIVI quantises
keys), its width, the element's scale type, and the per-head Hadamard rotation.  Nothing is
trained.

Per format: corpus-level PPL, ΔPPL % against the unchanged model and against ``nvfp4_rot``
(the pipeline's best 4-bit group, ``baseline_fp4_rot``) with paired bootstrap 95% intervals
over records, KL(baseline ‖ format) and top-1 agreement with theirs, and the stored bytes per
token (every attention layer, exact: :meth:`~ced_csa2.kv.formats.KVFormat.bytes_per_token`)
with the compression against bf16.  ``nvfp4`` and ``nvfp4_rot`` are the pipeline's
``baseline_fp4`` / ``baseline_fp4_rot`` round trips bit for bit (tests/kv/test_formats.py); here
each record runs alone (batch 1: a per-channel block must not take a padding token's key into its
scale), so their figures can differ from ``eval_ppl``'s (batch 8) in float32's last digits.

Teacher forcing reads every key from its full block; a decode cache keeps the newest, unfilled
block in full precision (KIVI's residual), so the token-axis rows are the pessimistic side for
the queries inside a block (:mod:`ced_csa2.kv.formats`).

Writes ``studies/kv_formats/metrics.json``, ``formats.md`` and ``bytes_vs_ppl.png``.  Params:
``studies/kv_formats.yaml`` and the root ``params.yaml`` (model, eval records, seed, eval_ppl).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from ced_csa2.config import Params, from_dict, load_params
from ced_csa2.data.records import check_prepared
from ced_csa2.eval.perplexity import agreement, eval_ids
from ced_csa2.eval.scoring import multi_group_nll
from ced_csa2.eval.stats import paired_deltas
from ced_csa2.kv.formats import KVFormat, StreamFormat
from ced_csa2.model_utils import geometry, load_model_and_tokenizer, qwen3_5_4b_config, resolve_device
from ced_csa2.pipeline.atomic_files import atomic_write_text, write_json
from ced_csa2.pipeline.figures import write_png
from ced_csa2.pipeline.paths import EVAL_JSONL
from ced_csa2.pipeline.study_runner import run_study
from ced_csa2.plan import load_plan
from ced_csa2.runtime.format_runtime import FormatRuntime

STUDY_PARAMS = Path("studies/kv_formats.yaml")
OUT = Path("studies/kv_formats")
QWEN = geometry(qwen3_5_4b_config())  # the full profile's geometry: its formats' bytes by accounting
REFERENCE = "nvfp4_rot"  # the pipeline's best 4-bit group (baseline_fp4_rot): every row is also paired against it
log = logging.getLogger("kv_formats")


@dataclass(frozen=True)
class Streams:
    k: StreamFormat
    v: StreamFormat


def load_study(path: Path = STUDY_PARAMS) -> dict[str, KVFormat]:
    """The formats by name, typed and checked (unknown or mistyped keys refused, naming them)."""
    raw = yaml.safe_load(path.read_text())
    if not isinstance(raw, dict) or set(raw) != {"formats"} or not isinstance(raw["formats"], dict):
        raise ValueError(f"{path}: expected one mapping 'formats: {{name: {{k: ..., v: ...}}}}'")
    formats = {}
    for name, spec in raw["formats"].items():
        try:
            s = from_dict(Streams, spec, f"formats.{name}")
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: {exc}") from None
        formats[name] = KVFormat(s.k, s.v)
    if REFERENCE not in formats:
        raise ValueError(f"{path}: the rows are paired against {REFERENCE!r}, which is not among {list(formats)}")
    return formats


def _ppl(sums: np.ndarray) -> float:
    """Corpus-level perplexity of per-record ``(summed NLL, tokens)`` rows."""
    return float(np.exp(sums[:, 0].sum() / sums[:, 1].sum()))


def run(params: Params, formats: dict[str, KVFormat], workdir: Path = Path("."), *, model_and_tok=None) -> dict:
    plan, _ = load_plan(params.plan, params.model)
    t0 = time.perf_counter()
    model, tok = model_and_tok or load_model_and_tokenizer(params.model, device=resolve_device(params.eval_ppl.device))
    geo = geometry(model.config)
    for name, fmt in formats.items():  # a format that does not fit the model's widths: refused before scoring
        fmt.bytes_per_token(geo.kv_dim, geo.head_dim)
        fmt.bytes_per_token(QWEN.kv_dim, QWEN.head_dim)
    ids = eval_ids(params, tok, workdir)
    extra = {name: FormatRuntime(model, fmt, geo.attention_layers, geo.head_dim) for name, fmt in formats.items()}
    # batch 1: a block along tokens must see only its record's keys (padding would enter its scale)
    nll = multi_group_nll(model, plan, ["baseline"], None, ids, [0] * len(ids), 1, tok.pad_token_id,
                          kv_format=params.kv_format, agreement=True, extra=extra,
                          block_tokens=params.eval_ppl.score_block_tokens)
    sums = {g: v[:, :2].numpy() for g, v in nll.items()}
    deltas = {base: paired_deltas(sums, "delta_ppl_pct", params.seed, base=base) for base in ("baseline", REFERENCE)}
    bf16 = 2 * 2 * geo.kv_dim * len(geo.attention_layers)
    rows = {"baseline": {"ppl": _ppl(sums["baseline"]), "bytes_per_token": bf16, "compression": 1.0}}
    for name, fmt in formats.items():
        v = nll[name]
        stored = fmt.bytes_per_token(geo.kv_dim, geo.head_dim) * len(geo.attention_layers)
        r = {"k": dataclasses.asdict(fmt.k), "v": dataclasses.asdict(fmt.v), "ppl": _ppl(sums[name]),
             "bytes_per_token": stored, "compression": bf16 / stored,
             "qwen3_5_4b_compression": 2 * 2 * QWEN.kv_dim / fmt.bytes_per_token(QWEN.kv_dim, QWEN.head_dim),
             "delta_pct": deltas["baseline"][name]["value"], "delta_pct_ci95": deltas["baseline"][name]["ci95"],
             **agreement(v, params.seed)}
        if name != REFERENCE:
            d = deltas[REFERENCE][name]
            r.update(delta_vs_reference_pct=d["value"], delta_vs_reference_pct_ci95=d["ci95"])
        rows[name] = r
        log.info("%s: ΔPPL %+.2f%% [%+.2f, %+.2f], %.2fx", name, r["delta_pct"], *r["delta_pct_ci95"], r["compression"])
    return {
        "protocol": {
            "model": params.model.name, "data": params.data.name, "records": len(ids),
            "tokens_scored": int(nll["baseline"][:, 1].sum()), "dtype": str(model.dtype).removeprefix("torch."),
            "text": "the pipeline's held-out eval records (eval_ppl's), every token after the first scored, "
                    "teacher-forced, one record per forward",
            "where": "every attention layer's K and V at k_proj/v_proj (pre-k_norm, pre-RoPE), read back from the format",
            "bytes": f"stored K+V bytes per token over the {len(geo.attention_layers)} attention layers "
                     "(elements and scale bytes; token-axis scales per token of whole blocks); bf16 for the baseline",
            "intervals": "paired bootstrap 95% over records (seed params.seed)", "reference": REFERENCE,
            "qwen3_5_4b": "compression against bf16 by accounting alone on Qwen3.5-4B's geometry (4 KV heads of 256, "
                          "RoPE on the first 64 channels of each): no quality measured there",
            "command": "dvc repro studies/dvc.yaml (python studies/kv_formats.py)",
        },
        "formats": rows,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def _stream(s: dict) -> str:
    exact = f" +{s['exact']} exact" if s.get("exact") else ""
    return (f"{s['element']} {s['group']} {'tokens' if s['axis'] == 'tokens' else 'ch'}"
            f"{' rot' if s['rotate'] else ''}{exact}")


def markdown(m: dict) -> str:
    p = m["protocol"]
    lines = [f"Block-scaled KV formats (4- and 6-bit elements) on {p['model']} ({p['dtype']}): {p['records']} eval records, {p['tokens_scored']:,} "
             f"scored tokens; {p['where']}. {p['intervals']}; not a Qwen3.5-4B result.", "",
             f"| format | K | V | bytes/token | compression | Qwen3.5-4B compression | ΔPPL % [95% CI] | "
             f"vs {p['reference']} [95% CI] | KL nats/token | top-1 % |", "|---|---|---|---:|---:|---:|---|---|---:|---:|"]
    for name, r in m["formats"].items():
        if name == "baseline":
            lines.append(f"| baseline (bf16) | | | {r['bytes_per_token']:,g} | 1.00× | 1.00× | – | – | – | – |")
            continue
        lo, hi = r["delta_pct_ci95"]
        ref = ("–" if "delta_vs_reference_pct" not in r else
               "{:+.2f} [{:+.2f}, {:+.2f}]".format(r["delta_vs_reference_pct"], *r["delta_vs_reference_pct_ci95"]))
        lines.append(f"| {name} | {_stream(r['k'])} | {_stream(r['v'])} | {r['bytes_per_token']:,g} | "
                     f"{r['compression']:.2f}× | {r['qwen3_5_4b_compression']:.2f}× | "
                     f"{r['delta_pct']:+.2f} [{lo:+.2f}, {hi:+.2f}] | {ref} | "
                     f"{r['kl']:.4f} | {r['top1_pct']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(m: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(n, r) for n, r in m["formats"].items() if n != "baseline"]
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (name, r) in enumerate(rows, 1):
        lo, hi = r["delta_pct_ci95"]
        ax.errorbar(r["bytes_per_token"], r["delta_pct"], yerr=[[r["delta_pct"] - lo], [hi - r["delta_pct"]]],
                    marker="o", capsize=3, color="#4c72b0")
        ax.annotate(str(i), (r["bytes_per_token"], r["delta_pct"]), textcoords="offset points", xytext=(5, 2),
                    fontsize=7)
    ax.set_xlabel("stored K+V bytes per token (every attention layer)")
    ax.set_ylabel("ΔPPL % vs baseline [95% CI]")
    # numbers on the points, names in the key: labels never overlap
    ax.text(1.02, 1.0, "\n".join(f"{i} {n}" for i, (n, _) in enumerate(rows, 1)), transform=ax.transAxes, va="top",
            fontsize=7, family="monospace")
    p = m["protocol"]
    ax.set_title(f"KV formats (4-/6-bit): {p['model']}, {p['records']} records (not Qwen3.5-4B)", fontsize=9)
    write_png(fig, path)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    params = load_params(Path("params.yaml"))
    check_prepared(params, Path("."), EVAL_JSONL)
    metrics = run(params, load_study())
    write_json(OUT / "metrics.json", metrics)
    atomic_write_text(OUT / "formats.md", markdown(metrics))
    plot(metrics, OUT / "bytes_vs_ppl.png")
    log.info("done in %.0f s:\n%s", metrics["seconds"], markdown(metrics))


if __name__ == "__main__":
    run_study(main)
