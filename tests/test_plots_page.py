"""The plots page works offline: DVC's template carries Vega's libraries from the pinned package, no CDN."""

import configparser

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
