"""README: short, its test command is CI's, its headline is the committed metrics/summary.json (it cannot go stale;
a user's own `make repro` rewrites the workspace file and must not turn this red: tests/test_pipeline_e2e.py)."""

import re
import shlex
import subprocess
import sys

from conftest import ROOT, readme_headline_problem

README = (ROOT / "README.md").read_text()


def test_readme_is_short_and_links_only_to_files_that_exist():
    assert len(README.splitlines()) <= 250
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


def test_the_headline_is_the_committed_metrics_summary_json():
    problem = readme_headline_problem(ROOT)
    assert problem is None, problem


def test_ci_runs_the_readme_test_command():
    assert "make test" in README and (ROOT / ".ci" / "run").read_text().strip().endswith("make test")


def test_make_test_hands_files_to_its_workers_in_the_order_the_conftest_collects_them(tmp_path):
    """The Makefile's pytest options keep a conftest's file order (tests/conftest.py puts the longest first);
    pytest-xdist's default would hand out the files with the most tests first."""
    line = next(line for line in (ROOT / "Makefile").read_text().splitlines() if "-m pytest" in line)
    words = shlex.split(line)
    options = words[words.index("pytest") + 1:]
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(
        "ORDER = ('test_c_one.py', 'test_b_three.py', 'test_a_six.py')\n"
        "def pytest_collection_modifyitems(items):\n"
        "    items.sort(key=lambda item: ORDER.index(item.path.name))\n")
    for name, count in (("a_six", 6), ("b_three", 3), ("c_one", 1)):
        (tmp_path / f"test_{name}.py").write_text(
            "import os\n" + "".join(
                f"def test_{i}():\n    with open('ran.txt', 'a') as f:\n"
                f"        f.write(os.environ['PYTEST_XDIST_WORKER'] + ' {name}\\n')\n" for i in range(count)))
    done = subprocess.run([sys.executable, "-m", "pytest", *options, "-p", "no:cacheprovider"], cwd=tmp_path,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    first = {}
    for worker, name in (row.split() for row in (tmp_path / "ran.txt").read_text().splitlines()):
        first.setdefault(worker, name)
    assert sorted(first.values()) == ["b_three", "c_one"]  # the conftest's first two files, one a worker
