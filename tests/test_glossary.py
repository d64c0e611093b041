"""A retired name stays retired: the names in ``docs/glossary.md``'s table are nowhere in the tree.

A rename leaves the old word in a docstring, a doc or a conf comment as easily as in code; the old word then
reads as a second thing.  The glossary's "Retired names" table lists them; this test scans every text file a
reader meets (``src/``, ``studies/``, ``conf/``, ``docs/``, ``README.md``), except that table and ``docs/LOG.md``
(the history), and names each file, line and word.
"""

import re
from pathlib import Path

from conftest import ROOT

GLOSSARY = ROOT / "docs" / "glossary.md"
SECTION = "## Retired names"
SCANNED = ("src", "studies", "conf", "docs")
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".json", ".tsv", ".lock"}
HISTORY = Path("docs", "LOG.md")


def retired_section(text: str) -> str:
    """The glossary's "Retired names" section: from its heading to the next ``## `` heading."""
    start = text.index(SECTION)
    end = text.find("\n## ", start + len(SECTION))
    return text[start:] if end < 0 else text[start:end]


def retired_names(text: str) -> list[str]:
    """The first column of the section's table: one backticked name per row (header and rule skipped)."""
    rows = [line for line in retired_section(text).splitlines() if line.startswith("| `")]
    return [re.match(r"\| `([^`]+)`", row).group(1) for row in rows]


def pattern(names: list[str]) -> re.Pattern:
    """Any of ``names`` as a whole word: not inside a longer identifier (``_bootstrap`` is not in ``paired_bootstrap``)."""
    return re.compile(r"(?<!\w)(" + "|".join(re.escape(n) for n in names) + r")(?!\w)")


def scanned_texts(root: Path, glossary: Path) -> dict[Path, str]:
    """``{file: text}`` of every scanned file under ``root``, the glossary without its retired table."""
    files = [p for d in SCANNED for p in (root / d).rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES]
    texts = {p: p.read_text(errors="replace") for p in [*files, root / "README.md"] if p.relative_to(root) != HISTORY}
    if glossary in texts:
        texts[glossary] = texts[glossary].replace(retired_section(texts[glossary]), "")
    return texts


def uses(root: Path, glossary: Path, names: list[str]) -> list[str]:
    """``file:line: name`` of every use of a retired name."""
    found = pattern(names)
    return [f"{p.relative_to(root)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(1)}"
            for p, text in sorted(scanned_texts(root, glossary).items()) for m in found.finditer(text)]


def test_the_glossary_lists_retired_names():
    names = retired_names(GLOSSARY.read_text())
    assert len(names) >= 10 and len(set(names)) == len(names)
    assert {"io_utils", "h5store", "mode_a_lm", "_rope_fn"} <= set(names)


def test_no_retired_name_is_used():
    assert uses(ROOT, GLOSSARY, retired_names(GLOSSARY.read_text())) == []


def test_a_reintroduced_name_is_named_with_its_file_and_line(tmp_path):
    """A copy of the glossary and a tree of two files: the retired word in a doc is found, the table itself and the
    history are not, nor a longer identifier that contains it."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "src").mkdir()
    glossary = tmp_path / "docs" / "glossary.md"
    glossary.write_text(GLOSSARY.read_text())
    (tmp_path / "docs" / "LOG.md").write_text("- Renames: `data/h5store` -> `data/dump_file`\n")
    (tmp_path / "src" / "stats.py").write_text("def paired_bootstrap():\n    pass\n")
    (tmp_path / "README.md").write_text("Results\n\nThe dump is read by `data.h5store`.\n")
    names = retired_names(glossary.read_text())
    assert uses(tmp_path, glossary, names) == ["README.md:3: h5store"]
