"""The objectives of the ``tune@<objective>`` branches: one small class each, in one registry.

Every branch starts from the ridge maps (``stages/tune.py``); its objective says what happens
next.  The tuning loop, the ``tune`` stage and ``estimate.py`` read these facts from
:data:`OBJECTIVES`, never from the name:

============  ======  ======================================================  ==========================
objective     trains  loss (per phase: ``ced``, ``csa2``, ``ced_csa2``)       teacher pass runs to
============  ======  ======================================================  ==========================
``ridge``     no      none: the ridge start as it is, the reference            --
``attn_out``  yes     relative MSE of each substituted layer's attention out   the top substituted layer
``distill``   yes     ``T^2`` KL of the logits ``+ kv_weight *`` K/V MSE       the final hidden state
============  ======  ======================================================  ==========================

The losses are :mod:`ced_csa2.train.objectives`'.  The seed's K/V-MSE objective (reported as
``kv_mse``) is the main branch (``train_projector`` / ``train_adapters``), not a tune objective.
``config.TUNE_OBJECTIVES``, the names ``train.objectives`` accepts, is :data:`OBJECTIVES`' keys
(``config`` sits below ``train/`` and cannot import this; ``tests/test_config_registries.py`` holds
the two equal).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from ..ced_runtime import CEDParts
from ..plan import LayerPlan
from .objectives import PHASE_GROUPS, attn_out_loss, distill_loss, teacher_pass

# What the maps of an objective that trains read beyond every objective's keys (stages.tune.PROVENANCE):
# the training records and the online budget.
ONLINE_PROVENANCE = ("data.name", "data.max_tokens", "data.revision", "train.online")


@dataclass(frozen=True)
class TuneObjective:
    """One objective of the ``tune`` branches.  This class itself trains nothing (``ridge``).

    An objective that trains is a subclass defining :meth:`loss`, with its facts in its row of
    :data:`OBJECTIVES`; a row whose facts contradict its class is refused at import.

    Attributes
    ----------
    name
        Its entry in ``train.objectives``, its stage ``tune@<name>`` and its folders
        ``models/objectives/<name>/``, ``metrics/objectives/<name>/``.
    final_teacher
        Whether its training loss reads the frozen model's final hidden state (its logits): its
        training batches' teacher passes then run to the end and keep it; otherwise each ends after
        the top substituted layer.  (The held-out passes always run to the end: the held-out KL.)
    step_cost
        One training step of each phase (:data:`~ced_csa2.train.objectives.PHASE_GROUPS`), teacher
        pass included, as a multiple of a plain forward of the same batch: ``estimate.py``'s time
        model.  Empty for an objective that trains nothing.
    provenance
        The params keys its maps record beyond every objective's (``stages.tune.PROVENANCE``): what
        its training reads.  Each must be among ``dvc.yaml``'s params of the ``tune`` stage.
    """

    name: str
    final_teacher: bool = False
    step_cost: Mapping[str, float] = field(default_factory=dict)
    provenance: tuple[str, ...] = ()

    def __post_init__(self):
        if self.trains and set(self.step_cost) != set(PHASE_GROUPS):
            raise ValueError(f"objective {self.name!r}: step_cost must give every phase {list(PHASE_GROUPS)}, "
                             f"got {sorted(self.step_cost)}")
        if not self.trains and (self.final_teacher or self.step_cost or self.provenance):
            raise ValueError(f"objective {self.name!r} trains nothing (its class has no loss): it has no "
                             "final_teacher, step_cost or provenance")

    @property
    def trains(self) -> bool:
        """Whether it trains the maps through the frozen model, phase by phase: its class defines a :meth:`loss`."""
        return type(self).loss is not TuneObjective.loss

    def loss(self, model: nn.Module, parts: CEDParts, plan: LayerPlan, group: str, teacher: dict,
             ids: torch.Tensor, mask: torch.Tensor, temperature: float, kv_weight: float,
             student: torch.Tensor | None = None, block_tokens: int | None = None) -> torch.Tensor:
        """The loss of the ``group`` substitution on one batch ``ids`` / ``mask`` ``(B, T)``: a scalar.

        The training step's and the held-out one's.  ``teacher``: the batch's
        :func:`~ced_csa2.train.objectives.teacher_pass` (to the final hidden state when
        :attr:`final_teacher`, and always for a held-out batch); ``temperature``, ``kv_weight``:
        ``train.online``'s.  For a held-out batch (no gradient): ``student``, the substituted model's
        final hidden states ``(B, T, hidden)`` when already computed, and ``block_tokens``, the LM
        head's positions per block (:func:`~ced_csa2.train.objectives.kl_from_hidden`); a loss that
        reads neither ignores them.
        """
        raise ValueError(f"objective {self.name!r} trains nothing: it has no loss")

    def batch_loss(self, model: nn.Module, parts: CEDParts, plan: LayerPlan, group: str, ids: torch.Tensor,
                   mask: torch.Tensor, temperature: float, kv_weight: float, teacher: dict | None = None
                   ) -> torch.Tensor:
        """:meth:`loss` of a training batch; ``teacher``: its teacher pass when already made
        (:class:`~ced_csa2.train.objectives.TeacherCache`), else made here for ``group`` alone."""
        if teacher is None:
            teacher = teacher_pass(model, plan, group, ids, mask, final=self.final_teacher)
        return self.loss(model, parts, plan, group, teacher, ids, mask, temperature, kv_weight)


@dataclass(frozen=True)
class AttnOut(TuneObjective):
    """Each substituted layer's attention re-run on its true input with the maps' K/V, against its true output."""

    def loss(self, model, parts, plan, group, teacher, ids, mask, temperature, kv_weight, student=None,
             block_tokens=None):
        return attn_out_loss(model, parts, plan, group, teacher, mask)


@dataclass(frozen=True)
class Distill(TuneObjective):
    """The substituted model (student) against the plain one (teacher): KL of their logits, plus K/V MSE."""

    def loss(self, model, parts, plan, group, teacher, ids, mask, temperature, kv_weight, student=None,
             block_tokens=None):
        return distill_loss(model, parts, plan, group, teacher, ids, mask, temperature, kv_weight,
                            student=student, block_tokens=block_tokens)


# The step costs: benchmarks/objective_throughput.py on SmolLM2 (ced and csa2 phases); the joint ced_csa2
# phase is taken as the dearer of the two.
OBJECTIVES: dict[str, TuneObjective] = {o.name: o for o in (
    TuneObjective("ridge"),
    AttnOut("attn_out", final_teacher=False, step_cost={"ced": 0.51, "csa2": 0.97, "ced_csa2": 0.97},
            provenance=ONLINE_PROVENANCE),
    Distill("distill", final_teacher=True, step_cost={"ced": 3.93, "csa2": 3.56, "ced_csa2": 3.93},
            provenance=ONLINE_PROVENANCE),
)}


def tune_objective(name: str) -> TuneObjective:
    """The registry's objective ``name``; a name it lacks is a one-line ``ValueError`` naming those it has."""
    if name not in OBJECTIVES:
        raise ValueError(f"unknown tune objective {name!r}; known: {list(OBJECTIVES)}")
    return OBJECTIVES[name]
