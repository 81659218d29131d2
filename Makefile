# make demo: set up .venv (first time), cache the generated clips' latents and text, train a tiny Wan2.2's LoRA from
# the cache (CPU, about 20 s; the first call also builds the tiny model, about 25 s, and sets up .venv: about 2.5
# minutes with a warm pip cache).
# make test: set up .venv (first time) and run the test suite.
# make docs: build the documentation site (docs/, mkdocs.yml) into site/.
# make setup: only the .venv, with wanexp installed editable (wanexp-train, wanexp-status, ... in .venv/bin).
# make setup TORCH_CUDA=cu126: torch (requirements.lock's version) as PyTorch's CUDA 12.6 build, from its own index,
# before the lock: the build for V100s (sm_70), which PyPI's CUDA 13 builds lack (docs/memory.md). Any PyTorch CUDA
# variant name works (cu128, ...); on an existing .venv it replaces the installed torch.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test setup docs clean

PACKAGE := $(VENV)/.wanexp-installed
TORCH_CUDA ?=
TORCH_PIN := torch==$(shell sed -n 's/^torch==//p' requirements.lock)+$(TORCH_CUDA) \
	--index-url https://download.pytorch.org/whl/$(TORCH_CUDA)

$(STAMP): requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(if $(TORCH_CUDA),$(PY) -m pip install -q $(TORCH_PIN))
	$(PY) -m pip install -q -r requirements.lock
	touch $(STAMP)

# wanexp itself, editable: importable from any folder, with the wanexp-* commands in $(VENV)/bin
$(PACKAGE): $(STAMP) pyproject.toml
	$(PY) -m pip install -q --no-deps -e .
	touch $(PACKAGE)

setup: $(PACKAGE)
	$(if $(TORCH_CUDA),$(PY) -m pip install -q $(TORCH_PIN))

# The demo (conf/experiment/demo_squares.yaml): a tiny base that draws white squares learns, as a LoRA, the red and
# the blue square its two captions name; it samples the base at step 0 and the LoRA at the end
# (DIR/validation/strip.png) and plots the loss (DIR/loss.png). tests/integration/test_demo_learns.py reads this line.
DEMO := experiment=demo_squares

# One intra-op thread (unless OMP_NUM_THREADS says otherwise): the tiny model runs as fast on one as on two, and
# many times faster when other processes share the cores (two threads then spin against them).
demo: export OMP_NUM_THREADS ?= 1
demo: $(PACKAGE)
	$(PY) -m wanexp.cli.cache $(DEMO)
	$(PY) train.py $(DEMO)

# Test-only references, outside the package's dependencies: DiffSynth-Studio's S2V model and wav2vec2 code (the S2V
# parity tests load its module files, not the package, so --no-deps) and the einops it uses.
REF := $(VENV)/ref
$(REF)/.installed: $(STAMP)
	$(PY) -m pip install -q --no-deps --target $(REF)/diffsynth diffsynth==2.1.12
	$(PY) -m pip install -q --no-deps --target $(REF)/einops einops==0.8.2
	touch $@

test: $(PACKAGE) $(REF)/.installed
	WANEXP_S2V_REFERENCE=$(REF)/diffsynth:$(REF)/einops $(PY) -m pytest -q -n 2 --maxschedchunk 2

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf outputs .pytest_cache
