"""The shared store reproduces Mode B's cached generation, uses exactly the accounted bytes and holds the
bytes its tensors' storages occupy."""
import contextlib

import pytest
import torch
from cache_storages import storage_sizes
from conftest import FORWARD32, rounding_tol, tiny_gemma3, tiny_llama
from tiny_maps import LLAMA_PLAN, QWEN_PLAN, random_parts
from transformers import DynamicCache

from ced_csa2 import kv_hooks
from ced_csa2.ced_runtime import CEDModeBRuntime
from ced_csa2.kv.block_format import Packed
from ced_csa2.kv.formats import FP4_FORMATS
from ced_csa2.kv import rotation
from ced_csa2.kv.kv_bytes import bytes_per_token, fp4_entry_bytes, kv_copies
from ced_csa2.kv.rotation import fp4_round_trip, layer_rotation
from ced_csa2.model_utils import geometry
from ced_csa2.kv.formats import group_format
from ced_csa2.plan import LayerPlan
from ced_csa2.groups import GROUPS
from ced_csa2.runtime.shared_kv import (
    SHARED_GROUPS,
    BlockKVCache,
    BlockLayer,
    FP4KVCache,
    SharedKVCache,
    TokenStore,
    SharedLayer,
    accounted_copies,
    cache_bytes,
    greedy_generate,
    shared_kv_generate,
)

# Tiny Gemma-3 (window 6, full at 3/6): a full source read by two sliding readers and a full
# one; and a sliding source read by sliding layers only (its store forgets old positions).
GEMMA_PLAN = LayerPlan(2, 3, (5, 6, 8))
GEMMA_SLIDING_PLAN = LayerPlan(1, 2, (4, 5))
PROMPT, NEW = 11, 6  # 16 cached positions: past the Gemma window
FP32_BYTES = 4


@pytest.fixture(params=["llama", "qwen3_5", "gemma3", "gemma3_sliding_source"])
def setup(request, tiny_model):
    """``(model, plan, parts, prompt)`` for the all-attention tiny Llama, the hybrid tiny Qwen3.5 and
    the sliding + full tiny Gemma-3."""
    model, plan, vocab = {"llama": lambda: (tiny_llama(), LLAMA_PLAN, 300),
                          "qwen3_5": lambda: (tiny_model[0], QWEN_PLAN, 250),
                          "gemma3": lambda: (tiny_gemma3(), GEMMA_PLAN, 300),
                          "gemma3_sliding_source": lambda: (tiny_gemma3(), GEMMA_SLIDING_PLAN, 300)}[request.param]()
    torch.manual_seed(1)
    prompt = torch.randint(0, vocab, (2, PROMPT))
    return model, plan, random_parts(geometry(model.config), plan), prompt


def mode_b(model, plan, group, parts, prompt):
    """Mode B's cached generation (HF generate) and the DynamicCache bytes of the same greedy run."""
    with torch.no_grad(), CEDModeBRuntime(model, plan, group, parts, kv_format="nvfp4"):
        # An explicit all-ones mask: otherwise generate() treats prompt tokens equal to
        # pad_token_id as padding.  eos_token_id=None: always NEW tokens.
        ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
        dynamic = greedy_generate(model, prompt, NEW, DynamicCache(config=model.config))
    return ref, cache_bytes(dynamic.cache).used


def no_hooks(model):
    return all(not (m._forward_hooks or m._forward_pre_hooks) for m in model.modules())


def stored_tokens(prompt):
    # The last generated token is never fed back, so it has no cache entry.
    return prompt.shape[0] * (prompt.shape[1] + NEW - 1)


def held_entries(geo, layers, prompt):
    """Entries (batch rows x positions) the caches of ``layers`` hold after generation, counted
    independently of the accounting module: a sliding layer keeps its last window - 1 positions."""
    positions = prompt.shape[1] + NEW - 1
    return prompt.shape[0] * sum(positions if geo.window(la) is None else min(positions, geo.window(la) - 1)
                                 for la in layers)


def accounted(geo, plan, group, storage, prompt):
    """The accounting module's bytes for the same cache: per token at this context, times its tokens."""
    per_token = bytes_per_token(accounted_copies(geo, plan, group, storage, FP32_BYTES), stored_tokens(prompt)
                                // prompt.shape[0])
    return round(stored_tokens(prompt) * per_token)


@pytest.mark.parametrize("group", SHARED_GROUPS)
def test_unquantised_store_reproduces_mode_b_generation(setup, group):
    model, plan, parts, prompt = setup
    ref, _ = mode_b(model, plan, group, parts, prompt)
    got = shared_kv_generate(model, plan, group, parts, prompt, NEW, storage="bf16")
    assert torch.equal(got.tokens, ref.sequences[:, PROMPT:])
    # Two decode paths over NEW steps: each step's float32 forward rounds differently (FORWARD32's 96 eps), the
    # differences carried through the cache into every later step's logits (~1): 10 x 96 eps.
    tol = rounding_tol(torch.float32, 10 * 96)
    torch.testing.assert_close(got.logits, torch.stack(ref.logits, dim=1), atol=tol, rtol=tol)
    assert no_hooks(model)


@pytest.mark.parametrize("group", ["share_plain", "ced_csa2", "ced_csa2_sink"])
def test_a_left_padded_batch_decodes_each_row_as_it_decodes_alone(setup, group):
    """``generate`` on a left-padded batch (lm-eval's batches) through the store gives each row the tokens that
    row gets unpadded: the store rebuilds RoPE at each row's own positions.  Ignoring the padding would rotate
    the short row's K by 3 positions too many and change its tokens."""
    model, plan, parts, prompt = setup
    pad = 3
    short = prompt[1:, pad:]
    padded = torch.cat([prompt[:1], torch.cat([torch.zeros(1, pad, dtype=prompt.dtype), short], dim=1)])
    mask = torch.ones_like(padded)
    mask[1, :pad] = 0
    cache = SharedKVCache(model, plan, group, parts)
    with torch.no_grad(), cache.feed():
        out = model.generate(padded, attention_mask=mask, cache=cache, max_new_tokens=NEW, do_sample=False,
                             pad_token_id=0, eos_token_id=None, output_logits=True, return_dict_in_generate=True)
    assert cache._store.pads.tolist() == [0, pad]
    logits = torch.stack(out.logits, dim=1)
    tol = rounding_tol(torch.float32, 10 * 96)  # two decode paths, as in the test above
    for row, alone in ((0, prompt[:1]), (1, short)):
        got = shared_kv_generate(model, plan, group, parts, alone, NEW)
        assert torch.equal(out.sequences[row, PROMPT:], got.tokens[0])
        torch.testing.assert_close(logits[row], got.logits[0], atol=tol, rtol=tol)
    assert no_hooks(model)


@pytest.mark.parametrize("group", SHARED_GROUPS)
def test_used_bytes_are_the_accounted_bytes_and_fewer_than_dynamic_cache(setup, group):
    model, plan, parts, prompt = setup
    geo = geometry(model.config)
    _, dynamic_bytes = mode_b(model, plan, group, parts, prompt)
    cache = shared_kv_generate(model, plan, group, parts, prompt, NEW).cache
    # Independently of the accounting module: every attention layer but the targets holds
    # 2 · kv_dim fp32 values per entry; the source's entries are the one stored copy.
    stored = [la for la in geo.attention_layers if la not in plan.targets]
    expected = held_entries(geo, stored, prompt) * 2 * geo.kv_dim * FP32_BYTES
    # A sink group's targets each hold their own K and V at each row's first `sink` positions, whatever the window.
    kept = prompt.shape[0] * GROUPS[group].sink * len(plan.targets) * 2 * geo.kv_dim * FP32_BYTES
    assert cache_bytes(cache).used == expected + kept
    context = stored_tokens(prompt) // prompt.shape[0]
    assert expected == round(stored_tokens(prompt) * bytes_per_token(
        kv_copies(geo, plan, GROUPS[group], "all_attention", FP32_BYTES), context))
    assert expected + kept == accounted(geo, plan, group, "bf16", prompt)
    assert dynamic_bytes == held_entries(geo, geo.attention_layers, prompt) * 2 * geo.kv_dim * FP32_BYTES
    assert cache_bytes(cache).used < dynamic_bytes


@pytest.mark.parametrize("group", ["csa2", "ced_csa2"])
def test_store_holds_the_pre_norm_pre_rope_source_kv(tiny_model, group):
    model, _ = tiny_model  # Qwen3.5: has a k_norm, so pre-norm and post-norm differ
    parts = random_parts(geometry(model.config), QWEN_PLAN)
    prompt = torch.randint(0, 250, (1, 9))
    cache = shared_kv_generate(model, QWEN_PLAN, group, parts, prompt, 1).cache  # prefill only
    with torch.no_grad(), kv_hooks.capture(model, [QWEN_PLAN.source], [QWEN_PLAN.split]) as seen:
        model(prompt)
    k, v = (parts.projector(seen["h"][QWEN_PLAN.split]) if group == "ced_csa2"
            else (seen["k"][QWEN_PLAN.source], seen["v"][QWEN_PLAN.source]))
    # the same float32 prefill, once inside the cached generation and once alone: a forward's roundings at most
    torch.testing.assert_close(cache._store.k.read(), k, **FORWARD32)
    torch.testing.assert_close(cache._store.v.read(), v, **FORWARD32)


@pytest.mark.parametrize("model_name,storage", [("llama", "nvfp4"), ("qwen3_5", "nvfp4"), ("qwen3_5", "mxfp4")])
def test_fp4_store_holds_packed_blocks_of_exactly_fp4_entry_bytes(tiny_model, model_name, storage):
    model, plan = (tiny_llama(), LLAMA_PLAN) if model_name == "llama" else (tiny_model[0], QWEN_PLAN)
    geo = geometry(model.config)
    parts = random_parts(geo, plan)
    prompt = torch.randint(0, 250, (2, PROMPT))
    fmt = FP4_FORMATS[storage]()
    got = shared_kv_generate(model, plan, "csa2", parts, prompt, NEW, storage=storage)
    dense = shared_kv_generate(model, plan, "csa2", parts, prompt, NEW, storage="bf16")
    store = got.cache._store
    assert isinstance(store.k.data, Packed) and store.k.data.shape == (2, PROMPT + NEW - 1, geo.kv_dim)
    assert store.used_bytes == 2 * stored_tokens(prompt) * fp4_entry_bytes(geo.kv_dim, fmt.group)
    n_dense = len(geo.attention_layers) - len(plan.targets) - 1
    dense_bytes = stored_tokens(prompt) * n_dense * 2 * geo.kv_dim * FP32_BYTES
    used = cache_bytes(got.cache).used
    assert used == dense_bytes + store.used_bytes
    assert used == stored_tokens(prompt) * bytes_per_token(accounted_copies(geo, plan, "csa2", storage, FP32_BYTES))
    assert used < cache_bytes(dense.cache).used
    # Layers below the source are untouched, so the prompt's entries are FP4 of the same K.
    expected = fmt.quantize(dense.cache._store.k.read()[:, :PROMPT])
    assert torch.equal(store.k.data.elements[:, :PROMPT], expected.elements)
    assert torch.equal(store.k.data.scales[:, :PROMPT], expected.scales)
    assert got.logits.isfinite().all() and no_hooks(model)


@pytest.mark.parametrize("storage", ["bf16", "nvfp4", "mxfp4"])
def test_a_token_store_read_at_positions_is_those_rows_of_the_whole_read(storage):
    """The sparse decode's read: packed rows gathered, then dequantised -- the same bits as the whole read's rows."""
    store = TokenStore(FP4_FORMATS[storage]() if storage in FP4_FORMATS else None)
    x = torch.randn(2, 9, 64)
    store.append(x[:, :5])
    store.append(x[:, 5:])
    at = torch.tensor([[0, 3, 8], [2, 2, 7]])  # per-row positions, a repeat included
    whole = store.read()
    assert torch.equal(store.read(at), torch.stack([whole[b, at[b]] for b in range(2)]))


@pytest.mark.parametrize("storage", ["bf16", "mxfp4"])
def test_a_token_store_growing_past_its_reserve_holds_every_entry_once(storage):
    """Appends that cross the reserved capacity (a prefill, then one entry a step past 2 x GROW), then a
    sliding window's cut and more appends: the entries read back are those written, in order; the bytes used
    are the entries', the bytes allocated the buffers' (the reserve included: capacity a multiple of GROW)."""
    fmt = FP4_FORMATS[storage]() if storage in FP4_FORMATS else None
    store, grow = TokenStore(fmt), TokenStore.GROW
    x = torch.randn(2, 2 * grow + 7, 32)
    store.append(x[:, :grow - 3])
    for t in range(grow - 3, x.shape[1]):
        store.append(x[:, t:t + 1])
    expected = x if fmt is None else fmt.dequantize(fmt.quantize(x))
    assert len(store) == x.shape[1] and torch.equal(store.read(), expected)
    entry = 32 * 4 if fmt is None else fp4_entry_bytes(32, fmt.group)
    assert store.used_bytes == 2 * x.shape[1] * entry
    assert store.allocated_bytes == 2 * 3 * grow * entry == sum(b.untyped_storage().nbytes() for b in store._buffers)
    store.keep_last(5)
    assert store.allocated_bytes == store.used_bytes == 2 * 5 * entry  # the cut is a copy of the entries kept
    store.append(x[:, :3])
    assert torch.equal(store.read(), torch.cat([expected[:, -5:], expected[:, :3]], dim=1))
    assert store.used_bytes == 2 * 8 * entry and store.allocated_bytes == 2 * grow * entry
    store.clear()
    assert len(store) == 0 and store.used_bytes == store.allocated_bytes == 0 and store.data is None


def test_fp4_layer_returns_the_fp4_round_trip_of_what_it_was_given():
    fmt = FP4_FORMATS["nvfp4"]()
    layer = BlockLayer(fmt, fmt)
    k1, v1, k2, v2 = (torch.randn(2, 3, n, 32) for n in (5, 5, 1, 1))
    layer.update(k1, v1)
    k, v = layer.update(k2, v2)
    for got, parts in ((k, (k1, k2)), (v, (v1, v2))):
        full = torch.cat(parts, dim=2)  # (B, n_kv, T, head_dim); groups run along n_kv·head_dim
        flat = full.transpose(1, 2).reshape(2, 6, 96)
        assert torch.equal(got, fmt.dequantize(fmt.quantize(flat)).view(2, 6, 3, 32).transpose(1, 2))
    assert layer.used_bytes == 2 * 2 * 6 * fp4_entry_bytes(96, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("storage", ["nvfp4", "mxfp4"])
def test_a_rotated_token_store_holds_fp4_of_the_rotated_entries_and_reads_the_rotated_round_trip(storage, dtype):
    """The buffers hold ``FP4(R x)`` per head (the unrotated store's bytes); a read, whole or at positions, is
    ``fp4_round_trip(fmt, x, R)`` -- Mode B's rotated rounding -- bit for bit, in the written dtype."""
    fmt, r = FP4_FORMATS[storage](), layer_rotation(32, 4)
    x = (torch.randn(2, 9, 64, dtype=torch.float64) * torch.linspace(0.1, 8, 64, dtype=torch.float64)).to(dtype)
    store, plain = TokenStore(fmt, r), TokenStore(fmt)
    for part in (x[:, :5], x[:, 5:]):
        store.append(part)
        plain.append(part)
    expected = fmt.quantize(r.rotate(x))
    assert torch.equal(store.data.elements, expected.elements) and torch.equal(store.data.scales, expected.scales)
    assert not torch.equal(plain.data.elements, store.data.elements)
    assert store.used_bytes == plain.used_bytes == 2 * 9 * fp4_entry_bytes(64, fmt.group)
    assert store.allocated_bytes == plain.allocated_bytes  # R is not among the buffers
    whole = store.read()
    assert whole.dtype == dtype and torch.equal(whole, fp4_round_trip(fmt, x, r))
    at = torch.tensor([[0, 3, 8], [2, 2, 7]])
    assert torch.equal(store.read(at), torch.stack([whole[b, at[b]] for b in range(2)]))


def test_a_rotated_fp4_layer_returns_the_rotated_round_trip_of_what_it_was_given():
    """Each stream rotated by its own ``R`` (here K by one matrix, V by another, to tell them apart) before FP4."""
    fmt = FP4_FORMATS["nvfp4"]()
    rk, rv = layer_rotation(32, 2), layer_rotation(32, 3)
    layer = BlockLayer(fmt, fmt, rotations={"k": rk, "v": rv})
    k1, v1, k2, v2 = (torch.randn(2, 3, n, 32) for n in (5, 5, 1, 1))
    layer.update(k1, v1)
    k, v = layer.update(k2, v2)
    for got, parts, r in ((k, (k1, k2), rk), (v, (v1, v2), rv)):
        flat = torch.cat(parts, dim=2).transpose(1, 2).reshape(2, 6, 96)  # heads contiguous along kv_dim
        assert torch.equal(got, fp4_round_trip(fmt, flat, r).view(2, 6, 3, 32).transpose(1, 2))
        assert not torch.equal(got, fp4_round_trip(fmt, flat).view(2, 6, 3, 32).transpose(1, 2))
    assert layer.used_bytes == 2 * 2 * 6 * fp4_entry_bytes(96, 16)  # the unrotated layer's: R is not stored


def test_the_rotated_caches_rotate_the_streams_of_rotated_streams_with_each_layer_s_matrix(tiny_model, monkeypatch):
    """``FP4KVCache(rotate=True)``: layer ``l``'s stores use ``layer_rotation(head_dim, l)``; the shared store the
    source's.  :data:`ROTATED_STREAMS` is read when the cache is built, as Mode B reads it: ``("k",)`` leaves V plain."""
    model, _ = tiny_model
    geo = geometry(model.config)
    cache = FP4KVCache(model.config, "nvfp4", rotate=True)
    for la in geo.attention_layers:
        stores = cache.layers[la - 1].k_store, cache.layers[la - 1].v_store
        assert all(torch.equal(s.rotation.matrix, layer_rotation(geo.head_dim, la).matrix) for s in stores), la
    assert all(s.rotation is None for la in FP4KVCache(model.config, "nvfp4").layers if isinstance(la, BlockLayer)
               for s in (la.k_store, la.v_store))
    monkeypatch.setattr(rotation, "ROTATED_STREAMS", ("k",))
    shared = SharedKVCache(model, QWEN_PLAN, "csa2", random_parts(geo, QWEN_PLAN), "nvfp4", rotate=True)
    assert torch.equal(shared._store.k.rotation.matrix, layer_rotation(geo.head_dim, QWEN_PLAN.source).matrix)
    assert shared._store.v.rotation is None
    only_k = FP4KVCache(model.config, "nvfp4", rotate=True).layers[geo.attention_layers[0] - 1]
    assert only_k.k_store.rotation is not None and only_k.v_store.rotation is None


def test_fp4_baseline_cache_stores_every_attention_layer_in_fp4(setup):
    model, plan, _, prompt = setup
    geo = geometry(model.config)
    got = greedy_generate(model, prompt, NEW, FP4KVCache(model.config, "nvfp4"))
    expected = held_entries(geo, geo.attention_layers, prompt) * 2 * fp4_entry_bytes(geo.kv_dim, 16)
    assert cache_bytes(got.cache).used == expected
    assert expected == accounted(geo, plan, "baseline", "nvfp4", prompt)
    assert got.logits.isfinite().all()


LONG = 186  # prompt: LONG + NEW - 1 = 191 cached positions, not a multiple of TokenStore.GROW


def slack(geo, plan, kind: str, batch: int, positions: int) -> int:
    """Bytes allocated beyond those used, derived from each layer's cache (``kind`` as in the test below).

    A :class:`TokenStore` that grew last holds a reserve up to the next multiple of ``GROW`` positions; one
    cut to a sliding window holds none (the cut is a copy).  A ``DynamicSlidingWindowLayer`` after a decode
    step keeps ``window - 1`` positions as a view of the step's ``window``: one position more.  A full
    ``DynamicLayer`` holds exactly its entries (a concatenation per step).
    """
    dense, fp4 = 2 * geo.kv_dim * FP32_BYTES, 2 * fp4_entry_bytes(geo.kv_dim, 16)
    k6v4 = 3 * geo.kv_dim // 4 + geo.kv_dim // 2 + 2 * (geo.kv_dim // 32)  # FP6 K + MXFP4 V, a scale per 32 each
    reserve = -(-positions // TokenStore.GROW) * TokenStore.GROW - positions
    total = 0
    for la in geo.attention_layers:
        sliding = geo.window(la) is not None
        if kind.startswith("fp4") or kind == "k6v4":
            total += 0 if sliding else reserve * (k6v4 if kind == "k6v4" else fp4)
        elif kind.startswith("shared") and la == plan.source:
            total += 0 if sliding else reserve * (fp4 if kind.startswith("shared_nvfp4") else dense)
        elif not (kind.startswith("shared") and la in plan.targets):
            total += dense if sliding else 0
    return batch * total


@pytest.mark.parametrize("kind", ["dynamic", "shared", "shared_nvfp4", "shared_nvfp4_rot", "fp4", "fp4_rot", "k6v4"])
def test_allocated_bytes_are_the_storages_of_the_cache_s_tensors(setup, kind):
    """At 191 cached positions: ``allocated`` is the distinct storages' bytes, found from the cache's tensors
    (the store once, however many layers read it), and exceeds ``used`` (the accounting's bytes) by the
    stores' reserves (fewer than ``GROW`` positions each) and the sliding layers' views.  A rotated store's
    bytes are its unrotated twin's (the same accounting); ``baseline_k6v4_rot``'s (K FP6, V MXFP4) are its own."""
    model, plan, parts, _ = setup
    geo = geometry(model.config)
    torch.manual_seed(2)
    prompt = torch.randint(0, 250, (2, LONG))
    if kind == "k6v4" and geo.kv_dim % 32:  # tiny Llama: kv_dim 16 holds no block of 32 channels
        with pytest.raises(ValueError, match="FP6 stores groups of 32 channels, which do not divide kv_dim = 16"):
            BlockKVCache(model.config, group_format(GROUPS["baseline_k6v4_rot"]))
        return
    cache = {"dynamic": lambda: DynamicCache(config=model.config), "fp4": lambda: FP4KVCache(model.config, "nvfp4"),
             "fp4_rot": lambda: FP4KVCache(model.config, "nvfp4", rotate=True),
             "k6v4": lambda: BlockKVCache(model.config, group_format(GROUPS["baseline_k6v4_rot"])),
             "shared": lambda: SharedKVCache(model, plan, "csa2", parts),
             "shared_nvfp4": lambda: SharedKVCache(model, plan, "csa2", parts, "nvfp4"),
             "shared_nvfp4_rot": lambda: SharedKVCache(model, plan, "csa2", parts, "nvfp4", rotate=True)}[kind]()
    with cache.feed() if kind.startswith("shared") else contextlib.nullcontext():
        greedy_generate(model, prompt, NEW, cache)
    positions = LONG + NEW - 1
    assert cache.get_seq_length() == positions == 191
    got = cache_bytes(cache)
    assert got.allocated == storage_sizes(cache)
    group = {"k6v4": "baseline_k6v4_rot"}.get(kind, "csa2" if kind.startswith("shared") else "baseline")
    storage = "nvfp4" if "fp4" in kind else "bf16"
    assert got.used == accounted(geo, plan, group, storage, prompt)
    assert got.allocated - got.used == slack(geo, plan, kind, prompt.shape[0], positions)
    stores = [t for la in cache.layers if isinstance(la, BlockLayer) for t in (la.k_store, la.v_store)]
    stores += [t for la in cache.layers[plan.source - 1:plan.source] if isinstance(la, SharedLayer)
               for t in (la.store.k, la.store.v)]
    assert bool(stores) == (kind != "dynamic")
    for tokens in stores:  # each store's reserve: fewer than GROW positions of its entries
        entry = tokens.used_bytes // (prompt.shape[0] * len(tokens))
        assert 0 <= tokens.allocated_bytes - tokens.used_bytes < prompt.shape[0] * TokenStore.GROW * entry


def test_hooks_are_removed_even_when_the_forward_fails(tiny_model):
    model, _ = tiny_model
    cache = SharedKVCache(model, QWEN_PLAN, "ced_csa2", random_parts(geometry(model.config), QWEN_PLAN))
    with pytest.raises(RuntimeError, match="boom"), cache.feed():
        assert not no_hooks(model)
        raise RuntimeError("boom")
    assert no_hooks(model)
    assert cache._store.captured is None


def test_refusals(tiny_model):
    model, _ = tiny_model
    llama = tiny_llama()
    parts = random_parts(geometry(model.config), QWEN_PLAN)
    for group in ("baseline", "ced"):
        with pytest.raises(ValueError, match=f"group '{group}' has no shared store"):
            SharedKVCache(model, QWEN_PLAN, group, parts)
    with pytest.raises(ValueError, match="group 'csa2' needs adapters"):
        SharedKVCache(model, QWEN_PLAN, "csa2")
    with pytest.raises(ValueError, match="unknown storage 'fp8'"):
        SharedKVCache(model, QWEN_PLAN, "share_plain", storage="fp8")
    with pytest.raises(ValueError, match="group 'ced_csa2_sink' keeps its first positions' entries exact; storage "
                                         "'nvfp4' would round the source's"):
        SharedKVCache(model, QWEN_PLAN, "ced_csa2_sink", parts, storage="nvfp4")
    with pytest.raises(ValueError, match="groups of 32 channels, which do not divide kv_dim = 16"):
        SharedKVCache(llama, LLAMA_PLAN, "share_plain", storage="mxfp4")
    with pytest.raises(ValueError, match="needs an FP4 storage"):
        FP4KVCache(model.config, "bf16")
    with pytest.raises(ValueError, match="a rotation applies to block-format entries"):
        TokenStore(None, layer_rotation(16, 1))

    cache = SharedKVCache(model, QWEN_PLAN, "share_plain")
    with pytest.raises(RuntimeError, match=r"inside `with cache.feed\(\):`"), torch.no_grad():
        model(torch.randint(0, 250, (1, 4)), cache=cache, use_cache=True)
    cache = SharedKVCache(llama, LLAMA_PLAN, "share_plain")
    with pytest.raises(ValueError, match="count from each row's first token"), torch.no_grad(), cache.feed():
        llama(torch.randint(0, 300, (1, 4)), position_ids=torch.arange(1, 5)[None], cache=cache, use_cache=True)
    with pytest.raises(NotImplementedError, match="plain incremental decoding only"):
        cache.crop(-1)
