# One command each, on a fresh clone: `make run` (the main job: an end-to-end decode through the
# bundled runner on its embedded default model) and `make test` (the suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run demo test thorough bench lint clean

RUN_STAMP := $(VENV)/.installed-run

# `make run` needs the package and torch only; `make test` adds the dev extra (pytest,
# hypothesis, triton for the interpreted kernel tests, ...).
$(RUN_STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q 'torch==2.13.0'  # the CPU wheel on local disk; never a CUDA download
	$(BIN)/pip install -q -e '.[torch]'
	touch $(RUN_STAMP)

$(STAMP): $(RUN_STAMP)
	$(BIN)/pip install -q -e '.[dev,torch]'
	touch $(STAMP)

run: $(RUN_STAMP)
	$(BIN)/shadowradix run

demo: $(RUN_STAMP)
	$(BIN)/shadowradix demo

test: $(STAMP)
	$(BIN)/python -m pytest --hypothesis-profile=ci --cov=shadowradix --cov=hisparse --cov=adapters --cov-branch \
		--cov-report=term-missing:skip-covered --cov-fail-under=95

thorough: $(STAMP)
	$(BIN)/python -m pytest --hypothesis-profile=thorough -p no:cacheprovider tests/test_stateful.py

bench: $(STAMP)
	$(BIN)/python bench/trace_replay.py

lint: $(STAMP)
	$(BIN)/ruff check shadowradix hisparse adapters tests bench
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis .coverage
