"""The report's content from the detailed results: the results, Mode A, objective and fit tables,
the groups table and headline (``metrics/groups.tsv``, ``metrics/summary.json``), the protocol
line and the figures.
"""

from __future__ import annotations

import math
from pathlib import Path

from ..config import Params, check_provenance
from ..maps.ridge import adapter_map
from ..pipeline.atomic_files import read_json
from ..pipeline.figures import write_png
from ..pipeline.paths import (GENERATION_METRICS, GSM8K_METRICS, METRICS, OBJECTIVES_EVAL, PPL_METRICS,
                              RETRIEVAL_METRICS, SEED_INIT, STORAGE_METRICS)
from ..groups import GROUP_NAMES, GROUPS

BASES = ("decoder_attention", "all_attention", "all_attention_amortised_32k")


CED_CSA2_START = {"csa2": "csa2's ridge maps, fitted on the true source K/V",
                  "projected": "ridge maps fitted on the projected source K/V its targets read"}


def _load(workdir: Path, name: str | Path) -> dict:
    return read_json(workdir / METRICS / f"{name}.json")


def _em(g: dict, key: str) -> str:
    m = g[key]
    lo, hi = m["ci95"]
    return f"{100 * m['exact_match']:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"


def _delta(d: dict, key: str, fmt: str) -> str:
    """``+1.23 [+0.45, +2.01]``: a change with its paired-bootstrap 95% interval (``–`` for the baseline)."""
    if key not in d:
        return "–"
    lo, hi = d[f"{key}_ci95"]
    return f"{fmt.format(d[key])} [{fmt.format(lo)}, {fmt.format(hi)}]"


def results_table(ppl: dict, gsm: dict, storage: dict) -> list[str]:
    """Markdown rows: one per runtime group."""
    kv = storage["active_model"]["kv"]["bf16"]
    head = ["group", "PPL", "ΔPPL % [95% CI]", *AGREEMENT_HEAD, "GSM8K strict EM % [95% CI]",
            "flexible EM % [95% CI]", "gold NLL/token", "Δ gold NLL [95% CI]"]
    head += [f"B/token bf16 ({b})" for b in BASES] + [f"compression ({b})" for b in BASES]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for group in sorted(ppl["groups"], key=GROUP_NAMES.index):  # the registry's order, not JSON's sorted keys
        p, g = ppl["groups"][group], gsm["groups"].get(group)
        cells = [group, f"{p['ppl']:.3f}", _delta(p, "delta_pct", "{:+.2f}"), *_agreement(p)]
        cells += [_em(g, "strict-match"), _em(g, "flexible-extract")] if g and "strict-match" in g else ["–"] * 2
        cells += [f"{g['gold_nll']['nll_per_token']:.4f}", _delta(g["gold_nll"], "delta", "{:+.4f}")] \
            if g else ["–"] * 2
        cells += [f"{kv[b][group]['bytes_per_token']:,.1f}" for b in BASES]
        cells += [f"{kv[b][group]['compression_vs_baseline']:.3f}×" for b in BASES]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


AGREEMENT_HEAD = ("KL(base ‖ group) nats/token [95% CI]", "top-1 agreement % [95% CI]")


def _agreement(d: dict) -> list[str]:
    """KL to the baseline and top-1 agreement cells (``–`` for the baseline)."""
    return [_delta(d, "kl", "{:.4f}"), _delta(d, "top1_pct", "{:.2f}")]


MODE_A_MAPS = {"main": "the main branch's maps", "trained": "maps trained through the skip (tune_mode_a)",
               "given": "maps given by the caller"}


def mode_a_table(ppl: dict, gsm: dict, train: dict) -> list[str]:
    """Mode A (prefill skip) against the plain prefill: quality, GSM8K through lm-eval, speed-up.

    ``train``: ``metrics/mode_a/train.json`` (the held-out KL of the trained maps before/after).
    """
    a, g = ppl["mode_a"], gsm.get("mode_a", {})
    if not a["covered"]:
        return [f"Mode A: not run — the plan does not cover attention layers {a['uncovered_attention_layers']} "
                "above the cut (use a covering plan)."]
    head = ["arm", "prefix PPL", "ΔPPL % [95% CI]", *AGREEMENT_HEAD, "GSM8K strict EM % [95% CI]",
            "flexible EM % [95% CI]", "gold NLL/token", "Δ gold NLL [95% CI]", "prefill speed-up bound"]
    gen = [_em(g, "strict-match"), _em(g, "flexible-extract")] if "strict-match" in g else ["–"] * 2
    gold = g.get("gold_nll")
    base_em = gsm["groups"].get("baseline", {})
    rows = [["baseline (full prefill)", f"{a['baseline']['ppl']:.3f}", "–", "–", "–",
             *([_em(base_em, "strict-match"), _em(base_em, "flexible-extract")] if "strict-match" in base_em
               else ["–"] * 2),
             f"{gsm['groups']['baseline']['gold_nll']['nll_per_token']:.4f}" if "baseline" in gsm["groups"] else "–",
             "–", "1×"],
            [f"mode_a (prefill skip, sink: {a['sink']}, replay {a['replay']}, {MODE_A_MAPS[a['maps']]})", f"{a['mode_a']['ppl']:.3f}", _delta(a, "delta_pct", "{:+.2f}"), *_agreement(a),
             *gen, f"{gold['nll_per_token']:.4f}" if gold else "–", _delta(gold, "delta", "{:+.4f}") if gold else "–",
             f"≤ {a['prefill_speedup_bound']:.2f}×"]]
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head), *("| " + " | ".join(r) + " |" for r in rows),
            "", f"Prompt = first {100 * a['prefix_fraction']:.0f}% of each of the {a['records']} eval records, scored "
            "on the rest. Speed-up bound: decoder layers the plain prefill runs / layers the skip runs (the maps' cost "
            "ignored); the measured speed-up is a timing of the machine, in `timings/eval_ppl.json` after a run "
            "and measured in `benchmarks/mode_a_prefill.py`, never in the results. "
            f"GSM8K: the same lm-eval task, each prompt prefilled by the skip (lm-eval `ModeALM`)"
            f"{'' if 'strict-match' in g else '; exact match not generated here (eval_gsm8k.mode_a: gold_nll)'}. "
            f"{a['note']}", *([""] if train.get("covered") else []), *([
                f"Trained maps (tune_mode_a): from the ridge maps (projectors: "
                f"{train['protocol'].get('projector_head', 'linear')}), {train['steps']} AdamW steps on "
                f"{train['protocol']['records']} train records ({train['tokens']:,} tokens) under the pure skip, "
                f"KL(plain ‖ Mode A) on the continuation; held-out KL ({train['protocol']['val_records']} records) "
                f"{train['val_before']['kl']:.4f} → {train['val_after']['kl']:.4f}."] if train.get("covered") else [])]


# GSM8K exact match reads as "no signal" when even the baseline's 95% interval stays below this:
# a small model (the embedded default's 135M) solves almost none, so no group can be told apart by it.
EM_FLOOR = 0.05


def gsm_note(ppl: dict, gsm: dict) -> list[str]:
    """Why to read gold NLL, not exact match, when the baseline's strict-match EM is near 0 (``[]`` otherwise)."""
    em = gsm["groups"].get("baseline", {}).get("strict-match")
    if not em or em["ci95"][1] >= EM_FLOOR:
        return []
    return [f"GSM8K exact match: the baseline itself solves {em['correct']} of {em['n']} (strict match; 95% "
            f"interval up to {100 * em['ci95'][1]:.1f}%): **{ppl['protocol']['model']}** is too small to solve "
            "GSM8K, so exact match cannot tell the groups apart here. Read the gold NLL/token column (each "
            "group's NLL of the reference solutions, Δ with a paired 95% interval): it measures the same "
            "reasoning text on every problem, solved or not.", ""]


def _maps_kept_at_start(fit: dict, name: str) -> list[str]:
    """The maps of ``fit`` (projector or adapters metrics) whose kept epoch is 0, e.g. ``adapter K → KV_22``."""
    out = [f"{name} → KV_{layer}" for layer, m in fit["layers"].items() if m.get("kept_epoch") == 0]
    return out + [f"{name} {kind.upper()} → KV_{layer}" for layer, m in fit["layers"].items() for kind in "kv"
                  if isinstance(m.get(kind), dict) and m[kind].get("kept_epoch") == 0]


def start_kept_note(projector: dict, adapters: dict) -> list[str]:
    """Why a trained map's figures equal ridge's: its best held-out epoch was 0, the ridge start (``[]`` if none).

    Only maps that start from ridge and keep their best held-out epoch (``keep: best_val``) say so; a
    random-init projector's epoch 0 is no ridge fit.
    """
    kept = [label for fit, name in ((projector, "projector H"), (adapters, "adapter KV_src"))
            if fit["run"]["keep"] == "best_val" and fit["run"].get("init", "ridge") == "ridge"
            for label in _maps_kept_at_start(fit, name)]
    if not kept:
        return []
    return [f"Kept at epoch 0 (metrics `kept_epoch`): {', '.join(kept)}. Training keeps the epoch of lowest "
            "held-out MSE, and for these maps no epoch beat the ridge start, so their trained cos and R² equal "
            "ridge's and their curves (metrics/curves) stay flat: what is shown is the ridge fit, which training "
            "did not improve on held-out tokens -- not a training run that failed to start.", ""]


def fit_table(ridge: dict, projector: dict, adapters: dict) -> list[str]:
    """Per-layer held-out fit of the maps: ridge vs trained, K and V (cos, R²)."""
    lines = ["| map | K cos ridge → trained | K R² ridge → trained | V cos ridge → trained | V R² ridge → trained |",
             "|---|---|---|---|---|"]
    for layer, m in projector["layers"].items():
        r = {kind: ridge[f"proj_{layer}_{kind}"] for kind in "kv"}
        lines.append(f"| projector H → KV_{layer} | " + " | ".join(
            f"{r[kind][stat]:.4f} → {m[kind][stat]:.4f}" for kind in "kv" for stat in ("cos", "r2")) + " |")
    for layer, m in adapters["layers"].items():
        lines.append(f"| adapter KV_src → KV_{layer} | " + " | ".join(
            f"{m[kind]['ridge'][stat]:.4f} → {m[kind]['trained'][stat]:.4f}" for kind in "kv"
            for stat in ("cos", "r2")) + " |")
    return lines


def served_fit_table(ridge: dict, targets: list[str], adapter_input: str) -> list[str]:
    """Ridge adapters fed the projected source: csa2's (fitted on the true source) vs those fitted on it."""
    lines = ["| adapter fed proj(H) → KV_t | K R² csa2's map → map fitted on proj(H) | "
             "V R² csa2's map → map fitted on proj(H) |", "|---|---|---|"]
    for t in targets:
        maps = {kind: (adapter_map(kind, int(t), adapter_input) + "_on_ced",
                       adapter_map(kind, int(t), adapter_input, projected=True)) for kind in "kv"}
        lines.append(f"| KV_{t} | " + " | ".join(
            f"{ridge[true]['r2']:.4f} → {ridge[fitted]['r2']:.4f}" for true, fitted in maps.values()) + " |")
    return lines


def objective_table(ppl: dict, gsm: dict, projector: dict, adapters: dict, objectives: dict[str, dict],
                    seed_init: dict, groups: list[str]) -> list[str]:
    """Rows ``(group, objective)``: the seed's ``kv_mse`` maps and every tuned objective, same protocols.

    ``objectives[name] = {"train": tune's train.json, "eval": {"protocol", "groups"} from eval_objectives}``;
    ``seed_init`` = eval_objectives' ``{"ced": ...}`` under the seed's literal projector recipe (random init).
    """
    for name, o in objectives.items():
        if o["eval"]["protocol"]["tokens_scored"] != ppl["protocol"]["tokens_scored"]:
            raise ValueError(f"metrics/objectives/eval.json ({name}) scored {o['eval']['protocol']['tokens_scored']} "
                             f"tokens, metrics/ppl.json {ppl['protocol']['tokens_scored']}: rerun the pipeline")
    def kv_mse_steps(group: str) -> int:  # the steps of the maps the group reads
        return (projector["run"]["steps"] * GROUPS[group].projected_source
                + adapters["run"]["steps"] * GROUPS[group].adapters)

    head = ["group", "objective", "PPL", "ΔPPL % [95% CI]", *AGREEMENT_HEAD, "gold NLL/token", "Δ gold NLL [95% CI]",
            "optimizer steps", "train tokens"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def row(group, objective, p: dict, gold: dict | None, steps="–", tokens="–"):
        cells = [f"{gold['nll_per_token']:.4f}", _delta(gold, "delta", "{:+.4f}")] if gold else ["–", "–"]
        lines.append("| " + " | ".join([group, objective, f"{p['ppl']:.3f}", _delta(p, "delta_pct", "{:+.2f}"),
                                        *_agreement(p), *cells, steps, tokens]) + " |")

    def main_branch(group):
        return ppl["groups"][group], gsm["groups"].get(group, {}).get("gold_nll")

    for group in ("baseline", "share_plain"):
        if group in ppl["groups"]:
            row(group, "— (no maps)", *main_branch(group))
    for group in groups:
        if group in ppl["groups"]:
            row(group, "kv_mse (seed)", *main_branch(group), f"{kv_mse_steps(group):,}", "(dumped rows)")
        if group in seed_init:
            row(group, "kv_mse, random init (seed read literally)", seed_init[group], seed_init[group]["gold_nll"],
                f"{projector[SEED_INIT]['run']['steps']:,}", "(dumped rows)")
        for name, o in objectives.items():
            # each group's maps are trained in its own phase, from ridge (``ridge`` itself: no phase, untrained)
            phase = o["train"]["phases"].get(group, {"steps": 0, "tokens": 0})
            g = o["eval"]["groups"][group]
            row(group, name, g, g["gold_nll"], f"{phase['steps']:,}", f"{phase['tokens']:,}")
    return lines


KEPT = {"best_val": "the epoch of lowest held-out MSE kept (0 = the start)", "last": "the last epoch kept"}


def _kept(fit: dict) -> str:
    """The epochs a trainer's maps ended with (``kept_epoch`` of each map in its metrics), e.g. ``0`` or ``0, 20``."""
    epochs = [m["kept_epoch"] for m in fit["layers"].values() if "kept_epoch" in m]
    epochs += [m[kind]["kept_epoch"] for m in fit["layers"].values() for kind in ("k", "v")
               if isinstance(m.get(kind), dict) and "kept_epoch" in m[kind]]
    return ", ".join(str(e) for e in sorted(set(epochs)))


SUMMARY_BASIS = "decoder_attention"  # the groups' KV bytes: bf16, the decoder's attention layers


def copied_note(evals: dict) -> list[str]:
    """One sentence naming the objective rows copied from the main branch (its maps, byte for byte), if any."""
    copied = evals.get("copied_from_main") or {}
    if not copied:
        return []
    labels = ", ".join(f"`{label}`" for label in copied)
    return [f"Not re-scored: {labels} read the main branch's maps byte for byte (the same tensors), so their "
            "rows are the main branch's rows (`eval_ppl`, `eval_gsm8k`), copied, as scoring them again gives."]


def group_rows(ppl: dict, gsm: dict, storage: dict, objectives: dict[str, dict], groups: list[str],
               generation: dict | None = None, retrieval: dict | None = None) -> dict:
    """Every scored group's numbers, flat: ``metrics/groups.tsv`` (all of them) and the headline's source.

    ``{group: {...}}`` for every runtime group of ``ppl.json``:

    * ``ppl``, ``dppl_pct`` (ΔPPL % vs baseline), ``kl`` (mean per-token KL(baseline ‖ group),
      nats) and ``top1`` (% of tokens whose argmax is the baseline's), each with ``_lo`` /
      ``_hi`` (paired bootstrap 95% CI over records) -- from ``ppl.json``;
    * ``gold_nll`` (GSM8K gold-solution NLL per token), ``dgold_nll`` (minus the baseline's)
      with ``_lo`` / ``_hi``; ``em_strict`` / ``em_flex`` (exact match %, strict-match /
      flexible-extract) with ``_lo`` / ``_hi`` (Wilson 95% CI, %) for the groups lm-eval
      generated for -- from ``gsm8k.json``;
    * ``kv_bytes`` (stored KV bytes per token) and ``kv_compression`` (× vs baseline), bf16 on
      the ``decoder_attention`` basis -- from ``storage.json``;
    * ``gen_first_divergence`` (mean tokens before the greedy text departs from the baseline's),
      ``gen_agreement`` (fraction of generated positions agreeing) and ``gen_dnll`` (Δ plausibility,
      nats/token), each with ``_lo`` / ``_hi`` (bootstrap 95% CI over prompts), for every group and
      ``mode_a`` decoded through its cache -- from ``generation.json`` (``generation``);
    * ``passkey_pct`` (% of the passkey records retrieved through the group's own cache, Wilson 95%
      ``_lo`` / ``_hi``) for the baseline, every group with such a cache and ``mode_a``, and
      ``dpasskey_points`` (the change against the baseline on the same records, points, paired
      bootstrap 95% ``_lo`` / ``_hi``) -- from ``retrieval.json`` (``retrieval``);

    plus ``{"<group>@<objective>": {"ppl", "dppl_pct", "kl", "top1", "gold_nll", "dgold_nll", ...}}``
    (with their CIs) for each ``train.eval_groups`` group under each tuned objective
    (``objectives[name]["eval"]``: from ``eval_objectives``, against the baseline it scores), and
    ``mode_a`` (when the plan covers): prefix ``ppl``, ``dppl_pct``, ``kl``, ``top1`` against
    the plain prefill, ``em_*``, ``gold_nll``, ``dgold_nll`` (vs the baseline); no timings
    (they differ between runs: ``timings/``).  Values are copied (EM and CI
    scaled to %), never rounded.
    """
    out: dict[str, dict[str, float]] = {}
    kv = storage["active_model"]["kv"]["bf16"][SUMMARY_BASIS]
    for group, p in ppl["groups"].items():
        row = {"ppl": p["ppl"], **_deltas(p, "dppl_pct", "delta_pct"), **_agreements(p)}
        g = gsm["groups"].get(group)
        if g:
            row |= {"gold_nll": g["gold_nll"]["nll_per_token"], **_deltas(g["gold_nll"], "dgold_nll", "delta")}
        if g and "strict-match" in g:  # the groups lm-eval generated for (eval_gsm8k.generate)
            row |= _exact_match(g)
        if group in kv:
            row |= {"kv_bytes": kv[group]["bytes_per_token"], "kv_compression": kv[group]["compression_vs_baseline"]}
        out[group] = row
    for name, o in objectives.items():
        for group in (g for g in groups if g in o["eval"]["groups"]):  # seed_init scores ced only
            e = o["eval"]["groups"][group]
            out[f"{group}@{name}"] = {"ppl": e["ppl"], **_deltas(e, "dppl_pct", "delta_pct"), **_agreements(e),
                                      "gold_nll": e["gold_nll"]["nll_per_token"],
                                      **_deltas(e["gold_nll"], "dgold_nll", "delta")}
    a, g = ppl["mode_a"], gsm.get("mode_a", {})
    if a["covered"]:
        out["mode_a"] = {"ppl": a["mode_a"]["ppl"], **_deltas(a, "dppl_pct", "delta_pct"), **_agreements(a)}
        if "strict-match" in g:  # eval_gsm8k.mode_a: generate
            out["mode_a"] |= _exact_match(g)
        if "gold_nll" in g:
            gold = g["gold_nll"]
            out["mode_a"] |= {"gold_nll": gold["nll_per_token"], **_deltas(gold, "dgold_nll", "delta")}
    for name, row in out.items():
        if "@" not in name:
            row |= _domain_columns(domain_results(ppl, name))
    for name, g in (generation or {}).get("groups", {}).items():
        if name in out and name != "baseline":
            out[name] |= _generation_columns(g)
    for name, r in (retrieval or {}).get("groups", {}).items():
        if name in out:
            out[name] |= _retrieval_columns(r)
    return out


def _generation_columns(g: dict) -> dict:
    """A ``generation.json`` row as ``gen_first_divergence``, ``gen_agreement``, ``gen_dnll`` with ``_lo``/``_hi``."""
    row = {}
    for name, key in (("gen_first_divergence", "first_divergence_mean"), ("gen_agreement", "agreement"),
                      ("gen_dnll", "delta_nll")):
        row |= {name: g[key], f"{name}_lo": g[f"{key}_ci95"][0], f"{name}_hi": g[f"{key}_ci95"][1]}
    return row


def _retrieval_columns(r: dict) -> dict:
    """A ``retrieval.json`` row as ``passkey_pct`` and, but for the baseline, ``dpasskey_points`` (``_lo``/``_hi``)."""
    row = {"passkey_pct": r["accuracy_pct"], "passkey_pct_lo": r["accuracy_ci95"][0],
           "passkey_pct_hi": r["accuracy_ci95"][1]}
    if "delta_points" in r:
        row |= {"dpasskey_points": r["delta_points"], "dpasskey_points_lo": r["delta_points_ci95"][0],
                "dpasskey_points_hi": r["delta_points_ci95"][1]}
    return row


def domain_results(ppl: dict, group: str) -> dict[str, dict]:
    """``{domain: result}`` of ``group`` (or ``mode_a``) on every other domain of ``ppl.json`` (``domains``)."""
    out = {}
    for domain, d in ppl.get("domains", {}).items():
        result = d["mode_a"] if group == "mode_a" else d["groups"].get(group)
        if result and result.get("covered", True):
            out[domain] = result
    return out


def _domain_columns(results: dict[str, dict]) -> dict:
    """``<domain>_ppl``, ``<domain>_dppl_pct``, ``<domain>_kl``, ``<domain>_top1`` (with ``_lo``/``_hi``) of every
    other domain, and ``worst_domain_dppl_pct`` / ``worst_domain`` (the largest of them; none for the baseline)."""
    row: dict = {}
    for domain, r in results.items():
        ppl = r["mode_a"]["ppl"] if "mode_a" in r else r["ppl"]
        row |= {f"{domain}_ppl": ppl, **{f"{domain}_{k}": v for k, v in
                                         {**_deltas(r, "dppl_pct", "delta_pct"), **_agreements(r)}.items()}}
    worst = max((d for d in results if f"{d}_dppl_pct" in row), key=lambda d: row[f"{d}_dppl_pct"], default=None)
    if worst is not None:
        row |= {"worst_domain_dppl_pct": row[f"{worst}_dppl_pct"], "worst_domain": worst}
    return row


# per compressed group; the baseline: BASELINE_HEADLINE
HEADLINE = ("dppl_pct", "kl", "dgold_nll", "worst_domain_dppl_pct", "gen_agreement", "gen_dnll", "passkey_pct")
BASELINE_HEADLINE = ("ppl", "gold_nll", "passkey_pct")
# Rows whose ΔPPL and KL are not against the baseline's PPL of the headline's first row.
HEADLINE_LABELS = {"mode_a": "mode_a (ΔPPL, KL: against the plain prefill, on each record's second half)"}


def summary(rows: dict[str, dict[str, float]]) -> dict:
    """``metrics/summary.json``, the DVC metrics: a screen of numbers that `dvc metrics diff` compares.

    Of :func:`group_rows`: the baseline's ``ppl``, ``gold_nll`` and ``passkey_pct``; for every other runtime
    group and ``mode_a``, the changes :data:`HEADLINE` (no intervals, no fits, no timings; the
    ``<group>@<objective>`` rows, intervals, top-1, EM, bytes and each domain's figures are in
    ``metrics/groups.tsv``).  ``worst_domain_dppl_pct``: ΔPPL % on the other domain where it is largest;
    ``gen_agreement`` / ``gen_dnll``: greedy decoding through the group's own cache against the baseline's;
    ``passkey_pct``: % of the passkey records retrieved through it (the baseline's too, which the others'
    are read against: a group's paired change with its interval is in ``metrics/groups.tsv``).
    """
    return {group: {k: row[k] for k in (HEADLINE if "dppl_pct" in row else BASELINE_HEADLINE) if k in row}
            for group, row in rows.items() if "@" not in group}


def headline_table(summary: dict[str, dict[str, float]]) -> list[str]:
    """The headline as a Markdown table, from ``metrics/summary.json`` alone (the report's and README's first table).

    One row per group in the summary's order: the baseline's PPL and gold NLL, then each
    group's ΔPPL %, KL, Δ gold NLL, ΔPPL % on its worst other domain, its greedy decoding's
    agreement with the baseline and Δ plausibility, and the passkey records it retrieves (the
    baseline's too; "–" where the group has none).
    """
    lines = ["| group | ΔPPL % (baseline: PPL) | KL nats/token | Δ gold NLL (baseline: NLL) "
             "| ΔPPL % worst other domain | greedy agreement | Δ plausibility nats/token | passkey % |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    formats = {"kl": ".4f", "dgold_nll": "+.4f", "worst_domain_dppl_pct": "+.2f", "gen_agreement": ".3f",
               "gen_dnll": "+.4f", "passkey_pct": ".0f"}
    for group, row in summary.items():
        if "dppl_pct" not in row:
            cells = [f"{row['ppl']:.3f}", "–", f"{row['gold_nll']:.4f}" if "gold_nll" in row else "–", "–", "–", "–",
                     f"{row['passkey_pct']:{formats['passkey_pct']}}" if "passkey_pct" in row else "–"]
        else:
            cells = [f"{row['dppl_pct']:+.2f}", *(f"{row[k]:{f}}" if k in row else "–" for k, f in formats.items())]
        lines.append(f"| {HEADLINE_LABELS.get(group, group)} | " + " | ".join(cells) + " |")
    return lines


def generation_table(generation: dict) -> list[str]:
    """``generation.json`` as the report's table: per group its cache, first divergence (mean, median),
    agreement, Δ plausibility (95% CIs) and bytes per cached position, with the protocol first."""
    p = generation["protocol"]

    def ci(value: float, bounds: list[float], fmt: str) -> str:
        return f"{value:{fmt}} [{bounds[0]:{fmt}}, {bounds[1]:{fmt}}]"

    lines = [f"Greedy decoding through each group's own cache: {p['model']} ({p['dtype']}), n = {p['prompts']} prompts "
             f"of {p['prompt_tokens']} tokens from {p['data']} (domain {p['domain']}), N = {p['new_tokens']} new "
             f"tokens each ({p['cached_positions']} cached positions after the last step), FP4 format "
             f"{p['kv_format']}; against {p['reference']}; Δ plausibility: {p['plausibility']}; CIs: {p['ci']}.", "",
             "| group | cache | first divergence, mean | median | agreement | Δ plausibility nats/token | "
             "used B/token | allocated B/token | used / baseline | allocated / baseline |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for g, r in generation["groups"].items():
        lines.append(
            f"| {g} | {r['cache']} | {ci(r['first_divergence_mean'], r['first_divergence_mean_ci95'], '.1f')} | "
            f"{ci(r['first_divergence_median'], r['first_divergence_median_ci95'], '.1f')} | "
            f"{ci(r['agreement'], r['agreement_ci95'], '.3f')} | {ci(r['delta_nll'], r['delta_nll_ci95'], '+.4f')} | "
            f"{r['used_bytes_per_token']:,.0f} | {r['allocated_bytes_per_token']:,.0f} | "
            f"{r['used_ratio_to_baseline']:.3f} | {r['allocated_ratio_to_baseline']:.3f} |")
    return lines + _not_run(p)


def _not_run(protocol: dict) -> list[str]:
    """The groups a decoding stage could not run, with why (none: no line)."""
    if not protocol["not_run"]:
        return []
    return ["", "Not run (no cache holds their bytes yet): "
            + "; ".join(f"`{g}`: {why}" for g, why in protocol["not_run"].items()) + "."]


def retrieval_table(retrieval: dict) -> list[str]:
    """``retrieval.json`` as the report's table: per label the records retrieved, accuracy [Wilson 95%] and the
    change against the baseline on the same records [paired bootstrap 95%], with the protocol first."""
    p = retrieval["protocol"]
    lines = [f"Passkey retrieval through each group's own cache: {p['model']} ({p['dtype']}), n = {p['records']} "
             f"records of {p['length']:,} tokens, {p['digits']}-digit keys, seed {p['seed']}, filler {p['filler']} "
             f"(domain {p['domain']}), needle depth {p['depth']}; {p['task']}; FP4 format {p['kv_format']}; "
             f"CIs: {p['ci']}.", "",
             "| group | retrieved | accuracy % | Δ points vs baseline |", "|---|---:|---:|---:|"]
    for g, r in retrieval["groups"].items():
        lo, hi = r["accuracy_ci95"]
        delta = (f"{r['delta_points']:+.1f} [{r['delta_points_ci95'][0]:+.1f}, {r['delta_points_ci95'][1]:+.1f}]"
                 if "delta_points" in r else "–")
        lines.append(f"| {g} | {r['retrieved']}/{r['n']} | {r['accuracy_pct']:.1f} [{lo:.1f}, {hi:.1f}] | {delta} |")
    return lines + _not_run(p)


def domains_table(rows: dict[str, dict], ppl: dict) -> list[str]:
    """Every group's (and Mode A's) ΔPPL % [95% CI] on the fitting domain's held-out records and on each other
    domain, and its worst other domain as a multiple of the held-out figure; last, the GSM8K gold solutions'
    Δ gold NLL as the same kind of figure (``exp(Δ) − 1``: gold-solution perplexity's change, in %).  Empty
    without other domains."""
    domains = list(ppl.get("domains", {}))
    if not domains:
        return []
    fitted = ppl["protocol"]["data"]
    trained = {d for d, v in ppl["domains"].items() if v["protocol"].get("trained_on_domain")}
    head = ["group", f"{fitted} (held out)", *(f"{d} (trained on)" if d in trained else d for d in domains),
            "worst ÷ held out", "GSM8K gold solutions"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for group, row in rows.items():
        if "@" in group or "dppl_pct" not in row:
            continue
        cells = [_range(row, "dppl_pct")] + [_range(row, f"{d}_dppl_pct") for d in domains]
        ratio = (f"{row['worst_domain_dppl_pct'] / row['dppl_pct']:.2f}× ({row['worst_domain']})"
                 if "worst_domain" in row and row["dppl_pct"] > 0 else "–")
        # exp is monotone: the interval's ends map to the interval of exp(Δ) - 1
        gold = _range({f"g{end}": 100 * math.expm1(row[f"dgold_nll{end}"]) for end in ("", "_lo", "_hi")}, "g") \
            if "dgold_nll" in row else "–"
        lines.append(f"| {HEADLINE_LABELS.get(group, group)} | " + " | ".join([*cells, ratio, gold]) + " |")
    return lines


def domains_protocol(ppl: dict) -> str:
    """One sentence: what each domain's figures were measured on (records, scored tokens)."""
    parts = [f"`{d}` {v['protocol']['records']} records ({v['protocol']['tokens_scored']:,} scored tokens)"
             for d, v in ppl.get("domains", {}).items()]
    p = ppl["protocol"]
    fitted = p.get("fitted_on", p["data"])
    return (f"Maps fitted on {fitted}. Held-out records of `{p['data']}`: {p['records']} records "
            f"({p['tokens_scored']:,} scored tokens); the other domains' evaluation records (never a training "
            f"record): {', '.join(parts)}. "
            "Same protocol on each (teacher-forced, every group and Mode A, Mode A on each record's second half "
            "against the plain prefill); paired bootstrap 95% intervals over that domain's records.")


def _range(row: dict, key: str) -> str:
    """``+1.23 [+0.45, +2.01]`` of a flat row's ``key`` and its ``_lo``/``_hi`` (``–`` where it has none)."""
    if key not in row:
        return "–"
    return f"{row[key]:+.2f} [{row[f'{key}_lo']:+.2f}, {row[f'{key}_hi']:+.2f}]"



def groups_table(rows: dict[str, dict[str, float]]) -> list[dict]:
    """``metrics/groups.tsv``: one row per group of :func:`group_rows`, every column; '' where a group has none."""
    columns = list(dict.fromkeys(k for row in rows.values() for k in row))
    return [{"group": group, **{c: row.get(c, "") for c in columns}} for group, row in rows.items()]


def _agreements(d: dict) -> dict:
    return {**_deltas(d, "kl", "kl"), **_deltas(d, "top1", "top1_pct")}


def _exact_match(g: dict) -> dict:
    """``em_strict`` / ``em_flex`` and their Wilson 95% bounds, in %."""
    row = {}
    for key, name in (("em_strict", "strict-match"), ("em_flex", "flexible-extract")):
        lo, hi = g[name]["ci95"]
        row |= {key: 100 * g[name]["exact_match"], f"{key}_lo": 100 * lo, f"{key}_hi": 100 * hi}
    return row


def _deltas(d: dict, name: str, key: str) -> dict:
    """``{name, name_lo, name_hi}`` from a change and its paired-bootstrap interval (empty for the baseline)."""
    if key not in d:
        return {}
    lo, hi = d[f"{key}_ci95"]
    return {name: d[key], f"{name}_lo": lo, f"{name}_hi": hi}


def chat_note(gsm_protocol: dict) -> str:
    """', chat template (exemplars as turns)' when lm-eval formatted the prompts as a chat ('' otherwise)."""
    if not gsm_protocol.get("apply_chat_template"):
        return ""
    return ", chat template" + (" (exemplars as turns)" if gsm_protocol.get("fewshot_as_multiturn") else "")


def protocol_line(ppl: dict, gsm: dict) -> str:
    p, g = ppl["protocol"], gsm["protocol"]
    return (f"Model **{p['model']}**, {p['dtype']} on {p['device']}; "
            f"PPL on {p['records']} held-out records of `{p['data']}` ({p['tokens_scored']:,} scored tokens, "
            f"{p['basis']}); GSM8K on **{g.get('label', g.get('math_set'))}** (n = {g['n']}, "
            f"{g['num_fewshot']}-shot{chat_note(g)}, greedy, ≤ {g['max_gen_toks']} new tokens, lm-eval "
            f"{g.get('lm_eval')}). "
            "KV bytes: bf16, per token, on the stated basis (docs/design.md §6).")


def window_line(storage: dict) -> str:
    """How the active model's sliding-window layers are counted ('' when it has none)."""
    windows = storage["active_model"]["geometry"].get("sliding_windows") or {}
    if not windows:
        return ""
    sizes = ", ".join(str(w) for w in sorted(set(windows.values())))
    return (f"Sliding-window layers ({len(windows)}: {', '.join(windows)}; window {sizes}) are counted per token "
            "in the per-token bases, the figure for a context within the window; storage.json's amortised bases "
            "hold min(context, window − 1) entries for them.")


# Fixed axes, so that two revisions' figures compare at a glance: ΔPPL % on a log axis over
# [DPPL_LIMITS]; a change below the lower limit is drawn at it (its bar says so).
DPPL_LIMITS = (0.1, 1000.0)


def _dppl_rows(ppl: dict) -> list[tuple[str, float, float, float]]:
    """``(label, ΔPPL %, lo, hi)`` of every compressed group and Mode A, smallest change first."""
    rows = [(g, d["delta_pct"], *d["delta_pct_ci95"]) for g, d in ppl["groups"].items() if "delta_pct" in d]
    a = ppl.get("mode_a", {})
    if a.get("covered"):
        rows.append(("mode_a (prefill skip)", a["delta_pct"], *a["delta_pct_ci95"]))
    return sorted(rows, key=lambda r: r[1])


def frontier(rows: dict[str, dict[str, float]]) -> list[dict]:
    """Every row of :func:`group_rows` that stores KV, fewest bytes first, marked where it is on the Pareto front.

    A recipe ``<group>@<objective>`` stores what its group stores; ``mode_a`` saves compute, not
    bytes, and is left out.  Each point: ``name``, ``kv_bytes``, ``kv_compression``, ``dppl_pct``
    with ``_lo``/``_hi`` (0 for the baseline) and ``front``: no other row stores at most as many
    bytes at a ΔPPL at most as large, one of them strictly less -- the row to pick at its byte
    budget.  The point estimates decide; the intervals say how sure that pick is.
    """
    points = []
    for name, r in rows.items():
        kv = rows.get(name.split("@")[0], {})
        if "kv_bytes" not in kv:
            continue
        d = {k: r.get(k, 0.0) for k in ("dppl_pct", "dppl_pct_lo", "dppl_pct_hi")}
        points.append({"name": name, "kv_bytes": kv["kv_bytes"], "kv_compression": kv["kv_compression"], **d})
    for p in points:
        p["front"] = not any(q["kv_bytes"] <= p["kv_bytes"] and q["dppl_pct"] <= p["dppl_pct"]
                             and (q["kv_bytes"] < p["kv_bytes"] or q["dppl_pct"] < p["dppl_pct"]) for q in points)
    return sorted(points, key=lambda p: (p["kv_bytes"], p["dppl_pct"]))


def frontier_table(points: list[dict]) -> list[str]:
    """:func:`frontier` as a Markdown table, the front's rows in bold."""
    lines = ["| KV bytes/token | compression | group / recipe | ΔPPL % [95% CI] | Pareto front |",
             "|---:|---:|---|---|:---:|"]
    for p in points:
        d = ("–" if p["name"] == "baseline" else
             f"{p['dppl_pct']:+.2f} [{p['dppl_pct_lo']:+.2f}, {p['dppl_pct_hi']:+.2f}]")
        name = f"**{p['name']}**" if p["front"] else p["name"]
        lines.append(f"| {p['kv_bytes']:,g} | {p['kv_compression']:.2f}× | {name} | {d} | {'✓' if p['front'] else ''} |")
    return lines


# Quality goals beyond the seed's contract, ΔPPL % vs baseline: a group's own row or one of its recipes.
GROUP_GOALS = {"ced": 2.0, "csa2": 4.0, "ced_csa2": 9.0}
# ΔPPL % at most, at a compression of at least (x), by a group storing its entries in a block format (FP4, FP6)
KV_FORMAT_GOAL = (2.0, 3.0)


def _counts_for(row: str, group: str) -> bool:
    """Whether ``row`` (a group or ``<group>@<objective>``) is a way of running ``group``: the same maps and
    sharing (:attr:`~ced_csa2.groups.Group.layout`), no block-format entries (``ced_sink`` counts for
    ``ced`` and ``ced_csa2_sink`` for ``ced_csa2``, ``csa2_fp4`` not for ``csa2``)."""
    base = GROUPS.get(row.split("@")[0])
    return base is not None and base.layout == GROUPS[group].layout and not base.stores_block_format


def goals(rows: dict[str, dict[str, float]]) -> list[dict]:
    """The quality goals against this run's rows of :func:`group_rows`: the best row for each, and whether it meets it.

    Each: ``goal`` (its wording), ``best`` (the row's name, ``None`` when no row qualifies), ``dppl_pct``
    with ``_lo``/``_hi``, ``met``.  A group's goal takes its own row, its ``<group>@<objective>``
    recipes and the rows of groups that only keep other entries (:func:`_counts_for`); the format goal
    takes the groups that store block-format entries
    (:attr:`~ced_csa2.groups.Group.stores_block_format`) and compress at least ``KV_FORMAT_GOAL[1]``x.
    """
    out = []
    candidates = [(f"`{group}` ≤ +{limit:g}%", limit, [n for n in rows if _counts_for(n, group)])
                  for group, limit in GROUP_GOALS.items()]
    limit, ratio = KV_FORMAT_GOAL
    candidates.append((f"KV format ≤ +{limit:g}% at ≥ {ratio:g}×", limit,
                       [n for n, r in rows.items() if n in GROUPS and GROUPS[n].stores_block_format
                        and r.get("kv_compression", 0) >= ratio]))
    for goal, limit, names in candidates:
        best = min(names, key=lambda n: rows[n]["dppl_pct"], default=None)
        r = rows[best] if best else {}
        out.append({"goal": goal, "best": best, **{k: r.get(k) for k in ("dppl_pct", "dppl_pct_lo", "dppl_pct_hi")},
                    "met": best is not None and r["dppl_pct"] <= limit})
    return out


def goals_table(met: list[dict]) -> list[str]:
    """:func:`goals` as a Markdown table."""
    lines = ["| goal | best row of this run | ΔPPL % [95% CI] | met? |", "|---|---|---|---|"]
    for g in met:
        d = "–" if g["best"] is None else f"{g['dppl_pct']:+.2f} [{g['dppl_pct_lo']:+.2f}, {g['dppl_pct_hi']:+.2f}]"
        lines.append(f"| {g['goal']} | {g['best'] or 'none qualifies'} | {d} | {'yes' if g['met'] else 'no'} |")
    return lines


def plots(out: Path, ppl: dict, adapters: dict, storage: dict, points: list[dict], generation: dict) -> list[Path]:
    """The report's four figures under ``out``: ΔPPL with intervals and compression, adapter fit, the
    bytes–quality frontier (``points``: :func:`frontier`), and greedy agreement by position (``generation``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths, model = [], ppl["protocol"]["model"]
    kv = storage["active_model"]["kv"]["bf16"]["decoder_attention"]
    rows = _dppl_rows(ppl)
    lo_lim, hi_lim = DPPL_LIMITS
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9, 0.35 * len(rows) + 1.2), sharey=True,
                                 gridspec_kw={"width_ratios": [3, 1]})
    ys = range(len(rows))
    values = [min(max(r[1], lo_lim), hi_lim) for r in rows]
    errors = [[v - min(max(r[2], lo_lim), v) for v, r in zip(values, rows)],
              [min(max(r[3], v), hi_lim) - v for v, r in zip(values, rows)]]
    ax.barh(ys, values, xerr=errors, color="#4c72b0", ecolor="#222222", capsize=2)
    for y, r, v, up in zip(ys, rows, values, errors[1]):  # the value right of its interval
        ax.text((v + up) * 1.1, y, f"{r[1]:+.1f}%" + (" (below axis)" if r[1] < lo_lim else ""), va="center",
                fontsize=7)
    ax.set_xscale("log")
    ax.set_xlim(lo_lim, hi_lim)
    ax.set_yticks(list(ys), [r[0] for r in rows], fontsize=8)
    ax.set_xlabel("ΔPPL % vs baseline (log axis; bars: paired 95% CI)")
    ax.set_title(f"Quality cost by group ({model}, embedded default)", fontsize=9)
    comp = [kv.get(r[0], {}).get("compression_vs_baseline", float("nan")) for r in rows]
    bx.barh(ys, comp, color="#55a868")
    bx.set_xlabel("KV compression ×\n(bf16, decoder attention)")
    bx.set_xlim(0, max([c for c in comp if c == c] + [1.0]) * 1.15)
    paths.append(write_png(fig, out / "ppl_by_group.png"))

    fig, ax = plt.subplots(figsize=(6, 3.5))
    # Layer numbers, not the JSON keys' strings: matplotlib would plot strings as categories
    # (and log a warning per line that they look like numbers).
    layers = [int(t) for t in adapters["layers"]]
    same = True
    for kind, marker in (("k", "o"), ("v", "s")):
        fits = {stage: [adapters["layers"][str(t)][kind][stage]["cos"] for t in layers] for stage in ("ridge", "trained")}
        same &= fits["ridge"] == fits["trained"]
        for stage, style in (("ridge", "--"), ("trained", "-")):
            ax.plot(layers, fits[stage], style, marker=marker, label=f"{kind.upper()} {stage}")
    ax.set_xticks(layers)
    ax.set_xlabel("target layer")
    ax.set_ylabel("held-out mean cosine")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title("CSA2 adapter fit per target layer" + (" (trained = ridge: the start was kept)" if same else ""),
                 fontsize=9)
    paths.append(write_png(fig, out / "adapter_cosine.png"))

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    numbered = [(i, p) for i, p in enumerate((p for p in points if p["name"] != "baseline"), 1)]
    labels: list[tuple[float, float, list[int]]] = []  # points closer than a label's size share one label
    for i, p in numbered:
        x, y = p["kv_bytes"], min(max(p["dppl_pct"], lo_lim), hi_lim)
        lo, hi = (min(max(p[k], lo_lim), hi_lim) for k in ("dppl_pct_lo", "dppl_pct_hi"))
        ax.errorbar(x, y, yerr=[[y - min(lo, y)], [max(hi, y) - y]], marker="o", capsize=2, linewidth=0.8,
                    color="#dd8452" if p["front"] else "#4c72b0")
        near = next((q for q in labels if abs(q[0] - x) < 300 and abs(math.log10(q[1] / y)) < 0.08), None)
        if near:
            near[2].append(i)
        else:
            labels.append((x, y, [i]))
    for x, y, ids in labels:
        ax.annotate(",".join(map(str, ids)), (x, y), textcoords="offset points", xytext=(5, 2), fontsize=7)
    front = [p for p in points if p["front"]]  # the baseline (ΔPPL 0, drawn at the axis' floor) included
    base = next((p for p in points if p["name"] == "baseline"), None)
    if base is not None:
        ax.scatter(base["kv_bytes"], lo_lim, marker="s", color="black", zorder=3, label="baseline (ΔPPL 0, at the floor)")
    ax.plot([p["kv_bytes"] for p in front], [min(max(p["dppl_pct"], lo_lim), hi_lim) for p in front],
            drawstyle="steps-post", color="#dd8452", linewidth=1, label="Pareto front (fewer bytes, lower ΔPPL)")
    ax.set_yscale("log")
    ax.set_ylim(lo_lim, hi_lim)
    ax.set_xlim(0, max([p["kv_bytes"] for p in points] + [1.0]) * 1.15)
    ax.set_xlabel("stored KV bytes/token (bf16, decoder attention layers)")
    ax.set_ylabel("ΔPPL % vs baseline (log; bars: paired 95% CI)")
    ax.set_title(f"Bytes vs quality, every group and recipe ({model})", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    # numbers on the points, names in the key: labels never overlap
    key = "\n".join(f"{i} {p['name']}" + (" *" if p["front"] else "") for i, p in numbered)
    ax.text(1.02, 1.0, key + "\n(* on the front)", transform=ax.transAxes, va="top", fontsize=7, family="monospace")
    paths.append(write_png(fig, out / "bytes_vs_ppl.png"))

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for g, r in generation["groups"].items():
        if g == "baseline":
            continue
        x = range(1, len(r["agreement_by_position"]) + 1)
        line, = ax.plot(x, r["agreement_by_position"], label=g)
        lo, hi = zip(*r["agreement_by_position_ci95"])
        ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
    g = generation["protocol"]
    ax.set_xlabel("position of the generated token")
    ax.set_ylabel("fraction of prompts agreeing with the baseline [95% CI]")
    ax.set_ylim(0, 1.02)
    ax.legend(fontsize=8)
    ax.set_title(f"Greedy decoding through each group's own cache ({model}, n = {g['prompts']}, "
                 f"{g['prompt_tokens']}-token prompts)", fontsize=9)
    paths.append(write_png(fig, out / "agreement.png"))
    return paths


GOLD_PROTOCOL = ("n", "math_set", "num_fewshot", "apply_chat_template", "fewshot_as_multiturn")
# what every result file of one run shares: the model, its numerics and the plan the maps were made for
RUN_PROTOCOL = ("model", "model_revision", "dtype", "plan", "kv_format")


def check_same_protocol(keys: tuple[str, ...], reference: tuple[Path, dict], *others: tuple[Path, dict],
                        measured: str = "was measured") -> None:
    """Refuse result files whose protocols differ from ``reference``'s on ``keys`` (a stale file of another run).

    Each argument is ``(file, its protocol)``; the error names both files and the values that differ.
    """
    name, protocol = reference
    for other, theirs in others:
        differ = {k: (theirs.get(k), protocol.get(k)) for k in keys if theirs.get(k) != protocol.get(k)}
        if differ:
            raise ValueError(f"{other} {measured} with {', '.join(f'{k}={a!r}' for k, (a, _) in differ.items())}, "
                             f"{name} with {', '.join(f'{k}={b!r}' for k, (_, b) in differ.items())}: "
                             "rerun the pipeline")


def build_report(params: Params, workdir: Path) -> tuple[str, dict, tuple[dict, dict, dict, list, dict]]:
    """``reports/results.md``'s text, :func:`group_rows` and the figures' inputs (ppl, adapters, storage and
    the :func:`frontier`) from the detailed results under ``workdir``."""
    workdir = Path(workdir)
    ppl, gsm, storage, generation, retrieval = (_load(workdir, n) for n in ("ppl", "gsm8k", "storage", "generation",
                                                                            "retrieval"))
    # The report itself reads no kv_format: figures of the FP4 groups measured (and bytes counted) in
    # another format than params.yaml's are refused, as every artifact made with other params is.
    # gsm8k.json and objectives/eval.json are held to ppl.json's format below (RUN_PROTOCOL).
    for path, made in ((PPL_METRICS, ppl["protocol"]), (STORAGE_METRICS, storage),
                       (GENERATION_METRICS, generation["protocol"]), (RETRIEVAL_METRICS, retrieval["protocol"])):
        check_provenance(workdir / path, {"kv_format": made.get("kv_format")}, params)
    ridge, projector, adapters = (_load(workdir, n) for n in ("ridge", "projector", "adapters"))
    evals = _load(workdir, Path("objectives") / "eval")
    missing = [o for o in params.train.objectives if o not in evals.get("objectives", {})]
    if missing or SEED_INIT not in evals:
        missing = missing or [SEED_INIT]
        raise ValueError(f"{workdir / OBJECTIVES_EVAL} has no scores for objectives {missing}: "
                         "run `dvc repro eval_objectives`")
    check_same_protocol(RUN_PROTOCOL, (PPL_METRICS, ppl["protocol"]), (GSM8K_METRICS, gsm["protocol"]),
                        (OBJECTIVES_EVAL, evals["protocol"]))
    check_same_protocol(GOLD_PROTOCOL, (GSM8K_METRICS, gsm["protocol"]), (OBJECTIVES_EVAL, evals["gold_protocol"]),
                        measured="scored gold NLL")
    objectives = {o: {"train": _load(workdir, Path("objectives") / o / "train"),
                      "eval": {"protocol": evals["protocol"], **evals["objectives"][o]}} for o in params.train.objectives}
    groups = params.train.eval_groups
    windows = window_line(storage)
    rows = group_rows(ppl, gsm, storage, objectives | {SEED_INIT: {"eval": {"groups": evals[SEED_INIT]}}}, groups,
                      generation, retrieval)
    points = frontier(rows)
    text = "\n".join([
        "# Results", "", protocol_line(ppl, gsm), "", *([windows, ""] if windows else []),
        "## Headline (metrics/summary.json; intervals in metrics/groups.tsv)", "", *headline_table(summary(rows)), "",
        *results_table(ppl, gsm, storage), "",
        *gsm_note(ppl, gsm),
        *(["## Other domains: how the maps transfer (ΔPPL % vs baseline)", "", domains_protocol(ppl), "",
           *domains_table(rows, ppl), ""] if ppl.get("domains") else []),
        "## Generation through each group's own cache", "", *generation_table(generation), "",
        "![agreement by position](agreement.png)", "",
        "## Passkey retrieval through each group's own cache", "", *retrieval_table(retrieval), "",
        "## Mode A: true CED (prefill skip)", "", *mode_a_table(ppl, gsm, _load(workdir, Path("mode_a") / "train")), "",
        "## Training objectives", "",
        "Same PPL and gold-NLL protocols as above; Δ against the baseline. `kv_mse (seed)` is the main "
        f"branch (projector from {projector['run']['init']} init, batch "
        f"{projector['run']['batch_size']}, {projector['run']['steps']:,} AdamW steps, "
        f"{KEPT[projector['run']['keep']]} (kept: epoch {_kept(projector)}); adapters from ridge on the true "
        f"source K/V, {KEPT[adapters['run']['keep']]} (kept epochs {_kept(adapters)}); K/V MSE); "
        "`kv_mse, random init` is the seed's projector recipe read literally (PyTorch's init, the last "
        "epoch), for `ced`; every other objective starts from the ridge maps (`ridge` = "
        "that start, untrained) and gives each group the maps made for it: `ced_csa2` gets its own projector "
        f"and adapters (starting from {CED_CSA2_START[params.train.ced_csa2_start]}), trained jointly under "
        "`ced_csa2` by the online objectives. Optimizer steps: what the maps a row reads were trained with -- "
        "for `kv_mse` the projector's AdamW steps (`ced`), the adapters' SGD steps (`csa2`) or both "
        "(`ced_csa2`), over dumped K/V rows; for an online objective the steps and tokens of the group's own "
        "phase (metrics/objectives/*/train.json). Wall times of every stage: "
        "`timings/<stage>.json` after a run.", "",
        *objective_table(ppl, gsm, projector, adapters, objectives, evals[SEED_INIT], groups), "",
        *copied_note(evals), "",
        "## Fit of the maps (held-out tokens)", "", *fit_table(ridge, projector, adapters), "",
        *start_kept_note(projector, adapters),
        *served_fit_table(ridge, list(adapters["layers"]), params.train_adapters.input), "",
        "Qwen3.5-4B geometry (computed from its config, no weights): "
        + ", ".join(f"{b}: baseline {storage['qwen3_5_4b']['kv']['bf16'][b]['baseline']['bytes_per_token']:,.0f} → "
                    f"csa2 {storage['qwen3_5_4b']['kv']['bf16'][b]['csa2']['bytes_per_token']:,.0f} B/token"
                    for b in BASES) + ".", "",
        f"_{storage['note']}_", "",
        "## Bytes and quality: the frontier", "",
        "Every group and recipe that stores KV (a recipe `<group>@<objective>` stores what its group stores), "
        "fewest bytes first; on the Pareto front (bold) no other row stores at most as many bytes at a ΔPPL at "
        "most as large: at each byte budget, the row of the front at or below it is the one to pick. Point "
        "estimates decide; the intervals say how sure the pick is.", "",
        *frontier_table(points), "",
        "## Quality goals beyond the seed", "",
        "Goals beyond the seed's contract, against this run's rows (each group's own row and its recipes; "
        "4-bit: the FP4 groups). Branches outside the default that meet them (more training records, "
        "`distill`, the attention sink kept, K in FP6) are studies, each with its command and measured time: "
        "docs/results.md, \"Beyond the seed\".", "",
        *goals_table(goals(rows)), "",
        "![PPL by group](ppl_by_group.png) ![adapter cosine](adapter_cosine.png) ![bytes vs PPL](bytes_vs_ppl.png)", "",
    ])
    return text, rows, (ppl, adapters, storage, points, generation)
