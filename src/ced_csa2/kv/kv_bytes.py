"""Exact KV-cache byte accounting (docs/design.md §6, seed 003 §4.4–4.6).

One generic rule covers every figure: the bytes of stored KV per token are

    Σ over stored copies of  entry_bytes / tokens_per_entry

where a *copy* is one cache some layer holds (a K cache, a V cache, an indexer-K cache,
...), ``entry_bytes`` is the size of one cache entry and ``tokens_per_entry`` (the
seed's compression ratio ``m``) is how many token positions share one entry.  Fixed
weights are counted with the same rule: one "entry" of ``params · dtype_bytes`` bytes
amortised over a whole context (``tokens_per_entry`` = context length).

Two parts:

* this project's groups (``baseline``, ``ced``, ``csa2``, ``ced_csa2``,
  ``share_plain``, ``xkv``, ...) on a :class:`~ced_csa2.model_utils.Geometry` and a
  :class:`~ced_csa2.plan.LayerPlan`, on the bases ``decoder_attention`` and
  ``all_attention`` (plus adapter weights or xKV bases amortised over a context);
* the DeepSeek-V4.1 reference accounting of seed 003, the test vectors of docs/design.md §6
  (288 / 68 / 890 / 3,514.25 B, the chain 3514.25 → 652 → 1630 → 890).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from ..csa2 import input_dim
from ..model_utils import Geometry
from ..plan import LayerPlan
from .formats import FORMATS

# Bytes per element of the dense dtypes the project reports.
DTYPE_BYTES = {"bf16": 2, "fp32": 4}
# Context lengths over which the fixed adapter weights are amortised (4K / 32K / 128K tokens).
CONTEXTS = {"4k": 4096, "32k": 32768, "128k": 131072}
# Bases of the per-token figures: which attention layers are counted.
BASES = ("decoder_attention", "all_attention")
# Both FP4 scale formats of seed 003 §4.4 (E4M3 and E8M0) are one byte per group.
FP4_SCALE_BYTES = 1


# ----------------------------------------------------------------------------- generic rule

@dataclass(frozen=True)
class StoredCopy:
    """One stored cache (or one amortised block of weights).

    Parameters
    ----------
    name
        What is stored, e.g. ``"K20"``, ``"main_kv_L3"``, ``"adapters"``.
    entry_bytes
        Bytes of one entry.
    tokens_per_entry
        Token positions one entry covers (the seed's ``m``; a context length for weights).
    max_entries
        At most this many entries are held, whatever the context (a sliding-window layer:
        ``window - 1``, what transformers' ``DynamicSlidingWindowLayer`` keeps between
        steps); ``None``: one per ``tokens_per_entry`` positions of the whole context.
    """

    name: str
    entry_bytes: float
    tokens_per_entry: int = 1
    max_entries: int | None = None

    def __post_init__(self):
        if self.entry_bytes < 0:
            raise ValueError(f"copy {self.name!r}: entry_bytes must be >= 0, got {self.entry_bytes}")
        if self.tokens_per_entry < 1:
            raise ValueError(f"copy {self.name!r}: tokens_per_entry must be >= 1, got {self.tokens_per_entry}")
        if self.max_entries is not None and self.max_entries < 1:
            raise ValueError(f"copy {self.name!r}: max_entries must be >= 1, got {self.max_entries}")

    def held_fraction(self, context: int | None) -> float:
        """Share of a ``context``-token cache's entries this copy holds: ``min(C, cap) / C`` (1 uncapped)."""
        if self.max_entries is None or context is None:
            return 1.0
        return min(context, self.max_entries) / context


def bytes_per_token(copies: Iterable[StoredCopy], context: int | None = None) -> float:
    """Σ ``entry_bytes / tokens_per_entry`` over ``copies`` (seed 003 §4.4: ``b / m`` per layer).

    With a ``context`` (tokens), a copy capped at ``max_entries`` (a sliding-window layer)
    counts ``min(context, max_entries) / context`` of that: bytes held at that context,
    per context token.  Without one, every copy counts per token -- the figure for
    contexts no longer than the smallest cap.
    """
    return float(sum(c.entry_bytes / c.tokens_per_entry * c.held_fraction(context) for c in copies))


def dense_entry_bytes(channels: int, dtype_bytes: int) -> int:
    """Bytes of an entry of ``channels`` elements stored at ``dtype_bytes`` each."""
    return channels * dtype_bytes


def fp4_entry_bytes(channels: int, group: int) -> int:
    """Bytes of an FP4 entry: ``D/2 + D/G`` (seed 003 §4.4, ``b(D, G)``).

    E2M1 elements pack two per byte (``D/2``); each group of ``G`` channels carries one
    1-byte scale (E4M3 or E8M0), ``D/G`` bytes.

    Raises
    ------
    ValueError
        If ``channels`` is odd or not a multiple of ``group``.
    """
    if channels % 2 or channels % group:
        raise ValueError(f"an FP4 entry needs an even number of channels divisible by the group: "
                         f"got {channels} channels in groups of {group}")
    return channels // 2 + channels // group * FP4_SCALE_BYTES


# ----------------------------------------------------------------------------- this project's groups

def basis_layers(geo: Geometry, plan: LayerPlan, basis: str) -> tuple[int, ...]:
    """Attention layers a basis counts: above the split (``decoder_attention``) or all (``all_attention``)."""
    if basis == "decoder_attention":
        return tuple(layer for layer in geo.attention_layers if layer > plan.split)
    if basis == "all_attention":
        return geo.attention_layers
    raise ValueError(f"unknown basis {basis!r}; choose one of {list(BASES)}")


def stored_layers(geo: Geometry, plan: LayerPlan, spec, basis: str) -> tuple[int, ...]:
    """The layers of ``basis`` that hold a K/V cache in group ``spec`` (CSA2 and xKV targets hold none).

    Under ``xkv`` the source's cache holds the group's one entry of coefficients (see :func:`kv_copies`).
    """
    dropped = set(plan.targets) if spec.shares_source_kv or spec.low_rank else set()
    return tuple(layer for layer in basis_layers(geo, plan, basis) if layer not in dropped)


def kv_copies(geo: Geometry, plan: LayerPlan, spec, basis: str, dtype_bytes: int,
              fp4_group: int = 16, rank: int | None = None) -> list[StoredCopy]:
    """One K and one V copy (``kv_dim`` channels, one entry per token) per storing layer.

    Qwen3.5-4B in bf16: ``2 · 1024 · 2 = 4,096`` B/token per attention layer (design §6).
    A sliding-window layer's copies hold at most ``window - 1`` entries (``max_entries``;
    :func:`bytes_per_token` applies it at a given context).
    The group's FP4 entries (:meth:`~ced_csa2.groups.Group.fp4_layers`: every layer, or only
    the shared source) cost ``fp4_entry_bytes(kv_dim, fp4_group)`` whatever the dtype.
    Under a ``low_rank`` group (``xkv``) the source's K and V copies hold the group's
    ``rank`` cross-layer coefficients instead (default ``rank = kv_dim``: csa2's bytes).
    A group with its own ``stream_formats`` stores each layer's K and V in its stream's block
    format (:meth:`~ced_csa2.kv.block_format.BlockFormat.entry_bytes`), whatever ``fp4_group`` and the dtype.
    """
    fp4 = spec.fp4_layers(geo.attention_layers, plan.source)
    fp4_bytes, dense = fp4_entry_bytes(geo.kv_dim, fp4_group), dense_entry_bytes(geo.kv_dim, dtype_bytes)
    coefficients = dense_entry_bytes(geo.kv_dim if rank is None else rank, dtype_bytes)
    own = ({kind: FORMATS[s.element](s.group).entry_bytes(geo.kv_dim) for kind, s in zip("KV", spec.stream_formats)}
           if spec.stream_formats is not None else None)

    def entry(layer: int, kind: str) -> int:
        if own is not None:
            return own[kind]
        if spec.low_rank and layer == plan.source:
            return coefficients
        return fp4_bytes if layer in fp4 else dense

    def cap(layer: int) -> int | None:
        window = geo.window(layer)
        return None if window is None else window - 1

    return [StoredCopy(f"{kind}{layer}", entry(layer, kind), max_entries=cap(layer))
            for layer in stored_layers(geo, plan, spec, basis) for kind in ("K", "V")]


def sink_copies(geo: Geometry, plan: LayerPlan, spec, basis: str, dtype_bytes: int) -> list[StoredCopy]:
    """A sink group's kept entries that no per-token copy holds: each target's own K and V at a sequence's first
    ``sink`` positions, dense (``max_entries = sink``: a constant per sequence once the context passes ``sink``).

    Only the shared store's targets keep entries of their own (:attr:`~ced_csa2.groups.Group.sink`); the
    source's kept entries are its stored ones, and under an ordinary cache (``ced_sink``) every kept entry is an
    ordinary one: no copies.  Not in :func:`kv_copies`: per token (the context past ``sink``) they cost nothing.
    """
    if not (spec.sink and spec.shares_source_kv):
        return []
    dense = dense_entry_bytes(geo.kv_dim, dtype_bytes)
    return [StoredCopy(f"{kind}{layer}_sink", dense, max_entries=spec.sink)
            for layer in basis_layers(geo, plan, basis) if layer in plan.targets for kind in ("K", "V")]


def sink_bytes_per_sequence(geo: Geometry, plan: LayerPlan, spec, dtype_bytes: int) -> int:
    """Bytes of a sink group's kept target entries per sequence of at least ``sink`` tokens (:func:`sink_copies`)."""
    return sum(int(c.entry_bytes) * c.max_entries for c in sink_copies(geo, plan, spec, "all_attention", dtype_bytes))


def adapter_params_per_target(kv_dim: int, width: int, input: str) -> int:
    """Parameters of one target's K and V adapters: ``2 · (n·d + d + n·w + w + w·d + d)``.

    Each of K and V is ``Linear(n, d)`` + ``Linear(n, w)`` + ``Linear(w, d)``, with biases,
    ``n`` the input width (``2d`` for ``input="kv"``, ``d`` for ``"own"``; design §2):
    8,395,776 (``own``) or 13,638,656 (``kv``) for ``d = 1024, w = 1536``.
    """
    d, w, n = kv_dim, width, input_dim(kv_dim, input)
    return 2 * (n * d + d + n * w + w + w * d + d)


def adapter_params(plan: LayerPlan, spec, kv_dim: int, width: int, input: str) -> int:
    """All adapter parameters a group holds: one K+V pair per target, or 0."""
    return len(plan.targets) * adapter_params_per_target(kv_dim, width, input) if spec.adapters else 0


def xkv_basis_params(plan: LayerPlan, spec, kv_dim: int, rank: int) -> int:
    """The ``xkv`` group's bases: ``2 · L · kv_dim · rank`` (K and V, ``L = 1 + len(targets)``), or 0."""
    return 2 * (1 + len(plan.targets)) * kv_dim * rank if spec.low_rank else 0


def rotation_params(geo: Geometry, plan: LayerPlan, spec) -> int:
    """A rotated group's matrices (``*_fp4_rot``, ``baseline_k6v4_rot``): ``head_dim²`` per rotated layer, or 0.

    One ``(head_dim, head_dim)`` matrix per layer whose entry is rotated
    (:meth:`~ced_csa2.groups.Group.rotated_layers`), shared by its heads, K and V
    (:mod:`ced_csa2.kv.rotation`).  Weights, never per token: a rotated group's :func:`kv_copies`
    are its unrotated twin's.  Built from a fixed seed per layer, so nothing needs storing; this
    is what they would take as dense matrices.
    """
    return len(spec.rotated_layers(geo.attention_layers, plan.source)) * geo.head_dim ** 2


def projector_params(hidden_size: int, kv_dim: int) -> int:
    """``Linear(hidden → 2·kv_dim)`` with bias (design §2: 5.24M on Qwen3.5-4B)."""
    return hidden_size * 2 * kv_dim + 2 * kv_dim


def kv_proj_params(hidden_size: int, kv_dim: int) -> int:
    """The bias-free ``k_proj`` + ``v_proj`` of one layer, which the CED projector replaces."""
    return 2 * hidden_size * kv_dim


def weight_copy(name: str, params: int, dtype_bytes: int, context: int) -> StoredCopy:
    """Fixed weights as one entry amortised over ``context`` tokens."""
    return StoredCopy(name, dense_entry_bytes(params, dtype_bytes), context)


# ----------------------------------------------------------------------------- DeepSeek-V4.1 reference (seed 003)

# §4.4: main KV = 512 channels, E2M1 + one E4M3 scale per 16 channels ("NVFP4 without
# its global scale"); indexer K = 128 channels, OCP MXFP4 = E2M1 + one E8M0 per 32.
V41_MAIN_KV = {"channels": 512, "group": 16}
V41_INDEXER_K = {"channels": 128, "group": 32}
# §4.3/4.4: the four Full (KV source) layers, 1-based, and their compression ratio m
# (m = 2 in the Encoder, layers <= 20; m = 1 in the Decoder).
V41_FULL_LAYERS = {3: 2, 9: 2, 15: 2, 21: 1}
# §4.6: a V4-Flash global-cache entry = 448 FP8 channels + 64 BF16 RoPE channels + 8 B of
# scales (the seed gives the 8 B as a total, not their grouping).
V4_ENTRY = {"fp8_channels": 448, "bf16_rope_channels": 64, "scale_bytes": 8}
# §4.6: V4-Flash has 21 CSA layers (m = 4, with an indexer) and 20 HCA layers (m = 128,
# no indexer), each holding its own global cache.
V4_FLASH_CSA = {"layers": 21, "m": 4}
V4_FLASH_HCA = {"layers": 20, "m": 128}


def v41_main_kv_entry_bytes() -> int:
    """``b(512, 16) = 256 + 32 = 288`` B (seed 003 §4.4)."""
    return fp4_entry_bytes(V41_MAIN_KV["channels"], V41_MAIN_KV["group"])


def v41_indexer_entry_bytes() -> int:
    """``b(128, 32) = 64 + 4 = 68`` B (seed 003 §4.4)."""
    return fp4_entry_bytes(V41_INDEXER_K["channels"], V41_INDEXER_K["group"])


def v4_entry_bytes() -> int:
    """``448 · 1 + 64 · 2 + 8 = 584`` B: V4-Flash's global-cache entry (seed 003 §4.6)."""
    return (dense_entry_bytes(V4_ENTRY["fp8_channels"], 1) + dense_entry_bytes(V4_ENTRY["bf16_rope_channels"], 2)
            + V4_ENTRY["scale_bytes"])


def global_kv_copies(layer_m: Mapping[str, int], main_entry: int, indexer_entry: int | None) -> list[StoredCopy]:
    """Per layer (name → ``m``): its main-KV copy and, when ``indexer_entry`` is given, its indexer-K copy."""
    copies = []
    for name, m in layer_m.items():
        copies.append(StoredCopy(f"main_kv_{name}", main_entry, m))
        if indexer_entry is not None:
            copies.append(StoredCopy(f"indexer_k_{name}", indexer_entry, m))
    return copies


def _v41_sources(m: int | None = None) -> dict[str, int]:
    """The four V4.1 source layers with their own ``m``, or all at ``m``."""
    return {f"L{layer}": m or own for layer, own in V41_FULL_LAYERS.items()}


def v41_copies() -> list[StoredCopy]:
    """V4.1's global cache: four Full layers, FP4 main KV + indexer K → 890 B/token (seed 003 §4.4)."""
    return global_kv_copies(_v41_sources(), v41_main_kv_entry_bytes(), v41_indexer_entry_bytes())


def v4_flash_copies() -> list[StoredCopy]:
    """V4-Flash: ``21 · (584 + 68)/4 + 20 · 584/128 = 3,514.25`` B/token (seed 003 §4.6)."""
    csa = {f"csa{i + 1}": V4_FLASH_CSA["m"] for i in range(V4_FLASH_CSA["layers"])}
    hca = {f"hca{i + 1}": V4_FLASH_HCA["m"] for i in range(V4_FLASH_HCA["layers"])}
    # the indexer K is already MXFP4 in V4 (seed 003 §4.4), so V4's indexer entry is the same 68 B
    return (global_kv_copies(csa, v4_entry_bytes(), v41_indexer_entry_bytes())
            + global_kv_copies(hca, v4_entry_bytes(), None))


def v41_chain() -> dict:
    """Seed 003 §4.6's four steps from V4-Flash to V4.1, each a :func:`bytes_per_token`.

    1. cross-layer reuse: the 41 caches collapse to the four source layers, still
       V4 format and ``m = 4``: ``4 · (584 + 68)/4 = 652`` B (÷ 5.39);
    2. relaxed sequence compression: ``m = 2, 2, 2, 1``, ``Σ 1/m`` 1 → 2.5: 1,630 B (× 2.5, a cost);
    3. FP4 main KV, 584 → 288 B per entry (indexer K stays 68 B): 890 B (÷ 1.83);
    4. net: 3,514.25 / 890 = 3.95×.

    Returns
    -------
    dict
        ``bytes_per_token`` of each step and the ``factors`` between them, unrounded.
    """
    v4_entry, indexer = v4_entry_bytes(), v41_indexer_entry_bytes()
    steps = {
        "v4_flash": bytes_per_token(v4_flash_copies()),
        # step 1 keeps V4-Flash's CSA ratio m = 4 on the four source layers
        "cross_layer_reuse": bytes_per_token(global_kv_copies(_v41_sources(V4_FLASH_CSA["m"]), v4_entry, indexer)),
        "relaxed_compression": bytes_per_token(global_kv_copies(_v41_sources(), v4_entry, indexer)),
        "fp4_main_kv": bytes_per_token(v41_copies()),
    }
    factors = {
        "cross_layer_reuse_divides_by": steps["v4_flash"] / steps["cross_layer_reuse"],
        "relaxed_compression_multiplies_by": steps["relaxed_compression"] / steps["cross_layer_reuse"],
        "fp4_main_kv_divides_by": steps["relaxed_compression"] / steps["fp4_main_kv"],
        "net_divides_by": steps["v4_flash"] / steps["fp4_main_kv"],
    }
    return {"bytes_per_token": steps, "factors": factors}
