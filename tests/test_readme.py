"""README: short, its test command is CI's, its headline is the committed metrics/summary.json (it cannot go stale;
a user's own `make repro` rewrites the workspace file and must not turn this red: tests/test_pipeline_e2e.py)."""

import re

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
