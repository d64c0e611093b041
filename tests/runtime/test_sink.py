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
