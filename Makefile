# Two commands set everything up on a fresh machine: `make demo` and `make test` (`make test-all` for every tier).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo lint test test-all bench venv clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned: 2.13.0 is the local CPU build; an unpinned torch would pull CUDA wheels.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[dev]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(PY) -m nnrun.demo

# The linter and the formatter (configured in pyproject.toml): the tree stays clean under both.
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The fast tier: lint, then every test that needs no extra process (no server, Ray cluster, notebook or
# fresh interpreter).
test: lint
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow"

# Everything, the fast tier included; CI runs this.
test-all: lint
	$(PY) -m pytest -q -p no:cacheprovider

bench: $(STAMP)
	$(PY) benchmarks/throughput.py

clean:
	rm -rf $(VENV)
