"""The storage table: stored KV bytes per token of every group on each basis (the decoder's
attention layers, all attention layers, amortised over a context), for the active model and
Qwen3.5-4B, and the maps' parameter counts.

The groups come in as their registry (``{name: Group}``, :data:`ced_csa2.groups.GROUPS`), read
only for their flags: byte accounting is data the runtime builds on, so it imports none of it.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..csa2 import mlp_width
from ..model_utils import Geometry, geometry, qwen3_5_4b_config
from ..plan import LayerPlan
from .kv_bytes import (
    BASES,
    CONTEXTS,
    DTYPE_BYTES,
    V4_ENTRY,
    V4_FLASH_CSA,
    V4_FLASH_HCA,
    V41_FULL_LAYERS,
    V41_INDEXER_K,
    V41_MAIN_KV,
    adapter_params,
    adapter_params_per_target,
    bytes_per_token,
    kv_copies,
    kv_proj_params,
    projector_params,
    rotation_params,
    sink_bytes_per_sequence,
    sink_copies,
    stored_layers,
    v4_entry_bytes,
    v41_chain,
    v41_indexer_entry_bytes,
    v41_main_kv_entry_bytes,
    weight_copy,
    xkv_basis_params,
)

# The seed's plan on Qwen3.5-4B (docs/design.md §0): cut after 16, project 20, adapt 24/28/32.
QWEN3_5_4B_PLAN = LayerPlan(split=16, source=20, targets=(24, 28, 32))


# The amortised bases are figures at one context length: adapter weights spread over it, and a
# sliding-window layer holding min(context, window - 1) entries of it.
BASIS_CONTEXT = {f"all_attention_amortised_{name}": n for name, n in CONTEXTS.items()}


WINDOW_NOTE = ("; a sliding-window layer counts per token as if the context fit its window (contexts up to "
               "window - 1 tokens) here, and min(context, window - 1) entries in the amortised bases")


BASIS_DOC = {
    "decoder_attention": "K+V caches of the attention layers above the split layer" + WINDOW_NOTE,
    "all_attention": "K+V caches of every attention layer" + WINDOW_NOTE,
    **{basis: f"all_attention plus the group's adapter weights or xkv bases (at the same dtype) and a sink group's "
              f"kept target entries amortised over a {n}-token context, every sliding-window layer holding "
              f"min({n}, window - 1) entries"
       for basis, n in BASIS_CONTEXT.items()},
}


PROJECTOR_COUNTING = (
    "the projector is not in any amortised basis: it replaces the projected layer's k_proj/v_proj "
    "(bias-free, 2 * hidden * kv_dim), weights the base model holds anyway; its net extra is its bias, 2 * kv_dim")


ADAPTER_COUNTING = (
    "adapter weights are counted gross, 2 * (n*d + d + n*w + w + w*d + d) per target (w = MLP width, n = input "
    "width: 2d when adapters read [K ‖ V], d when K reads K and V reads V), "
    "not netted against the targets' own k_proj/v_proj, which a shared store no longer needs either")


XKV_COUNTING = (
    "xkv stores per token one entry of xkv_rank coefficients for K and one for V (in place of the source's and "
    "targets' entries); its bases, 2 * L * kv_dim * xkv_rank parameters (L = source + targets), are counted "
    "as weights in the amortised bases")


ROTATION_COUNTING = (
    "the rotated groups' rotations (*_fp4_rot, baseline_k6v4_rot: one head_dim x head_dim matrix per rotated layer, "
    "shared by its heads, K and V) are built from a fixed seed per layer, so they are not stored and are in no basis: "
    "a rotated group's bytes per token are its unrotated twin's; rotation_params is their size as dense matrices")


SINK_COUNTING = (
    "a sink group's targets (ced_csa2_sink) each hold their own K and V at a sequence's first `sink` positions: a "
    "constant per sequence, in no per-token basis (decoder_attention, all_attention: the bytes of one more token "
    "once the context passes `sink`), counted in the amortised bases as min(context, sink) entries over the "
    "context; sink_bytes_per_sequence gives it (ced_sink's kept entries are its ordinary cache's: none)")


def qwen3_5_4b_geometry() -> Geometry:
    """Qwen3.5-4B's geometry from its locally built text config (:func:`~ced_csa2.model_utils.qwen3_5_4b_config`)."""
    return geometry(qwen3_5_4b_config())


def basis_copies(geo: Geometry, plan: LayerPlan, spec, dtype_bytes: int, width: int, adapter_input: str,
                 fp4_group: int, rank: int) -> dict[str, list]:
    """The stored copies of group ``spec`` on every basis (amortised bases add one adapter-weights copy,
    for ``xkv`` one copy of its bases, and a sink group's kept target entries; ``rank``: xkv's coefficients
    per token)."""
    copies = {basis: kv_copies(geo, plan, spec, basis, dtype_bytes, fp4_group, rank) for basis in BASES}
    weights = adapter_params(plan, spec, geo.kv_dim, width, adapter_input)
    bases = xkv_basis_params(plan, spec, geo.kv_dim, rank)
    kept = sink_copies(geo, plan, spec, "all_attention", dtype_bytes)
    for name, context in CONTEXTS.items():
        copies[f"all_attention_amortised_{name}"] = [
            *copies["all_attention"], *kept, weight_copy("adapters", weights, dtype_bytes, context),
            *([weight_copy("xkv_bases", bases, dtype_bytes, context)] if bases else [])]
    return copies


def kv_table(geo: Geometry, plan: LayerPlan, groups: Mapping, dtype_bytes: int, width: int, adapter_input: str,
             fp4_group: int, rank: int) -> dict:
    """``{basis: {group: {"bytes_per_token", "compression_vs_baseline"}}}`` at one dtype, for ``groups``
    (``{name: Group}``, ``baseline`` among them)."""
    per_group = {g: {basis: bytes_per_token(c, BASIS_CONTEXT.get(basis))
                     for basis, c in basis_copies(geo, plan, spec, dtype_bytes, width, adapter_input, fp4_group,
                                                  rank).items()}
                 for g, spec in groups.items()}
    return {basis: {g: {"bytes_per_token": per_group[g][basis],
                        "compression_vs_baseline": per_group["baseline"][basis] / per_group[g][basis]}
                    for g in groups}
            for basis in per_group["baseline"]}


def model_section(model: str, geo: Geometry, plan: LayerPlan, groups: Mapping, width_mult: float, adapter_input: str,
                  fp4_group: int, xkv_rank: int = 0) -> dict:
    """Every storage figure of one model geometry and plan for ``groups`` (``{name: Group}``; ``xkv_rank`` as
    params' ``xkv.rank``: 0 = kv_dim; ``adapter_input`` as ``train_adapters.input``)."""
    width = mlp_width(geo.kv_dim, width_mult)
    rank = xkv_rank or geo.kv_dim
    return {
        "model": model,
        "plan": {"split": plan.split, "source": plan.source, "targets": list(plan.targets),
                 "extra_sources": list(plan.extra_sources)},
        "geometry": {"n_layers": geo.n_layers, "hidden_size": geo.hidden_size, "kv_dim": geo.kv_dim,
                     "attention_layers": list(geo.attention_layers),
                     "sliding_windows": {str(layer): w for layer, w in geo.windows}},
        "stored_layers": {basis: {g: list(stored_layers(geo, plan, spec, basis)) for g, spec in groups.items()}
                          for basis in BASES},
        "weights": {
            "adapter_width": width,
            "adapter_input": adapter_input,
            "adapter_params_per_target": adapter_params_per_target(geo.kv_dim, width, adapter_input),
            "adapter_params": {g: adapter_params(plan, spec, geo.kv_dim, width, adapter_input)
                               for g, spec in groups.items()},
            "adapter_counting": ADAPTER_COUNTING,
            "xkv_rank": rank,
            "xkv_basis_params": {g: xkv_basis_params(plan, spec, geo.kv_dim, rank) for g, spec in groups.items()},
            "xkv_counting": XKV_COUNTING,
            "rotation_params": {g: rotation_params(geo, plan, spec) for g, spec in groups.items()},
            "rotation_counting": ROTATION_COUNTING,
            "projected_layers": list(plan.projected),
            "projector_params_per_layer": projector_params(geo.hidden_size, geo.kv_dim),
            "replaced_kv_proj_params_per_layer": kv_proj_params(geo.hidden_size, geo.kv_dim),
            "projector_counting": PROJECTOR_COUNTING,
        },
        "sink_bytes_per_sequence": {dtype: {g: sink_bytes_per_sequence(geo, plan, spec, nbytes)
                                            for g, spec in groups.items()}
                                    for dtype, nbytes in DTYPE_BYTES.items()},
        "sink_counting": SINK_COUNTING,
        "fp4_group": fp4_group,
        "kv": {dtype: kv_table(geo, plan, groups, nbytes, width, adapter_input, fp4_group, rank)
               for dtype, nbytes in DTYPE_BYTES.items()},
    }


def deepseek_section() -> dict:
    """Seed 003's DeepSeek-V4.1 accounting (the docs/design.md §6 test vectors)."""
    return {
        "basis": "global KV cache bytes per token (SWA window caches excluded), seed 003 §4.4-4.6",
        "formats": {"v41_main_kv_fp4_e4m3_scale": V41_MAIN_KV, "v41_indexer_k_mxfp4_e8m0_scale": V41_INDEXER_K,
                    "v4_flash_entry": V4_ENTRY, "v41_full_layers_m": {str(k): m for k, m in V41_FULL_LAYERS.items()},
                    "v4_flash_csa": V4_FLASH_CSA, "v4_flash_hca": V4_FLASH_HCA},
        "entry_bytes": {"v41_main_kv": v41_main_kv_entry_bytes(), "v41_indexer_k": v41_indexer_entry_bytes(),
                        "v4_flash": v4_entry_bytes()},
        "chain": v41_chain(),
    }


def seed_ratio_note(qwen: dict) -> str:
    """Why none of our bases gives the seed's 3.44× (with our Qwen3.5-4B bf16 CSA2 figures)."""
    bf16 = qwen["kv"]["bf16"]
    ours = ", ".join(f"{basis} {bf16[basis]['csa2']['compression_vs_baseline']:.4f}x" for basis in bf16)
    return (f"The seed reports 3.44x storage compression without stating its basis; it fits none of these "
            f"bases exactly. Ours for CSA2 on Qwen3.5-4B in bf16: {ours}.")
