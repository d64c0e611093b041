"""FP4 with rotation: R is orthogonal, the groups cost their plain twins' bytes, and the runtime applies R."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_llama
from tiny_maps import (
    QWEN_PLAN,
    random_parts,
    true_kv,
)

from ced_csa2.ced_runtime import CEDModeBRuntime
from ced_csa2.kv import rotation
from ced_csa2.kv.formats import FP4_FORMATS
from ced_csa2.kv.fp4 import MXFP4
from ced_csa2.kv.kv_bytes import BASES, bytes_per_token, kv_copies, rotation_params
from ced_csa2.kv.rotation import HeadRotation, fp4_round_trip, hadamard, layer_rotation, rotation_matrix
from ced_csa2.kv.storage_table import QWEN3_5_4B_PLAN, qwen3_5_4b_geometry
from ced_csa2.model_utils import Geometry, attention, geometry
from ced_csa2.plan import LayerPlan
from ced_csa2.groups import GROUPS, Group
from ced_csa2.runtime.shared_kv import SharedKVCache, accounted_copies

TWINS = {"baseline_fp4_rot": "baseline_fp4", "csa2_fp4_rot": "csa2_fp4", "ced_csa2_fp4_rot": "ced_csa2_fp4"}
SMOL = Geometry(n_layers=30, hidden_size=576, n_kv_heads=3, head_dim=64, attention_layers=tuple(range(1, 31)))
SMOL_PLAN = LayerPlan(15, 18, (22, 26, 30))


def eye(n):
    return torch.eye(n, dtype=torch.float64)


# ----------------------------------------------------------------------------- (a) the matrix


@pytest.mark.parametrize("n", [1, 2, 8, 16, 64, 256])
def test_hadamard_is_the_normalised_sylvester_matrix(n):
    h = hadamard(n)
    # float64 Hadamard entries ±n^-1/2, n-term sums: n × eps64 ≈ 3e-14 for n = 128
    assert torch.allclose(h @ h.T, eye(n), rtol=0, atol=1e-12) and torch.equal(h, h.T)
    entry = torch.full((n, n), n ** -0.5, dtype=torch.float64)
    # float64: n^-1/2 is one rounding (eps64/2 relative) in either computation
    assert torch.allclose(h.abs(), entry, rtol=0, atol=1e-15)
    assert torch.equal(h[0], h[0, 0].expand(n)) and h[0, 0] > 0  # first row all +


@pytest.mark.parametrize("n", [8, 64, 96, 80])  # 96, 80: not powers of two, the QR fallback
def test_rotation_is_orthogonal_seeded_and_per_layer(n):
    r = rotation_matrix(n, 7)
    assert r.dtype == torch.float64 and r.shape == (n, n)
    # float64 orthogonal matrix (QR), n-term sums: n × eps64 ≈ 3e-14 for n = 128
    assert torch.allclose(r @ r.T, eye(n), rtol=0, atol=1e-12) and torch.allclose(r.T @ r, eye(n), rtol=0, atol=1e-12)
    assert torch.equal(r, rotation_matrix(n, 7))  # determinism: weights from a seed
    assert not torch.allclose(r, rotation_matrix(n, 8))
    assert HeadRotation(n, 0).hadamard == (n in (8, 64))
    if n in (8, 64):  # randomised Hadamard: H · diag(±1)
        signs = (r / hadamard(n)).round()
        assert torch.equal(signs, signs[0].expand(n, n)) and set(signs[0].tolist()) == {-1.0, 1.0}
    assert torch.equal(layer_rotation(n, 5).matrix, rotation_matrix(n, rotation.ROTATION_SEED + 5))


@pytest.mark.parametrize("head_dim", [16, 64, 96])
def test_round_trip_without_fp4_returns_the_input(head_dim):
    r = layer_rotation(head_dim, 3)
    x = torch.randn(2, 5, 3 * head_dim, dtype=torch.float64) * 10
    y = r.rotate(x)
    assert y.dtype == torch.float64 and not torch.allclose(y, x)
    # float64 rotate and unrotate, |x| ~ 3 over n-term sums: ~2n × eps64 × 3 ≈ 2e-13
    torch.testing.assert_close(r.unrotate(y), x, rtol=0, atol=1e-12)
    x32 = x.float()
    back = r.unrotate(r.rotate(x32), dtype=torch.float32)
    assert back.dtype == torch.float32
    # float32 rotate and unrotate (two matmuls over head_dim terms, |x| ~ 3): <= 2 × head_dim roundings, ~40 eps32 ≈
    # 5e-6
    torch.testing.assert_close(back, x32, rtol=1e-5, atol=1e-5)
    # bf16 entries are rotated in float32 and read back in bf16
    xb = x32.bfloat16()
    assert r.rotate(xb).dtype == torch.float32 and r.unrotate(r.rotate(xb), dtype=torch.bfloat16).dtype == torch.bfloat16


def test_rotation_acts_on_each_head_alone():
    hd, r = 16, layer_rotation(16, 1)
    x = torch.randn(4, 3 * hd, dtype=torch.float64)
    y = r.rotate(x)
    for h in range(3):
        # float64 per-head matmuls in two groupings: ~head_dim × eps64 × |x| ≈ 1e-14
        torch.testing.assert_close(y[:, h * hd:(h + 1) * hd], x[:, h * hd:(h + 1) * hd] @ r.matrix.T, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="do not split into heads of 16 channels"):
        r.rotate(torch.randn(4, 40))


# ----------------------------------------------------------------------------- registry


def test_rotated_groups_are_their_plain_twins_plus_rotation():
    for rot, plain in TWINS.items():
        a, b = GROUPS[rot], GROUPS[plain]
        assert a.rotate and not b.rotate
        assert dataclasses.replace(a, name=plain, doc=b.doc, rotate=False) == b
    assert [g for g, spec in GROUPS.items() if spec.rotate] == list(TWINS)
    with pytest.raises(ValueError, match="rotate applies to FP4 entries"):
        Group("baseline_rot", False, False, False, "none", "", rotate=True)


# ----------------------------------------------------------------------------- (b) bytes


@pytest.mark.parametrize("geo,plan", [(qwen3_5_4b_geometry(), QWEN3_5_4B_PLAN), (SMOL, SMOL_PLAN)])
@pytest.mark.parametrize("rot", list(TWINS))
def test_rotated_group_costs_exactly_its_plain_twins_bytes(geo, plan, rot):
    plain = TWINS[rot]
    for basis in BASES:
        for dtype_bytes in (2, 4):
            for fp4_group in (16, 32):
                assert kv_copies(geo, plan, GROUPS[rot], basis, dtype_bytes, fp4_group) == \
                       kv_copies(geo, plan, GROUPS[plain], basis, dtype_bytes, fp4_group)
    for storage in FP4_FORMATS:
        got = bytes_per_token(accounted_copies(geo, plan, rot, storage, 2))
        assert got == bytes_per_token(accounted_copies(geo, plan, plain, storage, 2))
        assert got < bytes_per_token(accounted_copies(geo, plan, "baseline", "bf16", 2))
    # the matrices are weights: one head_dim x head_dim per FP4 layer, none for the plain twin
    n_fp4 = len(GROUPS[rot].fp4_layers(geo.attention_layers, plan.source))
    assert rotation_params(geo, plan, GROUPS[rot]) == n_fp4 * geo.head_dim ** 2
    assert rotation_params(geo, plan, GROUPS[plain]) == 0


def test_accounted_fp4_groups_count_their_own_fp4_entries():
    geo, plan = qwen3_5_4b_geometry(), QWEN3_5_4B_PLAN
    # csa2_fp4(_rot): only the shared source (layer 20) in FP4: 4 bf16 layers below it + one 576 B K and V
    for g in ("csa2_fp4", "csa2_fp4_rot"):
        assert bytes_per_token(accounted_copies(geo, plan, g, "nvfp4", 2)) == 4 * 4096 + 2 * 576
    for g in ("baseline_fp4", "baseline_fp4_rot"):
        assert bytes_per_token(accounted_copies(geo, plan, g, "nvfp4", 2)) == 8 * 2 * 576
    with pytest.raises(ValueError, match="give its kv_format as storage"):
        accounted_copies(geo, plan, "baseline_fp4_rot", "bf16", 2)


def test_shared_store_names_the_dense_twin_and_rotate_for_a_rotated_group(tiny_model):
    model, _ = tiny_model
    parts = random_parts(geometry(model.config), QWEN_PLAN)
    with pytest.raises(ValueError, match=r"has no shared store.*rotate=True for a \*_fp4_rot group"):
        SharedKVCache(model, QWEN_PLAN, "csa2_fp4_rot", parts, storage="nvfp4")
    with pytest.raises(ValueError, match="rotate=True rotates FP4 entries; storage 'bf16' is not FP4"):
        SharedKVCache(model, QWEN_PLAN, "csa2", parts, storage="bf16", rotate=True)


# ----------------------------------------------------------------------------- (c) R is applied


def _outlier_channels(n=2048, heads=4, head_dim=64):
    """Gaussian entries with every 16th channel 10x larger (per-channel outliers, as K has)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, heads * head_dim, generator=gen)
    x[:, ::16] *= 10
    return x


def test_rotation_lowers_mxfp4_error_on_outlier_channels():
    # MXFP4's power-of-two scale per 32 channels is set by the outlier; rotated, each head's
    # channels share its energy.  (NVFP4's finer E4M3 scale per 16 gains nothing here: its
    # plain error is already at the Gaussian level -- see ced_csa2.groups.)
    x, r = _outlier_channels(), layer_rotation(64, 1)
    plain = (fp4_round_trip(MXFP4(), x) - x).pow(2).mean()
    rotated = (fp4_round_trip(MXFP4(), x, r) - x).pow(2).mean()
    assert rotated < 0.6 * plain, (rotated, plain)


def _by_hand(fmt, x, layer, head_dim):
    """``Rᵀ dequant(FP4(R x))`` per head, written out with the layer's matrix."""
    r = rotation_matrix(head_dim, rotation.ROTATION_SEED + layer).float()
    heads = x.reshape(*x.shape[:-1], -1, head_dim)
    y = (heads @ r.T).reshape(x.shape)
    q = fmt.dequantize(fmt.quantize(y)).reshape(heads.shape)
    return (q @ r).reshape(x.shape)


@pytest.mark.parametrize("fmt_name", ["nvfp4", "mxfp4"])
def test_rotated_runtime_reads_back_rotated_fp4(tiny_model, fmt_name):
    """baseline_fp4_rot: every attention layer's rotated streams read Rᵀ FP4(R x) -- not FP4(x), not x."""
    model, _ = tiny_model
    geo, fmt = geometry(model.config), FP4_FORMATS[fmt_name]()
    assert "k" in rotation.ROTATED_STREAMS
    x = torch.randint(0, 250, (2, 21))
    seen = {}

    def probe(layer, kind):
        def hook(mod, inp, out):  # registered after the runtime's hooks: sees what the layer reads
            seen[(layer, kind)] = (F.linear(inp[0], mod.weight, mod.bias), out)
        return hook

    with torch.no_grad(), CEDModeBRuntime(model, QWEN_PLAN, "baseline_fp4_rot", kv_format=fmt_name):
        handles = [getattr(attention(model, layer), f"{kind}_proj").register_forward_hook(probe(layer, kind))
                   for layer in geo.attention_layers for kind in "kv"]
        rot_logits = model(x).logits
        for h in handles:
            h.remove()
    assert set(seen) == {(layer, kind) for layer in geo.attention_layers for kind in "kv"}
    for (layer, kind), (raw, read) in seen.items():
        plain = fmt.dequantize(fmt.quantize(raw))
        if kind not in rotation.ROTATED_STREAMS:
            assert torch.equal(read, plain), (layer, kind)
            continue
        assert torch.equal(read, _by_hand(fmt, raw, layer, geo.head_dim)), (layer, kind)
        # a real difference, not rounding: 1e-6 is ~8 eps32 of O(1) entries: beyond a float32 rounding
        assert not torch.allclose(read, plain, atol=1e-6) and not torch.allclose(read, raw, atol=1e-6)
    with torch.no_grad(), CEDModeBRuntime(model, QWEN_PLAN, "baseline_fp4", kv_format=fmt_name):
        plain_logits = model(x).logits
    # a real difference, not rounding: 1e-5 is ~84 eps32 of O(1) logits: beyond FORWARD32's rounding
    assert not torch.allclose(rot_logits, plain_logits, atol=1e-5)


def test_rotated_shared_source_is_what_the_adapters_read(tiny_model):
    """csa2_fp4_rot: the adapters get Rᵀ FP4(R KV_source) of the source layer (20), K and V."""
    model, _ = tiny_model
    geo, fmt = geometry(model.config), FP4_FORMATS["nvfp4"]()
    parts = random_parts(geo, QWEN_PLAN)
    x = torch.randint(0, 250, (1, 18))
    seen, adapters = {}, parts.adapters
    parts.adapters = lambda layer, k, v: seen.setdefault(layer, (k.clone(), v.clone())) and adapters(layer, k, v)
    with torch.no_grad(), CEDModeBRuntime(model, QWEN_PLAN, "csa2_fp4_rot", parts, kv_format="nvfp4"):
        model(x)
    k, v = true_kv(model, x, [20])[20]
    assert torch.equal(seen[24][0], _by_hand(fmt, k, 20, geo.head_dim))
    v_read = _by_hand(fmt, v, 20, geo.head_dim) if "v" in rotation.ROTATED_STREAMS else fmt.dequantize(fmt.quantize(v))
    assert torch.equal(seen[24][1], v_read)
    assert not torch.equal(seen[24][0], fmt.dequantize(fmt.quantize(k)))


def test_k_only_rotation_leaves_v_plain(tiny_model, monkeypatch):
    """ROTATED_STREAMS is read when the runtime is built: ("k",) rotates K and stores V as plain FP4."""
    monkeypatch.setattr(rotation, "ROTATED_STREAMS", ("k",))
    model, _ = tiny_model
    runtime = CEDModeBRuntime(model, QWEN_PLAN, "baseline_fp4_rot", kv_format="nvfp4")
    geo = geometry(model.config)
    assert set(runtime.rotations) == {(layer, "k") for layer in geo.attention_layers}
    assert not CEDModeBRuntime(model, QWEN_PLAN, "baseline_fp4", kv_format="nvfp4").rotations


@pytest.mark.parametrize("group", list(TWINS))
def test_rotated_groups_generate_with_a_cache(group):
    """What eval_gsm8k.generate does under the runtime: cached greedy generation runs and is finite."""
    model = tiny_llama()  # head_dim 8 (a power of two), kv_dim 16
    geo, plan = geometry(model.config), LayerPlan(2, 3, (5, 6))
    x = torch.randint(0, 300, (1, 10))
    with torch.no_grad(), CEDModeBRuntime(model, plan, group, random_parts(geo, plan), kv_format="nvfp4"):
        gen = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=4, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    assert gen.sequences.shape == (1, 14) and torch.stack(gen.logits).isfinite().all()
    assert all(not m._forward_hooks for m in model.modules())
