"""The evaluation groups: what each one changes, in one typed registry.

Config validation, the Mode B runtime, the shared store and the byte accounting all
read a group's meaning from here, never from its name.

========================  =========  ===============  ========  ==============
group                     projector  targets read     adapters  block-format
                          (CED)      the source KV              entries
========================  =========  ===============  ========  ==============
``baseline``              no         no               no        none
``share_plain``           no         yes (verbatim)   no        none
``ced``                   yes        no               no        none
``ced_sink`` [#sink]_     yes        no               no        none
``csa2``                  no         yes              yes       none
``ced_csa2``              yes        yes              yes       none
``ced_csa2_sink`` [#s]_   yes        yes              yes       none
``baseline_fp4``          no         no               no        every layer
``csa2_fp4``              no         yes              yes       shared source
``ced_csa2_fp4``          yes        yes              yes       shared source
``baseline_fp4_rot``      no         no               no        every layer [#rot]_
``csa2_fp4_rot``          no         yes              yes       shared source [#rot]_
``ced_csa2_fp4_rot``      yes        yes              yes       shared source [#rot]_
``baseline_k6v4_rot``     no         no               no        every layer [#k6v4]_
``xkv`` (low rank)        no         no [#xkv]_       no        none
========================  =========  ===============  ========  ==============

.. [#xkv] ``low_rank``: source and targets store one entry of ``xkv.rank`` cross-layer
   SVD coefficients per token for K and one for V (rank ``kv_dim``: csa2's bytes) and read
   their blocks of its reconstruction; the bases (``models/xkv.pt``) are weights.  Decoded through
   :class:`~ced_csa2.runtime.low_rank_kv.LowRankKVCache` (each forward's own chunk read exact).
.. [#sink] ``sink``: as ``ced``, but the first four positions of every sequence keep the
   source layer's own K/V (its ``k_proj``/``v_proj`` on four tokens; the ordinary cache holds
   them as it holds every entry: no bytes).  Four is StreamingLLM's number of sink tokens
   (Xiao et al., 2024); ``studies/sink.py`` measured why: CED's projector loses more than half
   its cost at the first position, which carries the model's massive activations.
.. [#s] as ``ced_csa2``, but the first four positions of every sequence keep each replaced layer's
   own K/V: the source's in the shared store (in place of its projection: no bytes), each target's
   in a table of its own (``sink · 2 · kv_dim`` values per sequence and target, served in place
   of its adapted entries; :class:`~ced_csa2.runtime.shared_kv.SharedKVCache`; what it costs:
   ``studies/sink.py`` and the report).
.. [#rot] ``rotate``: as the plain twin (same entries in FP4, same bytes per token), but
   each FP4 entry is rotated per head by a fixed randomised Hadamard matrix before FP4 and
   rotated back after reading (:mod:`ced_csa2.kv.rotation`): ``read = Rᵀ dequant(FP4(R x))``,
   K and V both (:data:`ced_csa2.kv.rotation.ROTATED_STREAMS`).  ``R`` is derived from a
   fixed seed per layer: weights, never stored per token.  Why K and V both: the rotation study
   (docs/results.md, "Beyond the seed") measured each stream rotated alone and both.
.. [#k6v4] ``stream_formats``: every attention layer's K in FP6 (E2M3 elements, an E4M3 scale per 32
   channels) and V in MXFP4 (E2M1, an E8M0 scale per 32 channels), each head of both rotated
   first by the layer's randomised Hadamard matrix: ``3D/4 + D/32`` + ``D/2 + D/32`` bytes per
   layer and token (3.05x fewer than bf16).  The formats are the group's own, not ``kv_format``.
   The winner of ``studies/kv_formats`` (its ``k_fp6_v_mx32_rot``; figures: docs/results.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FP4Scope = Literal["none", "every_layer", "shared_source"]
# The cache that holds a group's bytes when it decodes (Group.cache_kind; built by
# ced_csa2.eval.generation.group_cache).
CacheKind = Literal["ordinary", "shared_store", "fp4_every_layer", "formats_every_layer", "low_rank"]


@dataclass(frozen=True)
class StreamSpec:
    """How a group stores one stream (K or V) of every attention layer: a block format on the channel axis.

    Plain data, so this registry stays free of torch and of :mod:`ced_csa2.kv` (whose byte accounting
    is handed these entries); :func:`ced_csa2.kv.formats.group_format` makes it the study's ``StreamFormat``, which
    checks ``element`` and quantises.

    Attributes
    ----------
    element
        ``nvfp4``, ``mxfp4`` (E2M1 elements), ``fp6`` or ``mxfp6`` (E2M3): :data:`ced_csa2.kv.formats.FORMATS`.
    group
        Channels per scale byte.
    rotate
        Rotate each head by the layer's randomised Hadamard matrix before quantising
        (:func:`ced_csa2.kv.rotation.layer_rotation`), back after reading.
    """

    element: str
    group: int
    rotate: bool


@dataclass(frozen=True)
class Group:
    """One Mode B configuration.

    Attributes
    ----------
    name
        The key used in params, metrics and reports.
    projected_source
        CED: the source layer's K/V come from ``projector(H_split)`` (compute, not bytes).
    shares_source_kv
        CSA2-style sharing: the targets keep no K/V of their own; they read the source's
        stored entry (through the adapters, or verbatim when ``adapters`` is false).
    adapters
        The targets' K/V are ``adapter(KV_source)``; holds the adapter weights.
    fp4
        Which stored entries are FP4 (``kv_format``): ``every_layer`` -- every attention
        layer's own K/V; ``shared_source`` -- the one shared source entry only.
    doc
        One line for the report and ``metrics/storage.json``.
    low_rank
        xKV (:mod:`ced_csa2.maps.xkv`): the source and targets store nothing of their own; one
        entry of ``xkv.rank`` coefficients per token for K and one for V (cross-layer SVD
        bases, ``models/xkv.pt``) stands for all of them, and each of these layers reads its
        block of the reconstruction of the *clean* K/V (a compressed clean prefill).
    rotate
        The FP4 entries are rotated per head by a fixed orthogonal matrix before FP4 and
        rotated back after reading (:mod:`ced_csa2.kv.rotation`; FP4 groups only).  Same bytes
        per token as the group without it.
    sink
        The first ``sink`` positions of every sequence keep the plain model's K/V in each layer
        the group replaces (:func:`ced_csa2.kv_hooks.keep_initial`); 0: none.  Only for a group
        whose entries are dense: an ordinary cache with a projected source (``ced``: the source's
        kept entries are ordinary entries), or the dense shared store (each target holds its
        kept entries, a constant per sequence; the source's sit in the store).
    stream_formats
        ``(K, V)``: every attention layer's own K and V each stored in its own block format
        (:class:`StreamSpec`), fixed by the group; ``kv_format`` does not apply.  ``None``: none.
    """

    name: str
    projected_source: bool
    shares_source_kv: bool
    adapters: bool
    fp4: FP4Scope
    doc: str
    low_rank: bool = False
    rotate: bool = False
    sink: int = 0
    # A per-stream spec rather than an element name or a flag: K and V need different formats (K has
    # the outlier channels), and the byte accounting, the Mode B rounding and the cache all read the
    # same two specs, so no name maps to a format anywhere.  Its rotation lives in the specs (per
    # stream, as the kv_formats study sets it), not in ``rotate``, which rotates ``kv_format``'s entries.
    stream_formats: tuple[StreamSpec, StreamSpec] | None = None

    def __post_init__(self):
        if self.adapters and not self.shares_source_kv:
            raise ValueError(f"group {self.name!r}: adapters read the shared source entry, so they need sharing")
        if self.fp4 == "shared_source" and not self.shares_source_kv:
            raise ValueError(f"group {self.name!r}: 'shared_source' FP4 needs a shared source entry")
        if self.low_rank and (self.projected_source or self.shares_source_kv or self.is_fp4):
            # The basis spans the true K/V of source and targets: nothing to combine it with yet.
            raise ValueError(f"group {self.name!r}: low_rank (xKV) combines with no projection, sharing or FP4")
        if self.rotate and not self.is_fp4:
            raise ValueError(f"group {self.name!r}: rotate applies to FP4 entries, and the group stores none")
        if self.sink and not (self.cache_kind == "ordinary" and self.projected_source
                              or self.cache_kind == "shared_store" and not self.is_fp4):
            # The kept entries are the layers' own, dense: what rounds or compresses them stores no such entry yet.
            raise ValueError(f"group {self.name!r}: sink keeps the replaced layers' first entries in an ordinary "
                             "cache with a projected source or in the dense shared store, and this group has neither")
        if self.stream_formats is not None and (self.uses_maps or self.shares_source_kv or self.is_fp4
                                                or self.low_rank or self.rotate):
            # Every layer's own entries in the group's formats: nothing yet says how they combine with the rest.
            raise ValueError(f"group {self.name!r}: stream_formats combine with no maps, sharing, FP4, low_rank or "
                             "rotate (the specs carry their own rotation)")

    @property
    def uses_maps(self) -> bool:
        """Needs a trained projector or adapters."""
        return self.projected_source or self.adapters

    @property
    def layout(self) -> tuple[bool, bool, bool, bool]:
        """What the group maps and shares: (projected source, shared source, adapters, low rank).

        Groups of one layout read the same maps; they differ in how entries are stored (FP4,
        rotated) or which are kept (:attr:`sink`).
        """
        return self.projected_source, self.shares_source_kv, self.adapters, self.low_rank

    @property
    def is_fp4(self) -> bool:
        return self.fp4 != "none"

    @property
    def stores_block_format(self) -> bool:
        """Stores entries in a block format (a scale per block): FP4 by ``kv_format`` or its own ``stream_formats``."""
        return self.is_fp4 or self.stream_formats is not None

    @property
    def cache_kind(self) -> CacheKind:
        """The cache that holds this group's bytes when it decodes (rotated or not: :attr:`rotate`).

        ``shared_store`` -- the source's entry stored once (FP4 with ``fp4 = shared_source``), the
        targets nothing (``SharedKVCache``); ``fp4_every_layer`` -- every attention layer's own entry
        in FP4 (``FP4KVCache``); ``low_rank`` -- xKV's coefficients (``LowRankKVCache``);
        ``ordinary`` -- every layer its own entry in the model's dtype (``DynamicCache``; the
        projector changes compute, not bytes).
        """
        if self.low_rank:
            return "low_rank"
        if self.shares_source_kv:
            return "shared_store"
        if self.stream_formats is not None:
            return "formats_every_layer"
        return "fp4_every_layer" if self.fp4 == "every_layer" else "ordinary"

    def fp4_layers(self, attention_layers: tuple[int, ...], source: int) -> tuple[int, ...]:
        """Attention layers whose stored K/V entry is FP4 in this group."""
        if self.fp4 == "every_layer":
            return tuple(attention_layers)
        return (source,) if self.fp4 == "shared_source" else ()

    def rotated_layers(self, attention_layers: tuple[int, ...], source: int) -> tuple[int, ...]:
        """Attention layers with a rotated stored entry (each holds one ``head_dim²`` matrix for K and V)."""
        if self.stream_formats is not None:
            return tuple(attention_layers) if any(s.rotate for s in self.stream_formats) else ()
        return self.fp4_layers(attention_layers, source) if self.rotate else ()


GROUPS: dict[str, Group] = {g.name: g for g in (
    Group("baseline", False, False, False, "none", "every attention layer stores its own K/V"),
    Group("share_plain", False, True, False, "none",
          "stores as csa2, but targets reuse the source's KV unchanged: no adapter weights"),
    Group("ced", True, False, False, "none",
          "as baseline: CED replaces the source's k_proj/v_proj by the projector, which changes compute, not bytes"),
    Group("ced_sink", True, False, False, "none",
          "as ced (same bytes), the first 4 positions' K/V the source layer's own (StreamingLLM's attention sinks)",
          sink=4),
    Group("csa2", False, True, True, "none",
          "targets store nothing; they recompute K/V from the source's stored KV through the adapters"),
    Group("ced_csa2", True, True, True, "none", "stores as csa2 (the stored source KV is the projected one)"),
    Group("ced_csa2_sink", True, True, True, "none",
          "as ced_csa2, the first 4 positions' K/V each replaced layer's own (StreamingLLM's attention sinks): "
          "the source's in the store, each target's 4 entries per sequence", sink=4),
    Group("baseline_fp4", False, False, False, "every_layer",
          "as baseline, every stored entry in FP4 (kv_format; D/2 + D/G bytes per entry)"),
    Group("csa2_fp4", False, True, True, "shared_source",
          "as csa2, the one shared source entry in FP4 (the other layers' entries as in csa2)"),
    Group("ced_csa2_fp4", True, True, True, "shared_source",
          "as ced_csa2, the one shared source entry in FP4 (the other layers' entries as in ced_csa2)"),
    Group("baseline_fp4_rot", False, False, False, "every_layer",
          "as baseline_fp4 (same bytes), each FP4 entry's K and V rotated per head by a fixed randomised "
          "Hadamard matrix before FP4 and back after reading", rotate=True),
    Group("csa2_fp4_rot", False, True, True, "shared_source",
          "as csa2_fp4 (same bytes), the shared source entry's K and V rotated per head by a fixed randomised "
          "Hadamard matrix before FP4 and back after reading", rotate=True),
    Group("ced_csa2_fp4_rot", True, True, True, "shared_source",
          "as ced_csa2_fp4 (same bytes), the shared source entry's K and V rotated per head by a fixed "
          "randomised Hadamard matrix before FP4 and back after reading", rotate=True),
    Group("baseline_k6v4_rot", False, False, False, "none",
          "as baseline, every stored entry's K in FP6 (E2M3, an E4M3 scale per 32 channels; 3D/4 + D/32 bytes) and "
          "V in MXFP4 (D/2 + D/32 bytes), each rotated per head by a fixed randomised Hadamard matrix first",
          stream_formats=(StreamSpec("fp6", 32, rotate=True), StreamSpec("mxfp4", 32, rotate=True))),
    Group("xkv", False, False, False, "none",
          "training-free xKV baseline: source and targets store xkv.rank cross-layer SVD coefficients per token "
          "for K and for V (rank kv_dim: csa2's bytes), plus the bases as weights", low_rank=True),
)}
GROUP_NAMES = tuple(GROUPS)
MAP_GROUPS = tuple(name for name, g in GROUPS.items() if g.uses_maps)
# Groups whose targets read the source's stored KV (a SharedKVCache serves the dense ones).
SHARED_GROUPS = tuple(name for name, g in GROUPS.items() if g.shares_source_kv and not g.is_fp4)
# Groups that read a compressed clean prefill (xKV): Mode B teacher-forced, LowRankKVCache when decoding.
LOW_RANK_GROUPS = tuple(name for name, g in GROUPS.items() if g.low_rank)


def group(name: str) -> Group:
    """The registry entry of ``name`` (a clear error for an unknown one)."""
    if name not in GROUPS:
        raise ValueError(f"unknown group {name!r}; known: {list(GROUPS)}")
    return GROUPS[name]
