"""Generation through the cache that holds each group's bytes (ced_csa2.eval.generation): Mode B's tokens, the
accounted bytes to the byte, Mode A on its own cache, the fidelity figures, and the refusals."""

import pytest
import torch
from conftest import EPS64, tiny_gemma3, tiny_llama
from tiny_maps import GEMMA_PLAN, LLAMA_PLAN, QWEN_PLAN, identity_parts, random_parts
from transformers import DynamicCache

from ced_csa2.ced_runtime import CEDModeARuntime, CEDModeBRuntime
from ced_csa2.eval import generation as gen
from ced_csa2.kv.kv_bytes import fp4_entry_bytes
from ced_csa2.model_utils import geometry
from ced_csa2.runtime.groups import GROUPS
from ced_csa2.runtime.shared_kv import FP4KVCache, SharedKVCache

PROMPT, NEW = 11, 6  # 16 cached positions: past the tiny Gemma-3's window of 6
FP32_BYTES = 4
FORMAT = "nvfp4"


@pytest.fixture(params=["llama", "qwen3_5", "gemma3"])
def setup(request, tiny_model):
    """``(model, plan, parts, prompts (2, PROMPT))`` on the all-attention tiny Llama, the hybrid tiny Qwen3.5 and the
    sliding + full tiny Gemma-3 (a full source read by sliding and full targets)."""
    model, plan, vocab = {"llama": lambda: (tiny_llama(), LLAMA_PLAN, 300),
                          "qwen3_5": lambda: (tiny_model[0], QWEN_PLAN, 250),
                          "gemma3": lambda: (tiny_gemma3(), GEMMA_PLAN, 300)}[request.param]()
    torch.manual_seed(1)
    return model, plan, random_parts(geometry(model.config), plan), torch.randint(0, vocab, (2, PROMPT))


def mode_b_tokens(model, plan, group, parts, prompts, new=NEW):
    """HF ``generate`` under the group's Mode B runtime, with an ordinary cache (an FP4 group rounds what it reads)."""
    with torch.no_grad(), CEDModeBRuntime(model, plan, group, parts, kv_format=FORMAT):
        # All-ones mask: no prompt token taken for padding; eos_token_id=None: always `new` tokens.
        out = model.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    return out[:, prompts.shape[1]:]


def no_hooks(model):
    return all(not (m._forward_hooks or m._forward_pre_hooks) for m in model.modules())


# Every supported group whose real cache rounds as its Mode B twin does (baseline_fp4's FP4KVCache rounds K after
# k_norm and RoPE, Mode B's before: same bytes, other roundings, so it is checked on bytes and determinism below).
MODE_B_TWINS = [g for g in gen.supported_groups() if g != "baseline_fp4"]


def test_the_supported_groups_are_those_with_a_store():
    assert gen.supported_groups() == ("baseline", "share_plain", "ced", "csa2", "ced_csa2", "baseline_fp4",
                                      "csa2_fp4", "ced_csa2_fp4")
    assert all(GROUPS[g].rotate or GROUPS[g].low_rank for g in set(GROUPS) - set(gen.supported_groups()))


@pytest.mark.parametrize("group", MODE_B_TWINS)
def test_greedy_tokens_through_the_group_s_cache_are_mode_b_s(setup, group):
    model, plan, parts, prompts = setup
    run = gen.generate(model, plan, group, parts, prompts, NEW, FORMAT)
    assert run.tokens.shape == (2, NEW) and torch.equal(run.tokens, mode_b_tokens(model, plan, group, parts, prompts))
    assert run.positions == PROMPT + NEW - 1 and run.bytes.used == run.accounted  # generate checks it; here too
    assert no_hooks(model)


def test_the_tokens_tell_the_caches_apart():
    """What gives the test above its teeth: on the tiny Llama every group's tokens differ from the baseline's, and
    each FP4 group's from its dense twin's, so a cache holding the wrong entries would not pass as Mode B's."""
    model = tiny_llama()
    torch.manual_seed(1)
    prompts = torch.randint(0, 300, (2, PROMPT))
    parts = random_parts(geometry(model.config), LLAMA_PLAN)
    tokens = {g: gen.generate(model, LLAMA_PLAN, g, parts, prompts, NEW, FORMAT).tokens for g in gen.supported_groups()}
    for group, t in tokens.items():
        assert group == "baseline" or not torch.equal(t, tokens["baseline"]), group
        if GROUPS[group].is_fp4:
            assert not torch.equal(t, tokens[group.removesuffix("_fp4")]), group


def test_the_cache_is_chosen_from_the_group_s_flags(tiny_model):
    model, _ = tiny_model
    parts = random_parts(geometry(model.config), QWEN_PLAN)
    for name, spec in GROUPS.items():
        if name not in gen.supported_groups():
            continue
        built = gen.group_cache(model, QWEN_PLAN, name, parts, FORMAT)
        if spec.shares_source_kv:
            assert isinstance(built.cache, SharedKVCache) and built.cache.storage == built.storage
            assert built.storage == (FORMAT if spec.is_fp4 else "bf16")
        elif spec.is_fp4:
            assert isinstance(built.cache, FP4KVCache) and built.storage == FORMAT
        else:
            assert type(built.cache) is DynamicCache and built.storage == "bf16"
            assert isinstance(built.context, CEDModeBRuntime) and built.context.spec.projected_source == (name == "ced")


def test_used_bytes_are_the_accounted_bytes_counted_independently(setup):
    """Every supported group's used bytes after the last step, counted from the geometry without the accounting
    module: each storing layer holds its positions (a sliding one its last window - 1) of K and V entries, dense at
    the model's dtype or FP4 blocks of ``kv_dim / 2 + kv_dim / 16`` bytes."""
    model, plan, parts, prompts = setup
    geo = geometry(model.config)
    positions = PROMPT + NEW - 1
    dense, fp4 = 2 * geo.kv_dim * FP32_BYTES, 2 * fp4_entry_bytes(geo.kv_dim, 16)
    used = {}
    for group in gen.supported_groups():
        spec = GROUPS[group]
        run = gen.generate(model, plan, group, parts, prompts, NEW, FORMAT)
        expected = 0
        for layer in geo.attention_layers:
            if spec.shares_source_kv and layer in plan.targets:
                continue
            held = positions if geo.window(layer) is None else min(positions, geo.window(layer) - 1)
            in_fp4 = spec.fp4 == "every_layer" or (spec.fp4 == "shared_source" and layer == plan.source)
            expected += prompts.shape[0] * held * (fp4 if in_fp4 else dense)
        assert run.bytes.used == run.accounted == expected, group
        assert run.bytes.allocated >= run.bytes.used
        used[group] = run.used_per_token
    assert used["ced"] == used["baseline"] > used["csa2"] == used["share_plain"] == used["ced_csa2"] > used["csa2_fp4"]
    assert used["baseline"] > used["baseline_fp4"]


def test_the_fp4_baseline_is_deterministic_and_stores_fp4(setup):
    model, plan, parts, prompts = setup
    a, b = (gen.generate(model, plan, "baseline_fp4", parts, prompts, NEW, FORMAT) for _ in range(2))
    assert torch.equal(a.tokens, b.tokens) and a.bytes == b.bytes and a.kind == "FP4KVCache"


def test_mode_a_decodes_on_the_ordinary_cache_its_prefill_returns(tiny_model):
    model, _ = tiny_model
    torch.manual_seed(3)
    prompts = torch.randint(0, 250, (2, PROMPT))
    parts = random_parts(geometry(model.config), QWEN_PLAN)
    run = gen.mode_a_generation(model, QWEN_PLAN, parts, prompts, NEW, sink="mean")
    runtime = CEDModeARuntime(model, QWEN_PLAN, geometry(model.config), parts, sink="mean")
    assert torch.equal(run.tokens, runtime.generate(prompts, NEW))
    assert run.group == gen.MODE_A and run.kind == "DynamicCache"
    baseline = gen.generate(model, QWEN_PLAN, "baseline", parts, prompts, NEW, None)
    assert run.bytes.used == run.accounted == baseline.bytes.used  # the baseline's bytes: compute saved, not bytes
    # An exact sink and a replay over the whole prefill is the plain prefill: the baseline's tokens.
    plain = gen.mode_a_generation(model, QWEN_PLAN, identity_parts(model, prompts, QWEN_PLAN), prompts, NEW,
                                  replay=PROMPT, sink="exact")
    assert torch.equal(plain.tokens, baseline.tokens)


def test_the_baseline_against_itself_is_perfect_fidelity(tiny_model):
    model, _ = tiny_model
    torch.manual_seed(4)
    prompts = torch.randint(0, 250, (3, PROMPT))
    base = gen.generate(model, QWEN_PLAN, "baseline", None, prompts, NEW, None).tokens
    f = gen.fidelity(model, prompts, {"baseline": base}, seed=0)["baseline"]
    for stat in ("mean", "median"):
        assert f["first_divergence"][stat]["value"] == NEW and f["first_divergence"][stat]["ci95"] == [NEW, NEW]
    assert f["agreement"]["mean"]["value"] == 1.0 and f["agreement"]["by_position"] == [1.0] * NEW
    assert f["delta_nll"]["value"] == 0.0 and f["delta_nll"]["ci95"] == [0.0, 0.0]
    assert f["delta_nll"]["per_prompt"] == [0.0] * 3


def test_fidelity_counts_divergence_agreement_and_plausibility_per_prompt(tiny_model):
    model, _ = tiny_model
    torch.manual_seed(5)
    prompts = torch.randint(0, 250, (3, PROMPT))
    base = torch.randint(0, 250, (3, NEW))
    other = base.clone()
    other[0, 2] = (base[0, 2] + 1) % 250  # prompt 0 diverges at its 3rd token, then agrees again
    other[1, 0] = (base[1, 0] + 1) % 250  # prompt 1 at its first
    f = gen.fidelity(model, prompts, {"baseline": base, "x": other}, seed=0)["x"]
    assert f["first_divergence"]["per_prompt"] == [2, 0, NEW]
    assert f["first_divergence"]["mean"]["value"] == pytest.approx((2 + NEW) / 3, rel=8 * EPS64)  # a float64 mean
    assert f["first_divergence"]["median"]["value"] == 2
    assert f["agreement"]["by_position"][:3] == [2 / 3, 1.0, 2 / 3] and f["agreement"]["by_position"][3:] == [1.0] * 3
    assert f["agreement"]["mean"]["value"] == pytest.approx((3 * NEW - 2) / (3 * NEW), rel=8 * EPS64)  # as above
    nll = {k: gen.continuation_nll(model, prompts, t, 2) for k, t in {"b": base, "x": other}.items()}
    assert f["delta_nll"]["per_prompt"][2] == 0.0 and f["delta_nll"]["per_prompt"][0] != 0.0
    assert f["delta_nll"]["value"] == pytest.approx((nll["x"][:, 0] - nll["b"][:, 0]).sum() / (3 * NEW),
                                                    rel=64 * EPS64)  # float64 sums of three terms
    lo, hi = f["first_divergence"]["mean"]["ci95"]
    assert lo <= f["first_divergence"]["mean"]["value"] <= hi


def test_batches_join_into_one_run(tiny_model):
    model, _ = tiny_model
    torch.manual_seed(6)
    prompts = torch.randint(0, 250, (3, PROMPT))
    parts = random_parts(geometry(model.config), QWEN_PLAN)
    whole = gen.run_groups(model, QWEN_PLAN, ["csa2"], parts, prompts, NEW, FORMAT, mode_a=parts)
    split = gen.run_groups(model, QWEN_PLAN, ["csa2"], parts, prompts, NEW, FORMAT, mode_a=parts, batch_size=2)
    for label in ("csa2", gen.MODE_A):
        assert torch.equal(whole[label].tokens, split[label].tokens)
        assert whole[label].bytes.used == split[label].bytes.used == split[label].accounted
        assert whole[label].used_per_token == split[label].used_per_token


def test_refusals(tiny_model):
    model, _ = tiny_model
    parts = random_parts(geometry(model.config), QWEN_PLAN)
    prompts = torch.randint(0, 250, (2, PROMPT))
    for group in ("baseline_fp4_rot", "csa2_fp4_rot", "ced_csa2_fp4_rot", "xkv"):
        with pytest.raises(ValueError, match=f"^group '{group}' cannot be decoded through the cache") as err:
            gen.generate(model, QWEN_PLAN, group, parts, prompts, NEW, FORMAT)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="rotated FP4 store does not exist"):
        gen.group_cache(model, QWEN_PLAN, "csa2_fp4_rot", parts, FORMAT)
    with pytest.raises(ValueError, match="unknown group 'nope'"):
        gen.generate(model, QWEN_PLAN, "nope", parts, prompts, NEW, FORMAT)
    with pytest.raises(ValueError, match="group 'csa2_fp4' stores FP4 entries and needs kv_format"):
        gen.group_cache(model, QWEN_PLAN, "csa2_fp4", parts, None)
    with pytest.raises(ValueError, match="group 'csa2' needs adapters"):
        gen.group_cache(model, QWEN_PLAN, "csa2", None, FORMAT)
    window = model.config.get_text_config().max_position_embeddings
    with pytest.raises(ValueError, match=f"needs {window + 1} positions; the model's window is {window}$"):
        gen.generate(model, QWEN_PLAN, "baseline", parts, torch.zeros(1, window, dtype=torch.long), 2, None)
    with pytest.raises(ValueError, match="prompts of token ids"):
        gen.generate(model, QWEN_PLAN, "baseline", parts, prompts[0], NEW, None)
    with pytest.raises(ValueError, match="T >= 2"):
        gen.mode_a_generation(model, QWEN_PLAN, parts, prompts[:, :1], NEW)
    run = gen.generate(model, QWEN_PLAN, "csa2", parts, prompts, NEW, FORMAT)
    run.accounted += 1
    with pytest.raises(RuntimeError, match=r"^group 'csa2': its SharedKVCache\(bf16\) holds \d+ B of K/V") as err:
        gen.check_bytes(run)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="reference run 'baseline'"):
        gen.fidelity(model, prompts, {"csa2": run.tokens}, seed=0)
