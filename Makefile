# make demo: set up .venv (first time), cache the generated clips' latents and text, train the tiny Wan2.2 from the
# cache (CPU, about a minute).
# make test: set up .venv (first time) and run the test suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test setup clean

$(STAMP): requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.lock
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(PY) -m wanexp.cli.cache experiment=demo
	$(PY) train.py experiment=demo

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf outputs .pytest_cache
