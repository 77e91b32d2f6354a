"""A second algorithm on a Ray whose CPUs a first one holds fails at once, naming the holder.

Its own module (and so its own 2-CPU Ray): the check needs every CPU free when it starts, which a Ray shared with
Tune runs cannot promise -- Tune's clean-up of a finished trial is asynchronous, and a loaded machine once saw a
CPU held for minutes after every trial had ended, with no actor or placement group left to account for it."""
import pytest
import ray

from pipeline import Algorithm, PPOConfig


@pytest.fixture(scope="module")
def ray2():
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.slow
def test_a_second_algorithm_fails_fast_naming_the_one_holding_the_cpus(ray2, tmp_path):
    """On a 2-CPU Ray, restoring while the first algorithm's two runners still run cannot place its
    runners: say so at once (naming the holder), instead of waiting for a start-up timeout."""
    assert ray.available_resources().get("CPU") == 2
    first = (PPOConfig().environment("CartPole-v1").env_runners(num_env_runners=2, num_envs_per_env_runner=2)
             .training(train_batch_size_per_learner=256, minibatch_size=64, num_epochs=2).debugging(seed=0)
             .build(logdir=None))
    try:
        path = first.save(str(tmp_path / "ckpt"))
        with pytest.raises(RuntimeError, match=r"needs 2 CPUs .* 0 of 2 free: PPO built at .* holds 2 .*\.stop\(\)"):
            Algorithm.from_checkpoint(path, logdir=None)
    finally:
        first.stop()
    second = Algorithm.from_checkpoint(path, logdir=None)  # once the first is stopped, it fits
    second.stop()
