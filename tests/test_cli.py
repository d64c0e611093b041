"""Every command line answers a bad argument in at most two lines (usage, error), a non-zero exit, no traceback.

The commands run as ``python -m`` / ``python <script>`` would run them (``runpy`` with ``run_name="__main__"``,
``sys.argv`` set), one after another in ONE interpreter started for this file: a fresh interpreter per command
spent ~1.5 s importing torch 64 times.  Each command's stderr is captured at the file descriptor, so lines a
logging handler or tqdm writes to the real stream are counted too.
"""

import json
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
UNKNOWN_OPTION = [[*command, "--bogus"] for command in COMMANDS]

# Runs each command line of argv[1] (a JSON list) as __main__ and prints [exit status, stderr] per command.
DRIVER = r"""
import json, os, runpy, sys, tempfile, traceback
results = []
for args in json.loads(sys.argv[1]):
    sys.argv = [args[1] if args[0] == "-m" else args[0], *args[2 if args[0] == "-m" else 1:]]
    with tempfile.TemporaryFile(mode="w+") as err:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)
        try:
            if args[0] == "-m":
                sys.modules.pop(args[1], None)  # as a fresh `python -m` finds it: not yet imported
                runpy.run_module(args[1], run_name="__main__", alter_sys=True)
            else:
                sys.path.insert(0, os.path.dirname(args[0]))  # as `python script.py`: its folder first
                try:
                    runpy.run_path(args[0], run_name="__main__")
                finally:
                    sys.path.pop(0)
            status = 0
        except SystemExit as exc:
            status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            if exc.code is not None and not isinstance(exc.code, int):
                print(exc.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
            status = 1
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        err.seek(0)
        results.append([status, err.read()])
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def answers(tmp_path_factory) -> dict[str, tuple[int, list[str]]]:
    """Exit status and stderr lines of every command line of this file, by the line joined with spaces.

    Run in an empty folder: a command that went on anyway reads nothing there.
    """
    lines = UNKNOWN_OPTION + BAD_VALUES
    env = {k: v for k, v in os.environ.items() if k != "CED_CSA2_DEBUG"}
    env.update(PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", DRIVER, json.dumps(lines)], cwd=tmp_path_factory.mktemp("cli"),
                          env=env, capture_output=True, text=True, timeout=900, check=True)
    results = json.loads(done.stdout.splitlines()[-1])
    return {" ".join(line): (status, err.splitlines()) for line, (status, err) in zip(lines, results, strict=True)}


@pytest.mark.parametrize("command", UNKNOWN_OPTION, ids=[c[-2].rsplit("/", 1)[-1] for c in UNKNOWN_OPTION])
def test_an_unknown_option_is_the_usage_and_one_error_line(answers, command):
    status, err = answers[" ".join(command)]
    assert status != 0 and 1 <= len(err) <= 2 and err[0].startswith("usage: "), err
    assert not any("Traceback" in line for line in err), err


@pytest.mark.parametrize("command", BAD_VALUES, ids=[" ".join(c[-2:]) for c in BAD_VALUES])
def test_a_bad_value_is_at_most_two_lines_ending_in_the_error(answers, command):
    status, err = answers[" ".join(command)]
    assert status != 0 and 1 <= len(err) <= 2 and "error: " in err[-1], err
    assert not any("Traceback" in line for line in err), err
