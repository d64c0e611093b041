"""Fault catalogue: the studies (``python studies/<study>.py``) end as a stage does.

* every study refuses a corpus made for other params (``check_prepared``, as the stages that read it)
  before the model loads;
* a study's missing input is one ``error:`` line and exit status 2 from the real script, not a traceback;
* Ctrl-C is one line and exit status 130.
"""

import importlib
import subprocess
import sys

import pytest
from conftest import TINY_OVERRIDES, compose, tiny_params
from faults_common import ROOT, one_error_line, stage_env

from ced_csa2.pipeline.paths import MODE_A_SINK
from ced_csa2.pipeline.study_runner import run_study
from ced_csa2.stages import prepare

STUDIES = sorted((ROOT / "studies").glob("*.py"))
ARGS = {"sizing": ["--workdir", "."], "sharing": ["--k", "1"]}  # sizing's is required; sharing's part reads the corpus


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """The tiny profile's corpus as ``prepare`` writes it, each file with its record."""
    workdir = tmp_path_factory.mktemp("prepared")
    prepare.run(tiny_params(), workdir)
    return workdir


@pytest.mark.parametrize("script", STUDIES, ids=[p.stem for p in STUDIES])
def test_every_study_refuses_a_corpus_made_for_other_params_in_one_line(prepared, script, monkeypatch, capsys):
    """The folder holds no model files, dump or maps: a study that read anything else first would fail on that."""
    monkeypatch.chdir(prepared)
    monkeypatch.syspath_prepend(str(script.parent))  # as the study tests import them (tests/studies/)
    monkeypatch.setattr(sys, "argv", [str(script), *ARGS.get(script.stem, [])])
    (prepared / "params.yaml").write_text(compose([*TINY_OVERRIDES, "data.max_tokens=97"]))
    study = importlib.import_module(script.stem)
    with pytest.raises(SystemExit) as end:  # as its `python studies/<study>.py` runs it
        run_study(study.main, study.arguments() if hasattr(study, "arguments") else None)
    assert end.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("error: data/corpus/"), err
    assert ".jsonl: was made with data.max_tokens = 96, params.yaml has 97: rebuild it with `dvc repro`" in err[0]


def test_a_study_missing_an_input_is_one_line_exit_2(prepared):
    """The real script: ``studies/sink.py`` without tune_mode_a's sink constants (the corpus is current)."""
    (prepared / "params.yaml").write_text(compose(TINY_OVERRIDES))
    done = subprocess.run([sys.executable, str(ROOT / "studies" / "sink.py")], cwd=prepared, env=stage_env(),
                          capture_output=True, text=True, timeout=600, check=False)
    line = one_error_line(done)
    assert str(MODE_A_SINK) in line, line


def test_ctrl_c_in_a_study_is_one_line_exit_130(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", [__file__])  # no arguments, not pytest's

    def main():
        raise KeyboardInterrupt

    with pytest.raises(SystemExit) as end:
        run_study(main)
    assert end.value.code == 130
    assert capsys.readouterr().err == ("test_faults_studies: interrupted; every output is its complete old or new "
                                       "file (none is left half-written): run the study again to finish\n")
