# The two set-up commands of the README. Each creates .venv (once) and installs what it needs.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hvdray-installed
# torch's CPU build (constraints.txt pins it on Linux, where PyPI's torch is the CUDA build)
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
# the extras of the development install; cluster_configs/ install the same ones but test and docs
EXTRAS := test,tune,examples,tensorflow,docs

.PHONY: train test install bytecode

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch alone from its CPU index (--no-deps: its dependencies come from PyPI with the rest, so a machine
	# that cannot reach the CPU index, with the wheel in a local find-links, does not retry it for each)
	$(PY) -m pip install --quiet -c constraints.txt torch --extra-index-url $(TORCH_CPU_INDEX) --no-deps
	$(PY) -m pip install --quiet -c constraints.txt -e ".[$(EXTRAS)]"
	touch $(STAMP)

install: $(STAMP) bytecode

## hvdray's compiled modules, as pip writes them when it installs a wheel. An editable install leaves that to
## the first import, which writes nothing where PYTHONDONTWRITEBYTECODE is set (as on the development
## machines): every Ray worker process then compiled hvdray's ~75 modules from source, ~0.075 s of CPU more each.
## Only what changed since the last run is compiled again.
bytecode: $(STAMP)
	$(PY) -m compileall -q hvdray

## A real distributed training run: 2 workers on an embedded local Ray cluster, digits data.
train: $(STAMP) bytecode
	RAY_USAGE_STATS_ENABLED=0 $(PY) examples/pytorch_digits.py --num-workers 2 --epochs 10

## The whole test suite (unit, integration, multi-node, end-to-end) and the docs built with --strict.
## -X faulthandler: a crash of the pytest process, also while it exits, prints every thread's stack.
test: $(STAMP) bytecode
	RAY_USAGE_STATS_ENABLED=0 $(PY) -X faulthandler -m pytest -q -ra --durations=15 tests
