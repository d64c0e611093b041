"""docs/failures.md against the code: every message it quotes is one the code can write, and it names every
file of the fault catalogue (tests/faults/).

A quoted message (`` `error: ...` ``, a Ctrl-C line) is an example: its paths, keys and values are a user's,
and ``...`` elides.  It must be made of the code's own message strings: every letter and digit of it lies in
a match of some string literal or f-string of ``src/`` (its ``{...}`` fields matching any value, a cut at
the quote's ``...`` allowed), so a reworded message in the code, or a message the guide made up, fails here.
"""

import ast
import re

import pytest
from conftest import ROOT

FAILURES = ROOT / "docs" / "failures.md"
# A quoted message: `error: ...` or `<stage>: interrupted; ...`, holding `dvc ...` spans of its own (the remedy).
QUOTED = re.compile(r"`((?:error: |\w+: interrupted; )(?:[^`]|`dvc[^`]*`)*)`")
ELLIPSIS = "..."
FIELD = re.compile(r"(\{[^{}]*\}|%[sdr])")
MIN_LETTERS = 4  # a string with fewer letters or digits of its own ("{path}: {exc}") vouches for nothing


def quoted_messages() -> list[str]:
    text = " ".join(FAILURES.read_text().split())  # a quote may wrap across lines
    return [m for m in QUOTED.findall(text) if m != "error: <message>"]


def message_strings() -> list[list[str | None]]:
    """Every string literal and f-string of ``src/`` (docstrings excluded) as its pieces: text, or None for a field."""
    out = []
    for path in sorted((ROOT / "src").rglob("*.py")):
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if id(node) in docstrings:
                continue
            if isinstance(node, ast.JoinedStr):
                pieces = [v.value if isinstance(v, ast.Constant) else None for v in node.values]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                pieces = [node.value]
            else:
                continue
            # "{n}" in a plain string is a str.format field, "%s" a logging one
            pieces = [q for p in pieces for q in ([None] if p is None else FIELD.split(p))]
            pieces = [None if q is None or FIELD.fullmatch(q) else q for q in pieces if q != ""]
            if sum(c.isalnum() for p in pieces if p for c in p) >= MIN_LETTERS:
                out.append(pieces)
    return out


def pattern(pieces: list[str | None]) -> re.Pattern:
    """The message a string writes, or its beginning up to the quote's ``...``; a field is any value (at an end,
    one without spaces: a path, a name, a number)."""
    def field(i: int) -> str:
        return r"\S+" if i in (0, len(pieces) - 1) else r".+?"

    cuts, prefix = [], ""
    for i, p in enumerate(pieces):
        if p is None:
            prefix += field(i)
            continue
        words = re.split(r"(?<=\s)", p)  # cut after a space, or not at all
        for k in range(1, len(words)):
            cuts.append(prefix + re.escape("".join(words[:k])))
        prefix += re.escape(p)
    # whole words only: "generate" vouches for no part of "regenerate"
    lead = r"(?<!\w)" if pieces[0] and pieces[0][0].isalnum() else ""
    trail = r"(?!\w)" if pieces[-1] and pieces[-1][-1].isalnum() else ""
    return re.compile(lead + "(?:" + "|".join([f"(?:{prefix}){trail}",
                                               *(rf"(?:{c})\s*{re.escape(ELLIPSIS)}" for c in cuts)]) + ")")


@pytest.fixture(scope="module")
def patterns() -> list[tuple[str, list[str | None]]]:
    """Each message string with the text a match must hold: its first piece's first word (a cheap filter)."""
    return [(next(p for p in pieces if p and p.strip()).split()[0], pieces) for pieces in message_strings()]


def uncovered(message: str, patterns) -> str:
    """``message`` with every character no message string accounts for kept, the others blanked."""
    covered = [False] * len(message)
    for first, pieces in patterns:
        if first not in message:
            continue
        for m in pattern(pieces).finditer(message):
            covered[m.start():m.end()] = [True] * (m.end() - m.start())
    return "".join(c if not ok and c.isalnum() else " " for c, ok in zip(message, covered))


def test_failures_md_quotes_messages():
    assert len(quoted_messages()) >= 15, quoted_messages()


@pytest.mark.parametrize("message", quoted_messages())
def test_every_quoted_message_is_one_the_code_writes(message, patterns):
    left = uncovered(message, patterns)
    assert not left.strip(), f"docs/failures.md quotes words no message of src/ has:\n{message}\n{left}"


def test_the_check_refuses_a_reworded_message(patterns):
    good = ("error: models/ridge.pt: was made with ridge.lambda = 1.0, params.yaml has 10.0: rebuild it with `dvc repro` "
            "(or restore the params it was made with)")
    assert not uncovered(good, patterns).strip()
    assert "regenerate" in uncovered(good.replace("rebuild it", "regenerate it"), patterns).split()
    assert "from" in uncovered(good.replace("was made with", "was made from"), patterns).split()


def test_failures_md_names_every_file_of_the_fault_catalogue_and_no_other():
    named = set(re.findall(r"\b(test_faults\w*\.py)\b", FAILURES.read_text()))
    assert named == {p.name for p in (ROOT / "tests" / "faults").glob("test_*.py")}, "name catalogue files test_faults_*.py"
