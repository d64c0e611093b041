"""The pipeline graph cannot go stale: what each stage can import is what dvc.yaml declares.

The params keys and artifact files a stage actually reads are checked in
``test_pipeline_e2e.py`` (they need a real run); here the static half: every stage's
``src/`` deps equal the import closure of its entry module, and stages import only
library modules; the lab (modules only studies and benchmarks import) is the table
``docs/extending.md`` keeps; and ``python -m ced_csa2.graph`` (which rewrites those deps) leaves both
``dvc.yaml`` files as they are.
"""

import ast
import importlib
import re
from pathlib import Path

import pytest
import yaml
from conftest import ROOT

from ced_csa2 import graph
from ced_csa2.graph import code_closure, file_imports, import_closure, project_imports
from ced_csa2.train.objective_registry import OBJECTIVES

SRC = ROOT / "src"
STAGES_DIR = SRC / "ced_csa2" / "stages"
# The public modules (the seed's entry points, the typed config, the CLIs); the rest lives in
# one subpackage per concern.
TOP_LEVEL = {"__init__", "assets", "ced_runtime", "compose", "config", "csa2", "diff", "estimate", "graph", "kv_hooks",
             "plots_page", "model_utils", "plan", "groups", "projector", "release"}


def stage_templates() -> dict[str, dict]:
    """``dvc.yaml`` stages by name; a foreach stage gives its ``do`` template (deps differ only in ${item})."""
    stages = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    return {name: spec.get("do", spec) for name, spec in stages.items()}


STAGE_MODULES = sorted(p.stem for p in STAGES_DIR.glob("*.py") if p.stem != "__init__")


def test_every_stage_module_is_a_dvc_stage_and_back():
    templates = stage_templates()
    assert set(templates) == set(STAGE_MODULES)
    for name, spec in templates.items():
        assert spec["cmd"].split()[:3] == ["python", "-m", f"ced_csa2.stages.{name}"], name


@pytest.mark.parametrize("stage", STAGE_MODULES)
def test_code_deps_are_exactly_the_import_closure(stage):
    declared = {d for d in stage_templates()[stage]["deps"] if d.startswith("src/")}
    closure = import_closure(f"ced_csa2.stages.{stage}")
    assert declared == closure, (f"dvc.yaml stage '{stage}': add {sorted(closure - declared)}, "
                                 f"remove {sorted(declared - closure)} (python -m ced_csa2.graph)")


def covered(key: str, declared: list[str]) -> bool:
    """``key`` (a section or a dotted key) is one of ``declared`` params keys or lies under one."""
    return any(key == d or key.startswith(d + ".") for d in declared)


@pytest.mark.parametrize("stage", [s for s in STAGE_MODULES if hasattr(importlib.import_module(
    f"ced_csa2.stages.{s}"), "PROVENANCE")])
def test_what_an_artifact_records_it_was_made_from_is_among_its_stage_s_params(stage):
    """A recorded key dvc.yaml does not declare would refuse an artifact that `dvc repro` never rebuilds."""
    module = importlib.import_module(f"ced_csa2.stages.{stage}")
    declared = stage_templates()[stage]["params"]
    # tune@<objective>: each objective records its own keys on top (one stage template, the same params for all)
    own = [key for o in OBJECTIVES.values() for key in o.provenance] if stage == "tune" else []
    keys = (*module.PROVENANCE, *own)
    assert [k for k in keys if not covered(k, declared)] == [], f"dvc.yaml stage '{stage}' params: {declared}"


@pytest.mark.parametrize("stage", STAGE_MODULES)
def test_stages_import_only_library_modules(stage):
    others = {m for m in project_imports(f"ced_csa2.stages.{stage}") if m.startswith("ced_csa2.stages")}
    assert not others, f"stage {stage} imports another stage: {sorted(others)}"


def test_study_code_deps_are_exactly_the_import_closure():
    """studies/dvc.yaml (outside the default target) declares what its scripts import, as the stages do."""
    stages = yaml.safe_load((ROOT / "studies" / "dvc.yaml").read_text())["stages"]
    for name, spec in stages.items():
        spec = spec.get("do", spec)  # a foreach stage's template
        script = spec["cmd"].split()[1]
        assert script in spec["deps"], f"studies/dvc.yaml stage '{name}' must declare its script {script}"
        declared = {d for d in spec["deps"] if d.startswith("src/")}
        closure = import_closure(*file_imports(ROOT / script))
        assert declared == closure, (f"studies/dvc.yaml stage '{name}': add {sorted(closure - declared)}, "
                                     f"remove {sorted(declared - closure)} (python -m ced_csa2.graph)")


def library_modules() -> dict[str, Path]:
    """``{module: file}`` of every library module (the stages excluded)."""
    out = {}
    for path in (SRC / "ced_csa2").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        if "stages" not in parts:
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def lab_table() -> set[str]:
    """The modules of ``docs/extending.md``'s table "The lab: modules no stage imports", as repository paths."""
    section = (ROOT / "docs" / "extending.md").read_text().split("## The lab: modules no stage imports", 1)[1]
    return {f"src/ced_csa2/{cell}" for cell in re.findall(r"^\| `([^`]+\.py)` \|", section.split("\n## ")[0], re.M)}


def test_the_lab_is_the_modules_no_stage_imports():
    """The library modules outside every ``dvc.yaml`` stage's closure (the top-level CLIs aside) are the table's, and
    each is imported by a study or a benchmark: which edits invalidate ``dvc repro`` is written down, and true."""
    closures = {name: code_closure(spec["cmd"]) for name, spec in stage_templates().items()}
    pipeline = set().union(*closures.values())
    library = {path.relative_to(ROOT).as_posix() for module, path in library_modules().items()
               if module.removeprefix("ced_csa2.") not in TOP_LEVEL}
    listed = lab_table()
    entered = sorted(listed & pipeline)
    left = sorted(library - pipeline - listed)
    assert not entered and not left and listed <= library, (
        "docs/extending.md 'The lab: modules no stage imports' is stale:\n"
        + "".join(f"  {m}: now a dep of stages {sorted(s for s, c in closures.items() if m in c)}: editing it "
                  "invalidates `dvc repro`; remove its row\n" for m in entered)
        + "".join(f"  {m}: in no stage's closure: editing it re-runs only a study; add its row\n" for m in left)
        + "".join(f"  {m}: no such module; remove its row\n" for m in sorted(listed - library)))
    scripts = sorted((ROOT / "studies").glob("*.py")) + sorted((ROOT / "benchmarks").glob("*.py"))
    used = set().union(*(import_closure(*file_imports(script)) for script in scripts))
    assert sorted(listed - used) == [], "no study or benchmark imports these lab modules: dead code"


def test_library_never_imports_a_stage():
    for module, path in library_modules().items():
        assert not {m for m in project_imports(module) if m.startswith("ced_csa2.stages")}, path


def folder_imports() -> dict[tuple[str, str], set[str]]:
    """``{(folder, other folder): {"module -> imported module"}}`` over the subpackages of ``ced_csa2``."""
    edges: dict[tuple[str, str], set[str]] = {}
    for module in library_modules() | {f"ced_csa2.stages.{s}": None for s in STAGE_MODULES}:
        parts = module.split(".")
        for imported in project_imports(module):
            other = imported.split(".")
            if len(parts) > 2 and len(other) > 2 and parts[1] != other[1]:
                edges.setdefault((parts[1], other[1]), set()).add(f"{module} -> {imported}")
    return edges


def test_no_two_folders_import_each_other():
    """The subpackages stack: where ``a`` imports ``b``, ``b`` imports nothing of ``a`` (``kv`` below ``runtime``:
    formats and byte accounting are data the runtimes use), so a folder can be read and tested from the bottom up."""
    edges = folder_imports()
    mutual = {pair for pair in edges if pair[0] < pair[1] and pair[::-1] in edges}
    assert not mutual, "\n".join(f"{a} and {b} import each other: {sorted(edges[a, b])} and {sorted(edges[b, a])}"
                                  for a, b in sorted(mutual))


def test_only_the_public_modules_are_at_the_top_and_subpackage_inits_import_nothing():
    assert {p.stem for p in (SRC / "ced_csa2").glob("*.py")} == TOP_LEVEL
    for init in (SRC / "ced_csa2").glob("*/__init__.py"):
        tree = ast.parse(init.read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))], init


def test_the_graph_cli_rewrites_nothing_and_restores_a_dropped_dep(tmp_path):
    """``python -m ced_csa2.graph`` writes what the tests above ask for: on the committed files nothing; on a copy
    missing one stage's dep, that dep back, the file byte-identical to the committed one."""
    assert graph.stale() == []
    committed = (ROOT / "dvc.yaml").read_text()
    dropped = "        - src/ced_csa2/kv/rotation.py\n"  # the tune stage's, among others
    broken = tmp_path / "dvc.yaml"
    broken.write_text(committed.replace(dropped, "", 1))
    assert graph.stale((broken,)) == [broken]
    assert graph.with_code_deps(broken.read_text()) == committed


def test_the_graph_cli_gives_a_new_stage_its_code_deps_at_the_end_of_its_deps():
    """A stage written without any ``src/`` dep (new, or all of them deleted) gets its command's closure after its last
    dep, its comments kept in place; run again, nothing changes."""
    text = ("stages:\n  new:\n    cmd: python -m ced_csa2.compose\n    deps:\n      - conf  # the configs\n"
            "      # a comment inside the list\n      - params.yaml\n    outs:\n      - x\n")
    closure = "".join(f"      - {d}\n" for d in sorted(code_closure("python -m ced_csa2.compose")))
    assert closure and graph.with_code_deps(text) == text.replace("    outs:\n", closure + "    outs:\n")
    assert graph.with_code_deps(graph.with_code_deps(text)) == graph.with_code_deps(text)
