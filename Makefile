# The README's commands. `make demo`, `make test` and `make sanitize` each set everything up first:
#  - where python3 already has torch and pytest (the GPU machine: torch preinstalled, no network)
#    they use it;
#  - elsewhere they make .venv and install torch 2.13 (CPU build) and pytest into it, once.
# Then `make build` compiles fastkern._C in place (python/fastkern/_C.abi3.so), incrementally:
# objects and their dependency files live in build/, and only the units whose source, included
# headers or flags changed recompile (setup.py's docstring says how). The package is imported from
# python/ through PYTHONPATH (and, in .venv, a .pth file), so nothing is pip-installed and no
# network is needed. FASTKERN_CUDA_ARCHS=native builds only for this machine's GPU (see setup.py).
PYTHON ?= python3
HAVE_TORCH := $(shell $(PYTHON) -c "import importlib.util as u, sys; sys.exit(not (u.find_spec('torch') and u.find_spec('pytest')))" >/dev/null 2>&1 && echo yes)
ifeq ($(HAVE_TORCH),yes)
PY := $(PYTHON)
ENV :=
else
PY := .venv/bin/python
ENV := .venv/.ready
endif
export PYTHONPATH := $(CURDIR)/python$(if $(PYTHONPATH),:$(PYTHONPATH))

.PHONY: demo test bench build sanitize clean

.venv/.ready:
	$(PYTHON) -m venv .venv
	$(PY) -m pip install -q "torch==2.13.0" pytest numpy "setuptools>=64"
	echo "$(CURDIR)/python" > "$$($(PY) -c 'import site; print(site.getsitepackages()[0])')/fastkern-dev.pth"
	touch $@

build: $(ENV)
	$(PY) setup.py -q build_ext --inplace

demo: build
	$(PY) examples/quickstart.py

test: build
	$(PY) -m pytest -q tests

# CPU: the C code under AddressSanitizer + UBSan (its own build in build/sanitize), CPU tests.
# GPU (when compute-sanitizer and a GPU exist): memcheck, racecheck, synccheck on test subsets.
sanitize: build
	PY=$(PY) tools/sanitize.sh

bench: build
	$(PY) -m pytest -q benchmarks
	$(PY) -m fastkern.bench all

clean:
	rm -rf build python/fastkern/_C*.so python/*.egg-info
