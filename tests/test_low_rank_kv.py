"""LowRankKVCache: xKV decoded through a cache holding only its coefficients for the group's layers.

What is exact is checked (a decode step after a prefill against a hook-built teacher-forced reference), and that
the check has teeth (the reference differs from the plain model and from Mode B's xkv, which reconstructs the
current position too); the bytes are the coefficients', counted without the accounting."""

import pytest
import torch
from conftest import FORWARD32, tiny_gemma3, tiny_llama
from tiny_maps import GEMMA_PLAN, LLAMA_PLAN, random_parts, random_xkv, true_kv

from ced_csa2 import kv_hooks
from ced_csa2.ced_runtime import CEDModeBRuntime, CEDParts
from ced_csa2.eval import generation as gen
from ced_csa2.model_utils import attention, geometry
from ced_csa2.runtime.low_rank_kv import LowRankKVCache

SHARPEN = 30  # score scale: the tiny models' attention then is far from uniform (a fixed test input, not a tolerance)
PROMPT = 11  # past the tiny Gemma-3's window of 6: its sliding layers read only their last 5 reconstructions
FP32_BYTES = 4


@pytest.fixture(params=["llama", "gemma3"])
def setup(request):
    """All-attention tiny models only: the reference below fixes every layer's past K/V, which a linear-attention
    layer (the tiny Qwen3.5's) would not read."""
    model, plan = {"llama": (tiny_llama, LLAMA_PLAN), "gemma3": (tiny_gemma3, GEMMA_PLAN)}[request.param]
    model = model()
    for layer in geometry(model.config).attention_layers:
        # The random tiny models attend almost uniformly, so a 1% error in K would hide under the tolerance:
        # sharper scores make every K entry count.
        attention(model, layer).scaling *= SHARPEN
    torch.manual_seed(2)
    parts = CEDParts(xkv=random_xkv(geometry(model.config), plan))
    return model, plan, parts, torch.randint(0, 300, (2, PROMPT + 1))


def cached_decode_logits(model, plan, parts, ids):
    """Prefill ``ids[:, :-1]`` through the cache, then decode ``ids[:, -1]``: the step's logits ``(B, vocab)``."""
    cache = LowRankKVCache(model, plan, parts)
    with torch.no_grad(), cache.feed():
        model(input_ids=ids[:, :-1], cache=cache, use_cache=True)
        return model(input_ids=ids[:, -1:], cache=cache, use_cache=True).logits[:, -1]


def reference_logits(model, plan, parts, ids):
    """A teacher-forced pass of ``ids`` ``(B, T + 1)``: at every position ``< T`` each attention layer's
    ``k_proj``/``v_proj`` output is the clean one, the group's layers' read back from its coefficients
    (``XKVBasis.forward``); position ``T`` keeps the layer's own output of this pass."""
    T = ids.shape[1] - 1
    layers = geometry(model.config).attention_layers
    clean = true_kv(model, ids, layers)  # causal: positions < T are those of the prefill of T tokens
    fixed = dict(clean)
    recon = parts.xkv({l: clean[l][0] for l in parts.xkv.layers}, {l: clean[l][1] for l in parts.xkv.layers})
    fixed.update(recon)
    repl = {(l, kind): (lambda out, x=fixed[l][i]: torch.cat([x[:, :T], out[:, T:]], dim=1))
            for l in layers for i, kind in enumerate("kv")}
    with torch.no_grad(), kv_hooks.inject(model, repl):
        return model(ids).logits[:, -1]


def test_a_decode_step_reads_the_reconstructed_past_and_its_own_exact_entries(setup):
    model, plan, parts, ids = setup
    got = cached_decode_logits(model, plan, parts, ids)
    want = reference_logits(model, plan, parts, ids)
    torch.testing.assert_close(got, want, **FORWARD32)
    # Teeth: a cache reading the exact past (the plain model) or reconstructing the current position too (Mode B's
    # teacher-forced xkv) gives other logits, by far more than the tolerance.
    with torch.no_grad():
        plain = model(ids).logits[:, -1]
        with CEDModeBRuntime(model, plan, "xkv", parts, kv_format=None):
            mode_b = model(ids).logits[:, -1]
    for other in (plain, mode_b):
        assert (other - want).abs().max() > 100 * FORWARD32["atol"] + FORWARD32["rtol"] * want.abs().max()


def test_the_prefill_is_the_plain_model_s(setup):
    """The first forward attends only its own exact entries: no coefficient is read before it is written."""
    model, plan, parts, ids = setup
    cache = LowRankKVCache(model, plan, parts)
    with torch.no_grad(), cache.feed():
        got = model(input_ids=ids, cache=cache, use_cache=True).logits
        plain = model(ids).logits
    torch.testing.assert_close(got, plain, **FORWARD32)


@pytest.mark.parametrize("rank_div", [1, 2])
def test_the_cache_holds_the_coefficients_and_the_other_layers_entries(setup, rank_div):
    """Used bytes, counted from the geometry: every attention layer outside the group its K and V (a sliding one its
    last window - 1), the source ``2 · rank`` coefficients (at the source's window, if any), the targets nothing;
    equal to the accounting (generate checks it) and, at rank kv_dim, to csa2's bytes."""
    model, plan, _, ids = setup
    geo = geometry(model.config)
    rank = geo.kv_dim // rank_div
    parts = random_parts(geo, plan)
    parts.xkv = random_xkv(geo, plan, rank)
    new = 6
    run = gen.generate(model, plan, "xkv", parts, ids, new, None)
    positions = ids.shape[1] + new - 1
    expected = 0
    for layer in geo.attention_layers:
        if layer in plan.targets:
            continue
        held = positions if geo.window(layer) is None else min(positions, geo.window(layer) - 1)
        expected += ids.shape[0] * held * 2 * (rank if layer == plan.source else geo.kv_dim) * FP32_BYTES
    assert run.kind == f"LowRankKVCache(rank {rank})"
    assert run.bytes.used == run.accounted == expected and run.bytes.allocated >= run.bytes.used
    csa2 = gen.generate(model, plan, "csa2", parts, ids, new, None)
    assert (run.bytes.used == csa2.bytes.used) == (rank == geo.kv_dim)


def test_refusals(setup):
    model, plan, parts, _ = setup
    with pytest.raises(ValueError, match="group 'xkv' needs the cross-layer bases"):
        LowRankKVCache(model, plan, CEDParts())
    other = type(plan)(plan.split, plan.source, plan.targets[:-1], plan.extra_sources)
    with pytest.raises(ValueError, match="the xkv bases span layers"):
        LowRankKVCache(model, other, parts)
    cache = LowRankKVCache(model, plan, parts)
    with pytest.raises(RuntimeError, match="inside `with cache.feed"), torch.no_grad():
        model(input_ids=torch.zeros(1, 3, dtype=torch.long), cache=cache, use_cache=True)


def test_a_left_padded_batch_decodes_each_row_as_alone():
    """generate's left padding (lm-eval's batches): each row's reconstructed past gets RoPE at its own positions."""
    model = tiny_llama()
    for layer in geometry(model.config).attention_layers:
        attention(model, layer).scaling *= SHARPEN
    torch.manual_seed(3)
    parts = CEDParts(xkv=random_xkv(geometry(model.config), LLAMA_PLAN))
    long, short = torch.randint(1, 300, (1, 9)), torch.randint(1, 300, (1, 6))

    def tokens(ids, mask):
        cache = LowRankKVCache(model, LLAMA_PLAN, parts)
        with torch.no_grad(), cache.feed():
            out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=6, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
        return out[:, ids.shape[1]:]

    pads = torch.zeros(1, 3, dtype=torch.long)
    both = tokens(torch.cat([long, torch.cat([pads, short], 1)]),
                  torch.cat([torch.ones_like(long), torch.cat([pads, torch.ones_like(short)], 1)]))
    assert torch.equal(both, torch.cat([tokens(x, torch.ones_like(x)) for x in (long, short)]))
