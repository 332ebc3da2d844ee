# The README's commands. `make demo` and `make test` each set everything up first:
#  - where python3 already has torch (the GPU machine: torch preinstalled, no network) they use it;
#  - elsewhere they make .venv and install torch (CPU build) and pytest into it.
# Then they build fastkern._C from source (pip install -e ., no build isolation: no network needed).
PYTHON ?= python3
HAVE_TORCH := $(shell $(PYTHON) -c "import torch, pytest" >/dev/null 2>&1 && echo yes)
ifeq ($(HAVE_TORCH),yes)
PY := $(PYTHON)
ENV :=
else
PY := .venv/bin/python
ENV := .venv/.ready
endif

.PHONY: demo test bench build clean

.venv/.ready:
	$(PYTHON) -m venv .venv
	$(PY) -m pip install -q "torch==2.13.0" pytest numpy "setuptools>=64"
	touch $@

build: $(ENV)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .

demo: build
	$(PY) examples/quickstart.py

test: build
	$(PY) -m pytest -q tests

bench: build
	$(PY) -m pytest -q benchmarks
	$(PY) -m fastkern.bench all

clean:
	rm -rf build python/fastkern/_C*.so python/*.egg-info
