PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_WORKERS ?= 2

.PHONY: venv test demo lint bench clean

venv: $(STAMP)

# torchtitan (--no-deps) for its handler's test only: its training needs CUDA, its
# dependencies are heavy, and the handler needs only its structured logger.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[all,dev]'
	$(BIN)/pip install -q --no-deps 'torchtitan==0.3.0'
	touch $(STAMP)

test: venv
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=30 tests

demo: venv
	$(BIN)/stepscope demo

lint: venv
	$(BIN)/ruff check stepscope tests benchmarks examples
	$(BIN)/ruff format --check stepscope tests benchmarks examples
	$(BIN)/mypy
	$(BIN)/lint-imports --no-logo

bench: venv
	$(BIN)/python benchmarks/ingest.py
	$(BIN)/python benchmarks/profiler_overhead.py
	$(BIN)/python benchmarks/collective_tap.py
	$(BIN)/python benchmarks/analysis_scale.py
	$(BIN)/python benchmarks/detection_quality.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
