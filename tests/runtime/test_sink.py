"""Mode B groups with the attention sink kept (runtime.sink), on tiny real models."""

import pytest
import torch
from conftest import FORWARD32, tiny_llama
from tiny_maps import LLAMA_PLAN, QWEN_PLAN, random_parts, true_kv

from ced_csa2.ced_runtime import CEDModeBRuntime, SinkKV
from ced_csa2.eval.scoring import multi_group_nll
from ced_csa2.model_utils import geometry
from ced_csa2.runtime.sink import SinkGroup

GROUPS = ["ced", "csa2", "ced_csa2", "csa2_fp4_rot"]


@pytest.fixture(params=["llama", "qwen3_5"])
def setup(request, tiny_model):
    model, plan, vocab = ((tiny_llama(), LLAMA_PLAN, 300) if request.param == "llama"
                          else (tiny_model[0], QWEN_PLAN, 250))
    geo = geometry(model.config)
    return model, plan.validate(geo), geo, torch.randint(0, vocab, (2, 14))


def logits(model, runtime, x):
    with torch.no_grad(), runtime:
        return model(x).logits


@pytest.mark.parametrize("positions", [1, 4])
@pytest.mark.parametrize("group", GROUPS)
def test_the_exact_sink_is_the_plain_model_at_the_first_positions_and_changes_the_rest(setup, group, positions):
    model, plan, geo, x = setup
    parts = random_parts(geo, plan)
    with torch.no_grad():
        plain = model(x).logits
    kept = logits(model, SinkGroup(CEDModeBRuntime(model, plan, group, parts, kv_format="nvfp4"), "exact",
                                   positions=positions), x)
    bare = logits(model, CEDModeBRuntime(model, plan, group, parts, kv_format="nvfp4"), x)
    # The first positions read only each other: every layer's entries there are the plain model's, so their
    # whole path is; each one of them is replaced without the sink.
    n = positions
    torch.testing.assert_close(kept[:, :n], plain[:, :n], **FORWARD32)
    for t in range(n):
        # a real difference, not rounding: 1e-3 is ~8400 eps32 of O(1) logits, ~90x FORWARD32
        assert not torch.allclose(bare[:, t], plain[:, t], atol=1e-3)
    assert not torch.allclose(kept[:, n:], bare[:, n:], atol=1e-3)  # the others read them
    assert not torch.allclose(kept[:, n:], plain[:, n:], atol=1e-3)  # and their own entries stay replaced


def test_the_mean_sink_with_the_first_tokens_own_kv_is_the_exact_sink(setup):
    """Constants equal to this first token's true K/V (every row starts with it) give the exact sink's logits."""
    model, plan, geo, x = setup
    x[:, 0] = x[0, 0]
    kv = true_kv(model, x[:1, :1], plan.kv_layers)
    sink = SinkKV(plan.kv_layers, geo.kv_dim)
    for i, layer in enumerate(plan.kv_layers):
        sink.k[i], sink.v[i] = kv[layer][0][0, 0], kv[layer][1][0, 0]
    parts = random_parts(geo, plan)
    exact = logits(model, SinkGroup(CEDModeBRuntime(model, plan, "ced_csa2", parts, kv_format=None), "exact"), x)
    mean = logits(model, SinkGroup(CEDModeBRuntime(model, plan, "ced_csa2", parts, kv_format=None), "mean", sink), x)
    torch.testing.assert_close(mean, exact, **FORWARD32)


def test_sink_groups_score_in_the_shared_trunk_as_in_their_own_pass(setup):
    """multi_group_nll (``extra=``): a sink group's NLL equals its full forward's."""
    model, plan, geo, x = setup
    parts = random_parts(geo, plan)
    runtime = SinkGroup(CEDModeBRuntime(model, plan, "csa2", parts, kv_format=None), "exact")
    seqs = [row.tolist() for row in x]
    out = multi_group_nll(model, plan, ["baseline"], parts, seqs, [0, 0], 2, 0, kv_format=None,
                          extra={"csa2+sink": runtime})
    full = logits(model, SinkGroup(CEDModeBRuntime(model, plan, "csa2", parts, kv_format=None), "exact"), x)
    nll = torch.nn.functional.cross_entropy(full[:, :-1].flatten(0, 1).double(), x[:, 1:].flatten(), reduction="sum")
    # float32 NLL per token summed in float64, vs float64 cross-entropy of the same float32 logits: a few eps32 of
    # |log p| per token, ~1e-6 of the sum; 1e-5 relative leaves room
    assert out["csa2+sink"][:, 0].sum().item() == pytest.approx(nll.item(), rel=1e-5)


def test_refusals(setup):
    model, plan, geo, _ = setup
    runtime = CEDModeBRuntime(model, plan, "csa2", random_parts(geo, plan), kv_format=None)
    with pytest.raises(ValueError, match="mode must be one of"):
        SinkGroup(runtime, "first")
    with pytest.raises(ValueError, match=r"replaces layers \[.*\], for which the sink's constants hold no K/V"):
        SinkGroup(runtime, "mean", SinkKV((plan.source,), geo.kv_dim))
    with pytest.raises(ValueError, match="positions must be >= 1"):
        SinkGroup(runtime, "exact", positions=0)
    with pytest.raises(ValueError, match="'mean' holds constants for position 0 only"):
        SinkGroup(runtime, "mean", SinkKV(plan.kv_layers, geo.kv_dim), positions=4)


@pytest.mark.parametrize("group,bare", [("ced_sink", "ced"), ("ced_csa2_sink", "ced_csa2")])
def test_a_sink_group_is_its_bare_group_with_four_exact_sink_positions(setup, group, bare):
    """The registry's ``ced_sink`` / ``ced_csa2_sink`` run as the study's ``SinkGroup(<bare>, exact, 4)`` (the source
    and, for ``ced_csa2``, every adapted target kept), and differ from the bare group."""
    model, plan, geo, x = setup
    parts = random_parts(geo, plan)
    kept = logits(model, CEDModeBRuntime(model, plan, group, parts, kv_format=None), x)
    study = logits(model, SinkGroup(CEDModeBRuntime(model, plan, bare, parts, kv_format=None), "exact", positions=4), x)
    assert torch.equal(kept, study)
    without = logits(model, CEDModeBRuntime(model, plan, bare, parts, kv_format=None), x)
    assert not torch.allclose(kept, without, atol=1e-3)  # ~8400 eps32 of O(1) logits: a real difference


@pytest.mark.parametrize("prompt", [2, 6])
@pytest.mark.parametrize("group", ["ced_sink", "ced_csa2_sink"])
def test_a_cached_decode_keeps_only_the_first_positions(setup, group, prompt):
    """Greedy decoding through the group's own cache (``ced_sink``: the ordinary one; ``ced_csa2_sink``: the shared
    store) writes the tokens its teacher-forced pass predicts: a decode step (one token at position t >= 4) keeps the
    projection.  Taken by index, as the sink did before it read position ids, each step's token would be kept as a
    first position.  A 2-token prompt fills the first positions over the prefill and two decode steps."""
    from ced_csa2.eval import generation as gen

    model, plan, geo, x = setup
    parts = random_parts(geo, plan)
    prompts, new = x[:, :prompt], 8
    tokens = gen.generate(model, plan, group, parts, prompts, new, None).tokens
    full = torch.cat([prompts, tokens], dim=1)
    forced = logits(model, CEDModeBRuntime(model, plan, group, parts, kv_format=None), full)
    assert torch.equal(forced[:, prompts.shape[1] - 1:-1].argmax(-1), tokens)


@pytest.mark.parametrize("prompt", [3, 10])
def test_the_shared_store_serves_each_replaced_layer_s_own_first_entries(setup, prompt):
    """After a prefill (shorter than the sink, or longer) and two decode steps through ``ced_csa2_sink``'s shared
    store, what the source and each target read at the first four positions is the plain model's own K and V, as an
    ordinary cache of the plain model holds them; without the sink (``ced_csa2``) the projection and the adapters'
    entries are there instead, and after them the sink group's entries are its own reads, not the plain model's."""
    from ced_csa2.eval import generation as gen

    model, plan, geo, x = setup
    parts = random_parts(geo, plan)
    x = x[:, :prompt + 2]
    with torch.no_grad():
        plain = model(x, use_cache=True).past_key_values
    reads = {}
    for group in ("ced_csa2_sink", "ced_csa2"):
        built = gen.group_cache(model, plan, group, parts, None)
        with torch.no_grad(), built.open():
            model(x[:, :prompt], cache=built.cache, use_cache=True)
            for t in range(prompt, prompt + 2):
                model(x[:, t:t + 1], cache=built.cache, use_cache=True)
        store = built.cache.layers[plan.source - 1].store
        reads[group] = {layer: store.read(layer, 0) for layer in (plan.source, *plan.targets)}
    n = 4
    for layer in (plan.source, *plan.targets):
        own = plain.layers[layer - 1]
        for i, entry in enumerate((own.keys, own.values)):
            kept, bare = reads["ced_csa2_sink"][layer][i], reads["ced_csa2"][layer][i]
            assert kept.shape == entry.shape
            torch.testing.assert_close(kept[:, :, :n], entry[:, :, :n], **FORWARD32)
            # a real difference, not rounding: 1e-3 is ~8400 eps32 of O(1) entries, ~90x FORWARD32
            assert not torch.allclose(bare[:, :, :n], entry[:, :, :n], atol=1e-3), (layer, "kv"[i])
            # past the sink the adapted entries again: the same 1e-3, a real difference, not rounding
            assert not torch.allclose(kept[:, :, n:], entry[:, :, n:], atol=1e-3), (layer, "kv"[i])


def test_a_left_padded_row_keeps_its_own_first_positions():
    """Position ids, not indices: a row left-padded by 3 gives its real tokens the logits it gets alone."""
    model, plan = tiny_llama(), LLAMA_PLAN.validate(geometry(tiny_llama().config))
    parts = random_parts(geometry(model.config), plan)
    torch.manual_seed(2)
    row = torch.randint(1, 300, (1, 10))
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), row], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 10, dtype=torch.long)], dim=1)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # what generate() derives from the mask
    with torch.no_grad(), CEDModeBRuntime(model, plan, "ced_sink", parts, kv_format=None):
        alone = model(row).logits
        both = model(padded, attention_mask=mask, position_ids=position_ids).logits
    torch.testing.assert_close(both[:, 3:], alone, **FORWARD32)


def test_a_sink_needs_dense_entries_of_a_replaced_layer():
    """An ordinary cache with a projected source, or the dense shared store; not a group that replaces nothing,
    nor one whose store rounds or compresses the entries it would keep."""
    from ced_csa2.groups import Group

    refused = "sink keeps the replaced layers' first entries in an ordinary cache with a projected source or in the"
    for flags in ((False, False, False, "none"), (False, True, True, "shared_source"), (False, False, False,
                                                                                        "every_layer")):
        with pytest.raises(ValueError, match=refused):
            Group("refused_sink", *flags, "doc", sink=4)
    with pytest.raises(ValueError, match=refused):
        Group("xkv_sink", False, False, False, "none", "doc", low_rank=True, sink=4)
    assert Group("ced_sink2", True, False, False, "none", "doc", sink=2).sink == 2
    assert Group("csa2_sink", False, True, True, "none", "doc", sink=4).cache_kind == "shared_store"
