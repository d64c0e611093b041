"""Top-k + window sparse reads with V4.1's layer modes and HSI, on tiny real models."""

import pytest
import torch
from conftest import FORWARD32, tiny_llama
from tiny_maps import LLAMA_PLAN, QWEN_PLAN, random_parts  # sparse layers: 3..6 (5 and 6 read KV_3); 20, 24, 28, 32
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ced_csa2.ced_runtime import CEDModeBRuntime
from ced_csa2.eval.scoring import multi_group_nll
from ced_csa2.model_utils import geometry
from ced_csa2.plan import PlanError
from ced_csa2.runtime.layer_modes import LayerModes, ModeError, kv_sources
from ced_csa2.runtime.shared_kv import greedy_generate, shared_kv_generate
from ced_csa2.runtime.sparse_attention import (
    HSI,
    SelectionStats,
    SparseAttention,
    SparseGroup,
    SparseReads,
    hsi_pool,
    top_k,
)

T, NEW = 24, 5

# Per model: the ablation groups as (KV group, index sources), as the study defines them.
GROUPS = {
    "llama": {"full": ("baseline", {}), "full_reindex": ("csa2", {}), "full_reuse": ("csa2", {5: 3, 6: 3}),
              "reindex_reuse": ("csa2", {6: 5})},
    "qwen3_5": {"full": ("baseline", {}), "full_reindex": ("csa2", {}),
                "full_reuse": ("csa2", {24: 20, 28: 20, 32: 20}), "reindex_reuse": ("csa2", {28: 24, 32: 24})},
}


@pytest.fixture(params=["llama", "qwen3_5"])
def setup(request, tiny_model):
    model, plan, vocab = ((tiny_llama(), LLAMA_PLAN, 300) if request.param == "llama"
                          else (tiny_model[0], QWEN_PLAN, 250))
    geo = geometry(model.config)
    torch.manual_seed(3)
    return request.param, model, plan, geo, random_parts(geo, plan), torch.randint(0, vocab, (2, T))


def interface_untouched(model, before=dict(ALL_ATTENTION_FUNCTIONS._local_mapping)):
    return ALL_ATTENTION_FUNCTIONS._local_mapping == before and all(not m._forward_hooks for m in model.modules())


def sparse(model, plan, geo, parts, kv, index, reads, **kw):
    modes = LayerModes.build(plan, geo, kv, index)
    return SparseGroup(CEDModeBRuntime(model, plan, kv, parts, kv_format=None),
                       SparseAttention(model, modes, reads, geo, **kw))


@torch.no_grad()
def test_k_at_least_the_context_with_window_0_is_the_dense_group_exactly(setup):
    name, model, plan, geo, parts, ids = setup
    everything = SparseReads(k=T + NEW, window=0, hsi=HSI(block=4, pool_blocks=(T + NEW) // 4 + 1))
    for label, (kv, index) in GROUPS[name].items():
        with CEDModeBRuntime(model, plan, kv, parts, kv_format=None):
            dense = model(ids).logits
        for reads in (everything, SparseReads(k=T + NEW)):
            with sparse(model, plan, geo, parts, kv, index, reads):
                assert torch.equal(model(ids).logits, dense), (label, reads)
        # Cached generation: the shared store (csa2) or a DynamicCache (baseline KV), sparse on top.
        if kv == "csa2":
            ref = shared_kv_generate(model, plan, kv, parts, ids, NEW)
        else:
            ref = greedy_generate(model, ids, NEW, DynamicCache(config=model.config))
        with SparseAttention(model, LayerModes.build(plan, geo, kv, index), everything, geo):
            got = (shared_kv_generate(model, plan, kv, parts, ids, NEW) if kv == "csa2"
                   else greedy_generate(model, ids, NEW, DynamicCache(config=model.config)))
        assert torch.equal(got.tokens, ref.tokens) and torch.equal(got.logits, ref.logits), label
    assert interface_untouched(model)


@torch.no_grad()
def test_sparse_reads_change_the_output_and_sdpa_and_eager_agree():
    models = {impl: tiny_llama(impl) for impl in ("sdpa", "eager")}
    geo = geometry(models["sdpa"].config)
    parts = random_parts(geo, LLAMA_PLAN)
    ids = torch.randint(0, 300, (2, T))
    out = {}
    for impl, model in models.items():
        with CEDModeBRuntime(model, LLAMA_PLAN, "csa2", parts, kv_format=None):
            dense = model(ids).logits
        with sparse(model, LLAMA_PLAN, geo, parts, "csa2", {6: 5}, SparseReads(k=3, window=2)):
            out[impl] = model(ids).logits
        # a real difference, not rounding: 1e-3 is ~8400 eps32 of O(1) logits, ~90x FORWARD32
        assert not torch.allclose(out[impl], dense, atol=1e-3)
    torch.testing.assert_close(out["sdpa"], out["eager"], **FORWARD32)


@torch.no_grad()
def test_reuse_reads_exactly_the_indices_its_index_source_chose(setup):
    name, model, plan, geo, parts, ids = setup
    kv, index = GROUPS[name]["reindex_reuse"]
    k, window = 4, 3
    with sparse(model, plan, geo, parts, kv, index, SparseReads(k=k, window=window), record=True) as group:
        model(ids)
    trace = group.sparse.trace
    for layer, source in index.items():
        assert torch.equal(trace[layer]["chosen"], trace[source]["chosen"])
        assert torch.equal(trace[layer]["read"], trace[source]["chosen"] | trace[layer]["window"])
    # The index source really selected: k entries outside its window where it had more to choose from.
    source = trace[next(iter(index.values()))]
    more = (source["allowed"] & ~source["window"]).sum(-1) > k
    assert more.any() and (source["chosen"].sum(-1)[more] == k).all()
    assert not (source["chosen"] & source["window"]).any()
    # A Reindex layer in its place chooses for itself (so the check above can fail).
    with sparse(model, plan, geo, parts, kv, {}, SparseReads(k=k, window=window), record=True) as own:
        model(ids)
    layer, src = next(iter(index.items()))
    assert not torch.equal(own.sparse.trace[layer]["chosen"], own.sparse.trace[src]["chosen"])


def test_top_k_picks_the_k_best_candidates():
    torch.manual_seed(0)
    scores, candidates = torch.randn(2, 5, 9), torch.rand(2, 5, 9) > 0.4
    got = top_k(scores, candidates, 3)
    for b in range(2):
        for q in range(5):
            idx = [j for j in range(9) if candidates[b, q, j]]
            best = sorted(idx, key=lambda j: -scores[b, q, j].item())[:3]
            assert sorted(got[b, q].nonzero().flatten().tolist()) == sorted(best)


@pytest.mark.parametrize("newest_block", [True, False])
def test_hsi_pool_holds_the_newest_block_and_at_most_m_times_b_positions(newest_block):
    torch.manual_seed(0)
    q_len = kv_len = 37
    hsi = HSI(block=4, pool_blocks=3, newest_block=newest_block)
    causal = torch.ones(q_len, kv_len, dtype=torch.bool).tril()[None].expand(2, -1, -1)
    scores = torch.randn(2, q_len, kv_len)
    pool = hsi_pool(scores, causal, hsi)
    assert (pool.sum(-1) <= hsi.max_positions).all() and not (pool & ~causal).any()
    for b in range(2):
        for i in range(q_len):
            n_blocks = i // 4 + 1  # blocks holding a visible position
            block_max = [scores[b, i, 4 * r:min(4 * r + 4, i + 1)].max().item() for r in range(n_blocks)]
            if newest_block:
                block_max[-1] = float("inf")
            keep = sorted(range(n_blocks), key=lambda r: -block_max[r])[:3]
            expected = {j for r in keep for j in range(4 * r, min(4 * r + 4, i + 1))}
            assert set(pool[b, i].nonzero().flatten().tolist()) == expected
            if newest_block:
                assert all(pool[b, i, j] for j in range(4 * (i // 4), i + 1))  # the newest block, every time


@torch.no_grad()
def test_reindex_searches_only_the_hsi_pool_of_its_kv_source(setup):
    _, model, plan, geo, parts, ids = setup
    hsi = HSI(block=2, pool_blocks=3)
    with sparse(model, plan, geo, parts, "csa2", {}, SparseReads(k=3, window=1, hsi=hsi), record=True) as group:
        model(ids)
    trace = group.sparse.trace
    pool = trace[plan.source]["pool"]
    newest = torch.arange(T) // 2
    for i in range(T):  # the newest block is always there, and never more than M·b positions
        assert pool[:, i, 2 * newest[i]:i + 1].all()
    assert (pool.sum(-1) <= hsi.max_positions).all()
    for t in plan.targets:  # Reindex: its selection lies inside the source's pool
        assert not (trace[t]["chosen"] & ~pool).any()
        assert trace[t]["chosen"].any()


@torch.no_grad()
def test_hsi_pool_covering_the_context_gives_identical_outputs(setup):
    _, model, plan, geo, parts, ids = setup
    reads = SparseReads(k=3, window=2)
    covering = SparseReads(k=3, window=2, hsi=HSI(block=4, pool_blocks=T // 4))  # M·b = T
    out = {}
    for label, r in (("plain", reads), ("hsi", covering)):
        with sparse(model, plan, geo, parts, "csa2", {}, r):
            out[label] = model(ids).logits
        with SparseAttention(model, LayerModes.build(plan, geo, "csa2"), r, geo):
            out[label + "_cached"] = shared_kv_generate(model, plan, "csa2", parts, ids[:, :T - NEW], NEW).logits
    assert torch.equal(out["plain"], out["hsi"]) and torch.equal(out["plain_cached"], out["hsi_cached"])
    with sparse(model, plan, geo, parts, "csa2", {}, SparseReads(k=3, window=2, hsi=HSI(block=2, pool_blocks=2))):
        assert not torch.equal(model(ids).logits, out["plain"])  # a pool smaller than the context does bite


@pytest.mark.parametrize("kv,index,kv_ids,message", [
    ("csa2", {4: 3}, None, "layer 4 has its own KV but the index of layer 3: own KV with another layer's index"),
    ("baseline", {6: 5}, None, "layer 6 has its own KV but the index of layer 5"),
    ("csa2", {5: 3, 6: 5}, None, "layer 6 takes its index from layer 5, a Reuse layer; an index source must be a "
                                 "Full or Reindex layer"),
    ("csa2", {5: 6}, None, "layer 5 takes its index from layer 6, which is not an earlier sparse layer"),
    ("csa2", {5: 4}, None, "layer 5 reads KV_3 but takes its index from layer 4, which selects entries of KV_4"),
    ("csa2", {2: 2}, None, "layer modes name layer 2, which is not an attention layer above the cut"),
    ("csa2", {}, {4: 3}, "layer 4 is given KV source 3, but group 'csa2' gives it its own KV"),
])
def test_invalid_mode_assignments_are_refused_naming_the_layer(kv, index, kv_ids, message):
    geo = geometry(tiny_llama().config)
    with pytest.raises(ModeError, match=message):
        LayerModes.build(LLAMA_PLAN, geo, kv, index, kv_ids)


@pytest.mark.parametrize("kv_source,message", [
    ({3: 3, 4: 4, 5: 6, 6: 6}, "layer 5 takes its KV from layer 6, which is not an earlier sparse layer"),
    ({3: 3, 4: 3, 5: 4, 6: 6}, "layer 5 takes its KV from layer 4, which stores none of its own"),
])
def test_a_kv_source_must_be_an_earlier_full_layer(kv_source, message):
    with pytest.raises(PlanError, match=message):
        LayerModes(kv_source, {la: la for la in kv_source}).validate()


def test_modes_read_like_v41():
    geo = geometry(tiny_llama().config)
    assert kv_sources(LLAMA_PLAN, geo, "csa2") == {3: 3, 4: 4, 5: 3, 6: 3}
    modes = LayerModes.build(LLAMA_PLAN, geo, "csa2", {6: 5}, {5: 3, 6: 3})
    assert [modes.mode(la) for la in modes.layers] == ["full", "full", "reindex", "reuse"]
    assert modes.compact() == "3–4 F · 5 X · 6 R(5)" and modes.pool_sources() == (3,)


@torch.no_grad()
def test_statistics_count_reads_and_shared_selections():
    model = tiny_llama()
    geo = geometry(model.config)
    ids = torch.randint(0, 300, (1, T))
    stats = SelectionStats()
    k, window = 3, 2
    with SparseAttention(model, LayerModes.build(LLAMA_PLAN, geo, "csa2", {5: 3, 6: 3}), SparseReads(k, window), geo,
                         stats=stats):
        model(ids)
    reads = sum(min(i + 1, k + window) for i in range(T))
    for la in (3, 4, 5, 6):
        assert stats.layer[la]["queries"] == T and stats.layer[la]["read"] == reads
        assert stats.layer[la]["visible"] == T * (T + 1) / 2
    assert stats.layer[5]["scored"] == 0 and stats.layer[3]["scored"] == sum(max(i + 1 - window, 0) for i in range(T))
    assert stats.pairs[(5, 6)]["shared"] == stats.pairs[(5, 6)]["picked"]  # both Reuse of layer 3
    shared, chance = stats.shared_fraction([(3, 4)])
    assert 0 <= shared <= 1 and 0 < chance < 1
    assert not stats.source_pairs  # no Reindex layer
    with SparseAttention(model, LayerModes.build(LLAMA_PLAN, geo, "csa2"), SparseReads(k, window), geo, stats=stats):
        model(ids)
    assert set(stats.source_pairs) == {(3, 5), (3, 6)}  # each Reindex layer against its KV source
    assert 0 <= stats.shared_fraction(of=stats.source_pairs)[0] <= 1


@torch.no_grad()
def test_the_shared_trunk_scores_a_sparse_group_as_a_full_pass(setup):
    name, model, plan, geo, parts, ids = setup
    seqs = ids.tolist()
    groups = {"s": sparse(model, plan, geo, parts, "csa2", GROUPS[name]["full_reuse"][1], SparseReads(k=3, window=2))}
    got = multi_group_nll(model, plan, ["baseline"], parts, seqs, [0, 0], 2, kv_format=None, extra=groups)["s"]
    with groups["s"]:
        logits = model(ids).logits.double()
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").sum(1)
    # float32 logits of one forward through the sparse path vs another pass: FORWARD32 on logits, times |log p| (~6)
    # × the sequence's tokens (~100): <= 1e-3 absolute on the sum
    torch.testing.assert_close(got[:, 0], nll, atol=1e-3, rtol=1e-5)


def test_the_attention_interface_is_restored_even_when_the_forward_fails():
    model = tiny_llama()
    geo = geometry(model.config)
    with pytest.raises(RuntimeError, match="boom"), \
            SparseAttention(model, LayerModes.build(LLAMA_PLAN, geo, "baseline"), SparseReads(2), geo):
        assert not interface_untouched(model)
        raise RuntimeError("boom")
    assert interface_untouched(model)


# ----------------------------------------------------------------------------- trained indexers

def trained_indexers(setup, group):
    """``group``'s KV group, index sources, modes and a random indexer per selecting layer, with large offsets
    (no ReLU ties, so each top-k is unique)."""
    from ced_csa2.maps.indexer import IndexerConfig
    from ced_csa2.train.indexer_training import new_indexer

    name, model, plan, geo, _, _ = setup
    kv, index = GROUPS[name][group]
    modes = LayerModes.build(plan, geo, kv, index)
    out = {}
    for i, layer in enumerate(la for la in modes.layers if modes.selecting(la)):
        out[layer] = new_indexer(model, geo, layer, IndexerConfig(heads=2, offset=True), seed=10 + i)
        out[layer].b.bias.data.fill_(100.0)
    return kv, index, modes, out


@torch.no_grad()
def test_trained_indexers_pick_their_top_k_of_the_k_each_layer_is_handed(setup):
    """Under csa2 a target's K is adapter(KV_source): its indexer must rank those entries, from that K."""
    from ced_csa2.kv_hooks import capture
    from ced_csa2.model_utils import rotary

    name, model, plan, geo, parts, ids = setup
    kv, index, modes, indexers = trained_indexers(setup, "full_reindex")
    reads = SparseReads(k=4, window=3)
    with sparse(model, plan, geo, parts, kv, index, reads, record=True, indexers=indexers) as group, \
            capture(model, kv_layers=indexers) as seen, \
            capture_inputs(model, indexers) as inputs:
        model(ids)
    for layer, ix in indexers.items():
        trace = group.sparse.trace[layer]
        cos, sin = rotary(model, layer, inputs[layer], torch.arange(T)[None])
        keys = ix.stored_keys(seen["k"][layer], cos, sin)  # the injected K: adapter(KV_source) on a target
        q, w = ix.queries(inputs[layer], cos, sin)
        scores = v41_scores(q, w, keys)
        candidates = trace["allowed"] & ~trace["window"]
        assert torch.equal(trace["chosen"], top_k(scores, candidates, reads.k)), (name, layer)
    # The oracle picks otherwise somewhere (so the check above can fail).
    with sparse(model, plan, geo, parts, kv, index, reads, record=True) as oracle:
        model(ids)
    assert any(not torch.equal(oracle.sparse.trace[la]["chosen"], group.sparse.trace[la]["chosen"]) for la in indexers)
    assert interface_untouched(model)


def v41_scores(q, w, keys):
    """V4.1's score written out, with the offset: ``Σ_h w_h ReLU(q_h · k + b_h)``."""
    d = keys.shape[-1]
    dots = torch.einsum("bhqd,bkd->bhqk", q[..., :d], keys) + q[..., d:]
    return torch.einsum("bhq,bhqk->bqk", w, dots.relu())


def capture_inputs(model, layers):
    """k_proj's input of each layer (the attention input: what the indexer's queries read)."""
    import contextlib

    from ced_csa2.model_utils import attention

    @contextlib.contextmanager
    def ctx():
        got = {}
        handles = [attention(model, la).k_proj.register_forward_hook(
            lambda m, i, o, la=la: got.__setitem__(la, i[0])) for la in layers]
        try:
            yield got
        finally:
            for h in handles:
                h.remove()
    return ctx()


@torch.no_grad()
def test_trained_selection_needs_an_indexer_for_every_selecting_layer_and_a_teacher_forced_pass(setup):
    name, model, plan, geo, parts, ids = setup
    kv, index, modes, indexers = trained_indexers(setup, "full_reuse")
    first = min(indexers)
    with pytest.raises(ModeError, match=rf"layers \[{first}\] select their own entries but have no trained indexer"):
        SparseAttention(model, modes, SparseReads(k=3), geo, indexers={la: ix for la, ix in indexers.items()
                                                                       if la != first})
    # The shared trunk (what the layer-modes study scores with) runs it as a full pass does.
    groups = {"s": sparse(model, plan, geo, parts, kv, index, SparseReads(k=3, window=2), indexers=indexers)}
    got = multi_group_nll(model, plan, ["baseline"], parts, ids.tolist(), [0, 0], 2, kv_format=None, extra=groups)["s"]
    with groups["s"]:
        logits = model(ids).logits.double()
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), ids[:, 1:], reduction="none").sum(1)
    # float32 logits of one forward through the sparse path vs another pass: FORWARD32 on logits, times |log p| (~6)
    # × the sequence's tokens (~100): <= 1e-3 absolute on the sum
    torch.testing.assert_close(got[:, 0], nll, atol=1e-3, rtol=1e-5)
    # A cached step hands the layer more entries than its k_proj saw: refused, not ranked from a part.
    cache = DynamicCache(config=model.config)
    with CEDModeBRuntime(model, plan, kv, parts, kv_format=None), \
            SparseAttention(model, modes, SparseReads(k=3), geo, indexers=indexers):
        model(ids[:, :-1], cache=cache, use_cache=True)
        with pytest.raises(RuntimeError, match="needs every position in one forward"):
            model(ids[:, -1:], cache=cache, use_cache=True)
    assert interface_untouched(model)
