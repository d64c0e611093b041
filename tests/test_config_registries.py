"""Every choice a param offers is one the code has: each ``Literal`` in the typed config equals its registry's keys.

A ``Literal`` refuses a bad value in a second (``docs/failures.md``), but it is a second copy of a list the
code keeps elsewhere (the FP4 formats, the corpus readers, the activations...).  Adding to one and not the
other would either refuse a value the code runs or pass one it cannot run; this test fails instead and names
the two.  A ``Literal`` with no registry (the code branches on its values in place) is listed in
:data:`NO_REGISTRY`, so a new ``Literal`` must be placed in one table or the other.
"""

import dataclasses
import typing

import pytest

from ced_csa2 import config, csa2
from ced_csa2.ced_runtime import SINKS
from ced_csa2.data.corpus import CORPORA, DOMAIN_READERS
from ced_csa2.eval.results import CED_CSA2_START, KEPT, MODE_A_MAPS
from ced_csa2.kv.formats import FP4_FORMATS
from ced_csa2.model_utils import TINY_ARCHS
from ced_csa2.runtime.attention_calls import IMPLEMENTATIONS
from ced_csa2.train.objective_registry import OBJECTIVES
from ced_csa2.train.training import KEEP_CHOICES

# (section class, field) -> the registry the code runs the value through.
REGISTRIES = {
    ("Params", "kv_format"): FP4_FORMATS,
    ("TinyModelConfig", "arch"): TINY_ARCHS,
    ("ModelConfig", "attn_implementation"): IMPLEMENTATIONS,
    ("DataConfig", "kind"): CORPORA,
    ("DomainConfig", "kind"): DOMAIN_READERS,
    ("ProjectorConfig", "keep"): KEEP_CHOICES,
    ("AdaptersConfig", "keep"): KEEP_CHOICES,
    ("AdaptersConfig", "activation"): csa2.ACTIVATIONS,
    ("AdaptersConfig", "input"): csa2.INPUTS,
    ("ModeAConfig", "sink"): SINKS,
    ("TrainConfig", "ced_csa2_start"): CED_CSA2_START,
}
# (section class, field) -> the report's label for each value: every value has one (a table may label more).
LABELS = {
    ("ProjectorConfig", "keep"): KEPT,
    ("AdaptersConfig", "keep"): KEPT,
    ("ModeAConfig", "maps"): MODE_A_MAPS,
}
# Literals the code branches on in place (an `if` per value), so no second list exists to drift.
NO_REGISTRY = {
    ("ModelConfig", "kind"), ("ModelConfig", "device_map"), ("MathConfig", "kind"), ("ProjectorConfig", "init"),
    ("DistributedConfig", "backend"), ("EvalGSM8KConfig", "mode_a"), ("Params", "extra_projectors"),
}


def literal_fields() -> dict[tuple[str, str], tuple]:
    """``{(section class, field): its Literal's values}`` over every section of :mod:`ced_csa2.config`."""
    out = {}
    for cls in vars(config).values():
        if isinstance(cls, type) and issubclass(cls, config.Section) and dataclasses.is_dataclass(cls):
            for name, tp in typing.get_type_hints(cls).items():
                args = [a for a in typing.get_args(tp) if a is not type(None)] or [tp]  # Optional[Literal[...]]
                if typing.get_origin(tp) is typing.Literal or any(typing.get_origin(a) is typing.Literal for a in args):
                    literal = tp if typing.get_origin(tp) is typing.Literal else args[0]
                    out[(cls.__name__, name)] = typing.get_args(literal)
    return out


def test_every_literal_has_a_registry_or_says_it_has_none():
    fields = set(literal_fields())
    assert fields == set(REGISTRIES) | set(LABELS) | NO_REGISTRY, (
        f"place in REGISTRIES, LABELS or NO_REGISTRY: {sorted(fields - set(REGISTRIES) - set(LABELS) - NO_REGISTRY)}; "
        f"no longer a Literal: {sorted((set(REGISTRIES) | set(LABELS) | NO_REGISTRY) - fields)}")
    assert not NO_REGISTRY & (set(REGISTRIES) | set(LABELS))


@pytest.mark.parametrize("field", sorted(REGISTRIES), ids="{0[0]}.{0[1]}".format)
def test_a_literal_s_values_are_its_registry_s_keys(field):
    assert set(literal_fields()[field]) == set(REGISTRIES[field])


@pytest.mark.parametrize("field", sorted(LABELS), ids="{0[0]}.{0[1]}".format)
def test_every_value_of_a_literal_has_its_label(field):
    assert set(literal_fields()[field]) <= set(LABELS[field])


def test_the_tune_objectives_params_accept_are_the_registry_s():
    """``train.objectives`` is a list checked by hand against ``config.TUNE_OBJECTIVES`` (its refusal names ``kv_mse``'s
    branch), not a ``Literal``: the same rule, the registry's keys in its order."""
    assert config.TUNE_OBJECTIVES == tuple(OBJECTIVES)
