"""``python -m ced_csa2.diff``: groups.tsv old → new from git revisions and the workspace."""

import subprocess
import sys

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


def git(cwd, *args):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def test_cli_compares_a_commit_with_the_workspace_and_names_a_bad_revision(tmp_path):
    git(tmp_path, "init", "-q")
    git(tmp_path, "config", "user.email", "ci@example.com")
    git(tmp_path, "config", "user.name", "ci")
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
    assert bad.returncode == 2 and bad.stderr.startswith("error: metrics/groups.tsv at revision 'nosuchrev'")
    assert len(bad.stderr.strip().splitlines()) == 1
