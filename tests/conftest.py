import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Ray workers inherit this environment: lets them import tests.envs for the test environments.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray with a small fixed CPU count, started once per test module and shut down after."""
    import ray

    ray.init(num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()
