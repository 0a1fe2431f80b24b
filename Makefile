# The two commands of a fresh clone, each doing its own set-up:
#
#   make example    # a virtual environment in .venv (once), then the example: a small GPT with ConnectionMonitor
#   make test       # the same environment, then the default tests (about 3 minutes on 2 cores)
#   make test ALL=1 # every test: also the suite-scale runs and the multi-process ones (what CI runs, about 12 minutes)
#
# The tests run in WORKERS pytest-xdist processes (default: one per core, at most 4), each with one OpenMP thread:
# two torch processes with a thread per core each would oversubscribe the cores, where OpenMP threads spin and small
# kernels run many times slower. The 20 slowest tests are listed at the end.
#
# The environment is built once and rebuilt only when pyproject.toml changes. torch comes first, from TORCH (the
# CPU build CI pins; on a CUDA machine: make test TORCH="torch==2.13.0" TORCH_INDEX=https://download.pytorch.org/whl/cu126,
# or TORCH=torch for what pip picks); then connmon with its [dev] extras (the tests, ruff, mypy); then litgpt, a
# code base the tests read, without its pins (they clash with transformers 5; its model code needs none of them).

PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
LITGPT ?= litgpt==0.5.13
ALL ?=
WORKERS ?= auto

BIN := $(VENV)/bin
STAMP := $(VENV)/.connmon-installed

.PHONY: example test env clean-env

example: $(STAMP)
	$(BIN)/python examples/train_tiny_gpt.py  # W&B offline unless a login is set up

test: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n $(WORKERS) --maxprocesses 4 --durations=20 $(if $(ALL),--all)

env: $(STAMP)

$(STAMP): pyproject.toml
	@echo "== setting up $(VENV): $(TORCH), then connmon[dev] (tests, ruff, mypy), then $(LITGPT) without its pins"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	if $(BIN)/python -m pip show litgpt >/dev/null 2>&1; then $(BIN)/python -m pip uninstall --quiet --yes litgpt; fi  # a rebuild: the check below is of what connmon needs
	$(BIN)/python -m pip check
	$(BIN)/python -m pip install --quiet --no-deps "$(LITGPT)"
	@echo "== $(LITGPT) went in without its pins (huggingface-hub<1.4, jsonargparse<=4.41), which transformers 5 and \
	connmon's tests cannot meet: from here on pip check names those two, and only those"
	@touch $(STAMP)
	@echo "== $(VENV) is ready: $$($(BIN)/python -c 'import torch, connmon; print("torch", torch.__version__)')"

clean-env:
	rm -rf $(VENV)
