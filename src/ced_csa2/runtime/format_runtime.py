"""Every attention layer's K and V read back from one stored-KV format, scored as a group is (``kv_formats``).

:func:`ced_csa2.kv.formats.format_replacements` says what each layer's K and V read back as;
:class:`FormatRuntime` installs it on a model for the scoring's shared trunk.
"""

from __future__ import annotations

from .. import kv_hooks
from ..kv.formats import KVFormat, format_replacements
from .group_runtime import GroupRuntime
from ..groups import GROUPS


class FormatRuntime(GroupRuntime):
    """Every attention layer's K and V read back from a :class:`~ced_csa2.kv.formats.KVFormat`: scored like a group.

    A :class:`~ced_csa2.runtime.group_runtime.GroupRuntime` (``extra=`` of
    :func:`ced_csa2.eval.scoring.multi_group_nll`):
    ``replaced_layers`` (every attention layer, so the shared trunk branches at the first),
    ``spec`` (``baseline_fp4``'s: every layer's own entries stored, nothing shared) and
    ``seed`` (nothing to seed).  The hooks (:func:`ced_csa2.kv_hooks.inject`) are always removed.
    """

    def __init__(self, model, fmt: KVFormat, attention_layers, head_dim: int):
        self.model, self.fmt, self.spec = model, fmt, GROUPS["baseline_fp4"]
        self.replaced_layers = tuple(attention_layers)
        self._replacements = format_replacements(fmt, self.replaced_layers, head_dim)
        self._hooks = None

    def seed(self, **kwargs) -> None:
        """Nothing to hand over: the hooks read only the layer's own output."""

    def __enter__(self) -> FormatRuntime:
        self._hooks = kv_hooks.inject(self.model, self._replacements)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        hooks, self._hooks = self._hooks, None
        hooks.__exit__(*exc)
