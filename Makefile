# Every target that needs the package makes its virtualenv itself on first use, so each is one
# command on a fresh machine. test-gpu and gpu-session run on a GPU machine from the source
# tree with the Python there (it may have no package registry: nothing is installed).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The CUDA 13 stack (cupy-cuda13x, nvidia-cudnn-cu13), for the tests of the ctypes layer.
VENV13 := .venv-cu13
STAMP13 := $(VENV13)/.installed-stamp
CU13_TESTS := tests/test_loader.py tests/test_prototypes.py tests/test_status.py \
	tests/test_descriptors.py tests/test_cudnn_enums.py tests/test_cuda_major.py
GPU_REPORT ?= benchmarks/results/gpu-tests.md

.PHONY: install test test-cu13 test-gpu lint demo demo-distributed bench gpu-session clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

$(STAMP13): pyproject.toml
	$(PYTHON) -m venv $(VENV13)
	$(VENV13)/bin/python -m pip install --quiet -e '.[cuda13]' pytest
	touch $(STAMP13)

install: $(STAMP)

test: $(STAMP) $(STAMP13)
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q
	$(VENV13)/bin/python -m pytest -q -p no:cacheprovider $(CU13_TESTS)

test-cu13: $(STAMP13)
	$(VENV13)/bin/python -m pytest -q -p no:cacheprovider $(CU13_TESTS)

test-gpu:
	CUDNN_BN_GPU_REPORT=$(GPU_REPORT) PYTHONPATH=. $(PYTHON) -m pytest -m gpu -v -rs

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

demo: $(STAMP)
	$(PY) examples/batch_norm_backward.py
	$(PY) examples/train_mnist_like.py

# The demo network trained data-parallel on two processes with synchronized batch norm
# (one thread each: the two ranks share the machine's cores).
demo-distributed: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/mpiexec -n 2 $(PY) examples/train_distributed.py

# The GPU benchmark where a GPU is usable, the CPU engine's benchmark otherwise.
bench: $(STAMP)
	$(PY) benchmarks/bench.py

# Everything a session with a GPU should bring back, in one command: the GPU tests' report
# and the benchmark, both under OUT (the device tool's $OUT there).
OUT ?= benchmarks/results
gpu-session:
	-$(MAKE) --no-print-directory test-gpu GPU_REPORT=$(OUT)/gpu-tests.md
	PYTHONPATH=. $(PYTHON) benchmarks/bench_bn.py --out $(OUT)

clean:
	rm -rf $(VENV) $(VENV13) .pytest_cache .ruff_cache
