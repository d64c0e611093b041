"""Exact KV byte accounting: the docs/design.md §6 / seed 003 test vectors and this project's groups."""

import pytest
from tiny_maps import QWEN_PLAN

from ced_csa2.csa2 import CSA2Adapters
from ced_csa2.kv import kv_bytes as kb
from ced_csa2.model_utils import Geometry, attention
from ced_csa2.plan import LayerPlan
from ced_csa2.projector import KVProjector
from ced_csa2.groups import GROUPS

QWEN = Geometry(n_layers=32, hidden_size=2560, n_kv_heads=4, head_dim=256, attention_layers=tuple(range(4, 33, 4)))
SMOL = Geometry(n_layers=30, hidden_size=576, n_kv_heads=3, head_dim=64, attention_layers=tuple(range(1, 31)))
SMOL_PLAN = LayerPlan(15, 18, (22, 26, 30))


def bpt(geo, plan, group, basis, dtype_bytes=2):
    return kb.bytes_per_token(kb.kv_copies(geo, plan, GROUPS[group], basis, dtype_bytes))


# ----------------------------------------------------------------------------- generic rule

def test_bytes_per_token_sums_entry_over_tokens_per_entry():
    copies = [kb.StoredCopy("a", 100, 1), kb.StoredCopy("b", 100, 4), kb.StoredCopy("c", 6, 8)]
    assert kb.bytes_per_token(copies) == 100 + 25 + 0.75
    assert kb.bytes_per_token([]) == 0.0


@pytest.mark.parametrize("kwargs", [{"entry_bytes": -1}, {"entry_bytes": 1, "tokens_per_entry": 0}])
def test_stored_copy_rejects_impossible_values(kwargs):
    with pytest.raises(ValueError, match="copy 'x'"):
        kb.StoredCopy("x", **kwargs)


def test_entry_helpers():
    assert kb.dense_entry_bytes(1024, 2) == 2048
    # D/2 bytes of E2M1 plus one 1-byte scale per group
    assert kb.fp4_entry_bytes(64, 16) == 32 + 4
    with pytest.raises(ValueError, match="96 channels in groups of 64"):
        kb.fp4_entry_bytes(96, 64)


# ----------------------------------------------------------------------------- DeepSeek-V4.1 (seed 003 §4.4-4.6)

def test_v41_entry_bytes():
    assert kb.v41_main_kv_entry_bytes() == 288  # 512/2 + 512/16 = 256 + 32
    assert kb.v41_indexer_entry_bytes() == 68  # 128/2 + 128/32 = 64 + 4


def test_v41_global_kv_is_890_bytes_per_token_with_the_seeds_breakdown():
    copies = kb.v41_copies()
    assert kb.bytes_per_token(copies) == 890
    # Σ 1/m over the four Full layers (m = 2, 2, 2, 1)
    assert sum(1 / m for m in kb.V41_FULL_LAYERS.values()) == 2.5

    def part(prefix, layers):
        return kb.bytes_per_token(c for c in copies if c.name.startswith(prefix)
                                  and int(c.name.rsplit("L", 1)[1]) in layers)

    # seed 003 §4.4 table: layers 3, 9, 15 (m = 2): 432 + 102 = 534; layer 21 (m = 1): 288 + 68 = 356
    assert part("main_kv", {3, 9, 15}) == 432 and part("indexer_k", {3, 9, 15}) == 102
    assert part("main_kv", {21}) == 288 and part("indexer_k", {21}) == 68
    assert part("main_kv", {3, 9, 15, 21}) == 720 and part("indexer_k", {3, 9, 15, 21}) == 170


def test_v4_flash_entry_and_total():
    assert kb.v4_entry_bytes() == 448 * 1 + 64 * 2 + 8 == 584
    copies = kb.v4_flash_copies()
    assert len(copies) == 21 * 2 + 20
    csa = kb.bytes_per_token(c for c in copies if "csa" in c.name)
    hca = kb.bytes_per_token(c for c in copies if "hca" in c.name)
    assert csa == 21 * 163 and hca == 20 * 4.5625
    assert kb.bytes_per_token(copies) == 3514.25


def test_v41_chain_steps_and_factors():
    chain = kb.v41_chain()
    steps, factors = chain["bytes_per_token"], chain["factors"]
    assert steps == {"v4_flash": 3514.25, "cross_layer_reuse": 652, "relaxed_compression": 1630, "fp4_main_kv": 890}
    assert round(factors["cross_layer_reuse_divides_by"], 2) == 5.39
    assert round(factors["relaxed_compression_multiplies_by"], 2) == 2.5
    assert round(factors["fp4_main_kv_divides_by"], 2) == 1.83
    assert round(factors["net_divides_by"], 2) == 3.95
    # step 3 is the per-entry ratio (584 + 68) / (288 + 68); the net is ÷ 5.39 × 2.5 ÷ 1.83
    assert factors["fp4_main_kv_divides_by"] == pytest.approx((584 + 68) / (288 + 68))
    assert factors["net_divides_by"] == pytest.approx(factors["cross_layer_reuse_divides_by"]
                                                      / factors["relaxed_compression_multiplies_by"]
                                                      * factors["fp4_main_kv_divides_by"])


# ----------------------------------------------------------------------------- this project's groups

def test_qwen3_5_4b_bf16_figures_of_spec_section_6():
    layer_20 = [c for c in kb.kv_copies(QWEN, QWEN_PLAN, GROUPS["baseline"], "all_attention", 2)
                if c.name[1:] == "20"]
    assert kb.bytes_per_token(layer_20) == 2 * 1024 * 2 == 4096
    decoder = bpt(QWEN, QWEN_PLAN, "baseline", "decoder_attention"), bpt(QWEN, QWEN_PLAN, "csa2", "decoder_attention")
    everything = bpt(QWEN, QWEN_PLAN, "baseline", "all_attention"), bpt(QWEN, QWEN_PLAN, "csa2", "all_attention")
    assert decoder == (16384, 4096) and decoder[0] / decoder[1] == 4
    assert everything == (32768, 20480) and everything[0] / everything[1] == 1.6


@pytest.mark.parametrize("basis", kb.BASES)
def test_groups_ced_changes_no_bytes_and_share_plain_stores_like_csa2(basis):
    assert bpt(QWEN, QWEN_PLAN, "ced", basis) == bpt(QWEN, QWEN_PLAN, "baseline", basis)
    assert bpt(QWEN, QWEN_PLAN, "ced_csa2", basis) == bpt(QWEN, QWEN_PLAN, "csa2", basis)
    assert bpt(QWEN, QWEN_PLAN, "share_plain", basis) == bpt(QWEN, QWEN_PLAN, "csa2", basis)
    assert bpt(QWEN, QWEN_PLAN, "csa2", basis, 4) == 2 * bpt(QWEN, QWEN_PLAN, "csa2", basis, 2)


def test_stored_layers_follow_the_plan_on_an_all_attention_model():
    # SmolLM2: 30 attention layers; above split 15 are 16..30, of which the targets store nothing
    assert kb.stored_layers(SMOL, SMOL_PLAN, GROUPS["baseline"], "decoder_attention") == tuple(range(16, 31))
    kept = tuple(layer for layer in range(1, 31) if layer not in (22, 26, 30))
    assert kb.stored_layers(SMOL, SMOL_PLAN, GROUPS["csa2"], "all_attention") == kept
    assert bpt(SMOL, SMOL_PLAN, "csa2", "decoder_attention") == 12 * 2 * 192 * 2
    names = [c.name for c in kb.kv_copies(SMOL, SMOL_PLAN, GROUPS["csa2"], "decoder_attention", 2)]
    assert names[:4] == ["K16", "V16", "K17", "V17"] and "K22" not in names


def test_unknown_basis_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown basis 'encoder'"):
        kb.basis_layers(QWEN, QWEN_PLAN, "encoder")


def test_adapter_params_on_qwen3_5_4b():
    assert kb.adapter_params_per_target(1024, 1536, "own") == 8395776
    assert kb.adapter_params_per_target(1024, 1536, "kv") == 13638656
    assert kb.adapter_params(QWEN_PLAN, GROUPS["csa2"], 1024, 1536, "own") == 3 * 8395776 == 25187328
    assert kb.adapter_params(QWEN_PLAN, GROUPS["ced_csa2"], 1024, 1536, "kv") == 3 * 13638656
    for group in ("baseline", "ced", "share_plain"):
        assert kb.adapter_params(QWEN_PLAN, GROUPS[group], 1024, 1536, "kv") == 0


@pytest.mark.parametrize("input", ["kv", "own"])
def test_parameter_formulas_match_the_real_modules(tiny_model, input):
    adapters = CSA2Adapters([24, 28, 32], kv_dim=32, width=48, input=input)
    assert sum(p.numel() for p in adapters.parameters()) == kb.adapter_params(QWEN_PLAN, GROUPS["csa2"], 32, 48,
                                                                              input)
    projector = KVProjector(64, 32)
    assert sum(p.numel() for p in projector.parameters()) == kb.projector_params(64, 32)
    model, _ = tiny_model
    attn = attention(model, 20)
    replaced = sum(p.numel() for m in (attn.k_proj, attn.v_proj) for p in m.parameters())
    assert replaced == kb.kv_proj_params(model.config.hidden_size, 32)


def test_adapter_weights_amortise_over_the_context():
    copies = [*kb.kv_copies(QWEN, QWEN_PLAN, GROUPS["csa2"], "all_attention", 2),
              kb.weight_copy("adapters", 25187328, 2, kb.CONTEXTS["4k"])]
    # 25,187,328 bf16 parameters spread over 4,096 tokens: 12,298.5 B/token on top of 20,480
    assert kb.bytes_per_token(copies) == 20480 + 25187328 * 2 / 4096 == 32778.5
    assert kb.CONTEXTS == {"4k": 4096, "32k": 32768, "128k": 131072}


# ----------------------------------------------------------------------------- sliding windows

def test_a_sliding_layer_holds_min_context_window_minus_one_entries():
    window = 512  # Gemma-3-270M: full attention at 6, 12, 18
    geo = Geometry(n_layers=18, hidden_size=640, n_kv_heads=1, head_dim=256, attention_layers=tuple(range(1, 19)),
                   windows=tuple((la, window) for la in range(1, 19) if la not in (6, 12, 18)))
    plan = LayerPlan(9, 12, (14, 18))
    copies = kb.kv_copies(geo, plan, GROUPS["baseline"], "all_attention", 2)
    entry = 2 * 256  # one K (or V) entry in bf16
    assert [c.max_entries for c in copies if c.name in ("K5", "K6")] == [window - 1, None]
    assert kb.bytes_per_token(copies) == 18 * 2 * entry  # no context: every layer per token
    for context in (100, 511, 4096, 131072):
        held = 3 * 2 * entry * context + 15 * 2 * entry * min(context, window - 1)
        # float64 byte counts (integers up to ~1e9, one division): a few eps64 relative
        assert kb.bytes_per_token(copies, context) * context == pytest.approx(held, rel=1e-12)
    # csa2 drops one sliding (14) and one full (18) reader: at 128K the full one is what counts.
    csa2 = kb.kv_copies(geo, plan, GROUPS["csa2"], "all_attention", 2)
    saved = kb.bytes_per_token(copies, 131072) - kb.bytes_per_token(csa2, 131072)
    # float64 byte counts (integers, one division by 131072): a few eps64 relative
    assert saved == pytest.approx(2 * entry * (1 + (window - 1) / 131072), rel=1e-12)
