# The README's two commands, on a fresh machine with only Python and the shared fixtures beside the checkout:
#   make run    set up .venv (CPU torch, the package, its plugin packages) and run the main job (smoke matrix)
#   make test   set up the same way, add the [gguf] extra (gguf, llama-cpp-python: builds llama.cpp from source,
#               a few minutes), and run all the tests, slow ones included (what CI runs, through .ci/run; a plain
#               `pytest` skips the tests marked slow, and the llama.cpp tests skip where llama_cpp is missing)
# The setup is done once and redone only when a pyproject.toml changes, so a second call starts at once.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rcpu-bench-installed
GGUF_STAMP := $(VENV)/.rcpu-bench-gguf-installed
PYTEST_ARGS ?= -q
export HF_HUB_OFFLINE = 1
export HF_DATASETS_OFFLINE = 1
export TOKENIZERS_PARALLELISM = false
# The [gguf] extra's llama.cpp build: the library only (no examples, tools, tests, multimodal or curl).
LLAMA_CMAKE_ARGS ?= -DLLAVA_BUILD=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF \
	-DLLAMA_CURL=OFF

.PHONY: run test setup setup-gguf

run: setup
	$(BIN)/rcpu-bench run --matrix smoke

test: setup setup-gguf
	$(BIN)/python -m pytest tests plugins -m "slow or not slow" $(PYTEST_ARGS)

setup: $(STAMP)

setup-gguf: $(GGUF_STAMP)

# torch first: `torch==2.13.0` is the CPU build; an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml plugins/rcpu-example/pyproject.toml plugins/rcpu-slicegpt/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[test,ray]" -e plugins/rcpu-example -e plugins/rcpu-slicegpt
	touch $@

$(GGUF_STAMP): $(STAMP)
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install --quiet -e ".[gguf]"
	touch $@
