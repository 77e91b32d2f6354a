import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Ray workers inherit this environment: lets them import tests.envs for the test environments.
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
# The suite runs on Ray instances of its own, never on a cluster the machine happens to run: without
# RAY_ADDRESS every build (ray_address=None) starts runnel's own local Ray, and so do the subprocesses
# the tests start; the modules' own ray.init calls say address="local".
os.environ.pop("RAY_ADDRESS", None)
# Ray runs its workers at nice 15 and leaves drivers at 0. make test runs two modules side by side, each with
# its own Ray: one module's driver training a learner in-process would then take ~97 % of a shared core from
# the other module's actors (a runner not started in 120 s, a Tune trial's process minutes to exit). At equal
# niceness every process of the suite gets its fair share.
os.environ.setdefault("RAY_worker_niceness", "0")
# algo.train() writes a results directory (see pipeline.run_dirs): keep the suite's out of ~/runnel_results.
if "RUNNEL_RESULTS_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["RUNNEL_RESULTS_DIR"] = tempfile.mkdtemp(prefix="runnel-test-results-")
    atexit.register(shutil.rmtree, os.environ["RUNNEL_RESULTS_DIR"], True)


def pytest_configure(config):
    # make test runs two worker processes on two cores: torch's default of an intra-op thread per core in each
    # would spin against the other (algorithms set the driver's threads themselves; this covers the tests that
    # drive learners and modules directly)
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray of the module's own (never a running cluster) with a small fixed CPU count, started once
    per test module and shut down after."""
    import ray

    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    yield ray
    ray.shutdown()


# Rough cost of a test by its marker, for ordering the files below (a learning run takes a minute or more; a slow
# integration run several seconds; the rest well under one).
_COST = {"learning": 60, "slow": 10}


@pytest.hookimpl(trylast=True)  # after -m has deselected the long and seeds tests
def pytest_collection_modifyitems(session, config, items):
    # Under pytest-xdist (make test: --dist loadfile) each file goes to whichever worker is free, in collection
    # order. Alphabetical order can leave a learning-heavy file for the end, run by one worker while the other
    # idles; the costliest files first (longest processing time first) keeps both workers busy to the end.
    if config.getoption("dist", "no") == "no":
        return
    cost: dict[str, int] = {}
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        path = item.fspath.strpath
        first_seen.setdefault(path, i)
        cost[path] = cost.get(path, 0) + max((c for m, c in _COST.items() if item.get_closest_marker(m)), default=1)
    items.sort(key=lambda item: (-cost[item.fspath.strpath], first_seen[item.fspath.strpath]))
