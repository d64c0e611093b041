"""The plots page works offline: DVC's template carries Vega's libraries from the pinned package, no CDN."""

import configparser

import pytest
from conftest import ROOT

from ced_csa2 import plots_page


def test_the_committed_template_is_the_pinned_bundle_and_dvc_uses_it():
    committed = (ROOT / plots_page.TEMPLATE).read_text()
    assert committed == plots_page.page(plots_page.bundle()), "stale: run `python -m ced_csa2.plots_page`"
    assert "<script src" not in committed and "{scripts}" not in committed and committed.count("{plot_divs}") == 1
    assert "window.vegaEmbed" in committed
    config = configparser.ConfigParser()
    config.read(ROOT / ".dvc" / "config")
    assert (ROOT / ".dvc" / config["plots"]["html_template"]).resolve() == (ROOT / plots_page.TEMPLATE).resolve()


def test_out_naming_a_folder_writes_the_template_into_it(tmp_path):
    plots_page.main(["--out", str(tmp_path)])
    assert [p.name for p in tmp_path.iterdir()] == [plots_page.TEMPLATE.name]
    assert (tmp_path / plots_page.TEMPLATE.name).read_text() == plots_page.page(plots_page.bundle())


def test_out_that_cannot_be_written_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "a_file").write_text("not a folder")
    out = tmp_path / "a_file" / "page.html"
    with pytest.raises(SystemExit) as end:
        plots_page.main(["--out", str(out)])
    assert end.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"error: {out}: cannot write the template: "), err
