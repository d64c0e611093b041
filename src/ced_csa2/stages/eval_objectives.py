"""``eval_objectives`` stage: perplexity and GSM8K gold NLL of every training objective's maps.

    python -m ced_csa2.stages.eval_objectives     # what `dvc repro eval_objectives` runs

Scores the maps of ``models/objectives/<objective>/`` (stage ``tune@<objective>``; the
``ced_csa2*`` groups with the pair in its ``ced_csa2/`` folder, trained for them) for every
group of ``train.eval_groups`` and every objective of ``train.objectives``, with exactly
the main branch's protocols: the eval records' corpus-level perplexity (as
:func:`ced_csa2.eval.perplexity.groups_ppl`) and the gold-solution NLL on the tokenised prompts of
stage ``gold_pairs`` (``data/gsm8k_gold.json``), so this stage never runs ``eval_gsm8k``'s
generation.  Exact-match accuracy is not re-run here (generation dominates GSM8K's cost
and scores ~0 on the embedded model).

Every (group, objective) is one branch of the same shared trunk
(:func:`ced_csa2.eval.scoring.multi_group_nll`): the layers below a branch point and the baseline
run once per batch for all objectives, and the baseline is the reference of every paired
interval.  Two labels whose maps are the same tensors (a digest of what the group reads)
are scored once; ``scored_as`` in the output names the label a row was copied from.

``ced`` is also scored with the projector of the seed's recipe read literally (stage
``train_projector``'s reference, ``models/projector_seed_init/``: PyTorch's random init),
the reference the main branch's ridge start is judged against.

Writes ``metrics/objectives/eval.json``: ``{"protocol", "gold_protocol", "objectives":
{objective: {"groups": {group: {ppl, nll_per_token, tokens, delta_pct, kl, top1_pct, ...,
gold_nll}}}}, "seed_init": {"ced": {...}}, "scored_as": {label: label}}``.
"""

from __future__ import annotations

from pathlib import Path

from ..ced_runtime import CEDModeBRuntime, load_objective_parts, load_seed_init, maps_digest
from ..config import Params
from ..eval.gsm8k import groups_gold_nll, load_gold_pairs, prompt_protocol
from ..eval.perplexity import eval_ids, groups_ppl, protocol
from ..model_utils import load_model_and_tokenizer, resolve_device
from ..pipeline.atomic_files import write_json
from ..pipeline.paths import GOLD_PATH, OBJECTIVES_EVAL, SEED_INIT
from ..pipeline.stage_runner import run_stage
from ..plan import load_plan


def label(group: str, objective: str) -> str:
    return f"{group}@{objective}"


def run(params: Params, workdir: Path = Path("."), *, model_and_tok=None) -> dict:
    """Score ``train.eval_groups`` under every objective's maps; returns ``eval.json``'s content."""
    workdir = Path(workdir)
    plan, geo = load_plan(params.plan, params.model)
    pairs = load_gold_pairs(workdir / GOLD_PATH, params)
    model, tok = model_and_tok or load_model_and_tokenizer(params.model, device=resolve_device(params.eval_ppl.device))
    objectives = params.train.objectives
    parts = {o: load_objective_parts(workdir, o, params, plan, geo, model.device) for o in objectives}
    ids = eval_ids(params, tok, workdir)

    # One branch per distinct set of maps: the first label with a digest is scored, the others copy it.
    scored_as, first = {}, {}
    for o in objectives:
        for g in params.train.eval_groups:
            scored_as[label(g, o)] = first.setdefault(maps_digest(g, parts[o][g]), label(g, o))
    branches = {lab: CEDModeBRuntime(model, plan, lab.split("@")[0], parts[lab.split("@")[1]][lab.split("@")[0]],
                                     kv_format=params.kv_format) for lab in dict.fromkeys(scored_as.values())}
    seed_label = label("ced", SEED_INIT)
    branches[seed_label] = CEDModeBRuntime(model, plan, "ced", load_seed_init(workdir, params, plan, geo, model.device),
                                           kv_format=params.kv_format)
    # The baseline rides along (the trunk itself) as every paired interval's reference.
    ppl = groups_ppl(model, plan, ["baseline"], None, ids, params, tok.pad_token_id, extra=branches)
    gold = groups_gold_nll(model, plan, ["baseline"], None, pairs, params.eval_gsm8k.batch_size, tok.pad_token_id,
                           kv_format=params.kv_format, seed=params.seed, extra=branches,
                           block_tokens=params.eval_ppl.score_block_tokens)
    metrics = {
        "protocol": protocol(params, model, plan, ids, ppl["baseline"]["tokens"]),
        "gold_protocol": {"math_set": params.data.math.label, "math_revision": params.data.math.revision,
                          "n": len(pairs), **prompt_protocol(params), "source": str(GOLD_PATH)},
        "objectives": {o: {"groups": {g: {**ppl[scored_as[label(g, o)]], "gold_nll": gold[scored_as[label(g, o)]]}
                                      for g in params.train.eval_groups}} for o in objectives},
        SEED_INIT: {"ced": {**ppl[seed_label], "gold_nll": gold[seed_label]}},
        "scored_as": {lab: src for lab, src in scored_as.items() if lab != src},
    }
    write_json(workdir / OBJECTIVES_EVAL, metrics)
    return metrics


def main() -> None:
    run_stage(run)


if __name__ == "__main__":
    main()
