"""Every runtime scored like a group declares :class:`GroupRuntime` and has each of its members itself.

The runtimes are found in the code (every class of ``src/`` that subclasses ``GroupRuntime``, and every class
that has a ``replaced_layers`` and a ``seed``, which must be among them), so a new runtime is tested here
without editing a list: :data:`BUILDERS` must build one of each on the tiny Qwen3.5, or this test names it.
"""

import ast
import importlib
import inspect

import pytest
from conftest import ROOT
from tiny_maps import QWEN_PLAN, random_parts

from ced_csa2.ced_runtime import CEDModeBRuntime
from ced_csa2.kv.formats import group_format
from ced_csa2.model_utils import geometry
from ced_csa2.runtime.format_runtime import FormatRuntime
from ced_csa2.runtime.group_runtime import GroupRuntime
from ced_csa2.groups import GROUPS
from ced_csa2.runtime.layer_modes import LayerModes
from ced_csa2.runtime.sink import SinkGroup
from ced_csa2.runtime.sparse_attention import SparseAttention, SparseGroup, SparseReads
from ced_csa2.runtime.sub_plans import NestedRuntimes, spaced_full_layers, sub_plans

SRC = ROOT / "src"


def classes_in_src() -> dict[str, ast.ClassDef]:
    """``{"module:Class": node}`` of every class defined at the top of a ``src/`` module."""
    out = {}
    for path in SRC.rglob("*.py"):
        module = ".".join(path.relative_to(SRC).with_suffix("").parts)
        out.update({f"{module}:{n.name}": n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)})
    return out


def declares_group_runtime(node: ast.ClassDef) -> bool:
    return any(isinstance(b, ast.Name) and b.id == "GroupRuntime" for b in node.bases)


def looks_like_a_runtime(node: ast.ClassDef) -> bool:
    """Defines ``seed`` and ``replaced_layers`` (a method, a property or ``self.replaced_layers = ...``)."""
    defined = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
    assigned = {t.attr for n in ast.walk(node) if isinstance(n, ast.Assign) for t in n.targets
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    return "seed" in defined and "replaced_layers" in defined | assigned


CLASSES = classes_in_src()
RUNTIMES = sorted(name for name, node in CLASSES.items() if declares_group_runtime(node))


def protocol_members() -> set[str]:
    """The attributes and methods :class:`GroupRuntime` itself declares."""
    methods = {n for n, v in vars(GroupRuntime).items() if inspect.isfunction(v) and v.__qualname__.startswith(
        "GroupRuntime.")}
    return set(GroupRuntime.__annotations__) | methods


def missing_members(runtime) -> list[str]:
    """Members of :class:`GroupRuntime` that ``runtime`` gets only from the protocol's own stubs (or not at all)."""
    def own(name):
        if name in vars(runtime):
            return True
        owner = next((c for c in type(runtime).__mro__ if name in vars(c)), None)
        return owner is not None and owner is not GroupRuntime and owner.__module__ != "typing"
    return sorted(m for m in protocol_members() if not own(m))


def csa2(model, plan, geo):
    return CEDModeBRuntime(model, plan, "csa2", random_parts(geo, plan), kv_format=None)


BUILDERS = {
    CEDModeBRuntime: lambda model, geo: csa2(model, QWEN_PLAN, geo),
    FormatRuntime: lambda model, geo: FormatRuntime(model, group_format(GROUPS["baseline_k6v4_rot"]),
                                                    geo.attention_layers, geo.head_dim),
    SinkGroup: lambda model, geo: SinkGroup(csa2(model, QWEN_PLAN, geo), "exact", positions=4),
    SparseGroup: lambda model, geo: SparseGroup(csa2(model, QWEN_PLAN, geo), SparseAttention(
        model, LayerModes.build(QWEN_PLAN, geo, "csa2"), SparseReads(k=4, window=2), geo)),
    NestedRuntimes: lambda model, geo: NestedRuntimes(
        [csa2(model, p, geo) for p in sub_plans(geo, QWEN_PLAN.split, spaced_full_layers(geo, QWEN_PLAN.split, 2))]),
}


def runtime_class(name: str) -> type:
    module, cls = name.split(":")
    return getattr(importlib.import_module(module), cls)


def test_every_class_shaped_like_a_runtime_declares_the_protocol_and_each_is_built_here():
    shaped = sorted(name for name, node in CLASSES.items() if looks_like_a_runtime(node))
    assert [name for name in shaped if name not in RUNTIMES] == [], "subclass GroupRuntime (runtime/group_runtime.py)"
    assert len(RUNTIMES) >= 5
    assert {runtime_class(name) for name in RUNTIMES} == set(BUILDERS), "give BUILDERS one of each"


@pytest.mark.parametrize("name", RUNTIMES)
def test_each_runtime_is_a_group_runtime_with_every_member_of_its_own(name, tiny_model):
    model = tiny_model[0]
    geo = geometry(model.config)
    runtime = BUILDERS[runtime_class(name)](model, geo)
    assert isinstance(runtime, GroupRuntime)
    assert missing_members(runtime) == []
    assert runtime.spec in GROUPS.values()
    assert runtime.replaced_layers and set(runtime.replaced_layers) <= set(range(1, geo.n_layers + 1))
    with runtime as entered:
        assert entered is runtime
        runtime.seed(h_split=None)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules()), "hooks left after __exit__"


def test_a_runtime_without_its_own_seed_is_named():
    class Incomplete(GroupRuntime):
        spec, replaced_layers = GROUPS["baseline"], ()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            pass

    assert isinstance(Incomplete(), GroupRuntime)  # declaring it is not enough
    assert missing_members(Incomplete()) == ["seed"]
    assert protocol_members() == {"spec", "replaced_layers", "seed", "__enter__", "__exit__"}
