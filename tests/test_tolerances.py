"""Every float tolerance in tests/ is derived from a dtype or carries its reason (conftest: "Float tolerances").

A bare literal tolerance (a power of ten after ``<``, ``atol``, ``rtol``, ``abs`` or ``rel``) is what a test ends up
with when it is tuned to the machine it first passed on.  Each one must have a comment on its
own line or on the line just above saying why the bound holds (the dtype, the roundings, the
magnitude, or the effect a "must differ" threshold stays below); otherwise it is written with
:func:`conftest.rounding_tol`.
"""

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent

# `< 1e-6`, `<= 1e-10`, `atol=1e-5`, `rtol=1e-4`, `abs=1e-12`, `rel=1e-6` (also `= 1e-5` spacing and `1.5e-3`)
BARE = re.compile(r"(<=?\s*|\b(?:atol|rtol|abs|rel)\s*=\s*)\d+(?:\.\d*)?e-\d+")

def undocumented(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of each bare literal tolerance without a comment on its line or the line above."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        code = line.split("#", 1)[0]
        if BARE.search(code) and "#" not in line and not (i and lines[i - 1].lstrip().startswith("#")):
            found.append((i + 1, line.strip()))
    return found


def test_the_scan_sees_bare_tolerances_and_accepts_reasons():
    # the scan's own examples (not tolerances)
    assert undocumented("assert x < 1e-6\nok(a, b, atol=1e-5, rtol=0)\nf(rel=2.5e-3)\n") == [
        (1, "assert x < 1e-6"), (2, "ok(a, b, atol=1e-5, rtol=0)"), (3, "f(rel=2.5e-3)")]  # examples
    assert undocumented("assert x < 1e-6  # float64: ...\n# float32: ...\nok(a, b, atol=1e-5)\n") == []
    assert undocumented("tol = rounding_tol(torch.float32, 4, M)\nok(a, b, atol=tol, rtol=0)\nx = 1e-3\n") == []


def test_every_float_tolerance_in_the_tests_carries_its_reason():
    bad = {}
    for path in sorted(TESTS.rglob("*.py")):
        rel = path.relative_to(TESTS).as_posix()
        if sites := undocumented(path.read_text()):
            bad[rel] = sites
    assert not bad, "bare float tolerances without a reason (comment on the line or above, or use " \
                    f"conftest.rounding_tol): {bad}"
