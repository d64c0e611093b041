# Two commands set up everything on a fresh machine (Python 3.11 + PyPI only):
#   make repro   -- create .venv, install, run the embedded default pipeline (dvc repro)
#   make test    -- create .venv, install, run the test suite
# and one makes your run the reference of the next diffs:
#   make baseline  -- record the workspace's figures as the git tag `baseline` (python -m ced_csa2.diff --save-baseline)
PYTHON ?= python3
VENV := .venv
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export DVC_NO_ANALYTICS := 1

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --upgrade pip
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $@

.PHONY: repro test baseline
# Ends by saying which figures the next diff compares against: on a CPU other than the lock's, HEAD's differ everywhere.
repro: $(VENV)/.installed
	dvc repro
	@python -m ced_csa2.diff --which

baseline: $(VENV)/.installed
	python -m ced_csa2.diff --save-baseline

# Two test workers, one torch thread each: the tiny models gain little from a second intra-op
# thread, and two workers of two threads oversubscribe two cores (about twice as slow, measured).
# Whole files to a worker, in the order tests/conftest.py collects them (longest first):
# pytest-xdist would otherwise hand out first the files with the most tests.
test: $(VENV)/.installed
	OMP_NUM_THREADS=1 python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder
