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
are scored once; ``scored_as`` in the output names the label a row was copied from.  A
label whose maps are the main branch's (``models/``; the ridge objective's ``ced`` on the
embedded default, whose projector training keeps its ridge start) is not scored at all: its row
is the main branch's, copied from ``metrics/ppl.json`` and ``metrics/gsm8k.json``, which scored
the same maps with the same protocol (``copied_from_main`` names them; a group missing from
``eval_ppl.groups`` or ``eval_gsm8k.groups`` is scored here).

``ced`` is also scored with the projector of the seed's recipe read literally (stage
``train_projector``'s reference, ``models/projector_seed_init/``: PyTorch's random init),
the reference the main branch's ridge start is judged against.

Writes ``metrics/objectives/eval.json``: ``{"protocol", "gold_protocol", "objectives":
{objective: {"groups": {group: {ppl, nll_per_token, tokens, delta_pct, kl, top1_pct, ...,
gold_nll}}}}, "seed_init": {"ced": {...}}, "scored_as": {label: label}, "copied_from_main": {label: group}}``.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..ced_runtime import CEDModeBRuntime, load_objective_parts, load_parts, load_seed_init, maps_digest
from ..config import Params
from ..data.records import check_prepared
from ..eval.gsm8k import groups_gold_nll, load_gold_pairs, prompt_protocol
from ..eval.perplexity import eval_ids, groups_ppl, protocol
from ..model_utils import load_model_and_tokenizer, resolve_device
from ..pipeline.atomic_files import read_json, write_json
from ..pipeline.map_roles import MAIN
from ..pipeline.paths import EVAL_JSONL, GOLD_PATH, GSM8K_METRICS, MODELS, OBJECTIVES_EVAL, PPL_METRICS, SEED_INIT
from ..pipeline.stage_runner import run_stage, stage_arguments
from ..plan import load_plan


def label(group: str, objective: str) -> str:
    return f"{group}@{objective}"


def run(params: Params, workdir: Path = Path("."), *, model_and_tok=None) -> dict:
    """Score ``train.eval_groups`` under every objective's maps; returns ``eval.json``'s content."""
    workdir = Path(workdir)
    plan, geo = load_plan(params.plan, params.model)
    check_prepared(params, workdir, EVAL_JSONL)
    pairs = load_gold_pairs(workdir / GOLD_PATH, params)
    model, tok = model_and_tok or load_model_and_tokenizer(params.model, device=resolve_device(params.eval_ppl.device))
    objectives = params.train.objectives
    parts = {o: load_objective_parts(workdir, o, params, plan, geo, model.device) for o in objectives}
    ids = eval_ids(params, tok, workdir)

    # Maps the main branch scored already (same records, batches and seed: the same row, bit for bit).
    main_rows = main_branch_rows(workdir, params, plan, geo, model.device)
    # One branch per distinct set of maps: the first label with a digest is scored, the others copy it.
    scored_as, first, copied = {}, {}, {}
    for o in objectives:
        for g in params.train.eval_groups:
            digest = maps_digest(g, parts[o][g])
            if digest in main_rows:
                copied[label(g, o)] = g
            else:
                scored_as[label(g, o)] = first.setdefault(digest, label(g, o))
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
        "gold_protocol": {"math_set": params.data.math_label(), "math_revision": params.data.math.revision,
                          "n": len(pairs), **prompt_protocol(params), "source": str(GOLD_PATH)},
        "objectives": {o: {"groups": {g: main_rows[maps_digest(g, parts[o][g])] if label(g, o) in copied else
                                      {**ppl[scored_as[label(g, o)]], "gold_nll": gold[scored_as[label(g, o)]]}
                                      for g in params.train.eval_groups}} for o in objectives},
        SEED_INIT: {"ced": {**ppl[seed_label], "gold_nll": gold[seed_label]}},
        "scored_as": {lab: src for lab, src in scored_as.items() if lab != src},
        "copied_from_main": copied,
    }
    write_json(workdir / OBJECTIVES_EVAL, metrics)
    return metrics


def main_branch_rows(workdir: Path, params: Params, plan, geo, device) -> dict[str, dict]:
    """``{maps digest: row}`` of the main branch's groups of ``train.eval_groups`` that ``eval_ppl`` and
    ``eval_gsm8k`` both scored: the perplexity row of ``metrics/ppl.json`` with the gold NLL of
    ``metrics/gsm8k.json``, keyed by the digest of the maps in ``models/`` that the group reads."""
    groups = [g for g in params.train.eval_groups if g in params.eval_ppl.groups and g in params.eval_gsm8k.groups]
    if not groups:
        return {}
    main = load_parts(workdir / MODELS, params, plan, geo, role=MAIN, device=device, extra_sources=False)
    ppl, gsm8k = (read_json(workdir / path) for path in (PPL_METRICS, GSM8K_METRICS))
    return {maps_digest(g, main): {**ppl["groups"][g], "gold_nll": gsm8k["groups"][g]["gold_nll"]} for g in groups}


def main(argv: Sequence[str] | None = None) -> None:
    run_stage(run, *stage_arguments(run, argv))


if __name__ == "__main__":
    main()
