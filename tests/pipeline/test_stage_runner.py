"""The stage runner's progress lines: where a stage stands in dvc.yaml, its elapsed time, logs above tqdm bars."""

import logging
from pathlib import Path

from tqdm import tqdm

from ced_csa2.pipeline import stage_runner
from ced_csa2.pipeline.stage_runner import stage_position

ROOT = Path(__file__).resolve().parents[2]


def test_a_stage_s_position_is_counted_in_the_stage_table(tmp_path):
    pipeline = tmp_path / "dvc.yaml"
    pipeline.write_text("stages:\n  prepare:\n    cmd: a\n  tune:\n    foreach: [x]\n  report:\n    cmd: b\n")
    assert stage_position("tune@distill", pipeline) == f" (2 of 3 in {pipeline})"
    assert stage_position("report", pipeline) == f" (3 of 3 in {pipeline})"
    assert stage_position("a_study", pipeline) == ""
    assert stage_position("report", tmp_path / "missing.yaml") == ""


def test_the_project_s_stages_all_have_a_position():
    pipeline = ROOT / "dvc.yaml"
    assert stage_position("check_params", pipeline).startswith(" (1 of ")
    assert stage_position("report", pipeline) != ""


def test_a_stage_logs_its_start_and_elapsed_time_above_its_bars(tmp_path, monkeypatch, caplog, capsys):
    (tmp_path / "dvc.yaml").write_text("stages:\n  prepare:\n    cmd: a\n  test_stage_runner:\n    cmd: b\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(stage_runner, "load_params", lambda: None)
    handlers = []

    def run(params):
        # while the stage runs, the console handler writes through tqdm (tqdm.write), not into a bar
        handlers.extend(type(h).__name__ for h in logging.getLogger().handlers)
        with tqdm(total=1) as bar:
            logging.getLogger("stage").info("inside the bar")
            bar.update()

    with caplog.at_level("INFO"):
        stage_runner._run_stage(run)
    assert "_TqdmLoggingHandler" in handlers
    # the start on stdout (a fault's stderr stays one line), the elapsed time logged
    assert capsys.readouterr().out.splitlines()[0] == "stage test_stage_runner (2 of 2 in dvc.yaml)"
    lines = [r.getMessage() for r in caplog.records if r.name == stage_runner.__name__]
    assert len(lines) == 1 and lines[0].startswith("stage test_stage_runner done in ") and lines[0].endswith(" s")
