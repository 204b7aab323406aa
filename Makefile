# The two entry points: `make demo` and `make test` (both set up .venv when missing or stale).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-stamp
SETUP_INPUTS := pyproject.toml setup.py CMakeLists.txt scripts/setup_env.sh packaging/vllm-cpu-alias/pyproject.toml \
	$(shell find csrc -type f 2>/dev/null)

export VLLM_CPU_KVCACHE_SPACE ?= 2
export PYTHONUNBUFFERED := 1

.PHONY: setup test demo test-fast nvcc-check clean

$(STAMP): $(SETUP_INPUTS)
	bash scripts/setup_env.sh

setup: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests --durations=25

test-fast: $(STAMP)
	$(PY) -m pytest -q tests -m "not vllm"

demo: $(STAMP)
	$(VENV)/bin/vllm-dflash demo

# Compile-check every plain-CUDA source (no GPU needed).
nvcc-check:
	PYTHON=$(PY) bash scripts/nvcc_check.sh

clean:
	rm -rf build *.egg-info vllm_dflash/_C*.so
