"""Every command line answers a bad argument in at most two lines (usage, error), a non-zero exit, no traceback."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT

SRC = ROOT / "src" / "ced_csa2"
MODULES = sorted(f"ced_csa2.{p.stem}" for p in SRC.glob("*.py") if 'if __name__ == "__main__":' in p.read_text())
STAGES = sorted(f"ced_csa2.stages.{p.stem}" for p in (SRC / "stages").glob("*.py") if p.stem != "__init__")
SCRIPTS = sorted(p.relative_to(ROOT).as_posix() for folder in ("benchmarks", "studies")
                 for p in (ROOT / folder).glob("*.py"))
COMMANDS = [["-m", module] for module in MODULES + STAGES] + [[str(ROOT / script)] for script in SCRIPTS]
# A value the parser takes but the command refuses, one per kind of check, each before any work.
BAD_VALUES = [
    ["-m", "ced_csa2.compose", "--stdout", "nosuch.key=1"],  # a Hydra override of no key
    ["-m", "ced_csa2.estimate", "--device", "tpu"],
    ["-m", "ced_csa2.stages.tune", "nosuch_objective"],  # here: params.yaml is missing
    [str(ROOT / "benchmarks" / "fp4_throughput.py"), "--dtypes", "float99"],
    [str(ROOT / "benchmarks" / "sparse_step_profile.py"), "--params", "nosuch.yaml"],
    [str(ROOT / "studies" / "projector_recipe.py"), "--random-batch-sizes", "64,x"],
    [str(ROOT / "studies" / "sizing.py"), "--workdir", "nosuch"],
]


def run(tmp_path, args: list[str]) -> tuple[int, list[str]]:
    """Exit status and stderr lines of ``python <args>`` in an empty folder (a command that ran anyway reads nothing)."""
    env = {k: v for k, v in os.environ.items() if k != "CED_CSA2_DEBUG"}
    env.update(PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    return done.returncode, done.stderr.splitlines()


@pytest.mark.parametrize("command", COMMANDS, ids=[c[-1].rsplit("/", 1)[-1] for c in COMMANDS])
def test_an_unknown_option_is_the_usage_and_one_error_line(tmp_path, command):
    status, err = run(tmp_path, [*command, "--bogus"])
    assert status != 0 and 1 <= len(err) <= 2 and err[0].startswith("usage: "), err
    assert not any("Traceback" in line for line in err), err


@pytest.mark.parametrize("command", BAD_VALUES, ids=[" ".join(c[-2:]) for c in BAD_VALUES])
def test_a_bad_value_is_at_most_two_lines_ending_in_the_error(tmp_path, command):
    status, err = run(tmp_path, command)
    assert status != 0 and 1 <= len(err) <= 2 and "error: " in err[-1], err
    assert not any("Traceback" in line for line in err), err
