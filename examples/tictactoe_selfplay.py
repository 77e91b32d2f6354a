"""Tic-tac-toe by self-play: a PPO module ``"main"`` learns PettingZoo's ``tictactoe_v3`` against itself
and against a frozen copy of its untrained self (RLlib's self-play pattern of a trained main policy
against frozen older copies, here the oldest one).

PettingZoo's observation is drawn from the mover's side (plane 0: own marks, plane 1: the
opponent's), so one policy serves X and O. Episodes take turns (``League``): main against main, main
as X against the frozen copy, the frozen copy as X against main. Main against main alone converges
to the drawing play of two good players: on seed 0 after 120k moves the greedy policy beat a random
player in 89 % of games as X and 81.5 % as O (0 losses, the rest draws) -- strong, but not the
exploitation of weak moves a win needs. The frozen copy (``policies_to_train=["main"]``) keeps its
near-uniform initial policy, which the action mask turns into a random legal player. The observation's
``"action_mask"`` keeps the policy on empty squares (``actors.modules.action_mask``): it is never a
network input, it only rules out illegal moves. ``TicTacToe`` checks every move against the mask
its mover was shown and counts the illegal ones, so "no illegal move" is measured, not assumed.
After training, the greedy policy plays a uniformly random legal player as X and as O.

    python -m examples.tictactoe_selfplay [iterations [evaluate_every [rotation [lr_json]]]]
    python -m examples.tictactoe_selfplay 24 4 self,first,second,second 1e-3

``tests/test_tictactoe_selfplay.py`` runs this recipe.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from actors.modules.action_mask import observation_mask
from pipeline import PPOConfig, PettingZooEnv
from pipeline.algorithm import Algorithm

MODULE = "main"
FROZEN = "frozen_initial"
ROTATION = ("self", "first", "second")
"""The episodes' kinds in turn (``League``)."""
LR = [[0, 1e-3], [96_000, 1e-4]]
"""Learning rate over moves sampled. Seed 0, wins as O in 200 games at iterations 12/16/20/24: with
this decay 90/90/91/91 % (2 losses from 16 on); with a constant 1e-3 and the rotation
self/first/second/second 90.5/87.5/89.5/91.5 % (2-13 losses): the decay keeps late updates steady."""


def make_game() -> Any:
    from pettingzoo.classic import tictactoe_v3  # the pettingzoo extra

    return tictactoe_v3.env()


class TicTacToe(PettingZooEnv):
    """PettingZoo tic-tac-toe as a ``MultiAgentEnv`` that records every move and every illegal one
    (an action the mover's last ``action_mask`` ruled out; PettingZoo would end the game on it)."""

    def __init__(self, config: dict | None = None) -> None:
        super().__init__(make_game())
        self.moves = 0
        self.illegal_moves = 0
        self.shown: dict[Any, Any] = {}  # each agent's last observation

    def reset(self, *, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        obs, infos = super().reset(seed=seed, options=options)
        self.shown = dict(obs)
        return obs, infos

    def step(self, action_dict: dict) -> tuple[dict, dict, dict, dict, dict]:
        for agent, action in action_dict.items():
            self.moves += 1
            mask = observation_mask(self.shown.get(agent))
            if mask is None or not mask[int(action)]:
                self.illegal_moves += 1
        obs, rewards, terminateds, truncateds, infos = super().step(action_dict)
        self.shown.update(obs)
        return obs, rewards, terminateds, truncateds, infos


def to_shared(agent_id: Any, episode: Any, **kwargs: Any) -> str:
    """Both players on one module (plain self-play)."""
    return MODULE


class League:
    """The policy mapping: the ``k``-th episode that starts in this process is of kind
    ``rotation[k % len(rotation)]``: ``"self"`` main against main, ``"first"`` main as X against the
    frozen copy, ``"second"`` the frozen copy as X against main. Counting, not drawing at random: the
    same seed maps the same episodes the same way."""

    KINDS = ("self", "first", "second")

    def __init__(self, rotation: tuple[str, ...] = ROTATION) -> None:
        bad = [k for k in rotation if k not in self.KINDS]
        if not rotation or bad:
            raise ValueError(f"League rotation {rotation!r}: kinds must be among {self.KINDS}, at least one")
        self.rotation = tuple(rotation)
        self.kinds: dict[str, str] = {}  # episode id -> kind, for the episodes still running
        self.started = 0

    def __call__(self, agent_id: Any, episode: Any, **kwargs: Any) -> str:
        if episode.id_ not in self.kinds:
            self.kinds[episode.id_] = self.rotation[self.started % len(self.rotation)]
            self.started += 1
            if len(self.kinds) > 1024:  # long-finished episodes; a running one is among the newest
                del self.kinds[next(iter(self.kinds))]
        kind = self.kinds[episode.id_]
        first = agent_id == "player_1"
        return MODULE if kind == "self" or (kind == "first") == first else FROZEN


def selfplay_config(seed: int = 0, rotation: tuple[str, ...] = ROTATION, lr: Any = LR) -> PPOConfig:
    """The recipe, trained in the driver's process (a game is short and the model small: Ray actors
    would add more than they save on a laptop)."""
    return (PPOConfig().environment(TicTacToe)
            .multi_agent(policies={MODULE, FROZEN}, policy_mapping_fn=League(rotation), policies_to_train=[MODULE])
            .env_runners(num_env_runners=0, num_envs_per_env_runner=8)
            .rl_module(model_config={"fcnet_hiddens": [128, 128], "fcnet_activation": "relu"})
            .training(train_batch_size_per_learner=4000, minibatch_size=500, num_epochs=8, lr=lr,
                      gamma=0.95, lambda_=0.9, entropy_coeff=0.01, clip_param=0.2)
            .debugging(seed=seed))


def illegal_moves(algo: Algorithm) -> tuple[int, int]:
    """(moves, illegal moves) summed over the training envs."""
    counts = algo.env_runner_group.foreach_env_runner(
        lambda runner: runner.foreach_env(lambda env: (env.moves, env.illegal_moves)))
    pairs = [pair for per_runner in counts for pair in per_runner]
    return sum(m for m, _ in pairs), sum(i for _, i in pairs)


@dataclass
class Record:
    """Games of the learned policy against the random player, from the learned policy's side."""

    wins: int = 0
    draws: int = 0
    losses: int = 0
    moves: int = 0
    illegal_moves: int = 0

    @property
    def games(self) -> int:
        return self.wins + self.draws + self.losses

    @property
    def win_rate(self) -> float:
        return self.wins / max(1, self.games)


def play_random(policy: Callable[[dict], int], games: int, learned_first: bool, seed: int = 0) -> Record:
    """``games`` games of ``policy`` (an observation -> a square) against a uniformly random legal player."""
    rng = np.random.default_rng(seed)
    record = Record()
    env = make_game()
    for game in range(games):
        env.reset(seed=seed + game)
        learned = env.possible_agents[0 if learned_first else 1]
        for agent in env.agent_iter():
            obs, reward, terminated, truncated, _ = env.last()
            if terminated or truncated:
                if agent == learned:
                    record.wins += reward > 0
                    record.draws += reward == 0
                    record.losses += reward < 0
                env.step(None)
                continue
            legal = np.flatnonzero(obs["action_mask"])
            if agent == learned:
                action = int(policy(obs))
                record.moves += 1
                record.illegal_moves += action not in legal
            else:
                action = int(rng.choice(legal))
            env.step(action)
    env.close()
    return record


def greedy(algo: Algorithm) -> Callable[[dict], int]:
    return lambda obs: algo.compute_single_action(obs, explore=False, policy_id=MODULE)


def main(iterations: int = 20, evaluate_every: int = 4, rotation: str = ",".join(ROTATION), lr: Any = LR) -> None:
    algo = selfplay_config(rotation=tuple(rotation.split(",")), lr=lr).build(logdir=None)
    try:
        for i in range(1, iterations + 1):
            result = algo.train()
            print(f"iteration {i}: {result['env_runners']['num_env_steps_sampled_lifetime']} moves, "
                  f"mean episode length {result['env_runners']['episode_len_mean']:.2f}", flush=True)
            if i % evaluate_every == 0 or i == iterations:
                for first, seed in ((True, 10_000), (False, 20_000)):
                    r = play_random(greedy(algo), 200, learned_first=first, seed=seed)
                    print(f"  as {'first' if first else 'second'} player: {r.wins} wins, {r.draws} draws, "
                          f"{r.losses} losses of {r.games}; {r.illegal_moves} illegal of {r.moves} moves", flush=True)
        moves, illegal = illegal_moves(algo)
        print(f"training: {moves} moves, {illegal} illegal")
    finally:
        algo.stop()


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]), *sys.argv[3:4], *(json.loads(a) for a in sys.argv[4:5]))
