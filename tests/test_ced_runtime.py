"""Mode B substitutes exactly the planned layers; Mode A's prefill skip is exact with true K/V."""

import pytest
import torch
import torch.nn.functional as F
from conftest import FORWARD32, tiny_gemma3, tiny_llama
from tiny_maps import (
    GEMMA_PLAN,
    QWEN_PLAN,
    Replay,
    identity_parts,
    random_parts,
    true_kv,
)
from torch import nn

from ced_csa2 import kv_hooks
from ced_csa2.ced_runtime import CEDModeARuntime, CEDModeBRuntime, CEDParts, SinkKV, continue_from, plain_prefill
from ced_csa2.eval.perplexity import prefill_bound
from ced_csa2.model_utils import attention, geometry
from ced_csa2.plan import LayerPlan, PlanError
from ced_csa2.groups import GROUP_NAMES as GROUPS


@pytest.mark.parametrize("group", ["baseline", "ced", "csa2", "ced_csa2"])
def test_identity_substitution_gives_baseline_logits(tiny_model, group):
    model, _ = tiny_model
    x = torch.randint(0, 250, (2, 33))
    with torch.no_grad():
        ref = model(x).logits
        with CEDModeBRuntime(model, QWEN_PLAN, group, identity_parts(model, x, QWEN_PLAN), kv_format="nvfp4"):
            out = model(x).logits
    assert torch.equal(ref, out)
    assert all(not m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("group", GROUPS)
def test_each_group_replaces_exactly_its_layers(tiny_model, group):
    model, _ = tiny_model
    geo = geometry(model.config)
    runtime = CEDModeBRuntime(model, QWEN_PLAN, group, random_parts(geo, QWEN_PLAN), kv_format="nvfp4")
    replaced = set()

    def probe(layer):
        def hook(mod, inp, out):
            if not torch.equal(out, F.linear(inp[0], mod.weight, mod.bias)):
                replaced.add(layer)
        return hook

    with torch.no_grad(), runtime:
        # registered after the runtime's hooks, so it sees the final output
        handles = [attention(model, layer).k_proj.register_forward_hook(probe(layer))
                   for layer in geo.attention_layers]
        baseline_like = model(torch.randint(0, 250, (1, 20))).logits
        for h in handles:
            h.remove()
    assert replaced == set(runtime.replaced_layers)
    assert baseline_like.isfinite().all()


def test_csa2_reads_true_source_and_ced_csa2_projected(tiny_model):
    model, _ = tiny_model
    geo = geometry(model.config)
    parts = random_parts(geo, QWEN_PLAN)
    x = torch.randint(0, 250, (1, 16))
    seen = {}
    adapters = parts.adapters
    parts.adapters = lambda layer, k, v: seen.setdefault(layer, (k.clone(), v.clone())) and adapters(layer, k, v)
    with torch.no_grad(), CEDModeBRuntime(model, QWEN_PLAN, "csa2", parts, kv_format="nvfp4"):
        model(x)
    true_src = true_kv(model, x, [20])[20]
    assert torch.equal(seen[24][0], true_src[0])
    seen.clear()
    with torch.no_grad(), kv_hooks.capture(model, hidden_layers=[16]) as store:
        model(x)
        projected = parts.projector(store["h"][16])
    with torch.no_grad(), CEDModeBRuntime(model, QWEN_PLAN, "ced_csa2", parts, kv_format="nvfp4"):
        model(x)
    assert torch.equal(seen[28][1], projected[1])


def test_share_plain_targets_read_the_source_kv_verbatim(tiny_model):
    model, _ = tiny_model
    x = torch.randint(0, 250, (1, 18))
    seen = {}

    def probe(layer):
        return lambda mod, inp, out: seen.__setitem__(layer, out.clone())

    with torch.no_grad(), CEDModeBRuntime(model, QWEN_PLAN, "share_plain", kv_format="nvfp4"):
        handles = [attention(model, layer).v_proj.register_forward_hook(probe(layer)) for layer in (20, 24, 28, 32)]
        model(x)
        for h in handles:
            h.remove()
    assert torch.equal(seen[20], true_kv(model, x, [20])[20][1])
    assert all(torch.equal(seen[t], seen[20]) for t in (24, 28, 32))


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_fp4_groups_store_the_fp4_rounded_source(tiny_model, fmt):
    from ced_csa2.kv.formats import FP4_FORMATS

    model, _ = tiny_model
    parts = random_parts(geometry(model.config), QWEN_PLAN)
    x = torch.randint(0, 250, (1, 18))
    seen = {}
    adapters = parts.adapters
    parts.adapters = lambda layer, k, v: seen.setdefault(layer, (k.clone(), v.clone())) and adapters(layer, k, v)
    with torch.no_grad(), CEDModeBRuntime(model, QWEN_PLAN, "csa2_fp4", parts, kv_format=fmt):
        model(x)
    fmt_ = FP4_FORMATS[fmt]()
    true_k = true_kv(model, x, [20])[20][0]
    rounded = fmt_.dequantize(fmt_.quantize(true_k))
    assert torch.equal(seen[24][0], rounded) and not torch.equal(rounded, true_k)
    with torch.no_grad():
        ref = model(x).logits
        with CEDModeBRuntime(model, QWEN_PLAN, "baseline_fp4", kv_format=fmt):
            # a real difference, not rounding: 1e-4 is ~840 eps32 of O(1) logits, 8x FORWARD32
            assert not torch.allclose(model(x).logits, ref, atol=1e-4)


@pytest.mark.parametrize("group", ["ced", "ced_csa2"])
def test_cached_generation_equals_teacher_forced_logits(group):
    model = tiny_llama()
    geo = geometry(model.config)
    plan = LayerPlan(2, 3, (5, 6))
    x = torch.randint(0, 300, (1, 12))
    with torch.no_grad(), CEDModeBRuntime(model, plan, group, random_parts(geo, plan), kv_format="nvfp4"):
        # An explicit mask: otherwise generate() treats prompt tokens equal to pad_token_id as padding.
        gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=6, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
        full = model(gen.sequences).logits
    steps = torch.stack(gen.logits, dim=1)
    # float32 cached decode (attention over one query) against the whole forward, FP4 K/V re-quantized from values
    # equal up to rounding: 10x FORWARD32
    torch.testing.assert_close(steps, full[:, x.shape[1] - 1:-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("group", ["baseline", "ced", "csa2", "ced_csa2"])
def test_identity_substitution_is_exact_on_sliding_window_gemma3(group):
    # 20 positions against a window of 6; per-layer-type RoPE; q/k norms.
    model = tiny_gemma3()
    x = torch.randint(0, 300, (2, 20))
    with torch.no_grad():
        ref = model(x).logits
        with CEDModeBRuntime(model, GEMMA_PLAN, group, identity_parts(model, x, GEMMA_PLAN), kv_format="nvfp4"):
            out = model(x).logits
    assert torch.equal(ref, out)


@pytest.mark.parametrize("name,model,plan", [
    ("llama", tiny_llama, LayerPlan(2, 3, (5, 6), (4,))),
    ("gemma3", tiny_gemma3, GEMMA_PLAN),  # sliding caches keep their window; per-type theta
], ids=lambda v: v if isinstance(v, str) else "")
def test_mode_a_with_true_kv_reproduces_baseline(name, model, plan):
    model = model()
    geo = geometry(model.config)
    plan = plan.validate(geo)
    prompt, cont = torch.randint(0, 300, (2, 15)), torch.randint(0, 300, (2, 9))
    # The true K/V the skipped layers would have computed for the prompt (minus its last token).
    parts = identity_parts(model, prompt[:, :-1], plan)
    with torch.no_grad():
        ref = model(torch.cat([prompt, cont], 1)).logits[:, prompt.shape[1] - 1:-1]
    got = CEDModeARuntime(model, plan, geo, parts).continuation_logits(prompt, cont)
    torch.testing.assert_close(got, ref, **FORWARD32)
    wrong = CEDModeARuntime(model, plan, geo, random_parts(geo, plan)).continuation_logits(prompt, cont)
    # a real difference, not rounding: 1e-3 is ~8400 eps32 of O(1) logits, ~90x FORWARD32
    assert not torch.allclose(wrong, ref, atol=1e-3)


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_mode_a_replaying_the_whole_prompt_is_the_plain_prefill(name, tiny_model):
    """Replay >= the prefilled length leaves nothing to the maps: the plain prefill exactly (maps random)."""
    model, plan = (tiny_llama(), LayerPlan(2, 3, (5, 6), (4,))) if name == "llama" else (tiny_model[0], QWEN_PLAN)
    geo = geometry(model.config)
    plan = plan.validate(geo)
    prompt, cont = torch.randint(0, 250, (2, 12)), torch.randint(0, 250, (2, 6))
    ref = continue_from(model, plain_prefill(model, prompt[:, :-1]), prompt, cont)
    for replay in (11, 40):
        got = CEDModeARuntime(model, plan, geo, random_parts(geo, plan), replay=replay).continuation_logits(prompt, cont)
        assert torch.equal(got, ref), replay
    skip = CEDModeARuntime(model, plan, geo, random_parts(geo, plan), replay=4).continuation_logits(prompt, cont)
    # a real difference, not rounding: 1e-3 is ~8400 eps32 of O(1) logits, ~90x FORWARD32
    assert not torch.allclose(skip, ref, atol=1e-3)


def test_mode_a_replay_with_true_kv_of_the_older_positions_reproduces_baseline():
    """Older positions from exact maps + the replayed tail through every layer = the plain model (all-attention)."""
    model, plan = tiny_llama(), LayerPlan(2, 3, (5, 6), (4,))
    geo = geometry(model.config)
    plan = plan.validate(geo)
    prompt, cont = torch.randint(0, 300, (2, 15)), torch.randint(0, 300, (2, 9))
    replay = 5
    parts = identity_parts(model, prompt[:, :prompt.shape[1] - 1 - replay], plan)  # the mapped positions' true K/V
    with torch.no_grad():
        ref = model(torch.cat([prompt, cont], 1)).logits[:, prompt.shape[1] - 1:-1]
    got = CEDModeARuntime(model, plan, geo, parts, replay=replay).continuation_logits(prompt, cont)
    torch.testing.assert_close(got, ref, **FORWARD32)


@pytest.mark.parametrize("name,model,plan", [
    ("llama", tiny_llama, LayerPlan(2, 3, (5, 6), (4,))),
    ("gemma3", tiny_gemma3, GEMMA_PLAN),  # per-type theta: the mapped keys' RoPE must start at the sink's end
], ids=lambda v: v if isinstance(v, str) else "")
@pytest.mark.parametrize("replay", [0, 3])
def test_mode_a_sink_with_true_kv_of_the_mapped_positions_reproduces_baseline(name, model, plan, replay):
    """The sink through every layer + exact maps of the positions after it (+ a replayed tail) = the plain model."""
    model = model()
    geo = geometry(model.config)
    plan = plan.validate(geo)
    prompt, cont = torch.randint(0, 300, (2, 15)), torch.randint(0, 300, (2, 9))
    end = prompt.shape[1] - 1 - replay
    kv = {layer: (k[:, 1:end], v[:, 1:end]) for layer, (k, v) in true_kv(model, prompt[:, :-1], plan.kv_layers).items()}
    parts = CEDParts(Replay({None: kv[plan.source]}), Replay({t: kv[t] for t in plan.targets}),
                     {e: Replay({None: kv[e]}) for e in plan.extra_sources})
    with torch.no_grad():
        ref = model(torch.cat([prompt, cont], 1)).logits[:, prompt.shape[1] - 1:-1]
    got = CEDModeARuntime(model, plan, geo, parts, sink="exact", replay=replay).continuation_logits(prompt, cont)
    torch.testing.assert_close(got, ref, **FORWARD32)


def test_mode_a_mean_sink_puts_the_constants_at_the_first_position_only():
    """With sink="mean" the first position above the cut holds parts.sink's K/V, every other one the maps'."""
    model, plan = tiny_llama(), LayerPlan(2, 3, (5, 6), (4,))
    geo = geometry(model.config)
    plan = plan.validate(geo)
    prompt = torch.randint(0, 300, (2, 10))
    parts = identity_parts(model, prompt, plan)  # the true K/V of every position
    sink = SinkKV(plan.kv_layers, geo.kv_dim)
    torch.nn.init.normal_(sink.k), torch.nn.init.normal_(sink.v)
    parts.sink = sink
    cache = CEDModeARuntime(model, plan, geo, parts, sink="mean").prefill(prompt)
    plain = plain_prefill(model, prompt)
    for layer in plan.kv_layers:
        got, ref = cache.layers[layer - 1], plain.layers[layer - 1]
        torch.testing.assert_close(got.keys[:, :, 1:], ref.keys[:, :, 1:], **FORWARD32)
        torch.testing.assert_close(got.values[:, :, 1:], ref.values[:, :, 1:], **FORWARD32)
        k, v = sink(layer)  # pre-RoPE; RoPE at position 0 is the identity
        # float32: the sink entry copied (RoPE at position 0 is the identity up to one rounding): a few eps32 of
        # O(1) entries
        assert torch.allclose(got.keys[:, :, 0], k.view(-1, geo.head_dim).expand(2, -1, -1), atol=1e-6)
        # the value sink entry, as the key's above
        assert torch.allclose(got.values[:, :, 0], v.view(-1, geo.head_dim).expand(2, -1, -1), atol=1e-6)
    with pytest.raises(ValueError, match="parts.sink, which is None"):
        CEDModeARuntime(model, plan, geo, identity_parts(model, prompt, plan), sink="mean")


@pytest.mark.parametrize("name", ["llama", "qwen3_5"])
def test_mode_a_sink_over_the_whole_prompt_is_the_plain_prefill(name, tiny_model):
    """The exact sink + a replay covering the rest runs the plain prefill (maps random, never read)."""
    model, plan = (tiny_llama(), LayerPlan(2, 3, (5, 6), (4,))) if name == "llama" else (tiny_model[0], QWEN_PLAN)
    geo = geometry(model.config)
    plan = plan.validate(geo)
    prompt, cont = torch.randint(0, 250, (2, 12)), torch.randint(0, 250, (2, 6))
    ref = continue_from(model, plain_prefill(model, prompt[:, :-1]), prompt, cont)
    for replay in (10, 40):  # the first token and the last 10 of 11 (or more): every position, in two forwards
        both = CEDModeARuntime(model, plan, geo, random_parts(geo, plan), sink="exact",
                               replay=replay).continuation_logits(prompt, cont)
        torch.testing.assert_close(both, ref, **FORWARD32)
    skip = CEDModeARuntime(model, plan, geo, random_parts(geo, plan), sink="exact").continuation_logits(prompt, cont)
    # a real difference, not rounding: 1e-3 is ~8400 eps32 of O(1) logits, ~90x FORWARD32
    assert not torch.allclose(skip, ref, atol=1e-3)


def test_prefill_bound_counts_the_replayed_layers():
    geo, plan = geometry(tiny_llama().config), LayerPlan(2, 3, (5, 6), (4,))
    n = geo.n_layers
    assert prefill_bound(geo, plan) == n / 2
    assert prefill_bound(geo, plan, replay=100, prefilled=[10, 30]) == 1.0  # everything replayed
    assert prefill_bound(geo, plan, replay=5, prefilled=[10, 30]) == pytest.approx(
        n * 40 / (2 * 40 + (n - 2) * (5 + 5)))
    # The sink's tokens run above the cut too; sink + replay over the prompt is the plain prefill's work.
    assert prefill_bound(geo, plan, sink=1, prefilled=[10, 30]) == pytest.approx(n * 40 / (2 * 40 + (n - 2) * 2))
    assert prefill_bound(geo, plan, replay=5, sink=1, prefilled=[10, 30]) == pytest.approx(
        n * 40 / (2 * 40 + (n - 2) * (6 + 6)))
    assert prefill_bound(geo, plan, replay=5, sink=5, prefilled=[10]) == 1.0
    with pytest.raises(ValueError, match="prefilled lengths"):
        prefill_bound(geo, plan, replay=5)
    with pytest.raises(ValueError, match="prefilled lengths"):
        prefill_bound(geo, plan, sink=1)
    with pytest.raises(ValueError, match="replay must be >= 0"):
        CEDModeARuntime(tiny_llama(), plan.validate(geo), geo, CEDParts(), replay=-1)
    with pytest.raises(ValueError, match="sink must be one of"):
        CEDModeARuntime(tiny_llama(), plan.validate(geo), geo, CEDParts(), sink="first")


def test_mode_a_refuses_a_non_covering_plan(tiny_model):
    model, _ = tiny_model
    geo = geometry(model.config)
    with pytest.raises(PlanError, match=r"does not cover attention layers \[28\]"):
        CEDModeARuntime(model, LayerPlan(16, 20, (24, 32)), geo, CEDParts())


def test_mode_a_runs_on_hybrid_qwen3_5_with_zero_deltanet_state(tiny_model):
    model, _ = tiny_model
    geo = geometry(model.config)
    runtime = CEDModeARuntime(model, QWEN_PLAN, geo, random_parts(geo, QWEN_PLAN))
    prompt = torch.randint(0, 250, (1, 10))
    assert runtime.continuation_logits(prompt, torch.randint(0, 250, (1, 5))).shape == (1, 5, model.config.vocab_size)
    assert runtime.generate(prompt, 4).shape == (1, 4)


def test_unknown_group_and_missing_parts_are_refused(tiny_model):
    with pytest.raises(ValueError, match="unknown group 'cdd'"):
        CEDModeBRuntime(tiny_model[0], QWEN_PLAN, "cdd", kv_format="nvfp4")
    with pytest.raises(ValueError, match="group 'csa2' needs adapters"):
        CEDModeBRuntime(tiny_model[0], QWEN_PLAN, "csa2", CEDParts(projector=nn.Identity()), kv_format="nvfp4")


@pytest.mark.parametrize("group", ["ced", "csa2", "ced_csa2"])
def test_fp32_maps_drive_a_bf16_model(group):
    # load_parts gives fp32 maps; the embedded model may run in bf16 where that is native.
    model = tiny_llama().to(torch.bfloat16)
    geo = geometry(model.config)
    plan = LayerPlan(2, 3, (5, 6))
    with torch.no_grad(), CEDModeBRuntime(model, plan, group, random_parts(geo, plan), kv_format="nvfp4"):
        assert model(torch.randint(0, 300, (1, 8))).logits.dtype == torch.bfloat16


def test_the_sink_file_round_trips_and_is_refused_when_missing_or_made_for_another_plan(tmp_path):
    from ced_csa2.ced_runtime import load_sink, save_sink
    from ced_csa2.pipeline.checkpoint import CheckpointError
    from ced_csa2.pipeline.map_roles import MODE_A

    geo, plan = geometry(tiny_llama().config), LayerPlan(2, 3, (5, 6), (4,))
    sink = SinkKV(plan.kv_layers, geo.kv_dim)
    torch.nn.init.normal_(sink.k), torch.nn.init.normal_(sink.v)
    meta = {"role": MODE_A.as_meta(), "model": "tiny", "kv_dim": geo.kv_dim, "plan": {"split": 2}}
    path = save_sink(tmp_path / "sink.pt", sink, meta)
    back, got = load_sink(path, {"model": "tiny", "layers": list(plan.kv_layers), "kv_dim": geo.kv_dim})
    for layer in plan.kv_layers:  # stored in FP16, as every map file
        for a, b in zip(back(layer), sink(layer)):
            torch.testing.assert_close(a, b.half().float())
    assert got["layers"] == list(plan.kv_layers)
    with pytest.raises(CheckpointError, match=r"sink.pt: 'layers' is \[3, 4, 5, 6\] in the checkpoint, expected \[3\]"):
        load_sink(path, {"model": "tiny", "layers": [3]})
    with pytest.raises(CheckpointError, match=r"nothing.pt: mode_a_sink checkpoint not found"):
        load_sink(tmp_path / "nothing.pt", {})
