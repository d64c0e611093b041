"""The attention sink in Mode B: a group whose first position keeps the plain model's K/V, or constants.

A group replaces the K/V of some attention layers at every position (``ced``: the source's,
projected from ``H_split``; ``csa2``: the targets', adapted from the source's; the FP4 groups:
rounded).  The first position is the attention sink (StreamingLLM's term: the entry most heads
attend to when nothing else matches); it carries the model's massive activations, which maps
fitted over all positions do not reproduce, and every other position's attention leans on it.
:class:`SinkGroup` keeps it: in each layer the group replaces, the first position's K/V are the
plain model's (``exact``: the layer's own ``k_proj``/``v_proj`` output, which a cache would store
for one token per layer) or the constants of :class:`~ced_csa2.ced_runtime.SinkKV` (``mean``:
the mean over training records' first positions; nothing stored per sequence, nothing computed).
Position 0 attends to itself only, so with ``exact`` its whole path is the plain model's.
``exact`` may keep more than the first position: StreamingLLM keeps four initial tokens as sinks
(Xiao et al., 2024), because a model may park attention on any of the first few (on the embedded
default one record carries a massive activation at position 1).  ``mean`` has constants for
position 0 only.

The kept positions are read from the position ids each decoder layer gets
(:func:`ced_csa2.kv_hooks.keep_initial`), so the group also decodes through a cache.  Measured by
``studies/sink.py``; the pipeline's ``ced_sink`` and ``ced_csa2_sink`` groups are ``ced`` and ``ced_csa2``
with ``exact`` at four positions (:attr:`ced_csa2.groups.Group.sink`).
"""

from __future__ import annotations

from contextlib import ExitStack

from ..ced_runtime import SinkKV
from .. import kv_hooks
from .group_runtime import GroupRuntime

SINK_MODES = ("exact", "mean")


class SinkGroup(GroupRuntime):
    """A Mode B group's runtime with its initial ``positions`` kept: one context, scored like a group.

    Parameters
    ----------
    runtime
        A :class:`~ced_csa2.ced_runtime.CEDModeBRuntime`; what it replaces is what the sink keeps.
    mode
        ``"exact"`` (the plain model's K/V at the kept positions) or ``"mean"`` (``constants``, position 0).
    constants
        The sink's K/V per layer (``mode="mean"``); must hold every layer the group replaces.
    positions
        How many initial positions keep their K/V (``exact`` only; ``mean`` keeps position 0).

    A :class:`~ced_csa2.runtime.group_runtime.GroupRuntime` (:func:`ced_csa2.eval.scoring.multi_group_nll`'s
    ``extra=``): ``runtime``'s spec, replaced layers and seeding.
    """

    def __init__(self, runtime, mode: str, constants: SinkKV | None = None, positions: int = 1):
        if mode not in SINK_MODES:
            raise ValueError(f"SinkGroup: mode must be one of {list(SINK_MODES)}, got {mode!r}")
        if positions < 1 or (mode == "mean" and positions != 1):
            raise ValueError(f"SinkGroup: positions must be >= 1 ('mean' holds constants for position 0 only), "
                             f"got {positions} with mode {mode!r}")
        if mode == "mean":
            missing = [l for l in runtime.replaced_layers if constants is None or l not in constants.layers]
            if missing:
                raise ValueError(f"SinkGroup: group {runtime.group!r} replaces layers {missing}, for which the sink's "
                                 "constants hold no K/V")
        self.runtime, self.mode, self.constants, self.spec = runtime, mode, constants, runtime.spec
        self.positions = positions
        self._stack: ExitStack | None = None

    @property
    def replaced_layers(self) -> tuple[int, ...]:
        return self.runtime.replaced_layers

    def seed(self, **kwargs) -> None:
        self.runtime.seed(**kwargs)

    def __enter__(self) -> "SinkGroup":
        with ExitStack() as stack:
            stack.enter_context(self.runtime)
            constants = None if self.mode == "exact" else self.constants
            stack.enter_context(kv_hooks.keep_initial(self.runtime.model, self.replaced_layers, self.positions,
                                                      constants))
            self._stack = stack.pop_all()
        return self

    def __exit__(self, *exc) -> None:
        stack, self._stack = self._stack, None
        if stack is not None:
            stack.close()
