"""``python -m ced_csa2.diff``: groups.tsv old → new from git revisions, experiments, your baseline and the workspace."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ced_csa2.diff import diff_lines, parse_table
from ced_csa2.pipeline.atomic_files import write_tsv
from ced_csa2.pipeline.paths import GROUPS_TABLE

OLD = [{"group": "baseline", "ppl": 20.0, "dppl_pct": "", "dppl_pct_lo": "", "dppl_pct_hi": "", "kl": "", "kl_lo": "",
        "kl_hi": "", "dgold_nll": "", "dgold_nll_lo": "", "dgold_nll_hi": ""},
       {"group": "csa2", "ppl": 21.0, "dppl_pct": 5.0, "dppl_pct_lo": 4.0, "dppl_pct_hi": 6.0, "kl": 0.125,
        "kl_lo": 0.1, "kl_hi": 0.15, "dgold_nll": 0.25, "dgold_nll_lo": 0.2, "dgold_nll_hi": 0.3}]


def table(rows, tmp_path):
    write_tsv(tmp_path / "t.tsv", rows)
    return parse_table((tmp_path / "t.tsv").read_text(), "t.tsv")


def test_changed_rows_are_marked_and_show_old_to_new_with_the_new_interval(tmp_path):
    new_rows = [OLD[0], {**OLD[1], "dppl_pct": 7.5, "dppl_pct_lo": 6.0, "dppl_pct_hi": 9.0},
                {**OLD[1], "group": "ced"}]
    lines = diff_lines(table(OLD, tmp_path), table(new_rows, tmp_path))
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in lines[2:]}
    assert rows["baseline"] == ["–", "–", "–"]  # unchanged: no star
    assert rows["csa2 *"] == ["+5.00 → +7.50 [+6.00, +9.00]", "0.1250 [0.1000, 0.1500]", "+0.250 [+0.200, +0.300]"]
    assert rows["ced *"][0] == "– → +5.00 [+4.00, +6.00]"  # new in this revision


def test_a_cell_that_is_not_a_number_is_refused_naming_the_table_group_and_column(tmp_path):
    with pytest.raises(ValueError, match=r"^t.tsv: group 'csa2', column 'kl': 'n/a' is not a number"):
        table([OLD[0], {**OLD[1], "kl": "n/a"}], tmp_path)
    assert table([{**OLD[0], "worst_domain": "code"}], tmp_path)["baseline"]["worst_domain"] == "code"  # text column


def git(cwd, *args):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def init_repo(path):
    git(path, "init", "-q")
    git(path, "config", "user.email", "ci@example.com")
    git(path, "config", "user.name", "ci")


def test_cli_compares_a_commit_with_the_workspace_and_names_a_bad_revision(tmp_path):
    init_repo(tmp_path)
    write_tsv(tmp_path / GROUPS_TABLE, OLD)
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "old")
    write_tsv(tmp_path / GROUPS_TABLE, [OLD[0], {**OLD[1], "kl": 0.5}])
    done = subprocess.run([sys.executable, "-m", "ced_csa2.diff"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "| csa2 * | +5.00 [+4.00, +6.00] | 0.1250 → 0.5000 [0.1000, 0.1500] |" in done.stdout
    assert "HEAD → workspace" in done.stdout.splitlines()[0]
    bad = subprocess.run([sys.executable, "-m", "ced_csa2.diff", "nosuchrev"], cwd=tmp_path, capture_output=True,
                         text=True)
    assert bad.returncode == 2 and bad.stderr.startswith("error: 'nosuchrev' is neither a git revision nor a `dvc exp`")
    assert len(bad.stderr.strip().splitlines()) == 1


DVC = Path(sys.executable).parent / "dvc"
# The smallest DVC project whose metrics and experiments work as the pipeline's do: the headline in git.
DVC_YAML = "stages:\n  report:\n    cmd: 'true'\n    metrics:\n      - metrics/summary.json:\n          cache: false\n"


def run(cwd, *args):
    # Under `make test` the parent make's MAKEFLAGS/MAKELEVEL would make a nested `make -n` print its directory.
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    env["DVC_NO_ANALYTICS"] = "1"
    done = subprocess.run(args, cwd=cwd, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    return done.stdout


def diff(cwd, *args):
    return run(cwd, sys.executable, "-m", "ced_csa2.diff", *args)


def write_figures(repo, rows):
    """``groups.tsv`` and the headline of ``rows`` (the pipeline's ``report`` stage writes both)."""
    write_tsv(repo / GROUPS_TABLE, rows)
    summary = {r["group"]: {k: r[k] for k in ("dppl_pct", "kl") if r[k] != ""} for r in rows}
    (repo / "metrics" / "summary.json").write_text(json.dumps(summary))


def starred(out):
    return {line.split("|")[1].strip()[:-2] for line in out.splitlines() if line.split("|")[1:2]
            and line.split("|")[1].strip().endswith(" *")}


@pytest.fixture
def project(tmp_path):
    """A DVC project whose HEAD holds the lock's figures, and studies/dvc.lock beside dvc.lock."""
    init_repo(tmp_path)
    run(tmp_path, str(DVC), "init", "-q")
    (tmp_path / "dvc.yaml").write_text(DVC_YAML)
    (tmp_path / "params.yaml").write_text("ridge:\n  lambda: 1.0\n")
    (tmp_path / "studies").mkdir()
    (tmp_path / "studies" / "dvc.lock").write_text("schema: '2.0'\nstages: {}\n")
    write_figures(tmp_path, [OLD[0], OLD[1], {**OLD[1], "group": "ced"}])
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "the lock's figures")
    return tmp_path


def test_your_own_baseline_then_an_edit_shows_only_the_edited_rows(project):
    # `make repro` on another CPU: every figure moves a little
    mine = [OLD[0], {**OLD[1], "dppl_pct": 5.1, "kl": 0.126}, {**OLD[1], "group": "ced", "dppl_pct": 4.9}]
    write_figures(project, mine)
    assert "against HEAD" in diff(project, "--which") and "make baseline" in diff(project, "--which")
    assert starred(diff(project)) == {"csa2", "ced"}  # before any edit: the lock's CPU against yours
    status, lock = git(project, "status", "--porcelain"), (project / "studies" / "dvc.lock").read_bytes()
    refs = git(project, "for-each-ref", "--format=%(refname)").split()

    diff(project, "--save-baseline")
    # nothing but the tag: the workspace, the index, studies/dvc.lock and every other ref as they were
    assert git(project, "status", "--porcelain") == status and not git(project, "diff", "--cached")
    assert (project / "studies" / "dvc.lock").read_bytes() == lock
    assert git(project, "for-each-ref", "--format=%(refname)").split() == sorted([*refs, "refs/tags/baseline"])
    assert "against your baseline 'baseline'" in diff(project, "--which")
    assert starred(diff(project)) == set()

    write_figures(project, [mine[0], mine[1], {**mine[2], "kl": 0.25}])  # the edit touches one group
    out = diff(project)
    assert out.splitlines()[0].startswith("metrics/groups.tsv: baseline → workspace") and starred(out) == {"ced"}
    assert starred(diff(project, "HEAD")) == {"csa2", "ced"}  # the lock's figures, when asked
    moved = json.loads(run(project, str(DVC), "metrics", "diff", "baseline", "--json"))["metrics/summary.json"]
    assert set(moved) == {"ced.kl"} and moved["ced.kl"]["old"] == 0.125 and moved["ced.kl"]["new"] == 0.25

    diff(project, "--save-baseline")  # a later run replaces it
    assert starred(diff(project)) == set()
    git(project, "tag", "mine")  # someone's own tag is never moved
    bad = subprocess.run([sys.executable, "-m", "ced_csa2.diff", "--save-baseline", "mine"], cwd=project,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "tag 'mine' is not a baseline" in bad.stderr
    assert git(project, "rev-parse", "mine") == git(project, "rev-parse", "HEAD")


def test_experiment_names_resolve_like_revisions_and_sit_side_by_side(project):
    (project / "params.yaml").write_text("ridge:\n  lambda: 10.0\n")
    write_figures(project, [OLD[0], {**OLD[1], "dppl_pct": 9.0}, {**OLD[1], "group": "ced"}])
    run(project, str(DVC), "exp", "save", "-q", "-n", "lam10")
    assert git(project, "for-each-ref", "refs/exps").count("/lam10") == 1  # DVC's own ref, nothing faked
    write_figures(project, [OLD[0], OLD[1], {**OLD[1], "group": "ced"}])
    out = diff(project, "lam10")  # the experiment -> the workspace
    assert out.splitlines()[0].startswith("metrics/groups.tsv: lam10 → workspace") and starred(out) == {"csa2"}
    assert "| csa2 * | +9.00 → +5.00 [+4.00, +6.00] |" in out
    assert starred(diff(project, "HEAD", "lam10")) == {"csa2"}

    assert "`dvc exp` experiment" in " ".join(diff(project, "--help").split())  # --help says what it takes
    shown = diff(project, "--exps").splitlines()
    assert max(map(len, shown)) <= 100
    assert shown[1].split() == ["group", "HEAD", "lam10"]
    assert shown[3].split() == ["csa2", "+5.00", "+9.00"] and shown[-1] == "lam10: ridge.lambda=10.0"
    assert diff(project, "--exps", "--metric", "kl").splitlines()[3].split() == ["csa2", "0.1250", "0.1250"]
    bad = subprocess.run([sys.executable, "-m", "ced_csa2.diff", "--exps", "lam1"], cwd=project,
                         capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr == ("error: 'lam1' is neither a git revision nor a `dvc exp` "
                                                  "experiment (`dvc exp list` names them)\n")


def test_make_repro_ends_naming_the_baseline_and_make_baseline_sets_it(project):
    """The Makefile's own recipes (``make -n``: the pipeline and the venv are not what is tested), run here."""
    root = Path(__file__).resolve().parents[1]

    def recipe(target):
        lines = run(root, "make", "-n", "-o", ".venv/.installed", target).splitlines()
        assert lines[-1].startswith("python -m ced_csa2.diff ")
        return lines

    repro, baseline = recipe("repro"), recipe("baseline")
    assert repro[0] == "dvc repro" and len(baseline) == 1

    def after(lines):  # what the recipe's last command prints in the project
        return diff(project, *lines[-1].split()[3:])

    assert after(repro).startswith("next diff: against HEAD") and after(repro).count("\n") == 1
    after(baseline)
    assert after(repro).startswith("next diff: against your baseline 'baseline'")
