"""The RLlib pages' examples, continued: page 003, "Key concepts" (the rest, page 000, is in
``test_rllib_pages.py``, whose docstring says how these tests are written and what they check)."""
import numpy as np
import pytest


def _kill(actors):
    import ray

    for actor in actors:
        ray.kill(actor)


# --- 003 "Key concepts" ---------------------------------------------------------------------------------

def test_key_concepts_build_and_train(ray_cluster):
    """Page 003, "AlgorithmConfig and Algorithm": configure, build, ``print(algo.train())``."""
    from pipeline import PPOConfig

    # Configure.
    config = (
        PPOConfig()
        .environment("CartPole-v1")
        .training(
            train_batch_size_per_learner=500,  # runnel: 500, not 2000
            lr=0.0004,
        )
    )

    # Build the Algorithm.
    algo = config.build()

    try:
        # Train for one iteration, which is 2000 timesteps (1 train batch).
        result = algo.train()  # runnel: keep the result to check it
        print(result)
    finally:
        algo.stop()
    assert result["num_env_steps_sampled_lifetime"] >= 500
    assert result["training_iteration"] == 1


@pytest.mark.slow
def test_key_concepts_train_through_tune(ray_cluster, tmp_path):
    """Page 003: "Train through Ray Tune" with the config object and a lifetime-steps stop."""
    from ray import tune
    from ray import tune as train  # runnel: Ray 2.60: Tune takes tune.RunConfig (train.RunConfig(stop=...) raises)
    from pipeline import PPOConfig

    # Configure.
    config = (
        PPOConfig()
        .environment("CartPole-v1")
        .training(
            train_batch_size_per_learner=500,  # runnel: 500, not 2000
            lr=0.0004,
        )
    )

    # Train through Ray Tune.
    results = tune.Tuner(
        "PPO",
        param_space=config,
        # Train for 4000 timesteps (2 iterations).
        run_config=train.RunConfig(stop={"num_env_steps_sampled_lifetime": 1000},  # runnel: 1000, not 4000
                                   storage_path=str(tmp_path)),  # runnel: tmp_path, not ~/ray_results
    ).fit()

    assert not results.errors, results.errors
    assert results[0].metrics["training_iteration"] == 2
    assert results[0].metrics["num_env_steps_sampled_lifetime"] >= 1000


@pytest.mark.slow  # two env runner actors that import torch and, looking the env name up in Tune's registry, Ray Tune
def test_key_concepts_env_runner_actors(ray_cluster):
    """Page 003, "EnvRunner: Combining RL environment and RLModule": two remote env runners built
    from the config, each sampling three whole episodes."""
    from protocols import nested as tree  # runnel: dm_tree is no runnel dependency; nested.flatten flattens lists alike
    import ray
    from pipeline import PPOConfig
    from pipeline import SingleAgentEnvRunner

    # Configure the EnvRunners.
    config = (
        PPOConfig()
        .environment("Acrobot-v1")
        .env_runners(num_env_runners=2, num_envs_per_env_runner=1)
    )
    # Create the EnvRunner actors.
    env_runners = [
        ray.remote(SingleAgentEnvRunner).remote(config=config)
        for _ in range(config.num_env_runners)
    ]

    try:
        # Gather lists of `SingleAgentEpisode`s (each EnvRunner actor returns one
        # such list with exactly two episodes in it).
        episodes = ray.get([
            er.sample.remote(num_episodes=3)
            for er in env_runners
        ])
        # Two remote EnvRunners used.
        assert len(episodes) == 2
        # Each EnvRunner returns three episodes
        assert all(len(eps_list) == 3 for eps_list in episodes)

        # Report the returns of all episodes collected
        for episode in tree.flatten(episodes):
            print("R=", episode.get_return())
            assert -len(episode) <= episode.get_return() <= 0  # runnel: checked (Acrobot pays -1 a step)
    finally:
        _kill(env_runners)


@pytest.mark.slow
def test_key_concepts_learner_actor(ray_cluster):
    """Page 003, "Learner: Combining RLModule, loss function and optimizer": a remote PPO learner
    built from the config, updated from a list of episodes."""
    from protocols import nested as tree  # runnel: dm_tree is no runnel dependency; nested.flatten flattens lists alike
    from pipeline import PPOConfig as _PPOConfig

    # runnel: the episodes "we got from the EnvRunners above", sampled the runnel way today
    sampler = _PPOConfig().environment("Acrobot-v1").env_runners(num_env_runners=0, num_envs_per_env_runner=1).build()
    try:
        episodes = sampler.foreach_env_runner(lambda runner: runner.sample(num_episodes=2))
    finally:
        sampler.stop()

    import gymnasium as gym
    import ray
    from pipeline import PPOConfig
    from pipeline import DefaultModelConfig

    # Configure the Learner.
    config = (
        PPOConfig()
        .environment("Acrobot-v1")
        .training(lr=0.0001)
        .rl_module(model_config=DefaultModelConfig(fcnet_hiddens=[64, 32]))
    )
    # Get the Learner class.
    ppo_learner_class = config.get_default_learner_class()

    # Create the Learner actor.
    learner_actor = ray.remote(ppo_learner_class).remote(
        config=config,
        module_spec=config.get_multi_rl_module_spec(env=gym.make("Acrobot-v1")),
    )
    try:
        # Build the Learner.
        ray.get(learner_actor.build.remote())

        # Perform an update from the list of episodes we got from the `EnvRunners` above.
        learner_results = ray.get(learner_actor.update_from_episodes.remote(
            episodes=tree.flatten(episodes)
        ))
        print(learner_results["default_policy"]["policy_loss"])
        assert np.isfinite(learner_results["default_policy"]["policy_loss"])  # runnel: checked
    finally:
        _kill([learner_actor])
