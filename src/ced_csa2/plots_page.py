"""The offline ``dvc plots show`` page: DVC's HTML template with Vega, Vega-Lite and Vega-Embed inlined.

    python -m ced_csa2.plots_page      # rewrite .dvc/plots/offline.html (after changing the pin below)
    python -m ced_csa2.plots_page --out <file or folder>   # elsewhere (a folder: offline.html in it)

DVC's own page loads the three libraries from a CDN, so without network it is blank.  This
template carries them, from the bundle of the pinned ``vl-convert-python`` wheel (a test
checks the committed file against it), lays the panels out in rows with the report's figures
first, and ``.dvc/config`` names it (``plots.html_template``), so ``dvc plots show`` and
``dvc plots diff`` work offline as they are.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .pipeline.atomic_files import atomic_write_text
from .pipeline.cli import ArgumentParser

PIN = "1.9.0"  # vl_convert.__version__ of vl-convert-python==1.9.0.post1 (pyproject's test extra)
VEGA_LITE = "5.20"  # DVC's templates are Vega-Lite v5 specs
TEMPLATE = Path(".dvc") / "plots" / "offline.html"
# The bundle defines the three libraries as globals, before DVC's per-plot scripts call vegaEmbed.
EXPORTS = "window.vegaEmbed = vegaEmbed; window.vega = vega; window.vegaLite = vegaLite;"


def page(bundle: str) -> str:
    """The template text around the libraries' ``bundle`` (DVC fills ``{plot_divs}``; no ``{scripts}``: no CDN)."""
    return f"""<!DOCTYPE html>
<html>
<head>
    <meta charset="utf-8">
    <title>ced-csa2: dvc plots</title>
    <style>
        body {{ display: flex; flex-wrap: wrap; gap: 8px; font-family: sans-serif; }}
        body > div:has(img) {{ order: -1; flex-basis: 100%; }}  /* the report's figures first, full width */
    </style>
    <script>
{bundle}
    </script>
</head>
<body>
    {{plot_divs}}
</body>
</html>
"""


def bundle() -> str:
    """Vega, Vega-Lite and Vega-Embed as one script, from the pinned ``vl-convert-python``."""
    import vl_convert

    if vl_convert.__version__ != PIN:
        raise ValueError(f"vl-convert-python {vl_convert.__version__} is installed, the page is pinned to {PIN}: "
                         "pip install -e '.[test]'")
    return vl_convert.javascript_bundle(EXPORTS, vl_version=VEGA_LITE)


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(prog="python -m ced_csa2.plots_page", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=TEMPLATE,
                        help=f"where to write the template (default {TEMPLATE}; a folder: {TEMPLATE.name} in it)")
    args = parser.parse_args(argv)
    # A folder names where the template goes, as it does for ``cp``: ``--out .dvc/plots`` means the file DVC reads.
    out = args.out / TEMPLATE.name if args.out.is_dir() else args.out
    try:
        text = page(bundle())
    except (ImportError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    try:
        atomic_write_text(out, text)
    except OSError as e:  # the path or the machine (a file where a folder should be, permissions, a full disk)
        print(f"error: {out}: cannot write the template: {e}", file=sys.stderr)
        sys.exit(2)
    print(f"wrote {out} ({len(text):,} characters)")


if __name__ == "__main__":
    main()
