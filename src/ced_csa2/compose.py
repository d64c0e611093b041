"""Compose ``conf/`` into ``params.yaml`` -- what ``dvc exp run`` does, without DVC.

    python -m ced_csa2.compose                                  # embedded default
    python -m ced_csa2.compose model=tiny_qwen3_5 data=tiny plan=qwen3_5

``dvc repro`` never composes (it reads the committed ``params.yaml`` as is);
``dvc exp run -S group=option`` recomposes it with the same Hydra API as here.  A test
checks that composing the defaults reproduces the committed file.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .config import Params, from_dict
from .io_utils import atomic_write_text

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


def main(argv: list[str] | None = None) -> None:
    overrides = sys.argv[1:] if argv is None else argv
    atomic_write_text(Path("params.yaml"), compose(overrides))


if __name__ == "__main__":
    main()
