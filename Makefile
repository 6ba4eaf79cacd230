# Every target that needs the package makes .venv itself on first use, so each is one
# command on a fresh machine. test-gpu and bench run on the lent GPU machine from the
# source tree (no package registry there: nothing is installed).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
GPU_REPORT ?= benchmarks/results/gpu-tests.md

.PHONY: install test test-gpu lint demo bench gpu-session clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

test-gpu:
	CUDNN_BN_GPU_REPORT=$(GPU_REPORT) PYTHONPATH=. $(PYTHON) -m pytest -m gpu -v -rs

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

demo: $(STAMP)
	$(PY) examples/batch_norm_backward.py
	$(PY) examples/train_mnist_like.py

bench:
	PYTHONPATH=. $(PYTHON) benchmarks/bench_bn.py

# Everything a session with a GPU should bring back, in one command: the GPU tests' report
# and the benchmark, both under OUT (the device tool's $OUT there).
OUT ?= benchmarks/results
gpu-session:
	-$(MAKE) --no-print-directory test-gpu GPU_REPORT=$(OUT)/gpu-tests.md
	PYTHONPATH=. $(PYTHON) benchmarks/bench_bn.py --out $(OUT)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
