"""One home per fact (issue 65): measured figures live in the docs and the studies' outputs, never in a conf
comment or a library docstring or comment, where they go stale unseen; and a doc table that copies a committed
study's table is marked with its file and checked against it, as README's headline is against
``metrics/summary.json`` (:func:`conftest.readme_headline_problem`).  A conf comment or a docstring says *why*
a value or a choice is what it is and points to the doc that holds the figure (``docs/costs.md``,
``docs/results.md``).

The tripwire catches the forms a measurement is quoted in: a percentage or a ratio with decimals, a sign, a
``~`` or a range (``+4.2%``, ``1.77x``, ``~3.5x``, ``10-20x``), a time the same way (``~90 s``, ``0.35 s``) and a
throughput (``800 tok/s``).  Protocol words (``95%`` intervals), thresholds (``>= 80%``) and sizes computed from
shapes (``256 MiB``) are plain integers or other units and pass.  A derived constant that reads like a
measurement goes in :data:`DERIVED`, with its reason.
"""

import ast
import io
import itertools
import re
import subprocess
import tokenize

import pytest

from conftest import ROOT, staged_text

_NUM = r"\d+(?:[.,]\d+)*"
MEASURED = re.compile(
    r"(?<![\w.`])(?:"
    rf"[~+\-−]{_NUM}\s?%|\d+\.\d+\s?%|\d+[-–]\d+\s?%"  # percentages: signed, approximate, decimal, ranges
    rf"|~{_NUM}\s?[x×](?!\w)|\d+\.\d+\s?[x×](?!\w)|\d+[-–]\d+\s?[x×](?!\w)"  # ratios
    rf"|~{_NUM}\s?(?:s|ms|min)\b|\d+\.\d+\s?(?:s|ms|min)\b"  # times
    rf"|{_NUM}\s?(?:tok|tokens)/s"  # throughput
    r")")

# (file, quoted text) -> why it is no measurement.  Short on purpose: rephrase before adding to it.
DERIVED = {
    ("src/ced_csa2/csa2.py", "1.5 x"): "width_mult x kv_dim, the docstring's worked example of the formula",
    ("src/ced_csa2/groups.py", "3.05x"): "bytes per token of the FP6/MXFP4 formats against bf16, from the formats",
    ("src/ced_csa2/kv/kv_bytes.py", "3.95×"): "the last line of a worked byte computation in the docstring",
    ("src/ced_csa2/kv/storage_table.py", "3.44×"): "the seed's own stated figure, which the table explains",
    ("src/ced_csa2/stages/storage.py", "3.44×"): "the seed's own stated figure, which the table explains",
    ("src/ced_csa2/estimate.py", "~0.5%"): "attention's T x T FLOPs against the matmuls', from the shapes",
    ("src/ced_csa2/estimate.py", "~8%"): "attention's T x T FLOPs against the matmuls', from the shapes",
}


def conf_comments(path):
    """``(line, comment)`` for each YAML comment of ``path`` (a ``#`` opening a line or after a space)."""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        match = re.search(r"(?:^|\s)#(.*)$", line)
        if match:
            yield number, match.group(1)


def python_comments_and_docstrings(path):
    """``(line, text)`` for each comment and each docstring line of the Python file ``path`` (not its strings)."""
    source = path.read_text()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                for offset, line in enumerate(doc.splitlines()):
                    yield node.body[0].lineno + offset, line


def quoted_figures():
    """``(file, line, text quoted)`` for every measured-looking figure in conf comments (``conf/``, the studies' params,
    both ``dvc.yaml`` files) and library docstrings/comments."""
    confs = sorted((ROOT / "conf").rglob("*.yaml")) + sorted((ROOT / "studies").glob("*.yaml")) + [ROOT / "dvc.yaml"]
    sources = [(p, conf_comments) for p in confs]  # studies/*.yaml: the studies' params and studies/dvc.yaml
    sources += [(p, python_comments_and_docstrings) for p in sorted((ROOT / "src/ced_csa2").rglob("*.py"))]
    for path, texts in sources:
        for number, text in texts(path):
            for match in MEASURED.finditer(text):
                yield str(path.relative_to(ROOT)), number, match.group(0)


@pytest.mark.parametrize("text", ["costs +4.2% ΔPPL", "speed-up 1.77x -> 1.82x", "runs ~3.5x slower",
                                  "filters cost 10-20x", "KL in ~100 s", "~0.35 s per decode step", "1-6% (K)",
                                  "~50-150 tokens/s", "484 vs 800 tok/s", "a 1.65× slowdown", "~9 min"])
def test_the_tripwire_sees_a_measured_figure(text):
    assert MEASURED.search(text), text


@pytest.mark.parametrize("text", ["paired bootstrap 95% interval", "retrieves >= 80%", "256 MiB of logits",
                                  "forward + backward: 3x a forward", "8 x 512 tokens", "saturation costs ``0.4 s``",
                                  "a bound of 2.0", "E2M3, saturating at ±7.5", "rank 256", "tokens/s per phase"])
def test_the_tripwire_passes_what_is_no_measurement(text):
    assert not MEASURED.search(text), text


def test_no_conf_comment_or_library_docstring_quotes_a_measured_figure():
    found = [(path, line, text) for path, line, text in quoted_figures() if (path, text) not in DERIVED]
    assert not found, ("measured figures belong in docs/costs.md or docs/results.md (say why, point there): "
                       + "; ".join(f"{path}:{line}: {text!r}" for path, line, text in found))


def test_every_derived_figure_allowed_is_still_quoted():
    quoted = {(path, text) for path, _, text in quoted_figures()}
    assert not set(DERIVED) - quoted, f"stale DERIVED entries: {sorted(set(DERIVED) - quoted)}"


# A doc's copy of a committed file's tables: ``<!-- table: <path> -->``, the copy, ``<!-- /table -->``.
TABLE_BLOCK = re.compile(r"<!-- table: (\S+) -->\n(.*?)\n<!-- /table -->", re.S)
TABLE_SEPARATOR = re.compile(r"^\|[-:| ]+\|$")


def doc_files(root):
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def tables_of(text):
    """``text`` from its first table row on: a study's file opens with its protocol line, which the doc that
    copies the tables states in its own words."""
    lines = text.rstrip("\n").splitlines()
    first = next((i for i, line in enumerate(lines) if line.startswith("|")), len(lines))
    return "\n".join(lines[first:])


def table_block_problems(root):
    """Why each marked table of ``root``'s README and docs is not its file's tables (git's index, as the headline)."""
    problems = []
    for doc in doc_files(root):
        for rel, block in TABLE_BLOCK.findall(doc.read_text()):
            if not (root / rel).is_file():
                problems.append(f"{doc.relative_to(root)} copies {rel}, which does not exist")
                continue
            expected, where = staged_text(root, rel)
            if block != tables_of(expected):
                problems.append(f"{doc.relative_to(root)}'s copy of {rel} is stale against {where}; it should read:\n"
                                f"{tables_of(expected)}")
    return problems


def test_every_marked_table_is_its_files():
    problems = table_block_problems(ROOT)
    assert not problems, "\n\n".join(problems)


def test_a_drifted_copy_is_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "studies").mkdir()
    (tmp_path / "studies/t.md").write_text("Protocol line.\n\n| group | x |\n|---|---|\n| a | +1.00 |\n")
    copy = "<!-- table: studies/t.md -->\n| group | x |\n|---|---|\n| a | +1.00 |\n<!-- /table -->\n"
    (tmp_path / "README.md").write_text(copy)
    assert table_block_problems(tmp_path) == []
    (tmp_path / "README.md").write_text(copy.replace("+1.00", "+1.01"))
    assert "README.md's copy of studies/t.md is stale" in table_block_problems(tmp_path)[0]


def test_every_copied_study_row_is_inside_a_marked_table():
    """A doc that copies a committed study's table row by row, unmarked, would drift unseen."""
    studies = subprocess.run(["git", "ls-files", "studies"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    rows = {}
    for rel in (s for s in studies if s.endswith(".md")):
        lines = (ROOT / rel).read_text().splitlines()
        for previous, line in itertools.pairwise(lines):
            if line.startswith("|") and previous.startswith("|") and not TABLE_SEPARATOR.match(line):
                rows.setdefault(line, rel)
    unmarked = []
    for doc in doc_files(ROOT):
        outside = TABLE_BLOCK.sub("", doc.read_text())
        unmarked += [f"{doc.relative_to(ROOT)}: {rows[line]}: {line[:80]}" for line in outside.splitlines()
                     if line in rows]
    assert not unmarked, "mark the copy <!-- table: <file> --> ... <!-- /table -->: " + "; ".join(unmarked)
