# Two commands set everything up on a fresh machine: `make demo` and `make test`.
# Both create or reuse .venv themselves.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.maxdiff-installed

.PHONY: venv lint test test-slow test-all demo serve train-demo train-demo-captions train-demo-v2 clean

# make demo installs the package and what it imports (JAX, Flax, transformers' tokenizers, ...)
# and nothing else: no torch, diffusers, Ray or playwright (tests/test_readme.py checks a fresh
# venv). make serve adds the serve extra; make test everything the tests use.
DEMO_STAMP := $(VENV)/.maxdiff-demo-installed
SERVE_STAMP := $(VENV)/.maxdiff-serve-installed

$(DEMO_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	touch $(DEMO_STAMP)

$(SERVE_STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[serve]'
	touch $(SERVE_STAMP) $(DEMO_STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,train,serve]'
	touch $(STAMP) $(SERVE_STAMP) $(DEMO_STAMP)

venv: $(STAMP)

# ruff's checks as pyproject.toml configures them (pyflakes errors, syntax, long lines)
lint: $(STAMP)
	$(PY) -m ruff check .

# Both suites run on TEST_WORKERS pytest-xdist workers (2: this project's 2-core machines); a
# group (a test module, or one of tests/service's two) runs whole on one worker, the groups in
# the order tests/conftest.py gives them (the longest first: --no-loadscope-reorder).
# TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2
XDIST = -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(XDIST) --durations=20

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow $(XDIST) --durations=10

# Both suites in one session (what CI runs): a module's slow tests share its compiled pipelines,
# and the service's slow tests its Ray cluster and applications, instead of building them again
test-all: $(STAMP)
	$(PY) -m pytest -q $(XDIST) --durations=30

demo: $(DEMO_STAMP)
	$(PY) -m pipelines.demo

# The HTTP service on the embedded model (configs/serve.yaml: port 8000 on every interface);
# open http://127.0.0.1:8000/ for the playground. Ctrl+C stops it.
serve: $(SERVE_STAMP)
	$(VENV)/bin/serve run configs/serve.yaml

# Re-trains the embedded demo model (about 1.5 hours on 2 idle CPU cores) into maxdiff/assets/demo-model
# (or DEMO_OUT=DIR), on the training split of the shape/colour/background combinations only.
DEMO_OUT ?= maxdiff/assets/demo-model
train-demo: $(STAMP)
	$(PY) -m maxdiff.training.train --config configs/train-demo.yaml --out $(DEMO_OUT)

# Fine-tunes the embedded model on caption set v2 (background-first phrasings; the run and the
# rule that picks a snapshot are in pipelines/demo_eval.py, fixed before training): 3,000 UNet
# steps from the shipped weights, VAE reused, snapshots every 500 in out/demo-captions/snapshots
# (about 25 minutes on 2 idle cores). Then choose on validation:
#   python -m pipelines.demo_eval --model out/demo-captions/snapshots/step-N --split val / wording
CAPTIONS_OUT ?= out/demo-captions
train-demo-captions: $(STAMP)
	$(PY) -m maxdiff.training.train --config configs/train-demo.yaml --out $(CAPTIONS_OUT)/model \
	  --snapshots $(CAPTIONS_OUT)/snapshots --vae-from $(DEMO_OUT) \
	  --set init_from=$(DEMO_OUT) captions=v2 save_every=500 \
	  "unet_train={steps: 3000, batch: 32, lr: 3.0e-4, warmup: 100, weight_decay: 0.01}"

# The demo model from scratch on caption set v2 (#25; the run and its snapshot rule are in
# pipelines/demo_eval.py, fixed before training): train-demo's config, VAE reused, snapshots every
# 2,500 steps in out/demo-v2/snapshots (1.5-2.5 h on 2 idle cores). Stopped (Ctrl-C, kill), the
# same command continues from out/demo-v2/state.npz to the same weights.
V2_OUT ?= out/demo-v2
train-demo-v2: $(STAMP)
	$(PY) -m maxdiff.training.train --config configs/train-demo.yaml --out $(V2_OUT)/model \
	  --snapshots $(V2_OUT)/snapshots --vae-from $(DEMO_OUT) --set captions=v2 save_every=2500 \
	  --state $(V2_OUT)/state.npz

clean:
	rm -rf $(VENV) out .pytest_cache
