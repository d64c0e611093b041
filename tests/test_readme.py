"""README: short, its test command is CI's, its headline is metrics/summary.json (it cannot go stale)."""

import json
import re

from conftest import ROOT

from ced_csa2.eval.results import headline_table

README = (ROOT / "README.md").read_text()


def test_readme_is_short_and_links_only_to_files_that_exist():
    assert len(README.splitlines()) <= 250
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


def test_the_headline_is_metrics_summary_json():
    block = re.search(r"<!-- headline: metrics/summary.json -->\n(.*?)\n<!-- /headline -->", README, re.S)
    assert block, "README has no headline block"
    expected = "\n".join(headline_table(json.loads((ROOT / "metrics/summary.json").read_text())))
    assert block.group(1) == expected, f"README's headline is stale; it should read:\n{expected}"


def test_ci_runs_the_readme_test_command():
    assert "make test" in README and (ROOT / ".ci" / "run").read_text().strip().endswith("make test")
