# Two commands set everything up on a fresh machine: `make demo` and `make test`.
# Both create or reuse .venv themselves.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.maxdiff-installed

.PHONY: venv lint test test-slow demo serve train-demo clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,train,serve]'
	touch $(STAMP)

venv: $(STAMP)

# ruff's checks as pyproject.toml configures them (pyflakes errors, syntax, long lines)
lint: $(STAMP)
	$(PY) -m ruff check .

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

demo: $(STAMP)
	$(PY) -m pipelines.demo

# The HTTP service on the embedded model (configs/serve.yaml: port 8000 on every interface);
# open http://127.0.0.1:8000/ for the playground. Ctrl+C stops it.
serve: $(STAMP)
	$(VENV)/bin/serve run configs/serve.yaml

# Re-trains the embedded demo model (about 1.5 hours on 2 idle CPU cores) into maxdiff/assets/demo-model
# (or DEMO_OUT=DIR), on the training split of the shape/colour/background combinations only.
DEMO_OUT ?= maxdiff/assets/demo-model
train-demo: $(STAMP)
	$(PY) -m maxdiff.training.train --config configs/train-demo.yaml --out $(DEMO_OUT)

clean:
	rm -rf $(VENV) out .pytest_cache
