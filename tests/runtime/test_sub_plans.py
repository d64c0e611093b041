"""Several Full layers as nested single-source runtimes: the spacing rule, what each reader reads, the shared
trunk's scores, the FP4 nesting order, and bytes per token against real caches."""

import contextlib

import pytest
import torch
from conftest import rounding_tol, tiny_llama
from tiny_maps import random_parts
from transformers import DynamicCache

from ced_csa2 import kv_hooks
from ced_csa2.ced_runtime import CEDModeBRuntime
from ced_csa2.eval.scoring import multi_group_nll, sequence_nll
from ced_csa2.kv.formats import FP4_FORMATS
from ced_csa2.kv.kv_bytes import bytes_per_token, kv_copies
from ced_csa2.kv.rotation import fp4_round_trip
from ced_csa2.model_utils import Geometry, geometry
from ced_csa2.plan import LayerPlan, PlanError
from ced_csa2.groups import GROUPS
from ced_csa2.runtime.shared_kv import FP4KVCache, SharedKVCache, cache_bytes
from ced_csa2.runtime.sparse_decode import SparseDecode, SparseSharedKVCache
from ced_csa2.runtime.sub_plans import NestedRuntimes, SubPlansSharedKVCache, nested_copies, spaced_full_layers, \
    sub_plans

SMOL = Geometry(n_layers=30, hidden_size=576, n_kv_heads=3, head_dim=64, attention_layers=tuple(range(1, 31)))
SPLIT = 1  # tiny Llama: 6 attention layers, 5 above the cut -> at most 2 Full layers
FP32_BYTES = 4


@pytest.fixture(scope="module")
def llama():
    model = tiny_llama()
    geo = geometry(model.config)
    plans = sub_plans(geo, SPLIT, spaced_full_layers(geo, SPLIT, 2))
    torch.manual_seed(3)
    parts = [random_parts(geo, p, seed=i) for i, p in enumerate(plans)]
    return model, geo, plans, parts, torch.randint(0, 300, (2, 13))


def nested(model, plans, parts, group="csa2", outer=None):
    runtimes = [CEDModeBRuntime(model, plans[0], outer, kv_format="nvfp4")] if outer else []
    return NestedRuntimes(runtimes + [CEDModeBRuntime(model, p, group, q, kv_format="nvfp4")
                                      for p, q in zip(plans, parts)])


def test_full_layers_are_evenly_spaced_from_the_first_layer_above_the_cut():
    assert [spaced_full_layers(SMOL, 15, k) for k in (1, 2, 3, 4)] == [(16,), (16, 23), (16, 21, 26), (16, 19, 23, 27)]
    plans = sub_plans(SMOL, 15, (16, 19, 23, 27))
    assert [(p.source, p.targets) for p in plans] == [(16, (17, 18)), (19, (20, 21, 22)), (23, (24, 25, 26)),
                                                     (27, (28, 29, 30))]
    assert sub_plans(SMOL, 15, (16,)) == [LayerPlan(15, 16, tuple(range(17, 31)))]
    with pytest.raises(PlanError, match=r"8 Full layers over the 15 attention layers above split layer 15: .*k <= 7"):
        spaced_full_layers(SMOL, 15, 8)
    with pytest.raises(PlanError, match=r"Full layers \[17, 23\] must be .* the first of them 16"):
        sub_plans(SMOL, 15, (17, 23))


def test_one_sub_plan_nested_is_the_single_runtime_and_not_the_baseline(llama):
    model, geo, _, _, x = llama
    plan = sub_plans(geo, SPLIT, spaced_full_layers(geo, SPLIT, 1))[0]
    parts = random_parts(geo, plan)
    with torch.no_grad():
        base = model(x).logits
        with CEDModeBRuntime(model, plan, "csa2", parts, kv_format=None):
            single = model(x).logits
        with nested(model, [plan], [parts]):
            got = model(x).logits
    assert torch.equal(got, single)
    assert not torch.allclose(got, base, atol=1e-3)  # sharing moves the logits far beyond float32 rounding


def test_each_reader_reads_its_own_full_layer_as_the_modified_pass_computes_it(llama):
    model, _, plans, parts, x = llama
    with torch.no_grad(), nested(model, plans, parts), kv_hooks.capture(model, range(1, 7)) as kv:
        model(x)
    for plan, p in zip(plans, parts):
        for t in plan.targets:  # what each reader's layer is handed: its adapter of its own Full layer's K/V
            k, v = p.adapters(t, kv["k"][plan.source], kv["v"][plan.source])
            assert torch.equal(kv["k"][t], k) and torch.equal(kv["v"][t], v)
    assert all(not m._forward_hooks for m in model.modules())  # every hook removed on exit


def test_the_shared_trunk_scores_nested_runtimes_as_a_whole_forward_under_them(llama):
    model, _, plans, parts, _ = llama
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (17, 9, 23, 12)]
    arms = {"csa2": nested(model, plans, parts), "ced_csa2": nested(model, plans, parts, "ced_csa2"),
            "fp4_rot+csa2": nested(model, plans, parts, outer="baseline_fp4_rot")}
    scores = multi_group_nll(model, plans[0], ["baseline"], None, seqs, [0] * 4, 3, kv_format="nvfp4", extra=arms)
    for name, rt in arms.items():
        with rt:
            whole = sequence_nll(model, seqs, [0] * 4, 3)
        assert torch.equal(scores[name], whole), name  # same batches, same ops: bit for bit
        assert not torch.equal(scores[name], scores["baseline"]), name


def test_fp4_outside_the_sharing_runtimes_rounds_what_each_store_holds(llama):
    model, _, plans, parts, x = llama
    fmt = FP4_FORMATS["nvfp4"]()
    with torch.no_grad(), kv_hooks.capture(model, range(1, 7)) as raw, \
            nested(model, plans, parts, outer="baseline_fp4"), kv_hooks.capture(model, range(1, 7)) as read:
        model(x)  # `raw`, installed first, sees each k_proj/v_proj output; `read`, last, what attention gets
    readers = {t for p in plans for t in p.targets}
    for layer in set(range(1, 7)) - readers:  # every stored copy is FP4, the Full layers' included
        for kind in "kv":
            assert torch.equal(read[kind][layer], fp4_round_trip(fmt, raw[kind][layer], None)), (layer, kind)
    for plan, p in zip(plans, parts):
        for t in plan.targets:  # readers adapt the FP4 entry of their Full layer
            assert torch.equal(read["k"][t], p.adapters(t, read["k"][plan.source], read["v"][plan.source])[0])


def test_the_nesting_order_and_disjoint_sub_plans_are_enforced(llama):
    model, geo, plans, parts, _ = llama
    fp4 = CEDModeBRuntime(model, plans[0], "baseline_fp4", kv_format="nvfp4")
    shared = [CEDModeBRuntime(model, p, "csa2", q, kv_format=None) for p, q in zip(plans, parts)]
    with pytest.raises(ValueError, match="at most one every-layer FP4 runtime, then one sharing runtime"):
        NestedRuntimes([shared[0], fp4, shared[1]])  # FP4 inside would round the readers' adapted K/V
    with pytest.raises(ValueError, match="would round it twice"):
        NestedRuntimes([fp4, CEDModeBRuntime(model, plans[0], "csa2_fp4", parts[0], kv_format="nvfp4")])
    overlap = LayerPlan(SPLIT, 3, (5,))
    with pytest.raises(PlanError, match="must share one split and no layer"):
        NestedRuntimes([shared[0], CEDModeBRuntime(model, overlap, "csa2", random_parts(geo, overlap), kv_format=None)])


def prefill_bytes(model, cache, x):
    """``cache_bytes(cache).used`` after a prefill of ``x`` through the real cache (a shared store fed by its hooks)."""
    fed = isinstance(cache, (SharedKVCache, SubPlansSharedKVCache))
    with torch.no_grad(), (cache.feed() if fed else contextlib.nullcontext()):
        model(input_ids=x, cache=cache, use_cache=True)
    return cache_bytes(cache).used


@pytest.mark.parametrize("group,storage", [("csa2", "bf16"), ("csa2_fp4", "nvfp4")])
def test_nested_accounting_is_the_sum_over_sub_plans_of_what_each_real_store_saves(llama, group, storage):
    model, geo, plans, parts, x = llama
    tokens = x.numel()
    dense = prefill_bytes(model, DynamicCache(config=model.config), x)
    saved = 0
    for plan, p in zip(plans, parts):  # each sub-plan's SharedKVCache, against the ordinary cache
        cache = SharedKVCache(model, plan, "csa2", p, storage)
        saved += dense - prefill_bytes(model, cache, x)
    copies = nested_copies([kv_copies(geo, p, GROUPS[group], "all_attention", FP32_BYTES) for p in plans])
    assert tokens * bytes_per_token(copies) == dense - saved
    # an independent count: layers 1, 2 and 4 keep K and V, the Full layers in FP4 when the group says so
    fp4_entry = geo.kv_dim // 2 + geo.kv_dim // 16
    entry = {la: fp4_entry if storage == "nvfp4" and la in (2, 4) else geo.kv_dim * FP32_BYTES for la in (1, 2, 4)}
    assert bytes_per_token(copies) == 2 * sum(entry.values())


def test_fp4_every_stored_copy_with_sharing_is_the_fp4_cache_without_the_readers(llama):
    model, geo, plans, _, x = llama
    fp4 = FP4KVCache(model.config, "nvfp4")
    prefill_bytes(model, fp4, x)
    readers = {t for p in plans for t in p.targets}
    kept = sum(layer.used_bytes for i, layer in enumerate(fp4.layers, 1) if i not in readers)
    copies = nested_copies([kv_copies(geo, plans[0], GROUPS["baseline_fp4"], "all_attention", FP32_BYTES)]
                           + [kv_copies(geo, p, GROUPS["csa2"], "all_attention", FP32_BYTES) for p in plans])
    assert x.numel() * bytes_per_token(copies) == kept
    decoder = nested_copies([kv_copies(geo, p, GROUPS["csa2"], "decoder_attention", FP32_BYTES) for p in plans])
    assert [c.name for c in decoder] == ["K2", "V2", "K4", "V4"]  # the decoder basis: the Full layers alone


def test_the_sub_plans_shared_cache_decodes_as_the_nested_runtimes_and_holds_the_full_layers_only(llama):
    model, geo, plans, parts, x = llama
    cache = SubPlansSharedKVCache(model, plans, "csa2", dict(zip(plans, parts)))
    assert prefill_bytes(model, cache, x) == x.numel() * bytes_per_token(
        nested_copies([kv_copies(geo, p, GROUPS["csa2"], "all_attention", FP32_BYTES) for p in plans]))
    step = torch.randint(0, 300, (2, 1), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with cache.feed():
            got = model(input_ids=step, cache=cache, use_cache=True).logits[:, -1]
        with nested(model, plans, parts):  # Mode B on the whole sequence: every reader's K/V from its Full layer's
            ref = model(torch.cat([x, step], 1)).logits[:, -1]
        base = model(torch.cat([x, step], 1)).logits[:, -1]
    # two float32 paths (a cached step against one forward): FORWARD32's 96 eps per logit, a few times over
    tol = rounding_tol(torch.float32, 4 * 96)
    torch.testing.assert_close(got, ref, atol=tol, rtol=tol)
    assert not torch.allclose(got, base, atol=1e-3)  # the readers read the stores, not their own K/V
    assert all(not m._forward_hooks for m in model.modules())
    with pytest.raises(PlanError, match="must share one split and no layer"):
        SubPlansSharedKVCache(model, [plans[0], plans[0]], "csa2", dict(zip(plans, parts)))


def decoded(model, cache, x, steps):
    """Logits ``(B, steps, vocab)`` of ``steps`` greedy decode steps after prefilling ``x`` into ``cache``."""
    out = []
    with torch.no_grad():
        with cache.feed():
            logits = model(input_ids=x, cache=cache, use_cache=True).logits[:, -1:]
        for _ in range(steps):
            with cache.feed():
                logits = model(input_ids=logits.argmax(-1), cache=cache, use_cache=True).logits[:, -1:]
            out.append(logits)
    return torch.cat(out, 1)


def test_sparse_sub_plan_stores_read_as_each_sparse_cache_alone_and_as_the_dense_ones_when_they_cover(llama):
    model, geo, plans, parts, x = llama
    by_plan = dict(zip(plans, parts))
    reads = SparseDecode(k=3, window=2)  # 5 of the 13+ entries: the selection matters
    one = plans[:1]  # one sub-plan: the sparse cache itself
    assert torch.equal(decoded(model, SubPlansSharedKVCache(model, one, "csa2", by_plan, reads=reads), x, 4),
                       decoded(model, SparseSharedKVCache(model, one[0], "csa2", parts[0], reads=reads), x, 4))
    dense = decoded(model, SubPlansSharedKVCache(model, plans, "csa2", by_plan), x, 4)
    covering = SparseDecode(k=64, window=1)  # every entry selected: each reader's call is the dense one
    assert torch.equal(decoded(model, SubPlansSharedKVCache(model, plans, "csa2", by_plan, reads=covering), x, 4),
                       dense)
    sparse = decoded(model, SubPlansSharedKVCache(model, plans, "csa2", by_plan, reads=reads), x, 4)
    assert not torch.allclose(sparse, dense, atol=1e-3)  # the readers read their selections, not every entry
    assert all(not m._forward_hooks for m in model.modules())


def test_rotated_fp4_stores_decode_as_each_rotated_shared_cache_alone(llama):
    """``rotate``: each Full layer's FP4 store rotated by its own layer's rotation -- one sub-plan is the rotated
    ``SharedKVCache`` itself (csa2_fp4_rot's cache), bit for bit; two differ from the unrotated stores."""
    model, geo, plans, parts, x = llama
    by_plan = dict(zip(plans, parts))
    one = plans[:1]
    rotated = SubPlansSharedKVCache(model, one, "csa2", by_plan, "nvfp4", rotate=True)
    alone = SharedKVCache(model, one[0], "csa2", parts[0], "nvfp4", rotate=True)
    assert torch.equal(decoded(model, rotated, x, 4), decoded(model, alone, x, 4))
    assert cache_bytes(rotated).used == cache_bytes(alone).used
    both = decoded(model, SubPlansSharedKVCache(model, plans, "csa2", by_plan, "nvfp4", rotate=True), x, 4)
    plain = decoded(model, SubPlansSharedKVCache(model, plans, "csa2", by_plan, "nvfp4"), x, 4)
    assert not torch.equal(both, plain)  # FP4(R x) read back as Rᵀ dequant(.): another rounding
    with pytest.raises(ValueError, match=r"^SubPlansSharedKVCache: the sparse stores \(reads\) keep no rotated"):
        SubPlansSharedKVCache(model, plans, "csa2", by_plan, "nvfp4", rotate=True, reads=SparseDecode(k=3, window=2))
