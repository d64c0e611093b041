"""Compose ``conf/`` into ``params.yaml`` -- what ``dvc exp run`` does, without DVC.

    python -m ced_csa2.compose                                  # embedded default
    python -m ced_csa2.compose model=tiny_qwen3_5 data=tiny plan=qwen3_5 --force
    python -m ced_csa2.compose budget=cpu_full --stdout         # print, write nothing
    python -m ced_csa2.compose budget=cpu_full --diff           # what it would change in params.yaml

It refuses to overwrite a ``params.yaml`` that holds values conf/'s defaults do not give (hand
edits, or an earlier composition's overrides) where the new composition changes them, unless
``--force``, naming the keys; an override Hydra cannot apply or a value out of
range is one line, ``error: ...``, exit status 1.

``dvc repro`` never composes (it reads the committed ``params.yaml`` as is);
``dvc exp run -S group=option`` recomposes it with the same Hydra API as here.  A test
checks that composing the defaults reproduces the committed file.
"""

from __future__ import annotations

from pathlib import Path

from .config import Params, from_dict
from .pipeline.atomic_files import atomic_write_text

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def compose(overrides: list[str] = (), conf_dir: Path = CONF_DIR) -> str:
    """The composed, resolved and validated ``params.yaml`` text, exactly as DVC writes it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(config_dir=str(Path(conf_dir).resolve()), version_base=None):
        cfg = hydra_compose(config_name="config", overrides=list(overrides))
    OmegaConf.resolve(cfg)
    from_dict(Params, OmegaConf.to_container(cfg))  # validate before writing anything
    return OmegaConf.to_yaml(cfg)  # what dvc.utils.hydra.compose_and_dump writes


def compose_or_exit(overrides: list[str]) -> str:
    """:func:`compose` for a command line: a bad override or value ends the program with one line, ``error: ...``."""
    try:
        return compose(overrides)
    except ValueError as exc:  # ParamsError: a value out of range, named by its key
        raise SystemExit(f"error: {exc}") from None
    except Exception as exc:  # Hydra's override errors: keep their first line, drop the traceback
        if type(exc).__module__.startswith(("hydra", "omegaconf")):
            lines = str(exc).splitlines()
            text = lines[0]
            if getattr(exc, "options", None):  # a bad group option: Hydra lists the good ones a line each
                heading = next((line for line in lines if line.startswith("Available options")), "Available options")
                text += f"; {heading.rstrip(':')}: {', '.join(exc.options)}"
            raise SystemExit(f"error: overrides {list(overrides)}: {text}") from None
        raise


def changed_keys(old: dict, new: dict, prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two nested params dicts (added and removed keys included)."""
    out = []
    for key in sorted(set(old) | set(new), key=str):
        a, b, name = old.get(key), new.get(key), f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out += changed_keys(a, b, f"{name}.")
        elif a != b:
            out.append(name)
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse

    import yaml

    from .pipeline.cli import ArgumentParser

    ap = ArgumentParser(prog="python -m ced_csa2.compose", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="Hydra overrides of conf/, e.g. budget=cpu_full ridge.lambda=10")
    ap.add_argument("--force", action="store_true",
                    help="overwrite params.yaml even where it holds values the composition changes (hand edits)")
    ap.add_argument("--stdout", action="store_true", help="print the composition instead of writing params.yaml")
    ap.add_argument("--diff", action="store_true",
                    help="print a unified diff of params.yaml against the composition; write nothing")
    args = ap.parse_args(argv)
    text = compose_or_exit(args.overrides)
    target = Path("params.yaml")
    if args.stdout:
        print(text, end="")
        return
    if args.diff:
        import difflib

        current = target.read_text() if target.is_file() else ""
        print("".join(difflib.unified_diff(current.splitlines(keepends=True), text.splitlines(keepends=True),
                                           fromfile=str(target), tofile="composition")), end="")
        return
    if target.is_file() and not args.force:
        # Values that conf/'s defaults do not give are edits (by hand or by an earlier composition with
        # overrides): overwrite them only when asked to.
        current = yaml.safe_load(target.read_text()) or {}
        changed = changed_keys(current, yaml.safe_load(text))
        if changed and changed_keys(current, yaml.safe_load(compose([]))):
            shown = ", ".join(changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
            raise SystemExit(f"error: {target} holds other values than this composition for {shown}; "
                             "rerun with --force to overwrite them (or --stdout to see the composition)")
    atomic_write_text(target, text)


if __name__ == "__main__":
    main()
