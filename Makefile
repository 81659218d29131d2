# make demo: set up .venv (first time), cache the generated clips' latents and text, train the tiny Wan2.2 from the
# cache (CPU, about 30 s; the first call also sets up .venv: about 2.5 minutes with a warm pip cache).
# make test: set up .venv (first time) and run the test suite.
# make docs: build the documentation site (docs/, mkdocs.yml) into site/.
# make setup: only the .venv, with wanexp installed editable (wanexp-train, wanexp-status, ... in .venv/bin).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test setup docs clean

PACKAGE := $(VENV)/.wanexp-installed

$(STAMP): requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.lock
	touch $(STAMP)

# wanexp itself, editable: importable from any folder, with the wanexp-* commands in $(VENV)/bin
$(PACKAGE): $(STAMP) pyproject.toml
	$(PY) -m pip install -q --no-deps -e .
	touch $(PACKAGE)

setup: $(PACKAGE)

# The demo overfits two clips at a high lr so that its loss falls visibly in 30 steps, and samples the base model at
# step 0 and the LoRA at the end (DIR/validation/strip.png); tests/integration/test_demo_learns.py reads this line.
DEMO := experiment=demo data.max_samples=2 optim.lr=1e-2 callbacks.validation.every_n_steps=30 \
	callbacks.validation.steps=10

demo: $(PACKAGE)
	$(PY) -m wanexp.cli.cache $(DEMO)
	$(PY) train.py $(DEMO)

test: $(PACKAGE)
	$(PY) -m pytest -q -n 2 --maxschedchunk 2

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf outputs .pytest_cache
