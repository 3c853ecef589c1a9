# The two commands of the README's quick start. Each sets up its own virtualenv on first use.
#   make demo   # build the tiny local models, then run the CPU smoke recipe end to end (adapter in outputs/smoke)
#   make test   # the test suite, in one pytest process

VENV ?= .venv
PY := $(VENV)/bin/python
export HF_HUB_OFFLINE := 1
export WANDB_MODE := offline
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test lint clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch first: on this kind of machine a looser requirement pulls a multi-GB CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/trl-opd make-tiny artifacts/tiny
	$(VENV)/bin/accelerate launch --config_file recipes/accelerate/cpu.yaml -m trl_opd --config recipes/smoke_cpu.yaml

test: $(VENV)/.installed
	$(PY) -m pytest

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check trl_opd tests benchmarks

clean:
	rm -rf $(VENV) artifacts outputs
