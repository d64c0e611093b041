"""Which mix of training domains makes the maps transfer: candidates at equal rows, and leave-one-domain-out.

    dvc repro studies/dvc.yaml:training_mix       # runs: python studies/training_mix.py

The seed fits its maps on Wikipedia text alone; on the embedded default they then cost about
twice as much on other text (``docs/results.md``, "Other domains").  Each arm here is one
``data.mix`` (:func:`ced_csa2.data.corpus.mix_train`: exactly ``rows`` training tokens, each
domain its weight's share), pushed through the pipeline's own code in a scratch folder: its
``train.jsonl``, the ``dump`` stage, the ``ridge`` stage, and the ``ridge`` objective's maps
(:func:`~ced_csa2.train.tuning.ridge_served`: the closed-form projector and linear adapters the
trained maps start from).  ``ced``, ``csa2`` and ``ced_csa2`` of every arm are then scored as
``eval_ppl`` scores them, on the held-out records of the corpus and of every ``data.domains``
entry (the evaluation records never depend on the mix), against one baseline pass per domain:
ΔPPL %, KL and top-1 with paired bootstrap 95% intervals over records.

Arms: the ``candidates`` of ``studies/training_mix.yaml``, and one per domain of the
``leave_one_out_of`` candidate, trained without it (its weights renormalised) -- what a domain
costs when no training text resembles it.  ``math`` (GSM8K-derived) and ``fiction`` (one short
story) are never trained on, so every arm is judged on two domains it did not see.

The choice (``choice`` in ``mix.json``): among the candidates whose Wikipedia ΔPPL is within
0.5 points of the ``wiki`` arm's for every group, the one with the lowest mean ΔPPL over groups
on the domains no candidate trains on; the ridge maps rank the mixes, the trained maps of
``dvc repro`` then start from the chosen one's.

Writes ``studies/training_mix/mix.tsv`` (one row per arm, group and domain), ``mix.json`` (the
choice and its inputs) and ``mix.md``; the wall time to ``timings/study_training_mix.json``.
Params: ``studies/training_mix.yaml`` and the root ``params.yaml``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from ced_csa2.ced_runtime import CEDModeBRuntime
from ced_csa2.config import MixEntry, Params, from_dict, load_params
from ced_csa2.data.corpus import TokenBudget, build_records, mix_train, records_jsonl, write_prepared
from ced_csa2.data.records import check_prepared
from ced_csa2.eval.perplexity import eval_ids, groups_ppl
from ced_csa2.model_utils import load_model_and_tokenizer, resolve_device
from ced_csa2.pipeline.atomic_files import atomic_write_text, write_json, write_tsv
from ced_csa2.pipeline.paths import EVAL_JSONL, TIMINGS, TRAIN_JSONL, domain_jsonl
from ced_csa2.pipeline.study_runner import run_study
from ced_csa2.plan import load_plan
from ced_csa2.stages import dump, ridge
from ced_csa2.train.tuning import ridge_served

STUDY_PARAMS = Path("studies/training_mix.yaml")
OUT = Path("studies/training_mix")
GROUPS = ("ced", "csa2", "ced_csa2")
WIKI_SLACK = 0.5  # points of Wikipedia ΔPPL a candidate may give up against the seed's mix
log = logging.getLogger("training_mix")


@dataclass(frozen=True)
class Candidate:
    name: str
    mix: list[MixEntry]  # as data.mix


@dataclass(frozen=True)
class Study:
    rows: int  # each arm's training tokens
    candidates: list[Candidate]
    leave_one_out_of: str  # a candidate: one more arm per domain of it, trained without that domain


def load_study(path: Path = STUDY_PARAMS) -> Study:
    """The study's params, typed and checked (unknown or mistyped keys refused, naming them)."""
    study = from_dict(Study, yaml.safe_load(path.read_text()))
    names = [c.name for c in study.candidates]
    if study.rows < 1:
        raise ValueError(f"{path}: rows must be >= 1, got {study.rows}")
    if len(set(names)) != len(names) or "wiki" not in names or study.leave_one_out_of not in names:
        raise ValueError(f"{path}: candidates must have distinct names, 'wiki' (the seed's mix) and leave_one_out_of "
                         f"({study.leave_one_out_of!r}) among them; got {names}")
    if len(candidates(study)[study.leave_one_out_of]) < 2:
        raise ValueError(f"{path}: leave_one_out_of must name a candidate of two or more domains")
    return study


def candidates(study: Study) -> dict[str, dict[str, float]]:
    """``{candidate: {domain: weight}}``."""
    return {c.name: {e.domain: e.weight for e in c.mix} for c in study.candidates}


def arms(study: Study) -> dict[str, dict[str, float]]:
    """The candidates, then ``without_<domain>`` for each domain of ``leave_one_out_of``."""
    base = candidates(study)[study.leave_one_out_of]
    return {**candidates(study), **{f"without_{d}": {k: w for k, w in base.items() if k != d} for d in base}}


def arm_params(params: Params, mix: dict[str, float], rows: int) -> Params:
    """``params`` with ``data.mix`` set to ``mix`` over ``rows`` tokens (validated: unknown or eval-only domains refused)."""
    data = dataclasses.replace(params.data, mix=[MixEntry(d, float(w)) for d, w in mix.items()], mix_rows=rows)
    return dataclasses.replace(params, data=data, dump=dataclasses.replace(params.dump, records=0))


def fit_arm(params: Params, tok, budget: TokenBudget, pools, workdir: Path, plan, geo, model) -> dict:
    """One arm's maps through the pipeline's own stages in ``workdir``: ``{group: runtime}`` and the ridge fit."""
    mixed = mix_train(params.data, pools, budget)
    (workdir / TRAIN_JSONL).parent.mkdir(parents=True, exist_ok=True)
    write_prepared(params, workdir, TRAIN_JSONL, records_jsonl([r for records in mixed.values() for r in records]))
    dump.run(params, workdir)
    fit = ridge.run(params, workdir)
    served = ridge_served(params, plan, geo, workdir)
    runtimes = {g: CEDModeBRuntime(model, plan, g, served["ced_csa2" if g == "ced_csa2" else "csa2"],
                                   kv_format=params.kv_format) for g in GROUPS}
    return {"runtimes": runtimes, "rows": {d: sum(r.n_tokens for r in recs) for d, recs in mixed.items()},
            "r2": {name: round(v["r2"], 4) for name, v in fit.items() if isinstance(v, dict) and "r2" in v}}


def choose(rows: list[dict], study: Study, unseen: list[str], corpus: str) -> dict:
    """The candidate the default uses (module docstring), with what decided it."""
    def dppl(arm, group, domain):
        return next(r["dppl_pct"] for r in rows if (r["arm"], r["group"], r["domain"]) == (arm, group, domain))

    summary = {}
    for arm in candidates(study):
        slack = max(dppl(arm, g, corpus) - dppl("wiki", g, corpus) for g in GROUPS)
        unseen_mean = statistics.fmean(dppl(arm, g, d) for g in GROUPS for d in unseen)
        summary[arm] = {"wiki_slack_points": round(slack, 3), "unseen_mean_dppl_pct": round(unseen_mean, 3),
                        "eligible": slack <= WIKI_SLACK}
    eligible = [a for a in summary if summary[a]["eligible"]]
    return {"rule": f"lowest mean ΔPPL over {list(GROUPS)} on {unseen} among candidates within {WIKI_SLACK} points "
                    f"of the wiki arm's {corpus} ΔPPL for every group", "unseen_domains": unseen,
            "candidates": summary, "chosen": min(eligible, key=lambda a: summary[a]["unseen_mean_dppl_pct"])}


def table(rows: list[dict], mixes: dict, choice: dict, params: Params, study: Study, fits: dict) -> str:
    """``mix.md``: per arm and group, ΔPPL % [95% CI] on every domain (``*`` marks a domain the arm trained on)."""
    domains = list(dict.fromkeys(r["domain"] for r in rows))
    first = rows[0]
    lines = [f"Training mixes on {params.model.name} ({first['dtype']}), ridge maps (the `ridge` objective) on "
             f"{study.rows:,} training tokens per arm; ΔPPL % [paired 95% CI] on each domain's held-out records "
             f"(n per domain: " + ", ".join(f"{d} {next(r['records'] for r in rows if r['domain'] == d)}"
                                            for d in domains) + "); `*` = the arm trained on that domain. "
             "Embedded default, not a Qwen3.5-4B result.", "",
             "| arm | mix (share of rows) | group | " + " | ".join(domains) + " |",
             "|---|---|---|" + "---|" * len(domains)]
    for arm, mix in mixes.items():
        total = sum(mix.values())
        shares = ", ".join(f"{d} {w / total:.2f}" for d, w in mix.items())
        for g in GROUPS:
            cells = []
            for d in domains:
                r = next(x for x in rows if (x["arm"], x["group"], x["domain"]) == (arm, g, d))
                cells.append(f"{r['dppl_pct']:+.2f} [{r['dppl_ci_low']:+.2f}, {r['dppl_ci_high']:+.2f}]"
                             + ("\\*" if d in mix else ""))
            lines.append(f"| {arm} | {shares} | {g} | " + " | ".join(cells) + " |")
    lines += ["", f"Choice: **{choice['chosen']}** ({choice['rule']}).", "",
              "| candidate | worst-group Wikipedia ΔPPL above the wiki arm (points) | mean ΔPPL on unseen domains % |",
              "|---|---:|---:|"]
    lines += [f"| {a} | {c['wiki_slack_points']:+.2f} | {c['unseen_mean_dppl_pct']:+.2f} |"
              for a, c in choice["candidates"].items()]
    proj = f"proj_{first['source']}"
    lines += ["", "Held-out R² of each arm's ridge projector (on its own validation records): "
              + "; ".join(f"{a} {f['r2'][proj]:.4f}" for a, f in fits.items())]
    return "\n".join(lines) + "\n"


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    t0 = time.perf_counter()
    params = load_params(Path("params.yaml"))
    check_prepared(params, Path("."), EVAL_JSONL, *(domain_jsonl(d.name) for d in params.data.domains))
    study = load_study()
    mixes = arms(study)
    arm_set = {a: arm_params(params, mix, study.rows) for a, mix in mixes.items()}  # refuses a bad mix before work
    plan, geo = load_plan(params.plan, params.model)
    model, tok = load_model_and_tokenizer(params.model, device=resolve_device(params.eval_ppl.device))
    model.requires_grad_(False)
    budget = TokenBudget(tok, params.data.min_tokens, params.data.max_tokens)
    built = build_records(params.data, budget, {d: study.rows for mix in mixes.values() for d in mix})
    corpus = params.data.name
    ids = {corpus: eval_ids(params, tok, Path("."))} | {d.name: eval_ids(params, tok, Path("."), d.name)
                                                       for d in params.data.domains}
    fits, runtimes = {}, {}
    with tempfile.TemporaryDirectory(prefix="training_mix_") as scratch:
        for arm, p in arm_set.items():
            log.info("arm %s: %s", arm, mixes[arm])
            workdir = Path(scratch) / arm
            fits[arm] = fit_arm(p, tok, budget, built.pools, workdir, plan, geo, model)
            runtimes |= {f"{arm}/{g}": rt for g, rt in fits[arm].pop("runtimes").items()}
            for path in sorted(workdir.rglob("*.h5"), reverse=True):  # 1.4 GB a dump: one arm's at a time
                path.unlink()
    rows = []
    for domain, domain_ids in ids.items():
        log.info("scoring %d arms' groups on %s (%d records)", len(mixes), domain, len(domain_ids))
        scores = groups_ppl(model, plan, ["baseline"], None, domain_ids, params, tok.pad_token_id, extra=runtimes)
        for label, s in scores.items():
            if label == "baseline":
                continue
            arm, group = label.split("/")
            rows.append({"arm": arm, "group": group, "domain": domain, "trained_on": domain in mixes[arm],
                         "dppl_pct": s["delta_pct"], "dppl_ci_low": s["delta_pct_ci95"][0],
                         "dppl_ci_high": s["delta_pct_ci95"][1], "kl": s["kl"], "top1_pct": s["top1_pct"],
                         "records": len(domain_ids), "tokens": s["tokens"], "rows": study.rows,
                         "dtype": str(model.dtype).removeprefix("torch."), "source": plan.source})
    unseen = [d for d in ids if not any(d in mix for mix in candidates(study).values())]
    choice = choose(rows, study, unseen, corpus)
    log.info("chosen mix: %s (%s)", choice["chosen"], json.dumps(choice["candidates"]))
    write_tsv(OUT / "mix.tsv", rows)
    write_json(OUT / "mix.json", {"choice": choice, "arms": mixes, "rows_by_arm": {a: f["rows"] for a, f in fits.items()},
                                  "ridge_r2": {a: f["r2"] for a, f in fits.items()}})
    atomic_write_text(OUT / "mix.md", table(rows, mixes, choice, params, study, fits))
    write_json(TIMINGS / "study_training_mix.json", {"seconds": round(time.perf_counter() - t0, 1),
                                                     "threads": torch.get_num_threads()})


if __name__ == "__main__":
    run_study(main)
