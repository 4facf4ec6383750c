# The two commands: `make run` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: run test test-fast e2e fuzz bench lint clean

$(STAMP): pyproject.toml constraints-cpu.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints-cpu.txt -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)  ## train the default small GPT on Shakespeare, then print a sample
	$(PY) run.py --config configs/shakespeare_gpt.py

test: $(STAMP)  ## the whole test suite (what CI runs)
	$(PY) -m pytest -q -ra --durations=15 tests

test-fast: $(STAMP)  ## every module's fast tests (no multi-rank or heavy compile runs), for iterating
	$(PY) -m pytest -q -ra -m "not slow" --durations=10 tests

e2e: $(STAMP)  ## everything make test runs, plus the whole user-path matrix and the other e2e-marked cases
	$(PY) -m pytest -q -ra --e2e --durations=20 tests

fuzz: $(STAMP)  ## property tests with fresh random examples, twenty times as many as make test draws
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q -ra tests/test_fuzz.py

bench: $(STAMP)  ## benchmarks: print tables, compare against plain PyTorch
	$(PY) bench/step.py

lint: $(STAMP)
	$(PY) -m ruff check fxmega tests bench run.py configs examples

clean:
	rm -rf $(VENV) .cache runs
