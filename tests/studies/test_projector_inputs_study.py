"""studies/projector_inputs.py: the cut's features are the layer's own; a projector reading H_split alone is
the linear projector; a map fitted on exact linear data is recovered; bad params are refused."""

import sys

import pytest
import torch
from conftest import ROOT, tiny_params
from study_params import refused

sys.path.insert(0, str(ROOT / "studies"))
import projector_inputs as study_mod  # noqa: E402

from ced_csa2 import kv_hooks  # noqa: E402
from ced_csa2.model_utils import attention, geometry  # noqa: E402
from ced_csa2.plan import LayerPlan  # noqa: E402
from ced_csa2.projector import KVProjector  # noqa: E402


def test_the_committed_study_params_load():
    study = study_mod.load_study(ROOT / "studies" / "projector_inputs.yaml")
    assert study.inputs[0] == ["h_split"]


@pytest.mark.parametrize("inputs", ["[[attn_in]]", "[[h_split, h_split]]", "[[h_split, q_split]]", "[]"])
def test_bad_input_sets_are_refused(tmp_path, inputs):
    refused(study_mod, tmp_path, f"records: 4\nbatch_size: 2\ninputs: {inputs}\n", "inputs")


def test_cut_features_are_the_layer_s_attention_input_and_own_kv(tiny_model):
    model, _ = tiny_model
    plan = LayerPlan.from_config(tiny_params().plan).validate(geometry(model.config))
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    attn, seen = attention(model, plan.split), {}
    hook = attn.k_proj.register_forward_hook(lambda mod, inp, out: seen.update(x=inp[0].clone()))
    try:
        with torch.no_grad(), study_mod.cut_features(model, plan.split) as cut, \
                kv_hooks.capture(model, kv_layers=[plan.split]) as kv:
            model.model(input_ids=ids)
    finally:
        hook.remove()
    assert torch.equal(cut["attn_in"], seen["x"])  # q_proj and k_proj read the same normalised input
    assert torch.equal(cut["kv_split"], torch.cat([kv["k"][plan.split], kv["v"][plan.split]], -1))
    assert not attn.k_proj._forward_hooks and not attn.q_proj._forward_hooks  # removed on leaving


def test_a_projector_of_h_split_alone_is_the_linear_projector():
    g = torch.Generator().manual_seed(0)
    W, b, h = torch.randn(12, 8, generator=g), torch.randn(8, generator=g), torch.randn(2, 5, 12, generator=g)
    linear = KVProjector(12, 4)
    linear.init_from_ridge(W, b)
    assert all(torch.equal(a, c) for a, c in zip(study_mod.CutProjector(W, b, 4, ["h_split"], {})(h), linear(h)))
    # with an extra part the map reads [h ‖ extra] in that order
    extra = torch.randn(2, 5, 3, generator=g)
    W2 = torch.randn(15, 8, generator=g)
    k, v = study_mod.CutProjector(W2, b, 4, ["h_split", "attn_in"], {"attn_in": extra})(h)
    torch.testing.assert_close(torch.cat([k, v], -1), torch.cat([h, extra], -1) @ W2 + b)


def test_a_target_exactly_linear_in_an_input_set_is_recovered_on_held_out_rows(tiny_model):
    """Aim the fit at the cut layer's own K/V: ``k_proj``/``v_proj`` of its attention input, exactly linear.

    The set with ``attn_in`` must fit held-out rows to float32 rounding (features, targets and padding
    masks aligned); ``H_split`` alone (the layer's output, after its attention and MLP) cannot."""
    from types import SimpleNamespace

    model, tok = tiny_model
    geo = geometry(model.config)
    plan = SimpleNamespace(split=16, source=16)
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in [40, 33, 29, 40] * 4]
    study = study_mod.Study(inputs=[["h_split"], ["h_split", "attn_in"]], records=12, batch_size=4)
    maps = study_mod.fit_maps(model, plan, geo, study, rows[:12], rows[12:], 1e-6, tok.pad_token_id)
    assert maps["h_split+attn_in"]["rows"] == sum(map(len, rows[:12]))  # every real position, no padding
    for kind in "kv":
        exact = maps["h_split+attn_in"]["fit"][kind].result()
        assert exact["r2"] > 1 - 1e-6, exact
        assert maps["h_split"]["fit"][kind].result()["r2"] < 0.999
