"""Long-context retrieval: does the compressed cache still find a passkey hidden in filler text?

    dvc repro studies/dvc.yaml       # runs: python studies/retrieval.py  (and, stage retrieval_paired:
                                     #   --params studies/retrieval_paired.yaml --out studies/retrieval_paired)

Every quality figure of the pipeline is next-token PPL/KL on short records; sharing K/V
across layers and reading only a selection of it are what a retrieval test at length would
break.  Per length of ``studies/retrieval.yaml`` this study builds ``records`` seeded passkey
prompts (:mod:`ced_csa2.eval.retrieval`: the filler is the held-out corpus joined, the
needle at stratified depths) and scores, per record, whether greedy decoding returns the key:

* the Mode B groups of ``groups`` (the trained maps of ``models/``), teacher-forced in one
  forward each under the group's runtime;
* CSA2's sparse decode (:class:`~ced_csa2.runtime.sparse_decode.SparseSharedKVCache`) with
  the oracle selector and each trained indexer of ``sparse.indexers`` (``studies/indexer``):
  the prompt prefilled densely, then the answer decoded step by step, each step's targets
  reading the newest ``window`` entries and the source's top-``k``;
* the layer-mode groups of ``sparse.layer_modes`` (as ``studies/layer_modes.yaml`` defines
  them): every attention layer above the cut reads its window plus the oracle's top-``k``,
  prompt included, teacher-forced like the Mode B groups.

The baseline alone is also scored at ``baseline_lengths`` (where the unchanged model still
retrieves: the study's lengths are chosen below that).  Per group and length: accuracy with
its Wilson 95% interval, and the change in points against the baseline on the same records
(paired bootstrap over records; :func:`~ced_csa2.eval.retrieval.accuracy_row`, as the pipeline's
``eval_retrieval`` stage reports it) beside the exact McNemar test of the same pairs (:func:`mcnemar`).
``records`` is sized so that this paired change can tell a
5-point loss from none (``studies/retrieval.yaml``).  Model dtype: the root params' (float32 on the default).

Writes ``metrics.json``, ``retrieval.md`` and ``accuracy_vs_length.png`` into ``--out``
(``studies/retrieval``).  Params: ``--params`` (``studies/retrieval.yaml``) and the root
``params.yaml``; a params file without a ``sparse`` section runs no sparse arms and needs no indexers.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from scipy.stats import binomtest

from ced_csa2.ced_runtime import CEDModeBRuntime, load_parts
from ced_csa2.config import ParamsError, from_dict, load_params
from ced_csa2.data.records import check_prepared, read_records
from ced_csa2.eval import retrieval
from ced_csa2.maps.indexer import load_indexer
from ced_csa2.model_utils import attention, load_model_and_tokenizer, resolve_device, rope_fn
from ced_csa2.pipeline.atomic_files import atomic_write_text, write_json
from ced_csa2.pipeline.cli import ArgumentParser
from ced_csa2.pipeline.figures import write_png
from ced_csa2.pipeline.map_roles import MAIN
from ced_csa2.pipeline.paths import EVAL_JSONL, MODELS
from ced_csa2.pipeline.progress import Progress
from ced_csa2.pipeline.study_runner import run_study
from ced_csa2.plan import load_plan
from ced_csa2.groups import GROUP_NAMES, LOW_RANK_GROUPS
from ced_csa2.runtime.layer_modes import LayerModes
from ced_csa2.runtime.sparse_attention import SparseAttention, SparseGroup, SparseReads
from ced_csa2.runtime.sparse_decode import SparseDecode, SparseSharedKVCache

STUDY_PARAMS = Path("studies/retrieval.yaml")
OUT = Path("studies/retrieval")
INDEXERS = Path("studies/indexer")
log = logging.getLogger("retrieval")


@dataclass(frozen=True)
class LayerModeGroup:
    kv: str  # the Mode B group whose K/V the layers read (baseline | csa2 | ced_csa2 | share_plain)
    index_source_layer_ids: dict = field(default_factory=dict)  # {layer: index source}; others select their own


@dataclass(frozen=True)
class Sparse:
    window: int
    k: int
    indexers: list[str]
    layer_modes: dict  # {name: LayerModeGroup}


@dataclass(frozen=True)
class Study:
    lengths: list[int]
    baseline_lengths: list[int]
    records: int
    digits: int
    batch_size: int
    groups: list[str]
    sparse: Sparse | None = None  # None: no sparse arms (no oracle, indexers or layer modes)


def load_study(path: Path = STUDY_PARAMS) -> Study:
    """The study's params, typed and checked (unknown or mistyped keys refused, naming the file and key)."""
    raw = yaml.safe_load(path.read_text()) or {}
    sparse = raw.pop("sparse", None)
    try:
        study = from_dict(Study, raw)
        if sparse is not None:
            specs = {name: from_dict(LayerModeGroup, spec or {}, f"sparse.layer_modes.{name}")
                     for name, spec in (sparse.get("layer_modes") or {}).items()}
            study = dataclasses.replace(study, sparse=dataclasses.replace(
                from_dict(Sparse, {**sparse, "layer_modes": {}}, "sparse"), layer_modes=specs))
    except ParamsError as e:
        raise ParamsError(f"{path}: {e}") from None
    unknown = sorted(set(study.groups) - set(GROUP_NAMES))
    if unknown or "baseline" not in study.groups:
        raise ValueError(f"{path}: groups must include baseline and name Mode B groups ({', '.join(GROUP_NAMES)}); "
                         f"got unknown {unknown}" if unknown else f"{path}: groups must include baseline")
    if study.records < 1 or not study.lengths or study.batch_size < 1 or not 1 <= study.digits <= 9:
        raise ValueError(f"{path}: need records >= 1, some lengths, batch_size >= 1 and 1..9 digits; got {study}")
    if study.sparse is not None and study.sparse.k + study.sparse.window >= min(study.lengths):
        raise ValueError(f"{path}: sparse k + window ({study.sparse.k + study.sparse.window}) must stay below the "
                         f"shortest length ({min(study.lengths)}), or the reads cover the context")
    return study


def mcnemar(hits: list[bool], base: list[bool]) -> dict:
    """Exact McNemar test of a group's hits against the baseline's on the same records.

    Under no difference, each discordant record is equally likely either way, so ``b`` (the
    baseline retrieved, the group did not) of the ``b + c`` discordant records is
    Binomial(``b + c``, 1/2); the p-value is that binomial's two-sided exact tail (McNemar 1947;
    the exact form: Fagerland, Lydersen & Laake 2013, BMC Med. Res. Methodol. 13:91).

    Parameters
    ----------
    hits, base
        Per record (length ``n``, the same records in the same order): retrieved by the group, by the baseline.

    Returns
    -------
    dict
        ``b``, ``c`` (discordant counts) and ``p_value`` (1.0 without discordant records).
    """
    if len(hits) != len(base):
        raise ValueError(f"mcnemar: {len(hits)} records against a baseline of {len(base)}; pair the same records")
    b = sum(1 for h, r in zip(hits, base) if r and not h)
    c = sum(1 for h, r in zip(hits, base) if h and not r)
    return {"b": b, "c": c, "p_value": binomtest(b, b + c, 0.5).pvalue if b + c else 1.0}


def sparse_label(selector: str, reads: Sparse) -> str:
    return f"csa2 sparse {selector}@{reads.k}"


def layer_mode_groups(model, plan, geo, parts, study: Study, kv_format) -> dict[str, SparseGroup]:
    """Per layer-mode group of ``sparse.layer_modes``: its runtime, the oracle selecting ``k`` beside the window."""
    if study.sparse is None:
        return {}
    reads = SparseReads(k=study.sparse.k, window=study.sparse.window)
    out = {}
    for name, spec in study.sparse.layer_modes.items():
        modes = LayerModes.build(plan, geo, spec.kv, spec.index_source_layer_ids)
        out[f"{name} oracle@{reads.k}"] = SparseGroup(CEDModeBRuntime(model, plan, spec.kv, parts, kv_format=kv_format),
                                                      SparseAttention(model, modes, reads, geo))
    return out


def run(params, study: Study, workdir: Path = Path("."), *, model_and_tok=None, parts=None, indexers=None) -> dict:
    plan, geo = load_plan(params.plan, params.model)
    t0 = time.perf_counter()
    device = resolve_device(params.eval_ppl.device)
    model, tok = model_and_tok or load_model_and_tokenizer(params.model, device=device)
    parts = parts or load_parts(workdir / MODELS, params, plan, geo, role=MAIN, device=device, extra_sources=False,
                                low_rank=any(g in LOW_RANK_GROUPS for g in study.groups))
    if indexers is None:
        indexer_names = study.sparse.indexers if study.sparse else []
        rope, model_id = rope_fn(attention(model, plan.source)), params.model.hf_id or params.model.name
        indexers = {name: load_indexer(workdir / INDEXERS / f"{name}.pt", rope,
                                       expect={"model_id": model_id, "layer": plan.source})
                    for name in indexer_names}
    filler = tok("\n\n".join(r["text"] for r in read_records(workdir / EVAL_JSONL)), add_special_tokens=False)["input_ids"]
    reads = SparseDecode(k=study.sparse.k, window=study.sparse.window) if study.sparse else None
    selectors = {"oracle": None, **indexers} if study.sparse else {}
    sparse_groups = layer_mode_groups(model, plan, geo, parts, study, params.kv_format)

    hits: dict[int, dict[str, list[bool]]] = {}
    seconds: dict[int, dict[str, float]] = {}
    for length in sorted({*study.lengths, *study.baseline_lengths}):
        records = retrieval.passkey_prompts(tok, filler, length, study.records, params.seed, study.digits)
        groups = study.groups if length in study.lengths else ["baseline"]
        hits[length], seconds[length] = {}, {}
        runtimes = {g: CEDModeBRuntime(model, plan, g, parts, kv_format=params.kv_format) for g in groups}
        if length in study.lengths:
            runtimes |= sparse_groups
        for g, runtime in Progress(runtimes.items(), desc=f"retrieval @{length}", unit="group"):
            t = time.perf_counter()
            with runtime:
                hits[length][g] = retrieval.forward_hits(model, records, study.batch_size)
            seconds[length][g] = time.perf_counter() - t
            log.info("%d tokens, %s: %d/%d retrieved, %.0f s", length, g, sum(hits[length][g]), len(records),
                     seconds[length][g])
        if length not in study.lengths:
            continue
        for name, ix in selectors.items():
            label, t = sparse_label(name, study.sparse), time.perf_counter()
            hits[length][label] = retrieval.decode_hits(
                model, lambda ix=ix: SparseSharedKVCache(model, plan, "csa2", parts, reads=reads, indexer=ix), records)
            seconds[length][label] = time.perf_counter() - t
            log.info("%d tokens, %s: %d/%d retrieved, %.0f s", length, label, sum(hits[length][label]), len(records),
                     seconds[length][label])

    rows: dict[str, dict[int, dict]] = {}
    for length, by_group in hits.items():
        for g, h in by_group.items():
            base = None if g == "baseline" else by_group["baseline"]
            rows.setdefault(g, {})[length] = {**retrieval.accuracy_row(h, base, params.seed),
                                              **({"mcnemar": mcnemar(h, base)} if base else {}),
                                              "seconds": round(seconds[length][g], 1)}
    return {"protocol": {"model": params.model.hf_id or params.model.name, "dtype": str(model.dtype).removeprefix("torch."),
                         "task": "passkey retrieval (Mohtashami & Jaggi 2023): instruction, filler with one needle "
                                 "sentence, question; retrieved = greedy decoding returns every answer token "
                                 "(checked teacher-forced)",
                         "template": {"intro": retrieval.INTRO, "needle": retrieval.NEEDLE,
                                      "question": retrieval.QUESTION, "answer": retrieval.ANSWER},
                         "filler": f"{EVAL_JSONL} records joined with blank lines, a seeded offset per record",
                         "records_per_length": study.records, "digits": study.digits, "seed": params.seed,
                         "depth": "stratified: record i's needle inside the i-th of n equal slices of the filler",
                         "lengths": study.lengths, "baseline_lengths": study.baseline_lengths,
                         "sparse": None if study.sparse is None else {
                                    "window": reads.window, "k": reads.k, "selectors": list(selectors),
                                    "path": "prompt prefilled densely, answer decoded one step at a time",
                                    "layer_modes": {n: dataclasses.asdict(s) for n, s in study.sparse.layer_modes.items()},
                                    "layer_modes_path": "every attention layer above the cut reads its window and the "
                                                        "oracle's top-k (its own attention logits), prompt included, "
                                                        "teacher-forced"},
                         "plan": {"source": plan.source, "targets": list(plan.targets)}, "kv_format": params.kv_format,
                         "ci": "accuracy: Wilson 95%; change vs baseline: paired bootstrap over records, 95%",
                         "test": "exact McNemar vs baseline on the same records: b = baseline retrieved and the "
                                 "group not, c = the reverse, two-sided binomial p on b + c"},
            "groups": {g: {str(k): v for k, v in sorted(by_len.items())} for g, by_len in rows.items()},
            "seconds": round(time.perf_counter() - t0, 1)}


def _cell(r: dict | None) -> str:
    if r is None:
        return "—"
    lo, hi = r["accuracy_ci95"]
    cell = f"{r['accuracy_pct']:.0f} [{lo:.0f}, {hi:.0f}]"
    if "delta_points" in r:
        dlo, dhi = r["delta_points_ci95"]
        cell += f" ({r['delta_points']:+.0f} [{dlo:+.0f}, {dhi:+.0f}]"
        t = r.get("mcnemar")
        cell += f"; b {t['b']}, c {t['c']}, p {t['p_value']:.2g})" if t else ")"
    return cell


def markdown(m: dict) -> str:
    p = m["protocol"]
    lengths = sorted({int(k) for rows in m["groups"].values() for k in rows})
    lines = [f"Passkey retrieval: {p['model']} ({p['dtype']}), {p['records_per_length']} seeded records per length, "
             f"{p['digits']}-digit keys in {p['filler']}; {p['task']}. Cells: accuracy % [Wilson 95%] "
             f"(points vs baseline [paired bootstrap 95%]; exact McNemar: b records the baseline retrieved and "
             f"the group did not, c the reverse, two-sided p)."
             + (f" Sparse decode: window {p['sparse']['window']}, top-{p['sparse']['k']} of the source's selection "
                f"({p['sparse']['path']})." if p["sparse"] else ""),
             "",
             "| group | " + " | ".join(f"{n:,} tokens" for n in lengths) + " |",
             "|---|" + "---|" * len(lengths)]
    for g, rows in m["groups"].items():
        lines.append(f"| {g} | " + " | ".join(_cell(rows.get(str(n))) for n in lengths) + " |")
    return "\n".join(lines) + "\n"


def plot(m: dict, path: Path) -> None:
    """Accuracy against prompt length, one line per group, Wilson intervals as bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    groups = list(m["groups"])
    for i, (g, rows) in enumerate(m["groups"].items()):
        # a small horizontal offset per group keeps overlapping intervals readable
        xs = [int(n) * 2 ** (0.03 * (i - len(groups) / 2)) for n in rows]
        acc = [r["accuracy_pct"] for r in rows.values()]
        err = [[r["accuracy_pct"] - r["accuracy_ci95"][0] for r in rows.values()],
               [r["accuracy_ci95"][1] - r["accuracy_pct"] for r in rows.values()]]
        ax.errorbar(xs, acc, yerr=err, marker="o", capsize=3, label=g,
                    linestyle="--" if "sparse" in g else "-", linewidth=2.5 if g == "baseline" else 1.2)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt length, tokens")
    ax.set_ylabel("passkey retrieved, % [Wilson 95%]")
    ax.set_ylim(-2, 102)
    ax.legend(fontsize=7, ncol=2)
    p = m["protocol"]
    ax.set_title(f"Passkey retrieval: {p['model']}, {p['records_per_length']} records per length")
    write_png(fig, path)


def arguments() -> ArgumentParser:
    ap = ArgumentParser(prog="python studies/retrieval.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=Path, default=STUDY_PARAMS, help="the study's params (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=OUT, help="folder of metrics.json, retrieval.md, the plot "
                                                          "(default: %(default)s)")
    return ap


def main(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    params = load_params(Path("params.yaml"))
    check_prepared(params, Path("."), EVAL_JSONL)
    study = load_study(args.params)  # before the model loads: a bad params file ends in one line
    metrics = run(params, study)
    write_json(args.out / "metrics.json", metrics)
    atomic_write_text(args.out / "retrieval.md", markdown(metrics))
    plot(metrics, args.out / "accuracy_vs_length.png")
    log.info("done in %.0f s:\n%s", metrics["seconds"], markdown(metrics))


if __name__ == "__main__":
    run_study(main, arguments())
