# Two entry points, both doing all set-up on a fresh machine:
#   make demo   -- the end-to-end demo on embedded defaults (no cloud account, no GPU)
#   make test   -- the whole test suite
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
ENGINES := .venv-engines

.PHONY: setup engines lint test test-extended test-tools demo bench clean

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(PY) $(VENV)
	touch $@

setup: $(STAMP)

# NVRx and torchft, for their tests and the recovery benchmark's rows (scripts/engines-venv.sh)
$(ENGINES)/.installed: $(STAMP) scripts/engines-venv.sh
	bash scripts/engines-venv.sh $(VENV) $(ENGINES)
	touch $@

engines: $(ENGINES)/.installed

test-tools:
	bash scripts/test-tools.sh

lint: $(STAMP)
	$(BIN)/ruff check .

# 2 pytest-xdist workers: one pytest keeps one core busy on average (it waits on torchrun,
# servers, pip); loadfile keeps a module on one worker, so its module-scoped fixtures run once;
# the 30 slowest tests are printed at the end, so every run (CI's too) says where the time went
test: $(STAMP) engines test-tools lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=30 tests

test-extended: $(STAMP) engines test-tools  # the variants the default suite skips (marked extended)
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m extended tests

demo: $(STAMP)
	$(BIN)/python examples/demo.py

bench: $(STAMP)
	$(BIN)/python benchmarks/ckpt_bench.py

clean:
	rm -rf $(VENV) $(ENGINES) build *.egg-info
