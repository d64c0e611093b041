"""End to end: `dvc repro` on the tiny profile in a temporary copy of the repository."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def sh(cwd, *cmd):
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               DVC_NO_ANALYTICS="1", PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    """The project's files (tracked and untracked-not-ignored) in a fresh git repo, tiny profile."""
    dst = tmp_path_factory.mktemp("repo")
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for rel in files:
        if (ROOT / rel).is_file() and not rel.startswith(("metrics/", "dvc.lock")):
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dst / rel)
    sh(dst, "git", "init", "-q")
    sh(dst, sys.executable, "-m", "ced_csa2.compose", "model=tiny_qwen3_5", "data=tiny", "plan=qwen3_5")
    return dst


def test_repro_prepare_dump_then_nothing_to_do(repo):
    sh(repo, "dvc", "repro", "prepare", "dump")
    metrics = json.loads((repo / "metrics/dump.json").read_text())
    assert metrics["records"] == 48 and metrics["tokens"] > 0
    assert (repo / "data/dump/dump.h5").is_file() and not list((repo / "data").glob("*.partial.*"))
    again = sh(repo, "dvc", "repro", "prepare", "dump")
    assert "Running stage" not in again


def test_repro_through_train_adapters_and_lambda_ablation(repo):
    sh(repo, "dvc", "repro", "train_adapters", "train_projector")
    for name in ("ridge", "projector", "adapters"):
        assert (repo / f"metrics/{name}.json").is_file()
    params = repo / "params.yaml"
    params.write_text(params.read_text().replace("lambda: 1.0", "lambda: 10.0"))
    out = sh(repo, "dvc", "repro", "train_adapters", "train_projector")
    ran = {line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage")}
    assert ran == {"ridge", "train_adapters"}
    assert "lambda" in sh(repo, "dvc", "params", "diff")
