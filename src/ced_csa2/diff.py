"""Every group's change between two revisions, with intervals, on one screen.

    python -m ced_csa2.diff                 # HEAD -> the workspace
    python -m ced_csa2.diff main            # main -> the workspace
    python -m ced_csa2.diff HEAD~1 HEAD     # two commits (or experiments: dvc exp branch first)

Reads ``metrics/groups.tsv`` (written by the ``report`` stage, in git) at each revision and
prints a Markdown table: per group, ΔPPL %, KL and Δ gold NLL as ``old → new [95% CI of new]``,
a ``*`` on each row whose numbers changed.  ``dvc metrics diff`` compares the headline
(``metrics/summary.json``) without intervals; this adds them.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from .pipeline.paths import GROUPS_TABLE

COLUMNS = (("dppl_pct", "ΔPPL %", "+.2f"), ("kl", "KL", ".4f"), ("dgold_nll", "Δ gold NLL", "+.3f"))


def parse_table(text: str, source: str) -> dict[str, dict[str, str]]:
    """``{group: {column: cell}}`` of a ``groups.tsv`` text; ``source`` names it in errors."""
    lines = [line.split("\t") for line in text.splitlines() if line]
    if not lines or lines[0][0] != "group":
        raise ValueError(f"{source}: not a groups table (no 'group' header)")
    header = lines[0]
    return {row[0]: dict(zip(header[1:], row[1:])) for row in lines[1:]}


def read_table(rev: str | None, root: Path = Path(".")) -> dict[str, dict[str, str]]:
    """``groups.tsv`` at git revision ``rev`` (``None``: the workspace file)."""
    if rev is None:
        path = root / GROUPS_TABLE
        if not path.is_file():
            raise ValueError(f"{GROUPS_TABLE} not found in the workspace: run `dvc repro report`")
        return parse_table(path.read_text(), str(GROUPS_TABLE))
    done = subprocess.run(["git", "show", f"{rev}:{GROUPS_TABLE.as_posix()}"], cwd=root,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["git show failed"])[-1]
        raise ValueError(f"{GROUPS_TABLE} at revision {rev!r}: {reason}")
    return parse_table(done.stdout, f"{rev}:{GROUPS_TABLE}")


def _cell(old: dict | None, new: dict | None, key: str, fmt: str) -> str:
    def value(row):
        return float(row[key]) if row and row.get(key, "") != "" else None

    a, b = value(old), value(new)
    show = (lambda x: "–" if x is None else format(x, fmt))
    text = show(b) if a == b else f"{show(a)} → {show(b)}"
    if b is not None and new.get(f"{key}_lo", "") != "":
        text += f" [{float(new[f'{key}_lo']):{fmt}}, {float(new[f'{key}_hi']):{fmt}}]"
    return text


def diff_lines(old: dict[str, dict[str, str]], new: dict[str, dict[str, str]]) -> list[str]:
    """The Markdown table of every group in ``new`` (then those only in ``old``)."""
    lines = ["| group | " + " | ".join(name for _, name, _ in COLUMNS) + " |",
             "|---|" + "---|" * len(COLUMNS)]
    for group in [*new, *(g for g in old if g not in new)]:
        a, b = old.get(group), new.get(group)
        changed = a is None or b is None or any(a.get(k) != b.get(k) for k in {*a, *b})
        cells = [_cell(a, b, key, fmt) for key, _, fmt in COLUMNS]
        lines.append(f"| {group}{' *' if changed else ''} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ced_csa2.diff", description=__doc__.split("\n\n")[0])
    parser.add_argument("old", nargs="?", default="HEAD", help="git revision of the old table (default HEAD)")
    parser.add_argument("new", nargs="?", default=None, help="git revision of the new table (default: the workspace)")
    args = parser.parse_args(argv)
    try:
        old, new = read_table(args.old), read_table(args.new)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"{GROUPS_TABLE}: {args.old} → {args.new or 'workspace'} (* = changed; [95% CI] of the new value)")
    print("\n".join(diff_lines(old, new)))


if __name__ == "__main__":
    main()
