"""The pipeline graph's code deps: each stage's ``src/`` deps in ``dvc.yaml`` are its command's import closure.

    python -m ced_csa2.graph            # rewrite the src/ deps of dvc.yaml and studies/dvc.yaml, naming each changed
    python -m ced_csa2.graph --check    # write nothing; exit status 1 naming the stale files

Run it after changing what a stage module or a study script imports (``docs/extending.md``).  Only the
``- src/...`` lines of a stage are rewritten (comments, order and every other dep kept), so a stage must
declare at least one ``src/`` dep for its closure to be written.  ``tests/test_graph.py`` checks that both
files are what this writes.  No stage imports this module: editing it re-runs nothing.

The closure is static (:mod:`ast`): every ``ced_csa2`` import anywhere in a module, function-level
imports included, and every enclosing package's ``__init__`` (Python runs them before the module).
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

import yaml

from .pipeline.cli import ArgumentParser

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src"
PIPELINES = (ROOT / "dvc.yaml", ROOT / "studies" / "dvc.yaml")


def module_file(module: str) -> Path:
    """The file of a ``ced_csa2`` module: ``a/b.py``, or ``a/b/__init__.py`` for a package."""
    path = SRC.joinpath(*module.split("."))
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"


def project_imports(module: str) -> set[str]:
    """``ced_csa2`` modules imported anywhere in ``module`` (function-level imports included)."""
    file = module_file(module)
    return file_imports(file, module if file.name == "__init__.py" else module.rsplit(".", 1)[0])


def file_imports(file: Path, package: str = "") -> set[str]:
    """``ced_csa2`` modules imported anywhere in ``file`` (relative imports resolved in ``package``)."""
    found = set()
    for base, names in _import_statements(file.read_text(), package):
        if names is None:  # `import ced_csa2.x`
            found.add(base)
        for name in names or ():  # `from . import kv_hooks` names a module
            candidate = f"{base}.{name}"
            found.add(candidate if module_file(candidate).is_file() else base)
    return found


@functools.cache
def _import_statements(source: str, package: str) -> tuple[tuple[str, tuple[str, ...] | None], ...]:
    """``(module, names)`` of each ``ced_csa2`` import in ``source`` (``names`` None for a plain ``import``).

    Cached by the text: a closure visits each module once per stage, and the stages share most modules."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            if base.startswith("ced_csa2"):
                found.append((base, tuple(alias.name for alias in node.names)))
        elif isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if a.name.startswith("ced_csa2")]
    return tuple(found)


def import_closure(*modules: str) -> set[str]:
    """Repository paths of every project module ``modules`` can import, themselves included."""
    seen, todo = set(), list(modules)
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += project_imports(m)
    # Python runs every enclosing package's __init__ before a module (stages/__init__ before a stage).
    packages = {".".join(m.split(".")[:i]) for m in seen for i in range(1, m.count(".") + 1)}
    return {module_file(m).relative_to(ROOT).as_posix() for m in seen | packages}


def code_closure(cmd: str) -> set[str]:
    """The ``src/`` files a stage's command can import: its ``python -m`` module's closure, or a study script's."""
    words = cmd.split()
    if words[1] == "-m":
        return import_closure(words[2])
    return import_closure(*file_imports(ROOT / words[1]))


def with_code_deps(text: str) -> str:
    """``text`` (a ``dvc.yaml``) with each stage's ``src/`` deps replaced by its command's closure, sorted.

    A stage whose ``deps:`` list names no ``src/`` file yet (a new stage) gets its closure at the list's end."""
    cmds = {name: spec.get("do", spec)["cmd"] for name, spec in yaml.safe_load(text)["stages"].items()}
    lines, out, stage = text.splitlines(keepends=True), [], None
    deps_indent, has_src = None, False  # the open deps list's item indent, and whether it named src/ files
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.lstrip()
        indent = line[:len(line) - len(stripped)]
        in_list = (stripped.startswith("- ") and indent == deps_indent) or stripped.startswith("#")
        if deps_indent is not None and not in_list:
            if not has_src and stage in cmds:  # the deps list ended without src/ files
                out += [f"{deps_indent}- {d}\n" for d in sorted(code_closure(cmds[stage]))]
            deps_indent = None
        if line.startswith("  ") and not line.startswith("   ") and line.rstrip().endswith(":"):
            stage = line.strip()[:-1]
        if stripped.rstrip() == "deps:" and i + 1 < len(lines):
            nxt = lines[i + 1]
            deps_indent, has_src = nxt[:len(nxt) - len(nxt.lstrip())], False
        if stripped.startswith("- src/") and stage in cmds:
            has_src = True
            while i < len(lines) and lines[i].lstrip().startswith("- src/"):
                i += 1
            out += [f"{indent}- {d}\n" for d in sorted(code_closure(cmds[stage]))]
            continue
        out.append(line)
        i += 1
    return "".join(out)


def stale(paths: tuple[Path, ...] = PIPELINES) -> list[Path]:
    """Those of ``paths`` whose ``src/`` deps are not their stages' closures."""
    return [p for p in paths if with_code_deps(p.read_text()) != p.read_text()]


def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m ced_csa2.graph", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit status 1 if a file is stale")
    args = ap.parse_args(argv)
    paths = stale()
    for path in paths:
        if not args.check:
            path.write_text(with_code_deps(path.read_text()))
        print(f"{'stale' if args.check else 'rewrote'}: {path.relative_to(ROOT)}")
    return int(bool(paths) and args.check)


if __name__ == "__main__":
    sys.exit(main())
