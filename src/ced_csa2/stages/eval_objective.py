"""``eval_objective@<objective>`` stages: perplexity and GSM8K gold NLL of one objective's maps.

    python -m ced_csa2.stages.eval_objective distill     # what `dvc repro eval_objective@distill` runs

Scores the maps of ``models/objectives/<objective>/`` (stage ``tune@<objective>``; the
``ced_csa2*`` groups with the pair in its ``ced_csa2/`` folder, trained for them) for every
group of ``train.eval_groups`` with exactly the main branch's protocols: the eval
records' corpus-level perplexity (:func:`ced_csa2.perplexity.groups_ppl`) and the gold-solution
NLL on the tokenised prompts of stage ``gold_pairs`` (``data/gsm8k_gold.json``, no model
run), so ``dvc repro eval_objective@<objective>`` never runs ``eval_gsm8k``'s generation.
Exact-match accuracy is not re-run here (generation dominates GSM8K's cost and scores ~0
on the embedded model); the report takes ΔPPL against the main branch's baseline.

Writes ``metrics/objectives/<objective>/eval.json``:
``{"objective", "protocol": {...}, "gold_protocol": {...}, "groups": {group: {ppl, nll_per_token, tokens, gold_nll}}}``.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..ced_runtime import CEDParts, load_parts
from ..config import Params, require_listed
from ..entry import objective_arg, run_stage
from ..groups import GROUPS
from ..gsm8k import groups_gold_nll, load_gold_pairs
from ..io_utils import write_json
from ..model_utils import Geometry, load_model_and_tokenizer, resolve_device
from ..paths import GOLD_PATH, objective_metrics, objective_models
from ..perplexity import eval_ids, groups_ppl, protocol
from ..plan import LayerPlan, load_plan


def load_objective_parts(workdir: Path, objective: str, params: Params, plan: LayerPlan, geo: Geometry,
                         device) -> dict[str, CEDParts]:
    """The maps ``tune@<objective>`` wrote, per group: ``{group: CEDParts}`` for ``train.eval_groups``.

    The groups that project the source *and* adapt it (``ced_csa2*``) get the pair trained
    for them (``.../ced_csa2/``); the others the ``ced``/``csa2`` pair.  No extra sources
    (Mode B only).  Checked as :func:`ced_csa2.ced_runtime.load_parts` checks the main
    branch's maps (model, layer(s), ``hidden_size``/``kv_dim``, plan), plus ``objective``.
    """
    folder = workdir / objective_models(objective)
    pairs = {sub: load_parts(folder / sub, params, plan, geo, device=device, also={"objective": objective},
                             extra_sources=False) for sub in ("", "ced_csa2")}
    return {g: pairs["ced_csa2" if GROUPS[g].projected_source and GROUPS[g].adapters else ""]
            for g in params.train.eval_groups}


def run(params: Params, objective: str, workdir: Path = Path("."), *, model_and_tok=None) -> dict:
    """Score ``train.eval_groups`` with the objective's maps; returns ``eval.json``'s content."""
    workdir, t0 = Path(workdir), time.perf_counter()
    require_listed(params, objective)
    plan, geo = load_plan(params.plan, params.model)
    pairs = load_gold_pairs(workdir / GOLD_PATH, params)
    model, tok = model_and_tok or load_model_and_tokenizer(params.model, device=resolve_device(params.eval_ppl.device))
    parts = load_objective_parts(workdir, objective, params, plan, geo, model.device)
    ids = eval_ids(params, tok, workdir)
    # Every group at once on each batch (one shared trunk): the same figures as one group at a time.
    # The baseline rides along (one more branch of the trunk) for the paired ΔPPL / Δ gold NLL intervals.
    eval_groups = params.train.eval_groups
    scored = ["baseline", *eval_groups]
    ppl = groups_ppl(model, plan, scored, parts, ids, params, tok.pad_token_id)
    gold = groups_gold_nll(model, plan, scored, parts, pairs, params.eval_gsm8k.batch_size, tok.pad_token_id,
                           kv_format=params.kv_format, seed=params.seed,
                           block_tokens=params.eval_ppl.score_block_tokens)
    groups = {group: {**ppl[group], "gold_nll": gold[group]} for group in eval_groups}
    metrics = {
        "objective": objective,
        "protocol": protocol(params, model, plan, ids, groups[params.train.eval_groups[0]]["tokens"]),
        "gold_protocol": {"math_set": params.data.math.label, "math_revision": params.data.math.revision,
                          "n": len(pairs), "num_fewshot": params.eval_gsm8k.num_fewshot, "source": str(GOLD_PATH)},
        "groups": groups,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    write_json(workdir / objective_metrics(objective) / "eval.json", metrics)
    return metrics


def main() -> None:
    run_stage(run, objective_arg("eval_objective"))


if __name__ == "__main__":
    main()
