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
ΔPPL %, KL and top-1 with paired bootstrap 95% intervals over records; and as ``eval_gsm8k``
scores gold NLL, on the pairs of ``data/gsm8k_gold.json`` less the GSM8K items of the math
training pool's templates (Δ nats per token against the baseline, paired 95% interval).

Arms: the ``candidates`` of ``studies/training_mix.yaml``, and one per domain of the
``leave_one_out_of`` candidate, trained without it (its weights renormalised) -- what a domain
costs when no training text resembles it.  An arm with a ``math`` domain trains on
``math_templates`` seeded GSM-Symbolic templates (``data.mix_math_templates``, docs/design.md
§4); the split depends on the seed and ``math_templates`` alone, so every arm's gold NLL is
scored on the same items, labelled as the pipeline labels them ("GSM8K-100 minus the k
templates of the math training pool").

The choice (:func:`choose`, ``choice`` in ``mix.json``): among the candidates whose Wikipedia
ΔPPL is within 0.5 points of the ``wiki`` arm's for every group (the issue's bound against
today's Wikipedia-only mix), the one with the lowest **held-out ΔPPL**: the mean over groups
and over every evaluated domain but the corpus of what the candidate costs on that domain
when it has not trained on it -- its own figure on a domain outside its mix, and on a domain
inside it the figure of the arm trained on the rest of its mix (its leave-one-domain-out arm,
at the same rows).  Every candidate is so judged on the same domains, none on text it trained
on: training on a domain earns no credit there (its in-domain figure, and a math arm's
in-template math records, would flatter it), only what it does to the other domains.  The
corpus is left to the bound; fiction, which no arm trains on, enters every candidate's mean as
measured.  The ridge maps rank the mixes; the trained maps of ``dvc repro`` then start from the
chosen one's.

Writes ``studies/training_mix/mix.tsv`` (one row per arm, group and domain), ``mix.json`` (the
choice and its inputs, the gold NLL) and ``mix.md``; the wall time to
``timings/study_training_mix.json``.  Params: ``studies/training_mix.yaml`` and the root
``params.yaml``.
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
from ced_csa2.data.records import check_prepared, read_lines
from ced_csa2.eval.gsm8k import groups_gold_nll, load_gold_pairs
from ced_csa2.eval.perplexity import eval_ids, groups_ppl
from ced_csa2.model_utils import load_model_and_tokenizer, resolve_device
from ced_csa2.pipeline.atomic_files import atomic_write_text, write_json, write_tsv
from ced_csa2.pipeline.paths import EVAL_JSONL, GOLD_PATH, GSM8K_JSONL, TIMINGS, TRAIN_JSONL, domain_jsonl
from ced_csa2.pipeline.study_runner import run_study
from ced_csa2.plan import load_plan
from ced_csa2.stages import dump, ridge
from ced_csa2.train.tuning import ridge_served

STUDY_PARAMS = Path("studies/training_mix.yaml")
OUT = Path("studies/training_mix")
GROUPS = ("ced", "csa2", "ced_csa2")
WIKI_SLACK = 0.5  # points of Wikipedia ΔPPL a candidate may give up against the seed's mix
GOLD_GOALS = {"ced": 0.10, "csa2": 0.08, "ced_csa2": 0.20}  # issue 61: Δ gold NLL bounds, nats per token
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
    math_templates: int  # data.mix_math_templates of every arm with a math domain


def load_study(path: Path = STUDY_PARAMS) -> Study:
    """The study's params, typed and checked (unknown or mistyped keys refused, naming them)."""
    study = from_dict(Study, yaml.safe_load(path.read_text()))
    names = [c.name for c in study.candidates]
    if study.rows < 1:
        raise ValueError(f"{path}: rows must be >= 1, got {study.rows}")
    if study.math_templates < 1:
        raise ValueError(f"{path}: math_templates must be >= 1, got {study.math_templates}")
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


def leave_one_out_arms(study: Study, corpus: str) -> dict[str, dict[str, str]]:
    """``{candidate: {domain: arm}}``: for each domain a candidate trains on, but the corpus, the arm trained on the
    rest of its mix (the same shares, renormalised), whose figure on that domain :func:`choose` takes."""
    def shares(mix):
        return {d: round(w / sum(mix.values()), 9) for d, w in mix.items()}

    mixes = arms(study)
    out = {}
    for name, mix in candidates(study).items():
        out[name] = {}
        for d in (d for d in mix if d != corpus):
            rest = shares({k: w for k, w in mix.items() if k != d})
            arm = next((a for a, m in mixes.items() if shares(m) == rest), None)
            if arm is None:
                raise ValueError(f"{STUDY_PARAMS}: candidate {name!r} trains on {d!r}, but no arm trains on the rest "
                                 f"of its mix {rest} (the choice takes that arm's {d!r} figure); add it as a candidate")
            out[name][d] = arm
    return out


def arm_params(params: Params, mix: dict[str, float], rows: int, math_templates: int) -> Params:
    """``params`` with ``data.mix`` set to ``mix`` over ``rows`` tokens, ``math_templates`` templates if it has a
    math domain (validated: unknown domains, or a math domain with no templates, refused)."""
    math = any(d.kind == "math" and d.name in mix for d in params.data.domains)
    data = dataclasses.replace(params.data, mix=[MixEntry(d, float(w)) for d, w in mix.items()], mix_rows=rows,
                               mix_math_templates=math_templates if math else 0)
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


def choose(rows: list[dict], study: Study, corpus: str) -> dict:
    """The candidate the default uses (module docstring: held-out ΔPPL within the Wikipedia bound), with what decided it.

    Parameters
    ----------
    rows
        ``mix.tsv``'s rows: ``arm``, ``group``, ``domain`` and ``dppl_pct`` of every arm, group and domain.
    study
        The study's params (its candidates, and the arms :func:`leave_one_out_arms` takes figures from).
    corpus
        ``data.name``: the domain held by the bound, left out of the held-out mean.

    Returns
    -------
    dict
        ``rule``, ``domains`` (those averaged), ``candidates`` (per candidate: ``wiki_slack_points``,
        ``held_out_mean_dppl_pct``, ``held_out_from`` -- the arm each trained domain's figure comes from --
        and ``eligible``) and ``chosen``.
    """
    def dppl(arm, group, domain):
        return next(r["dppl_pct"] for r in rows if (r["arm"], r["group"], r["domain"]) == (arm, group, domain))

    domains = [d for d in dict.fromkeys(r["domain"] for r in rows) if d != corpus]
    held_out = leave_one_out_arms(study, corpus)
    summary = {}
    for arm in candidates(study):
        source = {d: held_out[arm].get(d, arm) for d in domains}
        slack = max(dppl(arm, g, corpus) - dppl("wiki", g, corpus) for g in GROUPS)
        mean = statistics.fmean(dppl(source[d], g, d) for g in GROUPS for d in domains)
        summary[arm] = {"wiki_slack_points": round(slack, 3), "held_out_mean_dppl_pct": round(mean, 3),
                        "held_out_from": {d: a for d, a in source.items() if a != arm}, "eligible": slack <= WIKI_SLACK}
    eligible = [a for a in summary if summary[a]["eligible"]]
    return {"rule": f"lowest mean ΔPPL over {list(GROUPS)} on {domains}, each domain a candidate trains on taken from "
                    f"its leave-one-domain-out arm, among candidates within {WIKI_SLACK} points of the wiki arm's "
                    f"{corpus} ΔPPL for every group", "domains": domains,
            "candidates": summary, "chosen": min(eligible, key=lambda a: summary[a]["held_out_mean_dppl_pct"])}


def gold_set(params: Params, problems: list[dict]) -> list[tuple[list[int], int]]:
    """The gold pairs of ``problems`` (the math set less the math training pool's items), from ``gold_pairs``'s file.

    ``data/gsm8k_gold.json`` holds one pair per problem of ``data/gsm8k.jsonl`` in file order, and a
    problem's prompt never depends on the others (the few-shot exemplars are lm-eval's fixed ones),
    so these are the pairs ``gold_pairs`` would write from a ``prepare`` with a math arm's mix.
    """
    pairs = load_gold_pairs(GOLD_PATH, params)
    ids = [json.loads(line)["id"] for line in read_lines(GSM8K_JSONL) if line.strip()]
    kept = {p["id"] for p in problems}
    if len(ids) != len(pairs) or not kept <= set(ids):
        raise ValueError(f"{GOLD_PATH} and {GSM8K_JSONL} do not hold the math set's {len(kept)} problems; "
                         "rerun `dvc repro gold_pairs`")
    return [pair for i, pair in zip(ids, pairs) if i in kept]


def table(rows: list[dict], mixes: dict, choice: dict, gold: dict, params: Params, study: Study, fits: dict) -> str:
    """``mix.md``: per arm and group, ΔPPL % [95% CI] on every domain (``*`` marks a domain the arm trained on), the
    choice, and each arm's Δ gold NLL."""
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
              "| candidate | worst-group Wikipedia ΔPPL above the wiki arm (points) | held-out mean ΔPPL % "
              "| trained domains' figures from |", "|---|---:|---:|---|"]
    lines += [f"| {a} | {c['wiki_slack_points']:+.2f} | {c['held_out_mean_dppl_pct']:+.2f} | "
              + (", ".join(f"{d}: {arm}" for d, arm in c["held_out_from"].items()) or "–") + " |"
              for a, c in choice["candidates"].items()]
    lines += ["", f"Δ gold NLL (nats per token) [paired 95% CI] on {gold['math_set']} ({gold['problems']} problems, "
              f"baseline {gold['baseline_nll_per_token']:.4f}); issue 61's goals: "
              + ", ".join(f"{g} ≤ +{v:.2f}" for g, v in GOLD_GOALS.items()) + ".", "",
              "| arm | " + " | ".join(GROUPS) + " |", "|---|" + "---|" * len(GROUPS)]
    lines += [f"| {arm} | " + " | ".join(f"{x['delta']:+.4f} [{x['delta_ci95'][0]:+.4f}, {x['delta_ci95'][1]:+.4f}]"
                                         for x in (by_group[g] for g in GROUPS)) + " |"
              for arm, by_group in gold["arms"].items()]
    proj = f"proj_{first['source']}"
    lines += ["", "Held-out R² of each arm's ridge projector (on its own validation records): "
              + "; ".join(f"{a} {f['r2'][proj]:.4f}" for a, f in fits.items())]
    return "\n".join(lines) + "\n"


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    t0 = time.perf_counter()
    params = load_params(Path("params.yaml"))
    check_prepared(params, Path("."), EVAL_JSONL, GSM8K_JSONL, *(domain_jsonl(d.name) for d in params.data.domains))
    study = load_study()
    corpus = params.data.name
    leave_one_out_arms(study, corpus)  # refuses a candidate the choice could not judge, before work
    mixes = arms(study)
    arm_set = {a: arm_params(params, mix, study.rows, study.math_templates) for a, mix in mixes.items()}  # as a bad mix
    # Every domain of every arm in one mix: its math domain (if any) draws its pool from the training
    # templates, and the math set drops their items, as for each math arm (the split is the same for all).
    every = arm_params(params, {d: 1.0 for mix in mixes.values() for d in mix}, study.rows, study.math_templates).data
    plan, geo = load_plan(params.plan, params.model)
    model, tok = load_model_and_tokenizer(params.model, device=resolve_device(params.eval_ppl.device))
    model.requires_grad_(False)
    budget = TokenBudget(tok, params.data.min_tokens, params.data.max_tokens)
    built = build_records(every, budget, {d: study.rows for mix in mixes.values() for d in mix})
    pairs = gold_set(params, built.problems)
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
    log.info("scoring %d arms' gold NLL on %s (%d problems)", len(mixes), every.math_label(), len(pairs))
    scores = groups_gold_nll(model, plan, ["baseline"], None, pairs, params.eval_gsm8k.batch_size, tok.pad_token_id,
                             kv_format=params.kv_format, seed=params.seed, extra=runtimes,
                             block_tokens=params.eval_ppl.score_block_tokens)
    gold = {"math_set": every.math_label(), "problems": len(pairs),
            "baseline_nll_per_token": scores["baseline"]["nll_per_token"], "arms": {
                arm: {g: {k: scores[f"{arm}/{g}"][k] for k in ("nll_per_token", "delta", "delta_ci95")} for g in GROUPS}
                for arm in mixes}}
    choice = choose(rows, study, corpus)
    log.info("chosen mix: %s (%s)", choice["chosen"], json.dumps(choice["candidates"]))
    write_tsv(OUT / "mix.tsv", rows)
    write_json(OUT / "mix.json", {"choice": choice, "gold_nll": gold, "arms": mixes, "rows_by_arm": {a: f["rows"] for a, f in fits.items()},
                                  "ridge_r2": {a: f["r2"] for a, f in fits.items()}})
    atomic_write_text(OUT / "mix.md", table(rows, mixes, choice, gold, params, study, fits))
    write_json(TIMINGS / "study_training_mix.json", {"seconds": round(time.perf_counter() - t0, 1),
                                                     "threads": torch.get_num_threads()})


if __name__ == "__main__":
    run_study(main)
