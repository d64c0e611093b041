"""What the online objectives gain from more training records, with and without the attention sink.

    dvc repro studies/dvc.yaml       # runs: python studies/online_records.py

An objective's branch (``tune@attn_out``; ``tune@distill`` in ``budget=cpu_full``) trains on
``train.online.records`` records (64 in the CPU budget: 16 steps per phase).  Here the same branch --
same recipe, same seed, same phases from the ridge start (:func:`ced_csa2.train.tuning.train_branch`)
-- is trained for each objective and record count of ``studies/online_records.yaml`` (one epoch:
the steps grow with the records), and its
``ced``, ``csa2`` and ``ced_csa2`` are scored on ``eval_ppl``'s records with its protocol
(teacher-forced, one shared trunk, paired bootstrap 95% intervals over records against one
baseline pass), each as the pipeline scores it (``sink: none``) and with the first position's
K/V kept as ``tune_mode_a``'s constants (``sink: mean``, :class:`~ced_csa2.runtime.sink.SinkGroup`;
``studies/sink.py`` measures why).  The ``attn_out`` rows at 64 records are the pipeline's own branch.
A branch with ``head_width > 0`` gives its projectors the adapters' form (the linear map plus a
zero-initialised residual MLP on the standardised ``H_split``,
:func:`~ced_csa2.train.tuning.with_projector_heads`), the MLP trained through the same phases at
``head_lr``: a map that is not linear, trained by the model's own signal.

Writes ``studies/online_records/records.tsv`` (one row per branch, group and sink: ΔPPL, KL, top-1,
the phase's held-out KL before and after training, its steps, the branch's seconds: three phases and their
held-out checks) and ``records.md``.
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
from ced_csa2.data.records import check_prepared
from ced_csa2.eval.perplexity import eval_ids, groups_ppl
from ced_csa2.model_utils import load_model_and_tokenizer, resolve_device
from ced_csa2.pipeline.atomic_files import atomic_write_text, write_tsv
from ced_csa2.pipeline.checkpoint import check_meta_provenance, expected_meta
from ced_csa2.pipeline.map_roles import MODE_A
from ced_csa2.pipeline.paths import EVAL_JSONL, MODE_A_SINK, TRAIN_JSONL
from ced_csa2.pipeline.study_runner import run_study
from ced_csa2.plan import load_plan
from ced_csa2.runtime.sink import SinkGroup
from ced_csa2.train.objectives import PHASE_GROUPS, online_records
from ced_csa2.train.tuning import ridge_served, train_branch, with_projector_heads

STUDY_PARAMS = Path("studies/online_records.yaml")
OUT = Path("studies/online_records")
OBJECTIVES = ("attn_out", "distill")  # the objectives that train through the model
log = logging.getLogger("online_records")


@dataclass(frozen=True)
class Branch:
    objective: str
    records: int
    head_width: int = 0  # > 0: the projectors get a residual MLP of this width (0: linear, as the pipeline's)


@dataclass(frozen=True)
class Study:
    branches: list[Branch]
    head_lr: float  # AdamW learning rate of the projectors' residual MLPs (their linear maps keep projector_lr)


def load_study(path: Path = STUDY_PARAMS) -> Study:
    """The study's params, typed and checked (unknown or mistyped keys refused, naming them)."""
    study = from_dict(Study, yaml.safe_load(path.read_text()))
    if not study.branches:
        raise ValueError(f"{path}: branches must list at least one (objective, records)")
    for i, b in enumerate(study.branches):
        if b.objective not in OBJECTIVES or b.records < 1 or b.head_width < 0:
            raise ValueError(f"{path}: branches[{i}] must train an objective of {list(OBJECTIVES)} on records >= 1 "
                             f"with head_width >= 0, got {b.objective!r} on {b.records}, head_width {b.head_width}")
    if not study.head_lr > 0:
        raise ValueError(f"{path}: head_lr must be > 0, got {study.head_lr}")
    return study


def table(rows: list[dict], params) -> str:
    """``records.md``: ΔPPL % [95% CI] per branch (objective, records), group and sink."""
    lines = [f"Online objectives by training records ({params.model.name}, {params.model.dtype}; "
             f"{rows[0]['eval_records']} eval records, {rows[0]['tokens']:,} scored tokens; not a Qwen3.5-4B result).",
             "", "| objective | records | projector | steps / phase | group | held-out KL before → after | branch s | "
             "ΔPPL % (sink: none) | ΔPPL % (sink: mean) |", "|---|---:|---|---:|---|---:|---:|---|---|"]
    for r in (r for r in rows if r["sink"] == "none"):
        kept = next(x for x in rows if x["sink"] == "mean"
                    and all(x[c] == r[c] for c in ("objective", "records", "head_width", "group")))
        projector = ("– (reads the true K/V)" if not r["projector_params"] else
                     f"ridge + MLP {r['head_width']} ({r['projector_params']:,} p.)" if r["head_width"]
                     else f"linear ({r['projector_params']:,} p.)")
        lines.append(f"| {r['objective']} | {r['records']} | {projector} | {r['steps']} | {r['group']} | "
                     f"{r['val_kl_before']:.4f} → {r['val_kl']:.4f} | "
                     f"{r['branch_s']:.0f} | "
                     f"{r['dppl_pct']:+.2f} [{r['dppl_ci_low']:+.2f}, {r['dppl_ci_high']:+.2f}] | "
                     f"{kept['dppl_pct']:+.2f} [{kept['dppl_ci_low']:+.2f}, {kept['dppl_ci_high']:+.2f}] |")
    return "\n".join(lines) + "\n"


def label(branch: Branch, group: str, sink: str) -> str:
    head = f"+mlp{branch.head_width}" if branch.head_width else ""
    return f"{group}@{branch.objective}{branch.records}{head}/{sink}"


def row(key: tuple[Branch, str, str], score: dict, phase: dict, eval_records: int) -> dict:
    """One TSV row: the arm ``(branch, group, sink)``, its training phase and its perplexity scores.

    ``projector_params``: the parameters of the projector the group's maps hold (0 for ``csa2``,
    which reads the true source K/V).
    """
    branch, group, sink = key
    log.info("%s: ΔPPL %+.2f%% [%+.2f, %+.2f], KL %.4f", label(*key), score["delta_pct"], *score["delta_pct_ci95"],
             score["kl"])
    return {"objective": branch.objective, "records": branch.records, "head_width": branch.head_width,
            "projector_params": phase["projector_params"] if group != "csa2" else 0, "group": group, "sink": sink,
            "steps": phase["steps"],
            "branch_s": round(phase["branch_s"], 1), "val_kl_before": phase["val_before"]["kl"],
            "val_kl": phase["val_after"]["kl"],
            "dppl_pct": score["delta_pct"], "dppl_ci_low": score["delta_pct_ci95"][0],
            "dppl_ci_high": score["delta_pct_ci95"][1], "kl": score["kl"], "kl_ci_low": score["kl_ci95"][0],
            "kl_ci_high": score["kl_ci95"][1], "top1_pct": score["top1_pct"], "eval_records": eval_records,
            "tokens": score["tokens"]}


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    params = load_params(Path("params.yaml"))
    check_prepared(params, Path("."), TRAIN_JSONL, EVAL_JSONL)
    study = load_study()
    plan, geo = load_plan(params.plan, params.model)
    model, tok = load_model_and_tokenizer(params.model, device=resolve_device(params.eval_ppl.device))
    ids = eval_ids(params, tok, Path("."))
    constants, meta = load_sink(MODE_A_SINK, expected_meta(params, plan, geo)["sink"])
    check_meta_provenance(MODE_A_SINK, meta, params, MODE_A)
    arms = {}  # (branch, group, sink) -> (runtime, the phase that trained its maps)
    for branch in study.branches:
        online = replaced(params.train.online, records=branch.records)
        p = replaced(params, train=replaced(params.train, online=online))
        served = ridge_served(p, plan, geo, Path("."))
        t0 = time.perf_counter()
        if branch.head_width:
            train_rows, _ = online_records(p, tok, Path("."))
            with_projector_heads(served, model, plan, train_rows, tok.pad_token_id, branch.head_width,
                                 params.train_adapters.activation, online.batch_size)
        phases, _, _ = train_branch(branch.objective, p, plan, served, model, tok, Path("."), head_lr=study.head_lr)
        seconds = time.perf_counter() - t0  # the branch: its three phases and their held-out checks
        log.info("%s on %d records (projector head %d): %.0f s of training", branch.objective, branch.records,
                 branch.head_width, seconds)
        for group in PHASE_GROUPS:
            maps = served.get(group, served["csa2"])
            phase = {**phases[group], "branch_s": seconds,
                     "projector_params": sum(w.numel() for w in maps.projector.parameters())}
            plain, kept = (CEDModeBRuntime(model, plan, group, maps, kv_format=params.kv_format) for _ in range(2))
            arms[branch, group, "none"] = plain, phase
            arms[branch, group, "mean"] = SinkGroup(kept, "mean", constants), phase
    scores = groups_ppl(model, plan, ["baseline"], None, ids, params, tok.pad_token_id,
                        extra={label(*key): runtime for key, (runtime, _) in arms.items()})
    rows = [row(key, scores[label(*key)], phase, len(ids)) for key, (_, phase) in arms.items()]
    write_tsv(OUT / "records.tsv", rows)
    atomic_write_text(OUT / "records.md", table(rows, params))


if __name__ == "__main__":
    run_study(main)
