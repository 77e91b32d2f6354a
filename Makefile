# Quick start:  make train   (set up, then train PPO on CartPole on the local embedded Ray)
#               make evaluate CHECKPOINT=<dir>   (play 10 episodes with a checkpoint 'make train' printed;
#                              ARGS='--episodes 3 --render' passes more flags to runnel evaluate)
#               make test    (set up, then run the test suite; .ci/run calls this)
#               make test-seeds   (the learning tests' further seeds: DQN and SAC seeds 1-2, IMPALA from clients; 1-2 min each)
#               make test-long    (runs of several minutes: multi-agent tic-tac-toe self-play, mpe2, two-policy APPO to 800, nodes lost on a simulated cluster,
#                                  learner recovery, two-learner IMPALA/APPO, the 3-minute soak; 30-40 min)
#               make test-fast   (the edit loop: unit, property and protocol tests, no learning or slow runs; 1.7-2.5 min on 2 fast cores, 3.7 on a slower AMD EPYC VM)
#               make help    (this text)
# Any other runnel command in a fresh shell: .venv/bin/runnel ..., or '. .venv/bin/activate' first.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin
# make test and make test-fast run test modules in this many worker processes (pytest-xdist; each module
# starts its own small Ray): 2 keeps the suite's CPUs busy on a 2-core machine; 1 runs them in this process.
TEST_WORKERS ?= 2
XDIST   = $(if $(filter 1,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile)
STAMP   = $(VENV)/.runnel-installed

.PHONY: setup train evaluate test test-seeds test-long test-fast bench clean help c-client-deps c-client

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip uninstall -q -y runnel >/dev/null 2>&1 || true   # the distribution's old name (now runnel-rl)
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	touch $(STAMP)

setup: $(STAMP)

train: setup
	$(BIN)/runnel train file tuned/cartpole-ppo.yaml

evaluate: setup
	@test -n "$(CHECKPOINT)" || { echo "make evaluate needs CHECKPOINT=<checkpoint directory>, the path 'make train' prints at the end, e.g. make evaluate CHECKPOINT=~/runnel_results/PPO_CartPole-v1_<date>/checkpoint_000050" >&2; exit 2; }
	$(BIN)/runnel evaluate $(CHECKPOINT) $(ARGS)

test: setup
	$(BIN)/python -m pytest -q $(XDIST) --durations=40 tests

test-seeds: setup
	$(BIN)/python -m pytest -q -m seeds tests

test-long: setup
	$(BIN)/python -m pytest -q -m long tests

test-fast: setup
	$(BIN)/python -m pytest -q $(XDIST) -m 'not learning and not slow and not seeds and not long' tests

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

help:
	@sed -n '/^# Quick start/,/^# Any other/p' Makefile | sed 's/^# \{0,1\}//'
