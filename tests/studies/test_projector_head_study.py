"""studies/projector_head.py end to end: a synthetic dump, the pipeline's maps on it, the tiny Qwen3.5 scoring."""

import sys

from conftest import ROOT, study_corpus
from study_params import refused
from tiny_dump import params, write_synthetic_dump

from ced_csa2.train.residual_projector_training import HeadConfig
from ced_csa2.stages import train_adapters, train_projector

sys.path.insert(0, str(ROOT / "studies"))
import projector_head as study_mod  # noqa: E402


def test_the_committed_study_params_load():
    study = study_mod.load_study(ROOT / "studies" / "projector_head.yaml")
    assert study.widths and study.train.epochs == 12


def test_no_widths_are_refused(tmp_path):
    refused(study_mod, tmp_path, "widths: []\ntrain: {epochs: 1, batch_size: 8, lr: 1.0e-3, weight_decay: 0.0, "
            "warmup_fraction: 0.1}\n", "widths must be positive")


def test_study_on_a_synthetic_dump(tiny_model, tmp_path):
    p = params()
    write_synthetic_dump(tmp_path, p)
    for stage in (train_projector, train_adapters):
        stage.run(p, tmp_path)
    study_corpus(tmp_path, records=3)
    study = study_mod.Study(widths=[16], train=HeadConfig(epochs=3, batch_size=128, lr=1e-2, weight_decay=0.0,
                                                          warmup_fraction=0.1))
    m = study_mod.run(p, study, tmp_path, model_and_tok=tiny_model)
    ridge_row, mlp = m["heads"]["ridge"], m["heads"]["mlp16"]
    assert list(m["heads"]) == ["ridge", "mlp16"] and ridge_row["kept_epoch"] == 0
    assert mlp["val_loss"] <= ridge_row["val_loss"] and mlp["parameters"] > ridge_row["parameters"]
    for row in (ridge_row, mlp):
        assert row["ced_kl"] > 0 and row["ced_csa2_kl"] > 0 and len(row["ced_dppl_pct_ci95"]) == 2
    assert "| mlp16 |" in study_mod.markdown(m)
