# The two set-up commands of the README. Each creates .venv (once) and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hvdray-installed

.PHONY: train test install

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt torch
	$(PY) -m pip install --quiet -c constraints.txt -e ".[test,tune,examples,tensorflow]"
	touch $(STAMP)

install: $(STAMP)

## A real distributed training run: 2 workers on an embedded local Ray cluster, digits data.
train: $(STAMP)
	RAY_USAGE_STATS_ENABLED=0 $(PY) examples/pytorch_digits.py --num-workers 2 --epochs 10

## The whole test suite (unit, integration, multi-node, end-to-end).
test: $(STAMP)
	RAY_USAGE_STATS_ENABLED=0 $(PY) -m pytest -q -ra --durations=15 tests
