"""How much an online objective gains from more training records, with and without the attention sink.

    dvc repro studies/dvc.yaml       # runs: python studies/online_records.py

The ``attn_out`` branch (``tune@attn_out``) trains on ``train.online.records`` records (64 in the
CPU budget: 16 steps per phase).  Here the same branch -- same recipe, same seed, same phases
from the ridge start (:func:`ced_csa2.train.tuning.train_branch`) -- is trained at each record
count of ``studies/online_records.yaml`` (one epoch: the steps grow with the records), and its
``ced``, ``csa2`` and ``ced_csa2`` are scored on ``eval_ppl``'s records with its protocol
(teacher-forced, one shared trunk, paired bootstrap 95% intervals over records against one
baseline pass), each as the pipeline scores it (``sink: none``) and with the first position's
K/V kept as ``tune_mode_a``'s constants (``sink: mean``, :class:`~ced_csa2.runtime.sink.SinkGroup`;
``studies/sink.py`` measures why).  The row at 64 records is the pipeline's own branch.

Writes ``studies/online_records/records.tsv`` (one row per record count, group and sink: ΔPPL,
KL, top-1, the phase's held-out KL after training and steps, the branch's seconds: three phases, held-out checks) and ``records.md``.
Params: ``studies/online_records.yaml`` and the root ``params.yaml``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from ced_csa2.ced_runtime import CEDModeBRuntime, load_sink
from ced_csa2.config import from_dict, load_params, replaced
from ced_csa2.eval.perplexity import eval_ids, groups_ppl
from ced_csa2.model_utils import load_model_and_tokenizer, resolve_device
from ced_csa2.pipeline.atomic_files import atomic_write_text, write_tsv
from ced_csa2.pipeline.checkpoint import check_meta_provenance, expected_meta
from ced_csa2.pipeline.paths import MODE_A_SINK
from ced_csa2.plan import load_plan
from ced_csa2.runtime.sink import SinkGroup
from ced_csa2.train.objectives import PHASE_GROUPS
from ced_csa2.train.tuning import ridge_served, train_branch

STUDY_PARAMS = Path("studies/online_records.yaml")
OUT = Path("studies/online_records")
OBJECTIVE = "attn_out"
log = logging.getLogger("online_records")


@dataclass(frozen=True)
class Study:
    records: list[int]


def load_study(path: Path = STUDY_PARAMS) -> Study:
    """The study's params, typed and checked (unknown or mistyped keys refused, naming them)."""
    study = from_dict(Study, yaml.safe_load(path.read_text()))
    if not study.records or min(study.records) < 1:
        raise ValueError(f"{path}: records must be positive and at least one, got {study.records}")
    return study


def table(rows: list[dict], params) -> str:
    """``records.md``: ΔPPL % [95% CI] per record count, group and sink."""
    lines = [f"`{OBJECTIVE}` branch by training records ({params.model.name}, {params.model.dtype}; "
             f"{rows[0]['eval_records']} eval records, {rows[0]['tokens']:,} scored tokens; not a Qwen3.5-4B result).",
             "", "| records | steps / phase | group | held-out KL after | branch s | ΔPPL % (sink: none) | "
             "ΔPPL % (sink: mean) |", "|---:|---:|---|---:|---:|---|---|"]
    for r in (r for r in rows if r["sink"] == "none"):
        kept = next(x for x in rows if x["sink"] == "mean" and x["records"] == r["records"] and x["group"] == r["group"])
        lines.append(f"| {r['records']} | {r['steps']} | {r['group']} | {r['val_kl']:.4f} | {r['branch_s']:.0f} | "
                     f"{r['dppl_pct']:+.2f} [{r['dppl_ci_low']:+.2f}, {r['dppl_ci_high']:+.2f}] | "
                     f"{kept['dppl_pct']:+.2f} [{kept['dppl_ci_low']:+.2f}, {kept['dppl_ci_high']:+.2f}] |")
    return "\n".join(lines) + "\n"


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    params, study = load_params(Path("params.yaml")), load_study()
    plan, geo = load_plan(params.plan, params.model)
    model, tok = load_model_and_tokenizer(params.model, device=resolve_device(params.eval_ppl.device))
    ids = eval_ids(params, tok, Path("."))
    constants, meta = load_sink(MODE_A_SINK, expected_meta(params, plan, geo)["sink"])
    check_meta_provenance(MODE_A_SINK, meta, params)
    runtimes, keys, trained = {}, {}, {}
    for records in study.records:
        p = replaced(params, train=replaced(params.train, online=replaced(params.train.online, records=records)))
        served = ridge_served(p, plan, geo, Path("."))
        t0 = time.perf_counter()
        phases, _, _ = train_branch(OBJECTIVE, p, plan, served, model, tok, Path("."))
        seconds = time.perf_counter() - t0  # the branch: its three phases and their held-out checks
        log.info("%d records: %.0f s of training", records, seconds)
        for group in PHASE_GROUPS:
            trained[records, group] = {**phases[group], "branch_s": seconds}
            parts = served.get(group, served["csa2"])
            for sink in ("none", "mean"):
                runtime = CEDModeBRuntime(model, plan, group, parts, kv_format=params.kv_format)
                label = f"{group}@{records}/{sink}"
                runtimes[label] = runtime if sink == "none" else SinkGroup(runtime, sink, constants)
                keys[label] = (records, group, sink)
    scores = groups_ppl(model, plan, ["baseline"], None, ids, params, tok.pad_token_id, extra=runtimes)
    rows = []
    for label, (records, group, sink) in keys.items():
        s, phase = scores[label], trained[records, group]
        rows.append({"records": records, "group": group, "sink": sink, "steps": phase["steps"],
                     "branch_s": round(phase["branch_s"], 1), "val_kl": phase["val_after"]["kl"],
                     "dppl_pct": s["delta_pct"], "dppl_ci_low": s["delta_pct_ci95"][0],
                     "dppl_ci_high": s["delta_pct_ci95"][1], "kl": s["kl"], "kl_ci_low": s["kl_ci95"][0],
                     "kl_ci_high": s["kl_ci95"][1], "top1_pct": s["top1_pct"], "eval_records": len(ids),
                     "tokens": s["tokens"]})
        log.info("%s: ΔPPL %+.2f%% [%+.2f, %+.2f], KL %.4f", label, s["delta_pct"], *s["delta_pct_ci95"], s["kl"])
    write_tsv(OUT / "records.tsv", rows)
    atomic_write_text(OUT / "records.md", table(rows, params))


if __name__ == "__main__":
    main()
