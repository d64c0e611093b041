"""Shared-trunk scoring gives every group exactly what a separate pass under its runtime gives."""

import dataclasses
import itertools

import pytest
import torch
from conftest import tiny_gemma3, tiny_llama
from tiny_maps import GEMMA_PLAN, LLAMA_PLAN, QWEN_PLAN, check_exact, random_parts, rows, separate

from ced_csa2.ced_runtime import CEDModeBRuntime
from ced_csa2.eval.scoring import branch_point, multi_group_nll
from ced_csa2.model_utils import geometry
from ced_csa2.plan import LayerPlan
from ced_csa2.groups import GROUP_NAMES, GROUPS


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def test_every_group_exact_on_hybrid_qwen3_5(tiny_model):
    shared = check_exact(tiny_model[0], QWEN_PLAN, GROUP_NAMES)
    # the maps are random: every group but baseline moves the NLL
    assert all(not torch.equal(shared[g], shared["baseline"]) for g in GROUP_NAMES if g != "baseline")


def test_every_group_exact_on_all_attention_llama(llama):
    # the tiny Llama's kv_dim (16) holds no 32-channel block: the block-format groups run on the other two models
    check_exact(llama, LLAMA_PLAN, [g for g in GROUP_NAMES if GROUPS[g].stream_formats is None])


def test_every_group_exact_on_sliding_window_gemma3():
    # Sequences up to 23 positions against a window of 6: the trunk replays each layer
    # type's own mask and (cos, sin).
    model = tiny_gemma3()
    shared = check_exact(model, GEMMA_PLAN, GROUP_NAMES)
    assert all(not torch.equal(shared[g], shared["baseline"]) for g in GROUP_NAMES if g != "baseline")
    model.config.final_logit_softcapping = 0.05  # the trunk's head caps logits as the model's forward does
    capped = check_exact(model, GEMMA_PLAN, ("baseline", "ced_csa2"))
    assert not torch.equal(capped["baseline"], shared["baseline"])


@pytest.mark.parametrize("groups", [("ced", "csa2", "ced_csa2"), ("share_plain",), ("csa2_fp4", "baseline_fp4"),
                                    ("xkv",), ("xkv", "ced")])
def test_groups_without_baseline_stop_the_trunk_early_and_stay_exact(llama, groups):
    check_exact(llama, LLAMA_PLAN, groups, batch_size=4)


def test_exact_in_bf16():
    model = tiny_llama().to(torch.bfloat16)
    check_exact(model, LLAMA_PLAN, ("baseline", "ced_csa2", "csa2", "baseline_fp4", "xkv"))


def test_branch_points():
    """Each group branches at the lowest layer whose K/V it changes, read off its registry flags: every attention
    layer's own entry quantised (the every-layer caches) -> the first attention layer; the source's own entry changed
    (projected, FP4 or low rank) -> the source; only the targets' (shared) -> the first target; nothing -> never
    (n_layers + 1)."""
    model = tiny_llama()
    parts = random_parts(geometry(model.config), LLAMA_PLAN)
    first_attention, n_layers = geometry(model.config).attention_layers[0], model.config.num_hidden_layers

    def expected(spec):
        if spec.cache_kind.endswith("every_layer"):
            return first_attention
        if spec.projected_source or spec.fp4 == "shared_source" or spec.low_rank:
            return LLAMA_PLAN.source
        return min(LLAMA_PLAN.targets) if spec.shares_source_kv else n_layers + 1

    got = {g: branch_point(CEDModeBRuntime(model, LLAMA_PLAN, g, parts, kv_format="nvfp4"), n_layers) for g in GROUPS}
    assert got == {g: expected(spec) for g, spec in GROUPS.items()}
    # four distinct layers on this plan (1 < 3 < 5 < 7), each some group's: every rule above is exercised
    assert sorted(set(got.values())) == [first_attention, LLAMA_PLAN.source, min(LLAMA_PLAN.targets), n_layers + 1]


def test_the_trunk_runs_once_per_batch(tiny_model):
    """Layer l runs once for the trunk plus once per group branching at or below l."""
    model, _ = tiny_model
    parts = random_parts(geometry(model.config), QWEN_PLAN)
    calls = {}
    handles = [layer.register_forward_hook(lambda m, i, o, l=l: calls.__setitem__(l, calls.get(l, 0) + 1))
               for l, layer in enumerate(model.model.layers, 1)]
    try:
        multi_group_nll(model, QWEN_PLAN, ["baseline", "csa2", "ced"], parts, [[5] * 6, [7] * 4], [0, 0], 2,
                        kv_format=None)
    finally:
        for h in handles:
            h.remove()
    # csa2 branches at 24 (its first target), ced at 20 (its source)
    assert calls == {l: 1 + (l >= 20) + (l >= 24) for l in range(1, 33)}


def test_unknown_group_or_missing_format_refused_before_scoring(llama):
    with pytest.raises(ValueError, match="needs kv_format"):
        multi_group_nll(llama, LLAMA_PLAN, ["baseline", "csa2_fp4"], random_parts(geometry(llama.config), LLAMA_PLAN),
                        [[1, 2, 3]], [0], 1, kv_format=None)


def independent_agreement(model, plan, group, parts, seq, cut):
    """KL(baseline ‖ group) summed over the scored tokens of one sequence, and agreeing argmaxes."""
    x = torch.tensor([seq])
    with torch.no_grad():
        base = torch.log_softmax(model(x).logits[0, :-1].float(), -1)[max(1, cut) - 1:]
        with CEDModeBRuntime(model, plan, group, parts, kv_format="nvfp4"):
            got = torch.log_softmax(model(x).logits[0, :-1].float(), -1)[max(1, cut) - 1:]
    return (base.exp() * (base - got)).sum().item(), int((base.argmax(-1) == got.argmax(-1)).sum())


@pytest.mark.parametrize("model_name", ["qwen3_5", "llama"])
def test_agreement_with_the_baseline_matches_an_independent_computation(model_name, tiny_model, llama):
    model, plan = (tiny_model[0], QWEN_PLAN) if model_name == "qwen3_5" else (llama, LLAMA_PLAN)
    parts = random_parts(geometry(model.config), plan)
    seqs, cut = rows(250)
    groups = ("baseline", "ced", "csa2_fp4", "share_plain")
    # batch_size 1: the same shapes as the one-sequence passes below, so the logits are bit-identical
    shared = multi_group_nll(model, plan, groups, parts, seqs, cut, 1, 0, kv_format="nvfp4", agreement=True)
    base = shared["baseline"]
    assert (base[:, 2] == 0).all() and torch.equal(base[:, 3], base[:, 1])  # the baseline against itself
    for group in groups[1:]:
        assert torch.equal(shared[group][:, :2], separate(model, plan, group, parts, seqs, cut, 1))
        want = torch.tensor([independent_agreement(model, plan, group, parts, s, c) for s, c in zip(seqs, cut)],
                            dtype=torch.float64)
        # fp32 reductions over the vocabulary in another order: ~1e-7 nats per token apart
        torch.testing.assert_close(shared[group][:, 2], want[:, 0], rtol=1e-4, atol=1e-5)
        assert torch.equal(shared[group][:, 3], want[:, 1])
        assert shared[group][:, 2].sum() > 0  # random maps move the distribution


def test_identity_maps_agree_fully_with_the_baseline(tiny_model):
    from test_ced_runtime import identity_parts

    model, _ = tiny_model
    x = torch.randint(0, 250, (3, 21), generator=torch.Generator().manual_seed(2))
    parts = identity_parts(model, x, QWEN_PLAN)  # maps that return the true K/V of exactly this batch
    groups = ("baseline", "ced", "csa2", "ced_csa2")
    shared = multi_group_nll(model, QWEN_PLAN, groups, parts, x.tolist(), [0, 4, 9], 3, 0, kv_format="nvfp4",
                             agreement=True)
    for group in groups:
        assert (shared[group][:, 2] == 0).all() and torch.equal(shared[group][:, 3], shared[group][:, 1]), group


def test_agreement_needs_the_baseline(llama):
    with pytest.raises(ValueError, match="against 'baseline', which is not among"):
        multi_group_nll(llama, LLAMA_PLAN, ["ced"], random_parts(geometry(llama.config), LLAMA_PLAN), [[1, 2, 3]],
                        [0], 1, kv_format="nvfp4", agreement=True)


# ----------------------------------------------------------------------------- the stages that use it

def test_eval_ppl_gives_each_group_what_one_group_at_a_time_gives(tmp_path, tiny_model):
    import dataclasses

    from test_eval_ppl import tiny_params_without_domains, write_eval

    from ced_csa2.config import PlanConfig
    from ced_csa2.eval.perplexity import eval_ids, group_ppl
    from ced_csa2.stages import eval_ppl

    model, tok = tiny_model
    write_eval(tmp_path, tok)
    plan = LayerPlan(16, 20, (24, 32))  # not covering: Mode A (slow on the DeltaNet fallback) is skipped
    params = dataclasses.replace(tiny_params_without_domains(eval_ppl={"groups": list(GROUP_NAMES), "batch_size": 3}),
                                 plan=PlanConfig("partial", 16, 20, [24, 32], []))
    parts = random_parts(geometry(model.config), plan)
    m = eval_ppl.run(params, tmp_path, parts=parts, model_and_tok=(model, tok))
    ids = eval_ids(params, tok, tmp_path)
    for group in GROUP_NAMES:
        assert {k: v for k, v in m["groups"][group].items() if not k.startswith(("delta_pct", "kl", "top1"))} == \
            group_ppl(model, plan, group, parts, ids, params, tok.pad_token_id), group


def objectives_workdir(tmp_path, tok, monkeypatch, params, parts):
    """eval_objectives' inputs in ``tmp_path``: eval records, gold pairs, and ``parts`` served as each objective's
    maps (loading is tested elsewhere, test_checkpoint_match.py); ``ced`` under the seed-literal projector rides
    along.  Returns the gold pairs."""
    from test_eval_ppl import write_eval

    from ced_csa2.eval.gsm8k import write_gold_pairs
    from ced_csa2.pipeline import paths
    from ced_csa2.plan import load_plan
    from ced_csa2.stages import eval_objectives

    plan, geo = load_plan(params.plan, params.model)
    served = {o: {g: p for g in params.train.eval_groups} for o, p in parts.items()}
    monkeypatch.setattr(eval_objectives, "load_objective_parts", lambda workdir, o, *args: served[o])
    seed_init = random_parts(geo, plan, seed=5)
    monkeypatch.setattr(eval_objectives, "load_seed_init", lambda *args: seed_init)
    write_eval(tmp_path, tok)
    seqs, cut = rows(250, seed=1)
    pairs = [(s, c) for s, c in zip(seqs, cut) if c < len(s)]
    write_gold_pairs(tmp_path / paths.GOLD_PATH, params, pairs)
    return pairs, seed_init


def test_eval_objectives_gives_each_group_what_one_group_at_a_time_gives(tmp_path, tiny_model, monkeypatch):
    """Two objectives in one shared pass: one with its own maps, one whose csa2 maps equal the first's (scored once)."""
    from conftest import tiny_params

    from ced_csa2.eval.gsm8k import gold_nll
    from ced_csa2.eval.perplexity import eval_ids, group_ppl
    from ced_csa2.plan import load_plan
    from ced_csa2.stages import eval_objectives

    model, tok = tiny_model
    # no group of the main branch scored (eval_ppl.groups): every label is scored here
    params = tiny_params(eval_gsm8k={"batch_size": 2}, eval_ppl={"groups": ["baseline"]},
                         train={"objectives": ["ridge", "attn_out"]})
    plan, geo = load_plan(params.plan, params.model)
    parts = {"ridge": random_parts(geo, plan, seed=3), "attn_out": random_parts(geo, plan, seed=4)}
    parts["attn_out"].adapters = parts["ridge"].adapters  # csa2@attn_out reads exactly csa2@ridge's tensors
    pairs, seed_init = objectives_workdir(tmp_path, tok, monkeypatch, params, parts)
    m = eval_objectives.run(params, tmp_path, model_and_tok=(model, tok))

    ids = eval_ids(params, tok, tmp_path)
    assert m["scored_as"] == {"csa2@attn_out": "csa2@ridge"}
    assert m["objectives"]["attn_out"]["groups"]["csa2"] == m["objectives"]["ridge"]["groups"]["csa2"]
    for objective, group in itertools.product(params.train.objectives, params.train.eval_groups):
        want = group_ppl(model, plan, group, parts[objective], ids, params, tok.pad_token_id)
        with CEDModeBRuntime(model, plan, group, parts[objective], kv_format=params.kv_format):
            want["gold_nll"] = gold_nll(model, pairs, params.eval_gsm8k.batch_size, tok.pad_token_id)
        got = m["objectives"][objective]["groups"][group]  # plus the paired changes against the baseline
        got_gold = {k: v for k, v in got["gold_nll"].items() if not k.startswith("delta")}
        assert {k: v for k, v in got.items() if not k.startswith(("delta", "kl", "top1")) and k != "gold_nll"} == \
            {k: v for k, v in want.items() if k != "gold_nll"}, group
        assert got_gold == want["gold_nll"] and got["delta_pct_ci95"][0] <= got["delta_pct"], group
    want = group_ppl(model, plan, "ced", seed_init, ids, params, tok.pad_token_id)
    got = m["seed_init"]["ced"]
    assert {k: v for k, v in got.items() if not k.startswith(("delta", "kl", "top1")) and k != "gold_nll"} == want


def test_eval_objectives_copies_the_rows_of_the_main_branch_s_maps_as_scoring_them_gives(tmp_path, tiny_model,
                                                                                         monkeypatch):
    """Labels whose maps are the main branch's are not scored: their rows are eval_ppl's and eval_gsm8k's (written
    here by the functions those stages call), and equal, interval for interval, what scoring them here gives."""
    from conftest import tiny_params

    from ced_csa2.eval.gsm8k import groups_gold_nll
    from ced_csa2.eval.perplexity import eval_ids, groups_ppl
    from ced_csa2.pipeline import paths
    from ced_csa2.pipeline.atomic_files import write_json
    from ced_csa2.plan import load_plan
    from ced_csa2.stages import eval_objectives

    model, tok = tiny_model
    params = tiny_params(eval_gsm8k={"batch_size": 2}, train={"objectives": ["ridge", "attn_out"]})
    plan, geo = load_plan(params.plan, params.model)
    parts = {"ridge": random_parts(geo, plan, seed=3), "attn_out": random_parts(geo, plan, seed=4)}
    pairs, _ = objectives_workdir(tmp_path, tok, monkeypatch, params, parts)
    groups = ["baseline", *params.train.eval_groups]
    assert set(groups) <= set(params.eval_ppl.groups) & set(params.eval_gsm8k.groups)
    # with no main-branch group scored (eval_ppl.groups) every label is scored here
    alone = dataclasses.replace(params, eval_ppl=dataclasses.replace(params.eval_ppl, groups=["baseline"]))
    scored_here = eval_objectives.run(alone, tmp_path, model_and_tok=(model, tok))
    assert scored_here["copied_from_main"] == {}

    # the main branch: the ridge objective's maps, scored as eval_ppl and eval_gsm8k score them
    monkeypatch.setattr(eval_objectives, "load_parts", lambda *args, **kwargs: parts["ridge"])
    ppl = groups_ppl(model, plan, groups, parts["ridge"], eval_ids(params, tok, tmp_path), params, tok.pad_token_id)
    gold = groups_gold_nll(model, plan, groups, parts["ridge"], pairs, params.eval_gsm8k.batch_size,
                           tok.pad_token_id, kv_format=params.kv_format, seed=params.seed)
    write_json(tmp_path / paths.PPL_METRICS, {"groups": ppl})
    write_json(tmp_path / paths.GSM8K_METRICS, {"groups": {g: {"gold_nll": gold[g]} for g in groups}})
    m = eval_objectives.run(params, tmp_path, model_and_tok=(model, tok))
    assert m["copied_from_main"] == {f"{g}@ridge": g for g in params.train.eval_groups}
    assert m["objectives"] == scored_here["objectives"] and m["seed_init"] == scored_here["seed_init"]
