# Quick start:  make train   (set up, then train PPO on CartPole on the local embedded Ray)
#               make test    (set up, then run the test suite; .ci/run calls this)
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.runnel-installed

.PHONY: setup train test bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

train: setup
	$(BIN)/runnel train file tuned/cartpole-ppo.yaml

test: setup
	$(BIN)/python -m pytest -q tests

bench: setup
	$(BIN)/python tests/benchmarks/codec.py
	$(BIN)/python tests/benchmarks/ppo_cartpole.py

clean:
	rm -rf $(VENV) build *.egg-info
