"""Sparse CSA2 decode: the dense store's generation while k covers the context; otherwise each target
reads exactly the window and the source's top-k, adapted at those positions only, at the dense bytes (used: the
entries, as accounted; allocated: the storages of the cache's tensors)."""

import pytest
import torch
from cache_storages import storage_sizes
from conftest import FORWARD32, tiny_gemma3, tiny_llama
from tiny_maps import LLAMA_PLAN, QWEN_PLAN, random_parts

from ced_csa2.model_utils import attention, geometry
from ced_csa2.plan import LayerPlan
from ced_csa2.runtime.attention_calls import AttentionCalls
from ced_csa2.runtime.shared_kv import SharedKVCache, TokenStore, cache_bytes, greedy_generate, shared_kv_generate
from ced_csa2.runtime.sparse_decode import KeptEntries, KeyScan, SparseDecode, SparseSharedKVCache

PROMPT, NEW = 11, 6  # up to 16 cached positions


@pytest.fixture(params=["llama", "llama_eager", "qwen3_5"])
def setup(request, tiny_model):
    """``(model, plan, parts, prompt)``: the all-attention tiny Llama (sdpa, and eager: a mask tensor even at
    decode, which the targets' shorter reads must drop) and the hybrid tiny Qwen3.5 (k_norm, partial RoPE)."""
    model, plan, vocab = {"llama": lambda: (tiny_llama(), LLAMA_PLAN, 300),
                          "llama_eager": lambda: (tiny_llama("eager"), LLAMA_PLAN, 300),
                          "qwen3_5": lambda: (tiny_model[0], QWEN_PLAN, 250)}[request.param]()
    torch.manual_seed(1)
    return model, plan, random_parts(geometry(model.config), plan), torch.randint(0, vocab, (2, PROMPT))


def sparse_generate(model, plan, group, parts, prompt, reads):
    cache = SparseSharedKVCache(model, plan, group, parts, reads=reads)
    with cache.feed():
        return greedy_generate(model, prompt, NEW, cache)


def untouched(model):
    return all(not (m._forward_hooks or m._forward_pre_hooks) for m in model.modules())


@pytest.mark.parametrize("group", ["csa2", "ced_csa2", "share_plain"])
def test_reads_that_cover_the_context_give_the_dense_store_s_generation_bit_for_bit(setup, group):
    model, plan, parts, prompt = setup
    dense = shared_kv_generate(model, plan, group, parts, prompt, NEW)
    sparse = sparse_generate(model, plan, group, parts, prompt, SparseDecode(k=PROMPT + NEW - 4, window=4))
    assert torch.equal(sparse.tokens, dense.tokens) and torch.equal(sparse.logits, dense.logits)
    assert cache_bytes(sparse.cache) == cache_bytes(dense.cache)  # used and allocated
    assert untouched(model)


def recorded_step(model, plan, cache, prompt):
    """Prefill ``prompt`` into ``cache``, then one decode step; the decode step's attention inputs per layer."""
    calls = AttentionCalls(attention(model, plan.source), "the test records the attention inputs")
    layers = {attention(model, la): la for la in (plan.source, *plan.targets)}
    seen = {}

    def record(original, module, query, key, value, mask, *args, **kwargs):
        if module in layers:
            seen[layers[module]] = (query, key, value)
        return original(module, query, key, value, mask, *args, **kwargs)

    with torch.no_grad(), cache.feed():
        x = model(input_ids=prompt, cache=cache, use_cache=True, logits_to_keep=1).logits[:, -1:].argmax(-1)
        with calls.routed(record):
            logits = model(input_ids=x, cache=cache, use_cache=True).logits[:, -1]
    return seen, logits


@pytest.mark.parametrize("storage", ["bf16", "nvfp4"])  # nvfp4: packed rows gathered, then dequantised
@pytest.mark.parametrize("group", ["csa2", "ced_csa2"])
def test_each_target_reads_the_window_and_the_source_s_top_k_adapted_at_those_positions(setup, group, storage):
    model, plan, parts, prompt = setup
    reads = SparseDecode(k=3, window=2)
    dense, dense_logits = recorded_step(model, plan, SharedKVCache(model, plan, group, parts, storage), prompt)
    sparse, sparse_logits = recorded_step(
        model, plan, SparseSharedKVCache(model, plan, group, parts, storage, reads=reads), prompt)
    query, key, _ = dense[plan.source]
    n = key.shape[2]
    assert n == PROMPT + 1
    torch.testing.assert_close(sparse[plan.source][1], key, rtol=0, atol=0)  # the source reads everything
    # The selection, independently: each query head's logits against its KV head's keys, summed over heads
    group_size = query.shape[1] // key.shape[1]
    older = key.repeat_interleave(group_size, dim=1)[:, :, :n - reads.window]  # (B, H, older, d)
    logits = (query * older).sum(-1)  # (B, H, older): the one query row broadcast over the entries
    top = logits.sum(1).topk(reads.k, dim=-1).indices.sort(-1).values
    expected = torch.cat([top, torch.arange(n - reads.window, n).expand(prompt.shape[0], -1)], dim=1)
    for t in plan.targets:
        _, k_dense, v_dense = dense[t]
        _, k_sparse, v_sparse = sparse[t]
        assert k_sparse.shape[2] == reads.k + reads.window
        at = expected[:, None, :, None].expand(-1, k_dense.shape[1], -1, k_dense.shape[-1])
        # float32: the adapter on 5 rows vs on all rows (another matmul blocking), then k_norm and RoPE
        # the kept entries re-adapted and gathered vs the dense read of the same positions: one forward's roundings
        torch.testing.assert_close(k_sparse, k_dense.gather(2, at), **FORWARD32)
        torch.testing.assert_close(v_sparse, v_dense.gather(2, at), **FORWARD32)
    # fewer entries read: not the dense step (1e-4 is ~840 float32 eps on logits ~1, 8x FORWARD32)
    assert not torch.allclose(sparse_logits, dense_logits, atol=1e-4)
    assert untouched(model)


def adapted(plan, model, prompt, kept: int) -> int:
    """The targets' K and V kept between steps: ``kept`` entries per target, float32."""
    return prompt.shape[0] * len(plan.targets) * kept * 2 * geometry(model.config).kv_dim * 4


@pytest.mark.parametrize("keep, kept", [(None, 5), (9, 9)])
def test_sparse_generation_holds_the_dense_store_s_bytes_and_the_kept_entries(setup, keep, kept):
    model, plan, parts, prompt = setup
    reads = SparseDecode(k=2, window=3, keep=keep)
    dense = shared_kv_generate(model, plan, "csa2", parts, prompt, NEW)
    sparse = sparse_generate(model, plan, "csa2", parts, prompt, reads)
    extra = adapted(plan, model, prompt, kept)
    sparse_bytes, dense_bytes = cache_bytes(sparse.cache), cache_bytes(dense.cache)
    assert sparse_bytes.used == dense_bytes.used + extra
    assert sparse_bytes.allocated == dense_bytes.allocated + extra == storage_sizes(sparse.cache)  # tables: exact
    assert reads.adapted_bytes(len(plan.targets), geometry(model.config).kv_dim, 4, prompt.shape[0]) == extra


def test_the_targets_keep_the_most_recently_read_entries_in_one_table_and_rebuild_only_the_others():
    """Slot by slot, with ``keep`` 3 and two entries read a step, two targets on one table: each step
    places the positions once, each target rebuilds exactly the positions not kept, the longest unread
    entry makes room, and every read returns that target's own entry of each position."""
    attn = torch.nn.Module()
    attn.head_dim = 2
    kept = KeptEntries(1, 3, torch.device("cpu"))
    like = torch.zeros(1, 1, 4)  # 2 KV heads of width 2
    reads = [[0, 1], [1, 2], [2, 3], [1, 3], [0, 3], [2, 3]]
    # the evicted: none (an empty slot takes 2), then 0, none (both kept), 2, then 1 (read at step 3)
    rebuilt = [[0, 1], [2], [3], [], [0], [2]]
    for step, (read, expect) in enumerate(zip(reads, rebuilt)):
        at = torch.tensor([read])
        slots = kept.place(at, step)
        for layer, sign in ((5, 1.0), (7, -2.0)):  # each target's entry: its own multiple of the position
            calls = []

            def rebuild(missed, sign=sign, calls=calls):
                positions = at.flatten()[missed].float()
                calls.extend(at.flatten()[missed].tolist())
                k = sign * positions[:, None, None].expand(-1, 2, 2)  # (misses, n_kv, head_dim)
                return k.transpose(0, 1)[None], -k.transpose(0, 1)[None]

            k, v = kept.read(layer, slots, attn, like, rebuild)
            assert calls == expect, f"step {step}, layer {layer}"
            assert torch.equal(k, sign * at.float()[:, None, :, None].expand(-1, 2, -1, 2)) and torch.equal(v, -k)
    assert sorted(kept.positions[0].tolist()) == [0, 2, 3]
    assert kept.used_bytes == 2 * 2 * 3 * 2 * 2 * 4  # 2 targets x K, V x 3 slots x 2 heads x 2 channels x float32


@pytest.mark.parametrize("keep", [None, 8])
def test_kept_entries_are_reused_and_only_other_positions_run_the_adapter(setup, keep):
    """Generation with the reuse equals generation that adapts every read entry at every step (the kept
    entries dropped before each step), to float32's matmul-blocking tolerance; after the first sparse step
    the adapters run on fewer rows than are read."""
    model, plan, parts, prompt = setup
    reads = SparseDecode(k=3, window=2, keep=keep)
    rows = []
    adapt = parts.adapt

    def counting(layer, k, v):
        rows.append(k.shape[0] * k.shape[1])
        return adapt(layer, k, v)

    def generate(reuse: bool):
        cache = SparseSharedKVCache(model, plan, "csa2", parts, reads=reads)
        x, out = prompt, []
        with torch.no_grad(), cache.feed():
            for _ in range(NEW):
                if not reuse:
                    cache._store.adapted = None
                rows.clear()
                logits = model(input_ids=x, cache=cache, use_cache=True).logits[:, -1]
                x = logits.argmax(-1, keepdim=True)
                out.append((logits, list(rows)))
        return out

    parts.adapt = counting
    try:
        reused, fresh = generate(True), generate(False)
    finally:
        parts.adapt = adapt
    read = prompt.shape[0] * (reads.k + reads.window)
    for step, ((logits, n_reused), (logits_fresh, n_fresh)) in enumerate(zip(reused, fresh)):
        torch.testing.assert_close(logits, logits_fresh, **FORWARD32)  # one float32 forward on two paths
        if step >= 2:  # the second sparse step on: some entries carried over (the window moved by one)
            assert n_fresh == [read] * len(plan.targets) and all(n < read for n in n_reused)
    assert untouched(model)


def test_refusals():
    model = tiny_gemma3()
    plan = LayerPlan(2, 3, (5, 6, 8))  # sliding readers 5 and 8 of a full source
    parts = random_parts(geometry(model.config), plan)
    with pytest.raises(NotImplementedError, match=r"layers \[5, 8\] of the plan have one"):
        SparseSharedKVCache(model, plan, "csa2", parts, reads=SparseDecode(k=4, window=2))
    with pytest.raises(ValueError, match="keeps sink entries, which the sparse reads do not serve"):
        SparseSharedKVCache(model, plan, "ced_csa2_sink", parts, reads=SparseDecode(k=4, window=2))
    with pytest.raises(ValueError, match="window >= 1"):
        SparseDecode(k=4, window=0)
    with pytest.raises(ValueError, match=r"at least the k \+ window = 6 entries"):
        SparseDecode(k=4, window=2, keep=5)


# ----------------------------------------------------------------------------- a trained indexer

def an_indexer(model, plan, **options):
    """A random-init indexer of the source layer (its selection is what is checked, not its quality);
    with an offset, random offsets (they start at 0)."""
    from ced_csa2.maps.indexer import IndexerConfig
    from ced_csa2.train.indexer_training import new_indexer

    indexer = new_indexer(model, geometry(model.config), plan.source, IndexerConfig(heads=2, **options), seed=3)
    if indexer.has_offset:
        with torch.no_grad():
            indexer.b.bias.copy_(torch.randn(indexer.heads))
    return indexer


def test_with_an_indexer_reads_that_cover_the_context_give_the_dense_store_s_generation(setup):
    model, plan, parts, prompt = setup
    dense = shared_kv_generate(model, plan, "csa2", parts, prompt, NEW)
    cache = SparseSharedKVCache(model, plan, "csa2", parts, reads=SparseDecode(k=PROMPT + NEW - 4, window=4),
                                indexer=an_indexer(model, plan))
    with cache.feed():
        sparse = greedy_generate(model, prompt, NEW, cache)
    assert torch.equal(sparse.tokens, dense.tokens) and torch.equal(sparse.logits, dense.logits)
    assert untouched(model)


@pytest.mark.parametrize("options", [{}, {"offset": True, "rotate_keys": True},
                                     {"offset": True, "rotate_keys": True, "key_copies": 2}],
                         ids=["v4_1", "offset_rotated", "two_copies"])
def test_with_an_indexer_every_reader_reads_the_window_and_the_indexer_s_top_k(setup, options):
    """The source too reads its selection; the selection is the indexer's, recomputed here from the
    source's k_proj inputs and outputs, its keys through an MXFP4 round trip as the store keeps them
    (rotated keys: the store holds them rotated; an offset: the query's last channel, not stored; two
    copies: side by side, every copy's bytes held)."""
    from ced_csa2.maps.indexer import key_bytes, key_format
    from ced_csa2.model_utils import rotary

    model, plan, parts, prompt = setup
    reads, indexer = SparseDecode(k=3, window=2), an_indexer(model, plan, **options)
    dense, _ = recorded_step(model, plan, SharedKVCache(model, plan, "csa2", parts), prompt)
    cache = SparseSharedKVCache(model, plan, "csa2", parts, reads=reads, indexer=indexer)
    proj, seen = attention(model, plan.source).k_proj, []
    hook = proj.register_forward_hook(lambda m, i, o: seen.append((i[0], o)))
    try:
        sparse, _ = recorded_step(model, plan, cache, prompt)
    finally:
        hook.remove()
    x, k = torch.cat([s[0] for s in seen], 1), torch.cat([s[1] for s in seen], 1)  # prefill + step
    n = k.shape[1]
    with torch.no_grad():
        cos, sin = rotary(model, plan.source, k, torch.arange(n)[None])
        fmt = key_format(indexer.key_width)
        keys = fmt.dequantize(fmt.quantize(indexer.keys(k, cos, sin)), torch.float32)
        q, w = indexer.queries(x[:, -1:], cos[:, -1:], sin[:, -1:])
        d = indexer.key_width
        dots = (q[:, :, 0, None, :d] * keys[:, None]).sum(-1) + q[:, :, 0, d:].sum(-1, keepdim=True)
        scores = torch.einsum("bh,bhk->bk", w[:, :, 0], dots.relu())
    top = scores[:, :n - reads.window].topk(reads.k, dim=-1).indices.sort(-1).values
    expected = torch.cat([top, torch.arange(n - reads.window, n).expand(prompt.shape[0], -1)], dim=1)
    for layer in (plan.source, *plan.targets):
        _, k_dense, v_dense = dense[layer]
        _, k_sparse, v_sparse = sparse[layer]
        at = expected[:, None, :, None].expand(-1, k_dense.shape[1], -1, k_dense.shape[-1])
        # the kept entries re-adapted and gathered vs the dense read of the same positions: one forward's roundings
        torch.testing.assert_close(k_sparse, k_dense.gather(2, at), **FORWARD32)
        torch.testing.assert_close(v_sparse, v_dense.gather(2, at), **FORWARD32)
    dense_cache = SharedKVCache(model, plan, "csa2", parts)
    with dense_cache.feed(), torch.no_grad():
        model(input_ids=torch.cat([prompt, prompt[:, :1]], 1), cache=dense_cache, use_cache=True)
    keys = prompt.shape[0] * n * key_bytes(indexer.key_width)
    assert cache_bytes(cache).used == cache_bytes(dense_cache).used + keys + adapted(plan, model, prompt, reads.kept)
    assert untouched(model)


@pytest.mark.parametrize("width", [16, 192])
def test_the_key_scan_decodes_mxfp4_bit_for_bit_as_the_format_does(width):
    """Blocks spanning 2^-140 .. 2^40 (subnormal and clamped scales), all-zero blocks, a batch of 2, a prefix."""
    from ced_csa2.maps.indexer import key_format

    torch.manual_seed(0)
    fmt = key_format(width)
    x = torch.randn(2, 300, width) * torch.exp2(torch.randint(-140, 40, (2, 300, 1)).float())
    x[:, ::7] = 0
    packed = fmt.quantize(x)
    decoded = KeyScan()(packed, 257)
    expected = fmt.dequantize(packed)[:, :257]
    assert decoded.dtype == torch.float32 and decoded.shape == (2, 257, width)
    assert torch.equal(decoded.view(torch.int32), expected.view(torch.int32))  # bits, -0.0 included
    nan = fmt.quantize(x[:, :2])
    nan.scales[0, 0, 0] = 255  # E8M0's NaN: decodes to NaN, never to a number
    assert KeyScan()(nan, 2)[0, 0, :fmt.group].isnan().all()


def test_the_key_scan_scores_block_by_block_the_keys_the_whole_decode_gives():
    """Blocks of 64 over 257 keys (a short last block): each block is handed exactly the whole decode's keys
    at its positions, its scores land at those positions, and the blocks reuse one buffer.  (The score is
    elementwise, so exact whatever the block's shape; a matmul's rounding may depend on it.)"""
    from ced_csa2.maps.indexer import key_format

    torch.manual_seed(0)
    fmt = key_format(32)
    packed = fmt.quantize(torch.randn(2, 300, 32))
    scan, seen, handed = KeyScan(), [], []
    scan.BLOCK = 64

    def score(keys):
        seen.append((keys.shape[1], keys.data_ptr()))
        handed.append(keys.clone())
        return keys[..., 3] - keys[..., 7]

    scores = scan.scores(packed, 257, score)
    whole = KeyScan()(packed, 257)
    assert torch.equal(torch.cat(handed, 1).view(torch.int32), whole.view(torch.int32))
    assert torch.equal(scores, whole[..., 3] - whole[..., 7])
    assert [m for m, _ in seen] == [64, 64, 64, 64, 1] and len({ptr for _, ptr in seen}) == 1


def test_a_sparse_cache_with_an_indexer_holds_its_storages_at_191_positions(setup):
    """At a context that is not a multiple of ``GROW``: ``allocated`` is the storages of the cache's tensors (the
    store's, the indexer keys' and the kept tables), beyond ``used`` by the store's and the keys' reserves."""
    from ced_csa2.maps.indexer import key_bytes

    model, plan, parts, _ = setup
    kv_dim, batch, prompt_len = geometry(model.config).kv_dim, 2, 186
    torch.manual_seed(2)
    prompt = torch.randint(0, 250, (batch, prompt_len))
    reads, indexer = SparseDecode(k=3, window=2), an_indexer(model, plan, rotate_keys=True, key_copies=2)
    cache = SparseSharedKVCache(model, plan, "csa2", parts, reads=reads, indexer=indexer)
    dense = SharedKVCache(model, plan, "csa2", parts)
    for c in (cache, dense):
        with c.feed():
            greedy_generate(model, prompt, NEW, c)
    positions = prompt_len + NEW - 1
    assert cache.get_seq_length() == positions == 191 and cache._store.adapted is not None
    got = cache_bytes(cache)
    assert got.allocated == storage_sizes(cache)
    keys = batch * positions * key_bytes(indexer.key_width)
    assert got.used == cache_bytes(dense).used + keys + adapted(plan, model, prompt, reads.kept)
    reserve = TokenStore.GROW - positions  # positions per store beyond the entries: the store's K and V, the keys
    assert got.allocated - got.used == batch * reserve * (2 * kv_dim * 4 + key_bytes(indexer.key_width))
