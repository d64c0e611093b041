"""The model's attention function, routed through a caller's function while a context is open.

transformers' attention modules look their attention function up per call in their
module's ``ALL_ATTENTION_FUNCTIONS`` (keyed by ``config._attn_implementation``), with the
module's own ``eager_attention_forward`` for ``"eager"``.  :meth:`AttentionCalls.routed`
replaces that entry with a function that hands every call to the caller's ``attend``
(which may change the keys, values or mask of the layers it cares about and pass the
rest on) and always restores the entry on exit.  Used by the sparse reads
(:mod:`~ced_csa2.runtime.sparse_attention`) and the sparse CSA2 decode
(:mod:`~ced_csa2.runtime.sparse_decode`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import nn

IMPLEMENTATIONS = ("sdpa", "eager")  # whose calls take a mask the callers can narrow or drop


class AttentionCalls:
    """The attention-function entry of the model that ``module`` (one of its attention modules) belongs to.

    Parameters
    ----------
    module
        An attention module of the model.
    why
        What needs the calls, for the error when the implementation is not one of
        :data:`IMPLEMENTATIONS`.
    """

    def __init__(self, module: nn.Module, why: str):
        self.impl = module.config._attn_implementation
        if self.impl not in IMPLEMENTATIONS:
            raise ValueError(f"{why}, which needs attn_implementation 'sdpa' or 'eager'; the model uses {self.impl!r}")
        owner = sys.modules[type(module).__module__]
        self._interface, self._eager = owner.ALL_ATTENTION_FUNCTIONS, owner.eager_attention_forward

    @contextmanager
    def routed(self, attend: Callable) -> Iterator[None]:
        """Every attention call goes to ``attend(original, module, query, key, value, attention_mask, *args, **kwargs)``."""
        local = self._interface._local_mapping
        had, previous = self.impl in local, local.get(self.impl)
        original = self._interface.get_interface(self.impl, self._eager)

        def call(module, query, key, value, attention_mask, *args, **kwargs):
            return attend(original, module, query, key, value, attention_mask, *args, **kwargs)

        self._interface[self.impl] = call
        try:
            yield
        finally:
            if had:
                local[self.impl] = previous
            else:
                local.pop(self.impl, None)
