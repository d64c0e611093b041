"""4-bit formats per stream: the token axis against an independent per-channel implementation, the
channel axis equal to the FP4 groups' round trip, exact bytes, a runtime scored like baseline_fp4, and the
study's winning format as the pipeline group baseline_k6v4_rot."""

import math
import sys

import pytest
import torch
from conftest import ROOT, nearest_on_grid, tiny_llama
from tiny_maps import LLAMA_PLAN, QWEN_PLAN, rows

from ced_csa2.eval.scoring import multi_group_nll
from ced_csa2.kv.formats import FP4_FORMATS, KVFormat, StreamFormat, group_format
from ced_csa2.kv.kv_bytes import fp4_entry_bytes, kv_copies, rotation_params
from ced_csa2.kv.rotation import fp4_round_trip, layer_rotation
from ced_csa2.model_utils import Geometry, geometry
from ced_csa2.plan import LayerPlan
from ced_csa2.runtime.format_runtime import FormatRuntime
from ced_csa2.groups import GROUPS
from ced_csa2.runtime.shared_kv import accounted_copies

GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1_reference(v: torch.Tensor) -> torch.Tensor:
    """Nearest E2M1 value of each element (saturating at 6); a tie goes to the even code."""
    return nearest_on_grid(v, GRID)


def per_channel_reference(x: torch.Tensor, group: int) -> torch.Tensor:
    """NVFP4 elements with one E4M3 scale per channel per block of ``group`` tokens, one block at a time."""
    out = torch.empty_like(x)
    b, t, d = x.shape
    for i in range(b):
        for c in range(d):
            for start in range(0, t, group):
                vals = x[i, start:start + group, c]
                scale = (vals.abs().max() / 6).to(torch.float8_e4m3fn).to(torch.float32)
                scale = scale if scale > 0 else torch.tensor(1.0)
                out[i, start:start + group, c] = e2m1_reference(vals / scale) * scale
    return out


def test_the_token_axis_is_one_scale_per_channel_per_block_of_tokens():
    torch.manual_seed(0)
    x = torch.randn(2, 21, 16) * 3  # 21 tokens: two blocks of 8 and a partial one of 5
    got = StreamFormat(group=8, axis="tokens").round_trip(x)
    assert torch.equal(got, per_channel_reference(x, 8))


def test_the_channel_axis_is_the_fp4_groups_round_trip_plain_and_rotated():
    torch.manual_seed(0)
    x = torch.randn(2, 7, 128)
    rot = layer_rotation(64, 3)
    for element, group in (("nvfp4", 16), ("mxfp4", 32)):
        fmt = FP4_FORMATS[element](group)
        assert torch.equal(StreamFormat(element, group).round_trip(x), fp4_round_trip(fmt, x))
        assert torch.equal(StreamFormat(element, group, rotate=True).round_trip(x, rot), fp4_round_trip(fmt, x, rot))


def test_per_channel_blocks_keep_an_outlier_channel_from_flattening_the_others():
    """Pre-RoPE keys' outlier channels: per-token blocks round their neighbours coarsely, per-channel ones do not."""
    torch.manual_seed(0)
    x = torch.randn(1, 64, 32)
    x[..., 5] *= 40
    def err(fmt):
        return ((fmt.round_trip(x) - x)[..., [c for c in range(32) if c != 5]] ** 2).mean().item()
    assert err(StreamFormat(axis="tokens")) < 0.25 * err(StreamFormat(axis="channels"))


def test_bytes_per_token_count_every_element_and_scale_byte():
    kv_dim = 192
    for group in (8, 16, 32):
        # channels: exactly the FP4 entry; tokens: T·D nibbles and one byte per channel per block, per token
        assert StreamFormat(group=group).bytes_per_token(kv_dim) == fp4_entry_bytes(kv_dim, group)
        t = 4 * group
        assert StreamFormat(group=group, axis="tokens").bytes_per_token(kv_dim) * t == t * kv_dim / 2 + kv_dim * t / group
    both = KVFormat(StreamFormat(group=8, axis="tokens"), StreamFormat(element="mxfp4", group=32))
    assert both.bytes_per_token(kv_dim) == kv_dim / 2 + kv_dim / 8 + kv_dim / 2 + kv_dim / 32
    with pytest.raises(ValueError, match="groups of 32"):
        StreamFormat(group=32).bytes_per_token(48)


def test_refusals():
    with pytest.raises(ValueError, match="element 'int4'"):
        StreamFormat(element="int4")
    with pytest.raises(ValueError, match="axis 'heads'"):
        StreamFormat(axis="heads")
    with pytest.raises(ValueError, match="needs the layer's rotation"):
        StreamFormat(rotate=True).round_trip(torch.randn(1, 2, 16))


def test_a_format_runtime_scores_exactly_as_the_fp4_groups_do():
    """NVFP4 on the channel axis at every attention layer is baseline_fp4 (rotated: baseline_fp4_rot), bit for bit."""
    model = tiny_llama()
    geo = geometry(model.config)
    nvfp4 = StreamFormat()
    rotated = StreamFormat(rotate=True)
    extra = {name: FormatRuntime(model, KVFormat(s, s), geo.attention_layers, geo.head_dim)
             for name, s in (("plain", nvfp4), ("rot", rotated))}
    extra["k_tokens"] = FormatRuntime(model, KVFormat(StreamFormat(axis="tokens"), nvfp4), geo.attention_layers,
                                      geo.head_dim)
    seqs, cut = rows(300)
    nll = multi_group_nll(model, LLAMA_PLAN, ["baseline", "baseline_fp4", "baseline_fp4_rot"], None, seqs, cut, 1,
                          0, kv_format="nvfp4", extra=extra)
    assert torch.equal(nll["plain"], nll["baseline_fp4"]) and torch.equal(nll["rot"], nll["baseline_fp4_rot"])
    assert not torch.equal(nll["k_tokens"], nll["baseline_fp4"]) and math.isfinite(nll["k_tokens"][:, 0].sum())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_exact_channels_keep_each_head_s_rotary_slice_and_quantise_the_rest_independently():
    """Qwen3.5's layout: 4 heads of 256, RoPE on the first 64 of each; the rest rotated NVFP4 over 192 channels."""
    torch.manual_seed(0)
    heads, head_dim, exact = 4, 256, 64
    x = torch.randn(2, 5, heads * head_dim) * 3
    fmt = StreamFormat(rotate=True, exact=exact)
    rot = layer_rotation(head_dim - exact, 8)
    got = fmt.round_trip(x, rot, head_dim)
    for h in range(heads):
        whole = x[..., h * head_dim:(h + 1) * head_dim]
        assert torch.equal(got[..., h * head_dim:h * head_dim + exact], whole[..., :exact])  # bit for bit
    # the rest of every head, gathered by hand, through the format without exact channels
    rest = torch.cat([x[..., h * head_dim + exact:(h + 1) * head_dim] for h in range(heads)], dim=-1)
    want = fp4_round_trip(FP4_FORMATS["nvfp4"](16), rest, rot)
    got_rest = torch.cat([got[..., h * head_dim + exact:(h + 1) * head_dim] for h in range(heads)], dim=-1)
    assert torch.equal(got_rest, want)
    # a whole head exact (full RoPE, SmolLM2: 64 of 64) is the identity
    assert torch.equal(StreamFormat(exact=64).round_trip(x[..., :192], None, 64), x[..., :192])


def test_exact_channels_cost_16_bits_each_and_the_format_the_rest():
    # Qwen3.5-4B's K: 4 heads x (64 exact x 2 B + 192 x 4 bits + 192 / 16 E4M3 scales)
    assert StreamFormat(exact=64).bytes_per_token(1024, 256) == 4 * (64 * 2 + 192 / 2 + 192 / 16)
    assert StreamFormat(exact=64).bytes_per_token(192, 64) == 192 * 2  # a whole head exact: bf16 bytes
    both = KVFormat(StreamFormat(element="fp6", group=32, exact=64), StreamFormat(element="mxfp4", group=32))
    assert both.bytes_per_token(1024, 256) == 4 * (128 + 192 * 6 / 8 + 192 / 32) + 1024 / 2 + 1024 / 32
    with pytest.raises(ValueError, match="head width"):
        StreamFormat(exact=64).bytes_per_token(1024)
    with pytest.raises(ValueError, match="head width"):
        StreamFormat(exact=300).round_trip(torch.randn(1, 2, 512), None, 256)
    with pytest.raises(ValueError, match="exact must be an int >= 0"):
        StreamFormat(exact=-1)


def test_baseline_k6v4_rot_scores_exactly_as_the_study_s_winning_format(tiny_model):
    """The pipeline group ``baseline_k6v4_rot`` is the kv_formats study's ``k_fp6_v_mx32_rot`` row, bit for bit
    (its format read from the committed study params, scored through the shared trunk beside it), and that
    format's rounding is not NVFP4's nor none."""
    sys.path.insert(0, str(ROOT / "studies"))
    import kv_formats as study_mod

    model, _ = tiny_model
    geo = geometry(model.config)
    study = study_mod.load_study(ROOT / "studies" / "kv_formats.yaml")["k_fp6_v_mx32_rot"]
    assert group_format(GROUPS["baseline_k6v4_rot"]) == study
    extra = {"study": FormatRuntime(model, study, geo.attention_layers, geo.head_dim)}
    seqs, cut = rows(250)
    nll = multi_group_nll(model, QWEN_PLAN, ["baseline", "baseline_fp4_rot", "baseline_k6v4_rot"], None, seqs, cut,
                          1, 0, kv_format="nvfp4", extra=extra)
    assert torch.equal(nll["study"], nll["baseline_k6v4_rot"])
    assert not torch.equal(nll["baseline_k6v4_rot"], nll["baseline"])
    assert not torch.equal(nll["baseline_k6v4_rot"], nll["baseline_fp4_rot"])
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_baseline_k6v4_rot_accounts_fp6_keys_and_mxfp4_values_and_a_rotation_per_layer():
    """Per attention layer and token: K ``3D/4 + D/32`` bytes, V ``D/2 + D/32`` (3.05x fewer than bf16 on
    SmolLM2's D = 192), whatever ``fp4_group`` says; one ``head_dim²`` rotation per attention layer."""
    geo = Geometry(n_layers=30, hidden_size=576, n_kv_heads=3, head_dim=64, attention_layers=tuple(range(1, 31)))
    plan = LayerPlan(split=16, source=20, targets=(24, 28))
    copies = {c.name: c.entry_bytes for c in kv_copies(geo, plan, GROUPS["baseline_k6v4_rot"], "all_attention", 2, 16)}
    assert copies == {f"{kind}{layer}": {"K": 144 + 6, "V": 96 + 6}[kind] for layer in range(1, 31) for kind in "KV"}
    assert 2 * 192 * 2 / (150 + 102) == pytest.approx(3.05, abs=0.005)  # the study's figure; rounding of the ratio
    assert rotation_params(geo, plan, GROUPS["baseline_k6v4_rot"]) == 30 * 64 ** 2
    assert rotation_params(geo, plan, GROUPS["baseline_fp4"]) == 0
    with pytest.raises(ValueError, match="fixes its own stream_formats"):
        accounted_copies(geo, plan, "baseline_k6v4_rot", "nvfp4", 2)
