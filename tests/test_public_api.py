"""What one module of the project uses of another is public: no ``from X import _name``, no ``X._name``.

A leading underscore says "only this module relies on it", so it can change with no caller to update.  Another
module reading it breaks that promise silently; this test names the file, the line and the name instead, and the
fix is to make the name public where it lives (or move it where its callers look for it, as ``model_utils.rope_fn``).
Scanned: every ``.py`` under ``src/``, ``studies/`` and ``benchmarks/``.  The tests may read the internals of what
they test (``cache._store``, a module's private helper they monkeypatch), but import only public names: a private
name a test needs is public where it lives, or tested through the public function that uses it.
"""

import ast
from pathlib import Path

from conftest import ROOT

from ced_csa2.graph import module_file

SCANNED = ("src", "studies", "benchmarks")


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def package_of(file: Path, src: Path) -> str:
    """The package a file under ``src`` resolves its relative imports in (``""`` for a script)."""
    if file.is_relative_to(src):
        parts = file.relative_to(src).with_suffix("").parts
        return ".".join(parts if parts[-1] == "__init__" else parts[:-1])
    return ""


def project_module(base: str, file: Path) -> bool:
    """``base`` (an absolute module name) is this project's: ``ced_csa2...`` or a sibling script of ``file``."""
    return base.split(".")[0] == "ced_csa2" or (file.parent / f"{base}.py").is_file()


def private_uses(file: Path, src: Path = ROOT / "src", *, reads: bool = True) -> list[tuple[int, str, str]]:
    """``(line, module, name)`` of every private name ``file`` imports from, or (``reads``) reads off, another
    project module."""
    package, tree = package_of(file, src), ast.parse(file.read_text())
    found, module_names = [], {}  # local name -> the project module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            if not project_module(base, file):
                continue
            for alias in node.names:
                if base.startswith("ced_csa2") and module_file(f"{base}.{alias.name}").is_file():
                    module_names[alias.asname or alias.name] = f"{base}.{alias.name}"  # `from . import kv_hooks`
                elif is_private(alias.name):
                    found.append((node.lineno, base, alias.name))
        elif isinstance(node, ast.Import):
            module_names.update((a.asname, a.name) for a in node.names if a.asname and project_module(a.name, file))
    for node in ast.walk(tree) if reads else ():
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in module_names
                and is_private(node.attr)):
            found.append((node.lineno, module_names[node.value.id], node.attr))
    return sorted(found)


def scanned_files() -> list[Path]:
    return sorted(p for d in SCANNED for p in (ROOT / d).rglob("*.py"))


def test_no_module_reads_another_module_s_private_names():
    uses = {(f.relative_to(ROOT).as_posix(), line, module, name)
            for f in scanned_files() for line, module, name in private_uses(f)}
    assert sorted(uses) == [], "make these public where they are defined"


def test_no_test_imports_a_private_name():
    imports = {(f.relative_to(ROOT).as_posix(), line, module, name)
               for f in sorted((ROOT / "tests").rglob("*.py")) for line, module, name in private_uses(f, reads=False)
               if module.startswith("ced_csa2")}
    assert sorted(imports) == [], "test these through the public API, or make them public where they are defined"


def test_the_scan_finds_each_kind_of_private_use(tmp_path):
    """The three spellings of reaching into another module, relative and absolute, are each reported."""
    pkg = tmp_path / "src" / "ced_csa2" / "eval"
    pkg.mkdir(parents=True)
    script = pkg / "probe.py"
    script.write_text("from .. import kv_hooks\nfrom ..ced_runtime import _hidden_thing, CEDParts\n"
                      "import ced_csa2.model_utils as mu\nfrom os import _exit\n"
                      "kv_hooks._private_hook()\nmu._helper\nkv_hooks.capture\n")
    assert private_uses(script, tmp_path / "src") == [(2, "ced_csa2.ced_runtime", "_hidden_thing"),
                                                      (5, "ced_csa2.kv_hooks", "_private_hook"),
                                                      (6, "ced_csa2.model_utils", "_helper")]
    assert private_uses(script, tmp_path / "src", reads=False) == [(2, "ced_csa2.ced_runtime", "_hidden_thing")]
