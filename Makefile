# Set-up and everyday commands. `make demo` and `make test` install what they need.
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-slow test-fast bench clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet -e ".[test,plots,hf]"
	touch $(STAMP)

demo: install
	OMP_NUM_THREADS=1 $(BIN)/python -m app.demo

# two pytest workers (pytest-xdist): a torchrun test's ranks wait on each other and
# on start-up, so the other worker keeps the second core busy (17 -> 13.5 min here)
TEST_WORKERS ?= 2

test: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not slow"

# the long runs make test leaves out (each names what covers it in make test)
test-slow: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m slow

test-fast: install
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not multiprocess and not slow"

bench: install
	OMP_NUM_THREADS=1 $(BIN)/python -m benchmarks.plan_time
	OMP_NUM_THREADS=1 $(BIN)/python -m benchmarks.intra_op

clean:
	rm -rf $(VENV) build *.egg-info
