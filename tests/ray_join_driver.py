"""A driver process for tests/test_ray_join.py: builds PPO once per scenario and prints one JSON line each.

``python tests/ray_join_driver.py '[{"ray_address": ..., "env_runners": 1, "environ": {...}}, ...]'``: each
scenario sets (or, with None, removes) environment variables, builds PPO with the given ``ray_address``, and
reports the GCS address of the Ray it ran on, or the error the build raised. It runs in a fresh
interpreter because whether Ray sends its token to a cluster (``RAY_AUTH_MODE``) is fixed when Ray is
imported, and the test process's Ray has long been imported.
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any

import ray

from pipeline import PPOConfig


def run(scenario: dict[str, Any]) -> dict[str, Any]:
    for key, value in scenario.get("environ", {}).items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    config = (PPOConfig().environment("CartPole-v1")
              .env_runners(num_env_runners=scenario["env_runners"], num_envs_per_env_runner=1)
              .learners(num_learners=scenario.get("learners", 0), num_gpus_per_learner=scenario.get("gpus", 0))
              .resources(ray_address=scenario["ray_address"]))
    try:
        algo = config.build(logdir=None)
    except Exception as err:  # noqa: BLE001 - the test asserts which error, by name
        return {"error": type(err).__name__, "message": str(err), "ray_initialized": ray.is_initialized()}
    try:
        return {"gcs_address": ray.get_runtime_context().gcs_address,
                "healthy_runners": algo.env_runner_group.num_healthy()}
    finally:
        algo.stop()
        ray.shutdown()


if __name__ == "__main__":
    for s in json.loads(sys.argv[1]):
        print(json.dumps(run(s)), flush=True)
