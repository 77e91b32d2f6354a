"""Starting or joining Ray for an algorithm: the one place the driver side calls ``ray.init``.

``init_ray_if_needed`` follows the ``ray_address`` rule of ``pipeline.config.cluster``: runnel's own local
Ray, sized for every actor the config asks for, or a running cluster joined deliberately -- said in a log
line, and its CPUs and GPUs checked against what the config's actors need, so that a cluster too small
fails at ``build()`` naming the shortfall instead of leaving actors pending until a timeout. A Ray this
process has already initialised (the user's own ``ray.init``, a Tune trial) is used as it is.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import ray

from pipeline.config.checks import ConfigError
from pipeline.config.cluster import CLIENT_SCHEME, RayTarget, address_problem, ray_target
from pipeline.config.inference import inference_settings

log = logging.getLogger("runnel")

SLACK = 1e-9
"""Fractional CPUs (0.5 per runner) add up with rounding error."""


class ClusterTooSmall(RuntimeError):
    """The joined cluster has fewer CPUs or GPUs in all than the config's actors need."""


@dataclass(frozen=True)
class ActorGroup:
    """``count`` actors of one kind (``what``: env runner, learner...) and what Ray reserves for each."""

    what: str
    count: int
    cpus: float
    gpus: float = 0.0

    def describe(self) -> str:
        each = f"{self.cpus:g} CPU" + (f" + {self.gpus:g} GPU" if self.gpus else "")
        return f"{self.count} {self.what}{'' if self.count == 1 else 's'} x {each}"


@dataclass(frozen=True)
class ActorNeeds:
    """The Ray actors a config asks for, group by group."""

    groups: tuple[ActorGroup, ...]

    @property
    def cpus(self) -> float:
        return sum(g.count * g.cpus for g in self.groups)

    @property
    def gpus(self) -> float:
        return sum(g.count * g.gpus for g in self.groups)

    def describe(self) -> str:
        parts = [g.describe() for g in self.groups if g.count > 0]
        return ", ".join(parts) if parts else "no actors"


def actor_needs(config: Any) -> ActorNeeds:
    """Every Ray actor ``config`` may start: env runners, evaluation env runners (whether built at set-up or
    at the first ``evaluate()``), learner actors, a remote replay actor and central inference servers. The
    driver runs outside Ray's accounting; with ``num_learners=0`` its learner's GPU is the driver machine's
    own (and so are an inference server's, with ``num_env_runners=0``: it runs in the driver too)."""
    replay = getattr(config, "replay_buffer_config", None)
    remote_replay = isinstance(replay, dict) and replay.get("remote") is True
    inference = inference_settings(config) if config.num_env_runners > 0 else None
    return ActorNeeds((
        ActorGroup("env runner", config.num_env_runners, config.num_cpus_per_env_runner),
        ActorGroup("evaluation env runner", config.evaluation_num_env_runners, config.num_cpus_per_env_runner),
        ActorGroup("learner", config.num_learners, config.num_cpus_per_learner, config.num_gpus_per_learner),
        ActorGroup("replay actor", int(remote_replay), float(replay.get("num_cpus", 1)) if remote_replay else 0.0),
        ActorGroup("inference server", 0 if inference is None else inference.num_inference_servers,
                   0.0 if inference is None else inference.num_cpus_per_inference_server,
                   0.0 if inference is None else inference.num_gpus_per_inference_server),
    ))


def init_ray_if_needed(config: Any) -> None:
    """Start runnel's own local Ray or join a running cluster, as ``config.ray_address`` says; nothing
    when Ray is already initialised in this process."""
    if ray.is_initialized():
        return
    target = ray_target(config.ray_address, os.environ)
    needs = actor_needs(config)
    if not target.joins:
        # address="local": Ray's default would join a cluster it finds and then refuse num_cpus
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, math.ceil(needs.cpus - SLACK)),
                 include_dashboard=False, logging_level=logging.WARNING, log_to_driver=True)
        return
    join_cluster(target, needs, config.algo_name)


def join_cluster(target: RayTarget, needs: ActorNeeds, name: str) -> None:
    """Connect to the cluster ``target`` names, say so, and check it can hold ``needs``; disconnected
    again (the cluster left running) when it cannot."""
    problem = address_problem(target.address, target.given_as)
    if problem:
        raise ConfigError(f"{problem}; or .resources(ray_address='local') for runnel's own local Ray")
    try:
        ray.init(address=target.address, logging_level=logging.WARNING)
    except ConnectionError as err:
        if refused_token(err):
            # Ray sends its token only to a cluster it found itself ("auto"), never to an address it was given
            raise ConnectionError(
                f"{name} could not join the Ray cluster at {target.address} ({target.source}): it asks for a token "
                f"and none was sent. Set RAY_AUTH_MODE=token with the cluster's token in ~/.ray/auth_token or "
                f"RAY_AUTH_TOKEN, or use ray_address='auto' on a node of that cluster; or set "
                f".resources(ray_address='local') for runnel's own local Ray") from err
        raise ConnectionError(
            f"{name} found no Ray cluster to join ({target.source}): {err}. Start one (ray start --head), "
            f"point RAY_ADDRESS or ray_address at a running one, or set .resources(ray_address='local') for "
            f"runnel's own local Ray") from err
    where = target.address if target.address.startswith(CLIENT_SCHEME) else ray.get_runtime_context().gcs_address
    total = ray.cluster_resources()
    cpus, gpus = total.get("CPU", 0.0), total.get("GPU", 0.0)
    nodes = sum(1 for n in ray.nodes() if n.get("Alive"))
    log.warning("%s joined the Ray cluster at %s (%s): %s, %s on %d node(s); its actors need %s, %s. "
                ".resources(ray_address='local') runs on runnel's own local Ray instead", name, where, target.source,
                amount(cpus, "CPU"), amount(gpus, "GPU"), nodes, amount(needs.cpus, "CPU"), amount(needs.gpus, "GPU"))
    short = [f"{amount(need - have, unit)} short"
             for need, have, unit in ((needs.cpus, cpus, "CPU"), (needs.gpus, gpus, "GPU")) if need > have + SLACK]
    if short:
        ray.shutdown()  # only this driver's connection: the cluster goes on
        raise ClusterTooSmall(
            f"{name} cannot run on the Ray cluster at {where} ({target.source}): its actors need "
            f"{amount(needs.cpus, 'CPU')} and {amount(needs.gpus, 'GPU')} ({needs.describe()}) but the cluster has "
            f"{amount(cpus, 'CPU')} and {amount(gpus, 'GPU')} in all on {nodes} node(s), {' and '.join(short)}. "
            f"Add nodes or start them with more (ray start --num-cpus=N --num-gpus=N); or ask for fewer (num_env_runners, num_cpus_per_env_runner=0.5 shares "
            f"CPUs, evaluation_num_env_runners, num_learners, num_gpus_per_learner); or train on runnel's own "
            f"local Ray: .resources(ray_address='local')")


def amount(n: float, unit: str) -> str:
    """``2 CPUs``, ``1 GPU``, ``0.5 CPU``."""
    return f"{n:g} {unit}" + ("" if n == 1 else "s")


def refused_token(err: BaseException) -> bool:
    """Whether Ray's failure to connect was the cluster refusing a missing or wrong token: an
    AuthenticationError in the chain, or (Ray's GCS client hands it on as text) named in a message."""
    chain: list[BaseException] = []
    at: BaseException | None = err
    while at is not None and at not in chain:
        chain.append(at)
        at = at.__cause__ or at.__context__
    return any(isinstance(e, ray.exceptions.AuthenticationError) or "AuthenticationError" in str(e) for e in chain)
