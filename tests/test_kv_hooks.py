"""Capture-then-reinject is exact; hooks always go away."""

import pytest
import torch
from conftest import tiny_gemma3, tiny_llama, tiny_params

from ced_csa2 import kv_hooks
from ced_csa2.model_utils import build_tiny_model, geometry


def _models():
    cfg = tiny_params().model
    for impl in ("sdpa", "eager"):
        yield f"qwen3_5-{impl}", build_tiny_model(cfg.tiny, vocab_size=300, attn_implementation=impl)
        yield f"llama-{impl}", tiny_llama(impl)
        yield f"gemma3-{impl}", tiny_gemma3(impl)


@pytest.mark.parametrize("name,model", list(_models()), ids=lambda v: v if isinstance(v, str) else "")
def test_reinjected_kv_gives_identical_logits(name, model):
    torch.manual_seed(1)
    x = torch.randint(0, 300, (2, 40))
    layers = geometry(model.config).attention_layers[-2:]
    with torch.no_grad():
        ref = model(x).logits
        with kv_hooks.capture(model, layers) as store:
            captured_run = model(x).logits
        captured = {(l, kind): store[kind][l].clone() for l in layers for kind in "kv"}
        with kv_hooks.inject(model, captured):
            reinjected = model(x).logits
        key = (layers[-1], "k")
        with kv_hooks.inject(model, {key: captured[key] + 0.05 * torch.randn_like(captured[key])}):
            perturbed = model(x).logits
        after = model(x).logits
    assert torch.equal(ref, captured_run)
    assert torch.equal(ref, reinjected)
    # a real difference, not rounding: 1e-4 is ~840 eps32 of O(1) logits, 8x FORWARD32
    assert not torch.allclose(ref, perturbed, atol=1e-4)
    assert torch.equal(ref, after)
    assert all(not m._forward_hooks for m in model.modules())


def test_hooks_removed_even_when_forward_raises():
    model = tiny_llama()
    with pytest.raises(RuntimeError, match="boom"):
        with kv_hooks.inject(model, {(2, "k"): lambda out: (_ for _ in ()).throw(RuntimeError("boom"))}):
            model(torch.zeros(1, 3, dtype=torch.long))
    assert all(not m._forward_hooks for m in model.modules())


def test_captured_hidden_state_is_layer_output():
    model = tiny_llama()
    x = torch.randint(0, 300, (1, 12))
    with torch.no_grad(), kv_hooks.capture(model, hidden_layers=[3]) as store:
        hs = model(x, output_hidden_states=True).hidden_states
    assert torch.equal(store["h"][3], hs[3])


def test_capture_refuses_a_deltanet_layer():
    model = build_tiny_model(tiny_params().model.tiny, vocab_size=300)
    with pytest.raises(ValueError, match="layer 3 has no softmax attention"):
        with kv_hooks.capture(model, [3]):
            pass
