# Quick start:  make train   (set up, then train PPO on CartPole on the local embedded Ray)
#               make test    (set up, then run the test suite; .ci/run calls this)
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.runnel-installed

.PHONY: setup train test bench clean c-client-deps c-client

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

# The C external client (examples/c_client): its build dependencies on Debian/Ubuntu, then the build.
c-client-deps:
	sudo apt-get install -y build-essential libzmq3-dev

c-client:
	cc -O2 -o examples/c_client/cartpole_client examples/c_client/cartpole_client.c -lzmq -lm

clean:
	rm -rf $(VENV) build *.egg-info
