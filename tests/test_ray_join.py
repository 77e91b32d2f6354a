"""Which Ray runnel runs on while another Ray already runs on the machine: the ``ray_address`` rule.

The rule itself (``pipeline.config.cluster``) is checked as a table. Then a real head is started with
``ray start --head`` (2 CPUs, token authentication, as a user's would be) under a temporary directory of
its own: Ray's lookup finds it only where this module points ``RAY_TMPDIR`` there, so the other Ray
users of the machine never see it, and every process of its session is killed at the end. With it
running, Ray's default ``ray.init(num_cpus=...)`` fails as runnel's builds used to; runnel's default and
``"local"`` start their own Ray instead; an address, ``RAY_ADDRESS`` or ``"auto"`` join it, saying so and
refusing a config the cluster cannot hold. Joins run in a fresh driver process (``tests/ray_join_driver.py``),
because Ray reads ``RAY_AUTH_MODE`` once, when it is imported.
"""
from __future__ import annotations

import json
import os
import pathlib
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Iterator

import pytest
import ray

from pipeline import DQNConfig, PPOConfig
from pipeline.config.base import ConfigError
from pipeline.config.cluster import ray_target
from pipeline.ray_cluster import actor_needs

ROOT = pathlib.Path(__file__).resolve().parents[1]
RAY_CLI = os.path.join(os.path.dirname(sys.executable), "ray")
DRIVER_TIMEOUT_S = 600


@pytest.mark.parametrize("setting, environ, address, joins", [
    (None, {}, "local", False),
    (None, {"RAY_ADDRESS": "10.0.0.1:6379"}, "10.0.0.1:6379", True),
    ("local", {"RAY_ADDRESS": "10.0.0.1:6379"}, "local", False),
    ("auto", {}, "auto", True),
    ("auto", {"RAY_ADDRESS": "10.0.0.1:6379"}, "10.0.0.1:6379", True),
    ("10.0.0.2:6379", {"RAY_ADDRESS": "10.0.0.1:6379"}, "10.0.0.2:6379", True),
    ("ray://head:10001", {}, "ray://head:10001", True),
])
def test_the_rule_picks_runnels_own_ray_unless_told_to_join(setting, environ, address, joins):
    target = ray_target(setting, environ)
    assert (target.address, target.joins) == (address, joins)


@pytest.mark.parametrize("value", ["localhost", "http://127.0.0.1:8265", 6379, "head:0", "head:port", "", "ray://"])
def test_a_value_that_is_no_ray_address_is_refused_at_validate(value):
    with pytest.raises(ConfigError) as err:
        PPOConfig().environment("CartPole-v1").resources(ray_address=value).validate()
    message = str(err.value)
    assert f"ray_address={value!r} is not a Ray address" in message
    assert "'local'" in message and "'auto'" in message and "'host:port'" in message
    if isinstance(value, str) and value.startswith("http://"):
        assert "dashboard" in message  # the address `ray job submit` takes, not ray.init


def test_needs_count_every_actor_the_config_may_start():
    ppo = (PPOConfig().env_runners(num_env_runners=3, num_cpus_per_env_runner=0.5)
           .evaluation(evaluation_num_env_runners=2).learners(num_learners=2, num_gpus_per_learner=1))
    needs = actor_needs(ppo)
    assert (needs.cpus, needs.gpus) == (3 * 0.5 + 2 * 0.5 + 2 * 1, 2)
    assert needs.describe() == ("3 env runners x 0.5 CPU, 2 evaluation env runners x 0.5 CPU, "
                                "2 learners x 1 CPU + 1 GPU")
    dqn = DQNConfig().env_runners(num_env_runners=1).training(replay_buffer_config={"remote": True, "num_cpus": 2})
    assert actor_needs(dqn).cpus == 1 + 2 and "1 replay actor x 2 CPU" in actor_needs(dqn).describe()


# --- a running head --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Head:
    address: str
    """The head's GCS host:port."""
    tmpdir: str
    """As RAY_TMPDIR, where Ray's own lookup (``ray.init()``, ``"auto"``) finds the head."""
    token: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_session(sid: int) -> None:
    """SIGKILL every process of session ``sid``: the head's daemons and the workers its raylet started
    (they leave its process group, not its session). Never ``ray stop``: that stops every Ray here."""
    assert sid != os.getsid(0), "the head must run in a session of its own"
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            if os.getsid(pid) == sid:
                os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # gone meanwhile, or not ours


@pytest.fixture(scope="module")
def head() -> Iterator[Head]:
    tmpdir = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    token = secrets.token_hex(32)
    env = dict(os.environ, RAY_TMPDIR=tmpdir, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    env.pop("RAY_ADDRESS", None)
    # every port Ray would otherwise take at a fixed number, so a second head elsewhere does not collide
    cmd = [RAY_CLI, "start", "--head", f"--port={free_port()}", "--num-cpus=2", "--num-gpus=0",
           f"--temp-dir={tmpdir}/ray", "--include-dashboard=false", f"--dashboard-port={free_port()}",
           f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
           "--disable-usage-stats"]
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=DRIVER_TIMEOUT_S)  # `ray start` returns once the head is up
        assert proc.returncode == 0, out
        address = pathlib.Path(tmpdir, "ray", "ray_current_cluster").read_text().strip()
        yield Head(address, tmpdir, token)
    finally:
        kill_session(proc.pid)
        proc.wait()
        shutil.rmtree(tmpdir, ignore_errors=True)


def small_ppo(ray_address: str | None, env_runners: int = 1) -> PPOConfig:
    return (PPOConfig().environment("CartPole-v1")
            .env_runners(num_env_runners=env_runners, num_envs_per_env_runner=1)
            .resources(ray_address=ray_address))


@pytest.mark.slow
def test_default_and_local_start_runnels_own_ray_beside_a_running_cluster(head, monkeypatch):
    monkeypatch.setenv("RAY_TMPDIR", head.tmpdir)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert not ray.is_initialized()
    # what every build did before the rule: Ray's default finds the head, then refuses num_cpus
    with pytest.raises(ValueError, match="num_cpus and num_gpus must not be provided"):
        ray.init(num_cpus=2, include_dashboard=False)
    assert not ray.is_initialized()
    for setting, ray_address_env in ((None, None), ("local", head.address)):
        if ray_address_env is not None:
            monkeypatch.setenv("RAY_ADDRESS", ray_address_env)  # ignored by "local"
        algo = small_ppo(setting).build(logdir=None)
        try:
            assert ray.get_runtime_context().gcs_address != head.address, setting
            assert algo.env_runner_group.num_healthy() == 1
        finally:
            algo.stop()
            ray.shutdown()


def drive(head: Head, scenarios: list[dict[str, Any]], auth_mode: str | None) -> tuple[list[dict], str]:
    """Run the scenarios in a fresh driver process; -> (its JSON lines, its stderr)."""
    env = dict(os.environ, RAY_TMPDIR=head.tmpdir, RAY_AUTH_TOKEN=head.token)
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_AUTH_MODE", None)
    if auth_mode is not None:
        env["RAY_AUTH_MODE"] = auth_mode
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "ray_join_driver.py"), json.dumps(scenarios)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=DRIVER_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == len(scenarios), done.stdout + done.stderr[-3000:]
    return lines, done.stderr


@pytest.mark.slow
def test_an_address_ray_address_or_auto_joins_the_cluster_and_checks_its_resources(head):
    joined, stderr = drive(head, [
        {"ray_address": head.address, "env_runners": 1},
        {"ray_address": None, "env_runners": 1, "environ": {"RAY_ADDRESS": head.address}},
        {"ray_address": "auto", "env_runners": 1, "environ": {"RAY_ADDRESS": None}},
        {"ray_address": head.address, "env_runners": 3},
        {"ray_address": head.address, "env_runners": 1, "learners": 1, "gpus": 1},
    ], auth_mode="token")
    for result in joined[:3]:
        assert result == {"gcs_address": head.address, "healthy_runners": 1}, result
    assert stderr.count(f"joined the Ray cluster at {head.address}") == 5, stderr[-3000:]
    too_few_cpus, no_gpu = joined[3], joined[4]
    assert too_few_cpus["error"] == "ClusterTooSmall" and not too_few_cpus["ray_initialized"]
    assert "need 3 CPUs" in too_few_cpus["message"] and "3 env runners x 1 CPU" in too_few_cpus["message"]
    assert "has 2 CPUs and 0 GPUs in all" in too_few_cpus["message"]
    assert "1 CPU short" in too_few_cpus["message"] and "GPU short" not in too_few_cpus["message"]
    assert "ray_address='local'" in too_few_cpus["message"] and "num_env_runners" in too_few_cpus["message"]
    assert no_gpu["error"] == "ClusterTooSmall" and not no_gpu["ray_initialized"]
    assert "1 learner x 1 CPU + 1 GPU" in no_gpu["message"]
    assert "1 GPU short" in no_gpu["message"] and "CPU short" not in no_gpu["message"]


@pytest.mark.slow
def test_joining_a_token_cluster_by_address_without_token_mode_says_what_to_set(head):
    (refused,), _ = drive(head, [{"ray_address": head.address, "env_runners": 1}], auth_mode=None)
    assert refused["error"] == "ConnectionError" and not refused["ray_initialized"]
    assert f"could not join the Ray cluster at {head.address}" in refused["message"]
    assert "RAY_AUTH_MODE=token" in refused["message"] and "ray_address='local'" in refused["message"]
