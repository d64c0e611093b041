"""``dvc plots show`` / ``diff`` of ``metrics/groups.tsv``: ΔPPL % per group with its interval, symlog x, one panel."""

import json
import re

import yaml
from conftest import ROOT
from test_diff import DVC, git, init_repo, run

from ced_csa2.pipeline.atomic_files import write_tsv
from ced_csa2.pipeline.paths import GROUPS_TABLE

TEMPLATE = ROOT / ".dvc" / "plots" / "groups.json"
TABLE = GROUPS_TABLE.as_posix()  # as dvc.yaml and `dvc plots --json` name it
ROWS = [{"group": "baseline", "dppl_pct": "", "dppl_pct_lo": "", "dppl_pct_hi": ""},
        {"group": "small", "dppl_pct": 1.0, "dppl_pct_lo": 0.5, "dppl_pct_hi": 1.5},
        {"group": "large", "dppl_pct": 258.0, "dppl_pct_lo": 148.0, "dppl_pct_hi": 440.0},
        {"group": "better", "dppl_pct": -0.5, "dppl_pct_lo": -1.0, "dppl_pct_hi": 0.0}]


def groups_plot_definition() -> dict:
    """The report stage's ``metrics/groups.tsv`` plot entry in the project's dvc.yaml."""
    plots = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["report"]["plots"]
    (entry,) = [p[TABLE] for p in plots if isinstance(p, dict) and TABLE in p]
    return entry


def test_the_template_is_json_with_dvc_s_anchors_and_dvc_yaml_uses_it():
    text = TEMPLATE.read_text()
    json.loads(text)
    assert set(re.findall(r"<DVC_METRIC_\w+>", text)) == {
        "<DVC_METRIC_DATA>", "<DVC_METRIC_TITLE>", "<DVC_METRIC_X>", "<DVC_METRIC_Y>", "<DVC_METRIC_X_LABEL>",
        "<DVC_METRIC_COLOR>"}
    assert groups_plot_definition()["template"] == TEMPLATE.stem


def shown_spec(repo, *command) -> dict:
    """The filled Vega-Lite spec of ``groups.tsv`` that ``dvc plots <command> --json`` renders."""
    shown = json.loads(run(repo, str(DVC), "plots", *command, "--json"))
    assert not shown.get("errors"), shown["errors"]
    (plot,) = shown["data"][TABLE]
    return plot["content"]


def test_dvc_plots_show_and_diff_draw_each_group_s_interval_on_a_symlog_axis_one_panel_wide(tmp_path):
    init_repo(tmp_path)
    run(tmp_path, str(DVC), "init", "-q")
    (tmp_path / ".dvc" / "plots").mkdir()
    (tmp_path / ".dvc" / "plots" / TEMPLATE.name).write_text(TEMPLATE.read_text())
    stage = {"cmd": "true", "plots": [{TABLE: groups_plot_definition()}]}
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"report": stage}}, allow_unicode=True))
    write_tsv(tmp_path / GROUPS_TABLE, ROWS)
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-qm", "groups")

    spec = shown_spec(tmp_path, "show")
    assert {row["group"] for row in spec["data"]["values"]} == {r["group"] for r in ROWS}
    numbers = {t["as"]: t["calculate"] for t in spec["transform"] if "calculate" in t}
    assert numbers == {"value": "toNumber(datum['dppl_pct'])", "lo": "toNumber(datum['dppl_pct_lo'])",
                       "hi": "toNumber(datum['dppl_pct_hi'])"}
    bars, points = (layer["encoding"] for layer in spec["layer"])
    assert (bars["x"]["field"], bars["x2"]["field"], points["x"]["field"]) == ("lo", "hi", "value")
    assert points["x"]["scale"]["type"] == "symlog" and points["x"]["title"].startswith("ΔPPL %")
    assert spec["encoding"]["y"]["sort"]["field"] == "value" and spec["width"] <= 600

    write_tsv(tmp_path / GROUPS_TABLE, [*ROWS[:2], {**ROWS[2], "dppl_pct": 30.0}, ROWS[3]])
    spec = shown_spec(tmp_path, "diff", "HEAD")
    assert "column" not in spec["encoding"] and "facet" not in spec  # revisions share the one panel...
    assert spec["encoding"]["color"]["field"] == "rev" and spec["encoding"]["yOffset"]["field"] == "rev"
    assert spec["encoding"]["color"]["scale"]["domain"] == ["workspace", "HEAD"]  # ...told apart by colour
    assert {row["rev"] for row in spec["data"]["values"]} == {"workspace", "HEAD"}
