"""Every group's change between two revisions, with intervals, on one screen.

    python -m ced_csa2.diff --save-baseline   # record this workspace's figures as your baseline (`make baseline`)
    python -m ced_csa2.diff                   # your baseline (else HEAD) -> the workspace
    python -m ced_csa2.diff HEAD              # the committed figures (the lock's machine) -> the workspace
    python -m ced_csa2.diff lam10             # a `dvc exp` experiment -> the workspace
    python -m ced_csa2.diff HEAD~1 lam10      # any two revisions or experiment names
    python -m ced_csa2.diff --exps            # every experiment of HEAD side by side: one column each
    python -m ced_csa2.diff --which           # which baseline the next diff compares against

A revision is anything git resolves (a commit, branch or tag) or the name of a ``dvc exp``
experiment (``refs/exps/...``; one based on HEAD first).  Reads ``metrics/groups.tsv`` (written
by the ``report`` stage, in git) at each and prints a Markdown table: per group, ΔPPL %, KL and
Δ gold NLL as ``old → new [95% CI of new]``, a ``*`` on each row whose numbers changed.

**Your baseline.**  The committed figures were made on the lock's CPU; on another CPU every row
differs before any edit.  ``--save-baseline [NAME]`` records the workspace's ``params.yaml``,
``dvc.lock`` and ``metrics/`` (as git would commit them) in a commit on top of HEAD under the
tag NAME (default ``baseline``), without touching the index, the workspace or
``studies/dvc.lock`` (``dvc exp save`` rewrites the latter).  Both diffs then compare against
it: ``python -m ced_csa2.diff`` by default, ``dvc metrics diff baseline`` by name.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from .pipeline.cli import ArgumentParser
from .pipeline.paths import GROUPS_TABLE

COLUMNS = (("dppl_pct", "ΔPPL %", "+.2f"), ("kl", "KL", ".4f"), ("dgold_nll", "Δ gold NLL", "+.3f"))
NUMERIC_COLUMNS = {key + end for key, _, _ in COLUMNS for end in ("", "_lo", "_hi")}  # what the diff reads as numbers
BASELINE = "baseline"  # the tag --save-baseline writes and the default diff reads
# What a baseline records: the run's inputs (params.yaml), its outputs' hashes (dvc.lock: the DVC-cached
# metrics of the run stay readable by `dvc metrics diff`) and the metrics git tracks.
SNAPSHOT_PATHS = ("params.yaml", "dvc.lock", "metrics")
SNAPSHOT_SUBJECT = "ced_csa2 baseline"  # first words of a baseline commit's message: how we know one of ours
# A baseline is a snapshot, not the user's own work: a fixed identity keeps it from needing (or
# borrowing) a configured git user.
SNAPSHOT_IDENTITY = {"GIT_AUTHOR_NAME": "ced_csa2", "GIT_AUTHOR_EMAIL": "ced_csa2@localhost",
                     "GIT_COMMITTER_NAME": "ced_csa2", "GIT_COMMITTER_EMAIL": "ced_csa2@localhost"}
SCREEN = 100  # columns of --exps' table
EXPS_METRICS = {key: (name, fmt) for key, name, fmt in COLUMNS}


def git(root: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """``git args`` in ``root``, not checked (callers name what failed)."""
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False,
                          env=None if env is None else {**os.environ, **env})


def experiments(root: Path) -> dict[str, list[tuple[str, str]]]:
    """``{name: [(baseline sha, commit sha), ...]}`` of the ``dvc exp`` experiments in ``root``'s git.

    DVC keeps an experiment as ``refs/exps/<sha[:2]>/<sha[2:]>/<name>``, ``sha`` the commit it was
    run on."""
    done = git(root, "for-each-ref", "--format=%(refname) %(objectname)", "refs/exps")
    found: dict[str, list[tuple[str, str]]] = {}
    for line in done.stdout.splitlines():
        ref, sha = line.split()
        parts = ref.split("/")
        if len(parts) == 5 and len(parts[2]) == 2:  # refs/exps/ab/cdef.../name (not exec/, celery/...)
            found.setdefault(parts[4], []).append((parts[2] + parts[3], sha))
    return found


def resolve(rev: str, root: Path = Path(".")) -> str:
    """The commit of ``rev``: a git revision, else a ``dvc exp`` name (the one run on HEAD first).

    Raises
    ------
    ValueError
        Naming ``rev`` when neither resolves, or when it names experiments on several commits but HEAD.
    """
    done = git(root, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    if done.returncode == 0:
        return done.stdout.strip()
    runs = experiments(root).get(rev, [])
    head = git(root, "rev-parse", "--verify", "--quiet", "HEAD").stdout.strip()
    on_head = [sha for base, sha in runs if base == head]
    if on_head or len(runs) == 1:
        return (on_head or [runs[0][1]])[0]
    if runs:
        raise ValueError(f"{rev!r} names {len(runs)} experiments, none run on HEAD: give one's commit "
                         f"({', '.join(sha[:7] for _, sha in runs)})")
    raise ValueError(f"{rev!r} is neither a git revision nor a `dvc exp` experiment (`dvc exp list` names them)")


def parse_table(text: str, source: str) -> dict[str, dict[str, str]]:
    """``{group: {column: cell}}`` of a ``groups.tsv`` text; ``source`` names it in errors."""
    lines = [line.split("\t") for line in text.splitlines() if line]
    if not lines or lines[0][0] != "group":
        raise ValueError(f"{source}: not a groups table (no 'group' header)")
    header = lines[0]
    table = {row[0]: dict(zip(header[1:], row[1:])) for row in lines[1:]}
    for group, row in table.items():  # every cell the diff reads is a number or empty ("–"): refuse others, named
        for column in NUMERIC_COLUMNS & row.keys():
            cell = row[column]
            try:
                float(cell or 0)
            except ValueError:
                raise ValueError(f"{source}: group {group!r}, column {column!r}: {cell!r} is not a number "
                                 "(rebuild it with `dvc repro report`)") from None
    return table


def read_table(rev: str | None, root: Path = Path(".")) -> dict[str, dict[str, str]]:
    """``groups.tsv`` at revision or experiment ``rev`` (``None``: the workspace file)."""
    if rev is None:
        path = root / GROUPS_TABLE
        if not path.is_file():
            raise ValueError(f"{GROUPS_TABLE} not found in the workspace: run `dvc repro report`")
        return parse_table(path.read_text(), str(GROUPS_TABLE))
    done = git(root, "show", f"{resolve(rev, root)}:{GROUPS_TABLE.as_posix()}")
    if done.returncode != 0:
        reason = (done.stderr.strip().splitlines() or ["git show failed"])[-1]
        raise ValueError(f"{GROUPS_TABLE} at revision {rev!r}: {reason}")
    return parse_table(done.stdout, f"{rev}:{GROUPS_TABLE}")


def _value(row: dict | None, key: str) -> float | None:
    return float(row[key]) if row and row.get(key, "") != "" else None


def _show(x: float | None, fmt: str) -> str:
    return "–" if x is None else format(x, fmt)


def _cell(old: dict | None, new: dict | None, key: str, fmt: str) -> str:
    a, b = _value(old, key), _value(new, key)
    text = _show(b, fmt) if a == b else f"{_show(a, fmt)} → {_show(b, fmt)}"
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


# ----------------------------------------------------------------------------- your baseline

def baseline_commit(name: str, root: Path = Path(".")) -> str | None:
    """The commit of baseline tag ``name``, ``None`` when there is none.

    Raises
    ------
    ValueError
        When tag ``name`` exists but is not a baseline (someone's own tag: never moved or read as one).
    """
    done = git(root, "rev-parse", "--verify", "--quiet", f"refs/tags/{name}^{{commit}}")
    if done.returncode != 0:
        return None
    sha = done.stdout.strip()
    if not git(root, "log", "-1", "--format=%s", sha).stdout.startswith(SNAPSHOT_SUBJECT):
        raise ValueError(f"tag {name!r} is not a baseline saved by --save-baseline: choose another name")
    return sha


def save_baseline(name: str = BASELINE, root: Path = Path(".")) -> str:
    """Record the workspace's :data:`SNAPSHOT_PATHS` in a commit on top of HEAD, tagged ``name``; its sha.

    Built in a temporary index (``git add`` there follows ``.gitignore``, so DVC-cached files stay
    out): the real index, the workspace and every other ref, ``studies/dvc.lock`` included, are left
    as they are.  An earlier baseline of that name is replaced.
    """
    root = Path(root)
    baseline_commit(name, root)  # refuses a tag that is not ours
    if not (root / GROUPS_TABLE).is_file():
        raise ValueError(f"{GROUPS_TABLE} not found in the workspace: run `dvc repro` first, then save it")
    head = git(root, "rev-parse", "--verify", "--quiet", "HEAD^{commit}").stdout.strip()
    if not head:
        raise ValueError("no commit to save a baseline on: commit first")
    with tempfile.TemporaryDirectory() as tmp:
        index = {"GIT_INDEX_FILE": str(Path(tmp) / "index")}
        steps = [("read-tree", "HEAD"), ("add", "-A", "--", *(p for p in SNAPSHOT_PATHS if (root / p).exists()))]
        for step in steps:
            done = git(root, *step, env=index)
            if done.returncode != 0:
                raise ValueError(f"git {step[0]}: {(done.stderr.strip().splitlines() or ['failed'])[-1]}")
        tree = git(root, "write-tree", env=index).stdout.strip()
    message = (f"{SNAPSHOT_SUBJECT} {name!r}: the workspace's {', '.join(SNAPSHOT_PATHS)} on top of {head[:7]}\n\n"
               "Saved by `python -m ced_csa2.diff --save-baseline`.")
    commit = git(root, "commit-tree", tree, "-p", head, "-m", message, env=SNAPSHOT_IDENTITY).stdout.strip()
    done = git(root, "tag", "-f", name, commit)
    if not commit or done.returncode != 0:
        raise ValueError(f"git could not record the baseline: {done.stderr.strip() or 'commit-tree failed'}")
    return commit


def default_old(root: Path = Path(".")) -> str:
    """What a bare ``python -m ced_csa2.diff`` compares against: the baseline tag, else HEAD."""
    return BASELINE if baseline_commit(BASELINE, root) else "HEAD"


def which_line(root: Path = Path(".")) -> str:
    """One line: which baseline the next diff compares against, and how to set your own."""
    sha = baseline_commit(BASELINE, root)
    if sha is None:
        return ("next diff: against HEAD, the committed figures of the lock's CPU (on another CPU every row "
                "differs); make your run the baseline: `make baseline`")
    parent = git(root, "rev-parse", f"{sha}^").stdout.strip()
    head = git(root, "rev-parse", "HEAD").stdout.strip()
    when = git(root, "log", "-1", "--format=%cd", "--date=format:%Y-%m-%d %H:%M", sha).stdout.strip()
    stale = "" if parent == head else f", saved on {parent[:7]}, HEAD is {head[:7]}"
    return (f"next diff: against your baseline {BASELINE!r} ({when}{stale}): `python -m ced_csa2.diff`, "
            f"`dvc metrics diff {BASELINE}`; the committed figures: `python -m ced_csa2.diff HEAD`")


# ----------------------------------------------------------------------------- experiments side by side

def exps_lines(root: Path, names: list[str], key: str = "dppl_pct") -> list[str]:
    """One column of ``key`` per experiment (``names``, or every one run on HEAD), its reference first
    (the baseline, else HEAD), a row per group in ``groups.tsv``: at most :data:`SCREEN` columns, then one
    line per experiment naming the params it changed against the reference."""
    from .compose import changed_keys

    import yaml

    reference = default_old(root)
    if not names:
        head = git(root, "rev-parse", "HEAD").stdout.strip()
        names = sorted(n for n, runs in experiments(root).items() if any(base == head for base, _ in runs))
    tables = {name: read_table(name, root) for name in [reference, *names]}
    label, fmt = EXPS_METRICS[key]
    groups = list(dict.fromkeys(g for table in tables.values() for g in table))
    first = max(len("group"), *map(len, groups))
    width = max(8, *(min(len(n), 10) for n in tables))
    fit = max(1, (SCREEN - first - 1) // (width + 1))
    shown = list(tables)[:fit]
    lines = [f"{label} per group; columns: {reference} (reference), then each experiment"
             + (f"; {len(tables) - fit} more left out: name them" if len(tables) > fit else ""),
             f"{'group':<{first}} " + " ".join(f"{n[:width]:>{width}}" for n in shown)]
    for group in groups:
        lines.append(f"{group:<{first}} " + " ".join(f"{_show(_value(tables[n].get(group), key), fmt):>{width}}"
                                                    for n in shown))

    def params(rev):
        return yaml.safe_load(git(root, "show", f"{resolve(rev, root)}:params.yaml").stdout) or {}

    ref = params(reference)
    for name in shown[1:]:
        new = params(name)
        edits = ", ".join(f"{k}={_dig(new, k)}" for k in changed_keys(ref, new)) or "no params changed"
        line = f"{name}: {edits}"
        lines.append(line if len(line) <= SCREEN else line[:SCREEN - 1] + "…")
    return lines


def _dig(tree: dict, dotted: str):
    for part in dotted.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m ced_csa2.diff", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old", nargs="?", default=None,
                        help="revision or experiment name of the old table (default: your baseline, else HEAD)")
    parser.add_argument("new", nargs="?", default=None,
                        help="revision or experiment name of the new table (default: the workspace)")
    parser.add_argument("--save-baseline", nargs="?", const=BASELINE, metavar="NAME",
                        help=f"record the workspace's figures as a baseline tag (default {BASELINE!r}) and exit")
    parser.add_argument("--which", action="store_true", help="say which baseline the next diff compares against")
    parser.add_argument("--exps", nargs="*", metavar="NAME",
                        help="experiments side by side, one column each (default: every one run on HEAD)")
    parser.add_argument("--metric", choices=list(EXPS_METRICS), default="dppl_pct", help="the column --exps shows")
    args = parser.parse_args(argv)
    root = Path(".")
    try:
        if args.save_baseline:
            commit = save_baseline(args.save_baseline, root)
            print(f"baseline {args.save_baseline!r} = this workspace's figures ({commit[:7]}); "
                  f"compare: `python -m ced_csa2.diff`, `dvc metrics diff {args.save_baseline}`")
            return
        if args.which:
            print(which_line(root))
            return
        if args.exps is not None:  # names before or after the flag alike
            names = [*(n for n in (args.old, args.new) if n), *args.exps]
            print("\n".join(exps_lines(root, names, args.metric)))
            return
        old_rev = args.old or default_old(root)
        old, new = read_table(old_rev, root), read_table(args.new, root)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"{GROUPS_TABLE}: {old_rev} → {args.new or 'workspace'} (* = changed; [95% CI] of the new value)")
    print("\n".join(diff_lines(old, new)))


if __name__ == "__main__":
    main()
