"""The evaluation groups: what each one changes, in one typed registry.

Config validation, the Mode B runtime, the shared store and the byte accounting all
read a group's meaning from here, never from its name.

======================  =========  ===============  ========  ==============
group                   projector  targets read     adapters  FP4 entries
                        (CED)      the source KV
======================  =========  ===============  ========  ==============
``baseline``            no         no               no        none
``share_plain``         no         yes (verbatim)   no        none
``ced``                 yes        no               no        none
``csa2``                no         yes              yes       none
``ced_csa2``            yes        yes              yes       none
``baseline_fp4``        no         no               no        every layer
``csa2_fp4``            no         yes              yes       shared source
``ced_csa2_fp4``        yes        yes              yes       shared source
======================  =========  ===============  ========  ==============
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

FP4Scope = Literal["none", "every_layer", "shared_source"]


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
    """

    name: str
    projected_source: bool
    shares_source_kv: bool
    adapters: bool
    fp4: FP4Scope
    doc: str

    def __post_init__(self):
        if self.adapters and not self.shares_source_kv:
            raise ValueError(f"group {self.name!r}: adapters read the shared source entry, so they need sharing")
        if self.fp4 == "shared_source" and not self.shares_source_kv:
            raise ValueError(f"group {self.name!r}: 'shared_source' FP4 needs a shared source entry")

    @property
    def uses_maps(self) -> bool:
        """Needs a trained projector or adapters."""
        return self.projected_source or self.adapters

    @property
    def is_fp4(self) -> bool:
        return self.fp4 != "none"

    def fp4_layers(self, attention_layers: tuple[int, ...], source: int) -> tuple[int, ...]:
        """Attention layers whose stored K/V entry is FP4 in this group."""
        if self.fp4 == "every_layer":
            return tuple(attention_layers)
        return (source,) if self.fp4 == "shared_source" else ()


GROUPS: dict[str, Group] = {g.name: g for g in (
    Group("baseline", False, False, False, "none", "every attention layer stores its own K/V"),
    Group("share_plain", False, True, False, "none",
          "stores as csa2, but targets reuse the source's KV unchanged: no adapter weights"),
    Group("ced", True, False, False, "none",
          "as baseline: CED replaces the source's k_proj/v_proj by the projector, which changes compute, not bytes"),
    Group("csa2", False, True, True, "none",
          "targets store nothing; they recompute K/V from the source's stored KV through the adapters"),
    Group("ced_csa2", True, True, True, "none", "stores as csa2 (the stored source KV is the projected one)"),
    Group("baseline_fp4", False, False, False, "every_layer",
          "as baseline, every stored entry in FP4 (kv_format; D/2 + D/G bytes per entry)"),
    Group("csa2_fp4", False, True, True, "shared_source",
          "as csa2, the one shared source entry in FP4 (the other layers' entries as in csa2)"),
    Group("ced_csa2_fp4", True, True, True, "shared_source",
          "as ced_csa2, the one shared source entry in FP4 (the other layers' entries as in ced_csa2)"),
)}
GROUP_NAMES = tuple(GROUPS)
MAP_GROUPS = tuple(name for name, g in GROUPS.items() if g.uses_maps)
# Groups whose targets read the source's stored KV (a SharedKVCache serves the dense ones).
SHARED_GROUPS = tuple(name for name, g in GROUPS.items() if g.shares_source_kv and not g.is_fp4)


def group(name: str) -> Group:
    """The registry entry of ``name`` (a clear error for an unknown one)."""
    if name not in GROUPS:
        raise ValueError(f"unknown group {name!r}; known: {list(GROUPS)}")
    return GROUPS[name]
