# The README's two commands, on a fresh machine with only Python and the shared fixtures beside the checkout:
#   make run    set up .venv (CPU torch, the package, its plugin packages) and run the main job (smoke matrix)
#   make test   set up the same way and run all the tests, slow ones included (what CI runs, through .ci/run;
#               a plain `pytest` skips the tests marked slow)
# The setup is done once and redone only when a pyproject.toml changes, so a second call starts at once.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rcpu-bench-installed
PYTEST_ARGS ?= -q
export HF_HUB_OFFLINE = 1
export HF_DATASETS_OFFLINE = 1
export TOKENIZERS_PARALLELISM = false

.PHONY: run test setup

run: setup
	$(BIN)/rcpu-bench run --matrix smoke

test: setup
	$(BIN)/python -m pytest tests plugins -m "slow or not slow" $(PYTEST_ARGS)

setup: $(STAMP)

# torch first: `torch==2.13.0` is the CPU build; an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml plugins/rcpu-example/pyproject.toml plugins/rcpu-slicegpt/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[test,ray]" -e plugins/rcpu-example -e plugins/rcpu-slicegpt
	touch $@
