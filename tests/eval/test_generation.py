"""Generation through the cache that holds each group's bytes (ced_csa2.eval.generation): Mode B's tokens, the
accounted bytes to the byte, Mode A on its own cache, the fidelity figures, and the refusals."""

import numpy as np
import pytest
import torch
from conftest import EPS32, EPS64, tiny_gemma3, tiny_llama
from tiny_maps import GEMMA_PLAN, LLAMA_PLAN, QWEN_PLAN, identity_parts, random_parts
from transformers import DynamicCache

from ced_csa2 import kv_hooks
from ced_csa2.ced_runtime import CEDModeARuntime, CEDModeBRuntime, CEDParts
from ced_csa2.eval import generation as gen
from ced_csa2.eval.scoring import sequence_nll
from ced_csa2.kv.formats import FP4_FORMATS
from ced_csa2.kv.kv_bytes import fp4_entry_bytes
from ced_csa2.kv.rotation import layer_rotation
from ced_csa2.model_utils import geometry
from ced_csa2.groups import GROUPS
from ced_csa2.kv.formats import group_format
from ced_csa2.runtime.low_rank_kv import LowRankKVCache
from ced_csa2.runtime.shared_kv import BlockKVCache, BlockLayer, FP4KVCache, SharedKVCache, greedy_generate

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


# Every supported group whose real cache rounds as its Mode B twin does.  baseline_fp4(_rot)'s FP4KVCache and
# baseline_k6v4_rot's BlockKVCache round K after k_norm and RoPE, Mode B's before: same bytes, another rounding of
# K, so those are checked on bytes, determinism and what their stores hold below (V rounded as Mode B's, K not).
# xkv's LowRankKVCache reads each forward's own chunk exact (Mode B reconstructs it too): test_low_rank_kv.
MODE_B_TWINS = [g for g in gen.supported_groups()
                if GROUPS[g].cache_kind not in ("fp4_every_layer", "formats_every_layer", "low_rank")]
ROTATED = [g for g in GROUPS if GROUPS[g].rotate]


def fitting_groups(geo) -> list[str]:
    """The supported groups whose blocks fit ``geo``: the tiny Llama's kv_dim 16 holds no block of 32 channels, so
    baseline_k6v4_rot runs on the tiny Qwen3.5 and Gemma-3 only (its cache refuses kv_dim 16: test_shared_kv)."""
    return [g for g in gen.supported_groups() if GROUPS[g].stream_formats is None or geo.kv_dim % 32 == 0]


def dense_twin(group: str) -> str:
    """The group without FP4 entries of an FP4 group (``csa2_fp4_rot`` -> ``csa2``)."""
    return group.split("_fp4")[0]


def test_every_group_decodes_through_a_cache():
    """Every group has a cache holding its bytes, the low-rank xkv included (LowRankKVCache), in registry order;
    an unknown group is refused."""
    assert gen.supported_groups() == tuple(GROUPS) and "xkv" in gen.supported_groups()
    assert not any(gen.cache_refusal(g) for g in GROUPS)
    with pytest.raises(ValueError, match="unknown group 'nope'"):
        gen.cache_refusal("nope")


@pytest.mark.parametrize("group", MODE_B_TWINS)
def test_greedy_tokens_through_the_group_s_cache_are_mode_b_s(setup, group):
    model, plan, parts, prompts = setup
    run = gen.generate(model, plan, group, parts, prompts, NEW, FORMAT)
    assert run.tokens.shape == (2, NEW) and torch.equal(run.tokens, mode_b_tokens(model, plan, group, parts, prompts))
    assert run.positions == PROMPT + NEW - 1 and run.bytes.used == run.accounted  # generate checks it; here too
    assert no_hooks(model)


def test_the_tokens_tell_the_caches_apart():
    """What gives the test above its teeth: on the tiny Llama every group's tokens differ from the baseline's, each
    unrotated FP4 group's from its dense twin's and each rotated one's from its unrotated twin's, so a cache holding
    the wrong entries (or forgetting the rotation) would not pass as Mode B's.  (The rotated groups' tokens are their
    dense twins' here: rotated NVFP4 loses less.)"""
    model = tiny_llama()
    torch.manual_seed(1)
    prompts = torch.randint(0, 300, (2, PROMPT))
    parts = random_parts(geometry(model.config), LLAMA_PLAN)
    tokens = {g: gen.generate(model, LLAMA_PLAN, g, parts, prompts, NEW, FORMAT).tokens
              for g in fitting_groups(geometry(model.config))}
    for group, t in tokens.items():
        assert group == "baseline" or not torch.equal(t, tokens["baseline"]), group
        if GROUPS[group].is_fp4:
            twin = group.removesuffix("_rot") if GROUPS[group].rotate else dense_twin(group)
            assert not torch.equal(t, tokens[twin]), group


def test_the_cache_is_chosen_from_the_group_s_flags(tiny_model):
    model, _ = tiny_model
    parts = random_parts(geometry(model.config), QWEN_PLAN)
    for name, spec in GROUPS.items():
        if name not in gen.supported_groups():
            continue
        built = gen.group_cache(model, QWEN_PLAN, name, parts, FORMAT)
        rotated = ", rotated" if spec.rotate else ""
        if spec.shares_source_kv:
            assert spec.cache_kind == "shared_store"
            assert isinstance(built.cache, SharedKVCache) and built.cache.storage == built.storage
            assert built.storage == (FORMAT if spec.is_fp4 else "bf16") and built.cache.rotate == spec.rotate
            assert built.kind == f"SharedKVCache({built.storage}{rotated})"
        elif spec.low_rank:
            assert spec.cache_kind == "low_rank" and isinstance(built.cache, LowRankKVCache)
            assert built.storage == "bf16" and built.rank == parts.xkv.rank == built.cache.rank
            assert built.kind == f"LowRankKVCache(rank {parts.xkv.rank})"
        elif spec.stream_formats is not None:
            assert spec.cache_kind == "formats_every_layer" and built.storage == "bf16"
            assert isinstance(built.cache, BlockKVCache) and built.cache.formats == group_format(spec)
            assert built.kind == "BlockKVCache(k fp6/32 rotated, v mxfp4/32 rotated)"
        elif spec.is_fp4:
            assert spec.cache_kind == "fp4_every_layer"
            assert isinstance(built.cache, FP4KVCache) and built.storage == FORMAT and built.cache.rotate == spec.rotate
            assert built.kind == ("FP4KVCache(rotated)" if spec.rotate else "FP4KVCache")
        else:
            assert spec.cache_kind == "ordinary"
            assert type(built.cache) is DynamicCache and built.storage == "bf16"
            assert isinstance(built.open(), CEDModeBRuntime) and built.open().spec == spec


def test_used_bytes_are_the_accounted_bytes_counted_independently(setup):
    """Every supported group's used bytes after the last step, counted from the geometry without the accounting
    module: each storing layer holds its positions (a sliding one its last window - 1) of K and V entries, dense at
    the model's dtype, FP4 blocks of ``kv_dim / 2 + kv_dim / 16`` bytes, or baseline_k6v4_rot's FP6 K and MXFP4 V;
    a sink group's targets their first positions' dense K and V."""
    model, plan, parts, prompts = setup
    geo = geometry(model.config)
    positions = PROMPT + NEW - 1
    dense, fp4 = 2 * geo.kv_dim * FP32_BYTES, 2 * fp4_entry_bytes(geo.kv_dim, 16)
    k6v4 = 3 * geo.kv_dim // 4 + geo.kv_dim // 2 + 2 * (geo.kv_dim // 32)  # a scale byte per 32 channels each
    used = {}
    for group in fitting_groups(geo):
        spec = GROUPS[group]
        run = gen.generate(model, plan, group, parts, prompts, NEW, FORMAT)
        expected = 0
        for layer in geo.attention_layers:
            if (spec.shares_source_kv or spec.low_rank) and layer in plan.targets:
                continue
            held = positions if geo.window(layer) is None else min(positions, geo.window(layer) - 1)
            in_fp4 = spec.fp4 == "every_layer" or (spec.fp4 == "shared_source" and layer == plan.source)
            low_rank = spec.low_rank and layer == plan.source  # 2 · rank coefficients (test_low_rank_kv: rank < kv_dim)
            entry = (k6v4 if spec.stream_formats is not None else fp4 if in_fp4
                     else 2 * parts.xkv.rank * FP32_BYTES if low_rank else dense)
            expected += prompts.shape[0] * held * entry
        if spec.shares_source_kv:  # a sink group's targets each hold their own K and V at the first `sink` positions
            expected += prompts.shape[0] * min(positions, spec.sink) * len(plan.targets) * dense
        assert run.bytes.used == run.accounted == expected, group
        assert run.bytes.allocated >= run.bytes.used
        used[group] = run.used_per_token
    assert used["ced"] == used["baseline"] > used["csa2"] == used["share_plain"] == used["ced_csa2"] > used["csa2_fp4"]
    assert used["ced_csa2_sink"] > used["ced_csa2"]  # its targets' first positions
    assert used["xkv"] == used["csa2"]  # rank kv_dim: csa2's bytes
    assert used["baseline"] > used["baseline_fp4"]
    for group in ROTATED:  # R is a weight: the rotated store holds its unrotated twin's bytes
        assert used[group] == used[group.removesuffix("_rot")], group


@pytest.mark.parametrize("group", ["baseline_fp4", "baseline_fp4_rot"])
def test_the_fp4_baseline_is_deterministic_and_stores_fp4(setup, group):
    model, plan, parts, prompts = setup
    a, b = (gen.generate(model, plan, group, parts, prompts, NEW, FORMAT) for _ in range(2))
    assert torch.equal(a.tokens, b.tokens) and a.bytes == b.bytes
    assert a.kind == ("FP4KVCache(rotated)" if GROUPS[group].rotate else "FP4KVCache")


def unrotated_read(store, rotation):
    """``Rᵀ dequant(raw)`` of a :class:`TokenStore`'s raw FP4 blocks, ``(B, T, kv_dim)`` float32, by hand."""
    return rotation.unrotate(store.fmt.dequantize(store.data, torch.float32))


@pytest.mark.parametrize("group", ["csa2_fp4_rot", "ced_csa2_fp4_rot"])
@pytest.mark.parametrize("storage", ["nvfp4", "mxfp4"])
def test_the_rotated_shared_store_holds_the_rotated_blocks_mode_b_rounds(tiny_model, group, storage):
    """The raw store holds ``FP4(R x)`` of the source's pre-norm, pre-RoPE entries (``x``: the dense twin's store,
    bit-identical over the prompt since nothing below the source differs): un-rotated by hand it is Mode B's
    rounding of ``x`` bit for bit, and the unrotated twin's blocks (the same ``x``, no ``R``) are not."""
    model, _ = tiny_model  # Qwen3.5: kv_dim 64 holds MXFP4's groups of 32 as well
    torch.manual_seed(7)
    parts = random_parts(geometry(model.config), QWEN_PLAN)
    prompts = torch.randint(0, 250, (2, PROMPT))
    source, head_dim = QWEN_PLAN.source, geometry(model.config).head_dim
    fmt, r = FP4_FORMATS[storage](), layer_rotation(head_dim, source)
    stores = {}
    for g in (group, group.removesuffix("_rot"), dense_twin(group)):
        built = gen.group_cache(model, QWEN_PLAN, g, parts, storage)
        with built.open():
            greedy_generate(model, prompts, NEW, built.cache)
        stores[g] = built.cache._store
    rot, plain, dense = stores[group], stores[group.removesuffix("_rot")], stores[dense_twin(group)]
    mode_b = CEDModeBRuntime(model, QWEN_PLAN, group, parts, kv_format=storage)
    for kind in "kv":
        x = getattr(dense, kind).read()[:, :PROMPT]
        raw = getattr(rot, kind).data
        expected = fmt.quantize(r.rotate(x))
        assert torch.equal(raw.elements[:, :PROMPT], expected.elements), kind
        assert torch.equal(raw.scales[:, :PROMPT], expected.scales), kind
        rounded = mode_b._fake_quant(x, source, kind)
        assert torch.equal(unrotated_read(getattr(rot, kind), r)[:, :PROMPT], rounded), kind
        assert torch.equal(getattr(rot, kind).read()[:, :PROMPT], rounded), kind  # the store's own read
        # A store without the rotation: other blocks, and its read is not Mode B's rotated rounding.
        assert not torch.equal(getattr(plain, kind).data.elements[:, :PROMPT], raw.elements[:, :PROMPT]), kind
        assert not torch.equal(getattr(plain, kind).read()[:, :PROMPT], rounded), kind
        assert not torch.equal(fmt.dequantize(raw)[:, :PROMPT], rounded), kind  # read without un-rotating


@pytest.mark.parametrize("storage", ["nvfp4", "mxfp4"])
def test_the_rotated_fp4_baseline_rounds_v_as_mode_b_and_k_after_rope(tiny_model, storage):
    """``baseline_fp4_rot``'s every-layer store, captured in the same prefill: each attention layer's V store is
    ``FP4(R_l v)`` of its ``v_proj`` output, so un-rotated it is Mode B's rounding of V bit for bit; its K store is
    ``FP4(R_l k)`` of K after k_norm and RoPE, so un-rotated it is *not* Mode B's rounding of the ``k_proj`` output
    (the documented caveat, true here: Qwen3.5 has a k_norm, and RoPE moves every position but the first)."""
    model, _ = tiny_model
    geo = geometry(model.config)
    fmt = FP4_FORMATS[storage]()
    prompts = torch.randint(0, 250, (2, PROMPT))
    built = gen.group_cache(model, QWEN_PLAN, "baseline_fp4_rot", None, storage)
    with torch.no_grad(), built.open(), kv_hooks.capture(model, list(geo.attention_layers)) as seen:
        model(input_ids=prompts, cache=built.cache, use_cache=True)
    mode_b = CEDModeBRuntime(model, QWEN_PLAN, "baseline_fp4_rot", None, kv_format=storage)
    for layer in geo.attention_layers:
        cached = built.cache.layers[layer - 1]
        assert isinstance(cached, BlockLayer)
        r = layer_rotation(geo.head_dim, layer)
        v = seen["v"][layer]
        assert torch.equal(cached.v_store.data.elements, fmt.quantize(r.rotate(v)).elements), layer
        assert torch.equal(unrotated_read(cached.v_store, r), mode_b._fake_quant(v, layer, "v")), layer
        assert not torch.equal(unrotated_read(cached.k_store, r), mode_b._fake_quant(seen["k"][layer], layer, "k"))


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
    nll = gen.continuation_nlls(model, prompts, {"b": base, "x": other}, 8)  # fidelity's default batch
    assert f["delta_nll"]["per_prompt"][2] == 0.0 and f["delta_nll"]["per_prompt"][0] != 0.0
    assert f["delta_nll"]["value"] == pytest.approx((nll["x"][:, 0] - nll["b"][:, 0]).sum() / (3 * NEW),
                                                    rel=64 * EPS64)  # float64 sums of three terms
    lo, hi = f["first_divergence"]["mean"]["ci95"]
    assert lo <= f["first_divergence"]["mean"]["value"] <= hi


@pytest.mark.parametrize("model_name", ["llama", "qwen3_5"])
def test_the_shared_prefill_gives_every_group_its_own_prefill_to_the_bit(model_name, tiny_model):
    """PromptTrunk's prefill (the plain layers below each cache's branch run once, their entries copied) gives every
    supported group the logits and the cache of its own whole prefill, bit for bit (fp32): the logits after the
    prompts and after one more decode step through the filled cache.  On the all-attention Llama the ordinary and
    shared-store caches do take the trunk (branch above layer 1; the projector's stores seeded with H_split)."""
    model, plan, vocab = (tiny_llama(), LLAMA_PLAN, 300) if model_name == "llama" else (tiny_model[0], QWEN_PLAN, 250)
    parts = random_parts(geometry(model.config), plan)
    torch.manual_seed(1)
    prompts, step = torch.randint(0, vocab, (3, 40)), torch.randint(0, vocab, (3, 1))
    n = len(model.model.layers)
    # the Llama's kv_dim of 16 holds no 32-channel block formats (baseline_k6v4_rot's)
    groups = [g for g in gen.supported_groups() if model_name == "qwen3_5" or GROUPS[g].stream_formats is None]

    def built():
        return {g: gen.group_cache(model, plan, g, parts, "nvfp4") for g in groups}

    shared, own = built(), built()
    first_layer_calls = []
    handle = model.model.layers[0].register_forward_hook(lambda *args: first_layer_calls.append(1))
    try:
        trunk = gen.PromptTrunk(model, plan, [b.branch for b in shared.values()], prompts)
        logits = {g: trunk.prefill(b) for g, b in shared.items()}
    finally:
        handle.remove()
    for g in groups:
        with torch.inference_mode(), own[g].open():
            assert torch.equal(logits[g], gen.next_logits(model, own[g].cache, prompts)), g
        with torch.inference_mode(), shared[g].open():
            after_shared = gen.next_logits(model, shared[g].cache, step)
        with torch.inference_mode(), own[g].open():
            assert torch.equal(after_shared, gen.next_logits(model, own[g].cache, step)), g
    if model_name == "llama":
        assert shared["baseline"].branch == n + 1
        assert shared["csa2"].branch == shared["csa2_fp4"].branch == plan.source
        assert 1 < shared["ced"].branch <= plan.split + 1
        assert shared["ced_csa2"].branch == shared["ced_csa2_fp4"].branch == shared["ced"].branch
        assert shared["baseline_fp4"].branch == shared["xkv"].branch == 1
        # layer 1 ran in the trunk and in the whole prefills of the branch-1 caches only
        assert len(first_layer_calls) == 1 + sum(b.branch == 1 for b in shared.values()) < 1 + len(groups)


@pytest.mark.parametrize("model_name", ["llama", "qwen3_5"])
def test_decoding_from_the_shared_prefill_gives_every_group_its_own_generation(model_name, tiny_model):
    """run_groups (one PromptTrunk per batch, each group decoding from it) writes for every supported group the
    tokens and the bytes that its own whole prefill and decode (generate) give, exactly (fp32)."""
    model, plan, vocab = (tiny_llama(), LLAMA_PLAN, 300) if model_name == "llama" else (tiny_model[0], QWEN_PLAN, 250)
    parts = random_parts(geometry(model.config), plan)
    torch.manual_seed(2)
    prompts = torch.randint(0, vocab, (3, PROMPT))
    groups = [g for g in gen.supported_groups() if model_name == "qwen3_5" or GROUPS[g].stream_formats is None]
    runs = gen.run_groups(model, plan, groups, parts, prompts, NEW, FORMAT).runs
    for g in groups:
        own = gen.generate(model, plan, g, parts, prompts, NEW, FORMAT)
        assert torch.equal(runs[g].tokens, own.tokens), g
        assert (runs[g].bytes, runs[g].positions, runs[g].kind) == (own.bytes, own.positions, own.kind), g



def test_continuations_scored_on_one_prefill_are_the_whole_sequences_nll(tiny_model):
    """continuation_nlls (each batch's prompts prefilled once, every continuation scored on a copy of that cache) gives
    each continuation the NLL that scoring prompt + continuation in one forward gives (sequence_nll), within fp32:
    other matmul shapes only."""
    model, _ = tiny_model
    torch.manual_seed(6)
    prompts = torch.randint(0, 250, (3, PROMPT))
    runs = {"a": torch.randint(0, 250, (3, NEW)), "b": torch.randint(0, 250, (3, NEW))}
    nll = gen.continuation_nlls(model, prompts, runs, 2)
    for label, tokens in runs.items():
        whole = sequence_nll(model, torch.cat([prompts, tokens], 1).tolist(), [PROMPT] * 3, 3).numpy()
        assert (nll[label][:, 1] == NEW).all() and (whole[:, 1] == NEW).all()
        # a sum of NEW fp32 log-softmax terms of magnitude ~log(vocab): each within a few ulps
        assert np.allclose(nll[label][:, 0], whole[:, 0], rtol=64 * NEW * EPS32, atol=0), label
    assert not np.array_equal(nll["a"], nll["b"])


def test_batches_join_into_one_run(tiny_model):
    model, _ = tiny_model
    torch.manual_seed(6)
    prompts = torch.randint(0, 250, (3, PROMPT))
    parts = random_parts(geometry(model.config), QWEN_PLAN)
    one = gen.run_groups(model, QWEN_PLAN, ["csa2"], parts, prompts, NEW, FORMAT, mode_a=parts)
    assert one.step_seconds is None  # one group: no other arm to alternate its steps with
    whole, split = one.runs, gen.run_groups(model, QWEN_PLAN, ["csa2"], parts, prompts, NEW, FORMAT, mode_a=parts,
                                            batch_size=2).runs
    for label in ("csa2", gen.MODE_A):
        assert torch.equal(whole[label].tokens, split[label].tokens)
        assert whole[label].bytes.used == split[label].bytes.used == split[label].accounted
        assert whole[label].used_per_token == split[label].used_per_token


def test_refusals(tiny_model):
    model, _ = tiny_model
    parts = random_parts(geometry(model.config), QWEN_PLAN)
    prompts = torch.randint(0, 250, (2, PROMPT))
    with pytest.raises(ValueError, match="^group 'xkv' needs the cross-layer bases of models/xkv.pt") as err:
        gen.generate(model, QWEN_PLAN, "xkv", CEDParts(), prompts, NEW, FORMAT)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="group 'csa2_fp4_rot' stores FP4 entries and needs kv_format"):
        gen.group_cache(model, QWEN_PLAN, "csa2_fp4_rot", parts, "bf16")
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


def test_the_decode_steps_are_timed_alternated_through_each_group_s_cache(setup, monkeypatch):
    """run_groups decodes the groups step by step, alternated, in an order rotated each round: their step times are
    the decode's own steps (the first of each untimed), each through the group's own cache (the shared store's
    caches grow; its hooks are gone after each step)."""
    model, plan, parts, prompts = setup
    groups = ["baseline", "csa2", "csa2_fp4"]
    built = []
    real_group_cache = gen.group_cache

    def spying_group_cache(*args):  # the real builder; kept to read the caches after the decode
        built.append(real_group_cache(*args))
        return built[-1]

    monkeypatch.setattr(gen, "group_cache", spying_group_cache)
    decoded = gen.run_groups(model, plan, groups, parts, prompts, NEW, FORMAT)
    paired = decoded.step_seconds
    assert set(paired.seconds) == set(groups) and all(t > 0 for t in paired.seconds.values())
    # NEW tokens: the first from the prefill's logits, NEW - 1 steps, the first of each untimed
    assert paired.repeats == NEW - 2 and len(paired.order) == paired.repeats * len(groups)
    assert len({tuple(paired.order[i:i + len(groups)]) for i in range(0, len(paired.order), len(groups))}) > 1
    # the prompts and every token but the last fed back, through each group's cache
    assert [b.kind for b in built] == ["DynamicCache", "SharedKVCache(bf16)", "SharedKVCache(nvfp4)"]
    assert all(b.cache.get_seq_length() == PROMPT + NEW - 1 for b in built)
    assert all(decoded.runs[g].tokens.shape == (len(prompts), NEW) for g in groups)
    assert no_hooks(model)


def test_baseline_k6v4_rot_s_cache_rounds_v_as_mode_b_and_k_after_rope(tiny_model):
    """``baseline_k6v4_rot``'s every-layer store, captured in the same prefill: each attention layer's V store is
    the MXFP4 blocks of ``R_l v`` (its ``v_proj`` output), so read back it is the study's (Mode B's) rounding of V
    bit for bit; its K store holds FP6 blocks (3 bytes per 4 channels) of K after k_norm and RoPE: not Mode B's
    rounding of the ``k_proj`` output (the caveat ``baseline_fp4_rot`` documents).  Mode B's own pass is compared
    at the first attention layer only: above it the two passes' inputs differ by that K rounding."""
    model, _ = tiny_model
    geo = geometry(model.config)
    fmt = group_format(GROUPS["baseline_k6v4_rot"])
    prompts = torch.randint(0, 250, (2, PROMPT))
    built = gen.group_cache(model, QWEN_PLAN, "baseline_k6v4_rot", None, None)
    with torch.no_grad(), built.open(), kv_hooks.capture(model, list(geo.attention_layers)) as seen:
        model(input_ids=prompts, cache=built.cache, use_cache=True)
    with torch.no_grad(), CEDModeBRuntime(model, QWEN_PLAN, "baseline_k6v4_rot", None, kv_format=None), \
            kv_hooks.capture(model, list(geo.attention_layers)) as rounded:
        model(input_ids=prompts)
    for layer in geo.attention_layers:
        cached = built.cache.layers[layer - 1]
        assert isinstance(cached, BlockLayer)
        r = layer_rotation(geo.head_dim, layer)
        v = seen["v"][layer]
        assert torch.equal(cached.v_store.data.elements, FP4_FORMATS["mxfp4"]().quantize(r.rotate(v)).elements), layer
        assert torch.equal(cached.v_store.read(), fmt.v.round_trip(v, r)) and not torch.equal(cached.v_store.read(), v)
        assert cached.k_store.data.elements.shape[-1] == 3 * geo.kv_dim // 4, layer
    first = built.cache.layers[geo.attention_layers[0] - 1]
    assert torch.equal(first.v_store.read(), rounded["v"][geo.attention_layers[0]])
    assert not torch.equal(first.k_store.read(), rounded["k"][geo.attention_layers[0]])
