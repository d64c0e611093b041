"""What the scoring asks of a runtime: the interface every context scored like a group shares.

:func:`ced_csa2.eval.scoring.multi_group_nll` (and :func:`ced_csa2.eval.perplexity.groups_ppl` through it)
scores each group under its :class:`~ced_csa2.ced_runtime.CEDModeBRuntime`, and any other runtime passed as
``extra=`` the same way: it runs the plain model once up to the lowest layer a runtime changes (the shared
trunk), hands the runtime what its hooks would have captured below that layer, and runs the rest inside it.
:class:`GroupRuntime` names the members that takes.  Every runtime declares it (subclasses it explicitly), so
a runtime missing a member fails where it is defined, not in the middle of a scoring run; the runtimes
are :class:`~ced_csa2.ced_runtime.CEDModeBRuntime`, :class:`~ced_csa2.runtime.format_runtime.FormatRuntime`,
:class:`~ced_csa2.runtime.sink.SinkGroup`, :class:`~ced_csa2.runtime.sparse_attention.SparseGroup` and
:class:`~ced_csa2.runtime.sub_plans.NestedRuntimes` (``tests/runtime/test_group_runtime.py`` finds them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Protocol, runtime_checkable

from ..groups import Group

if TYPE_CHECKING:
    import torch


@runtime_checkable
class GroupRuntime(Protocol):
    """A context under which a plain HF model runs as one evaluation arm, scored with a shared trunk.

    Attributes
    ----------
    spec
        The registry entry whose flags the scoring reads (:class:`~ced_csa2.groups.Group`):
        ``low_rank`` makes the trunk capture the clean K/V of the plan's source and targets for
        :meth:`seed`'s ``clean_kv``.  A runtime that is not one group reports the one it stores like.
    replaced_layers
        The 1-based layers whose output may differ from the plain model's inside the context, sorted
        or not; the lowest is the branch point (:func:`~ced_csa2.eval.scoring.branch_point`): the trunk
        runs the plain model below it once for every runtime.  Empty: the plain model (``baseline``).
    """

    spec: Group
    replaced_layers: tuple[int, ...]

    def seed(self, *, h_split: torch.Tensor | None = None, source_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
             clean_kv: Mapping[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
        """Hand the hooks what they would have captured in the layers the trunk ran (called inside the context).

        Parameters
        ----------
        h_split
            ``H_split`` ``(B, T, hidden)``, the split layer's output, when the split is below the branch point.
        source_kv
            The source layer's true ``(K, V)``, each ``(B, T, kv_dim)``, when the source is below it.
        clean_kv
            ``{layer: (K, V)}`` of the plain model for the plan's source and every target (``spec.low_rank``).
        """

    def __enter__(self) -> GroupRuntime:
        """Install the hooks on the model; from here every forward runs as this arm."""

    def __exit__(self, *exc) -> None:
        """Remove every hook installed by :meth:`__enter__`, also on an error: the model is plain again."""
