"""What Ray Tune needs to host runnel's algorithms as trials.

``pipeline.registry.register_algorithm`` calls ``register_with_tune`` for each algorithm as its module is
imported (``pipeline``'s first algorithm or config name imports every built-in), so
``tune.Tuner("PPO", param_space=config.to_dict())`` finds it by name and ``tune.Tuner(PPO,
param_space=config)`` takes the config object itself. Each trial gets one placement group holding
the driver and every actor the config asks for (Ray places the trial's actors inside it).
"""
from __future__ import annotations

import logging
from typing import Any

import ray.tune
from ray.tune.execution.placement_groups import PlacementGroupFactory

log = logging.getLogger("runnel")


def resource_request(config: Any) -> PlacementGroupFactory:
    """Bundles: the driver (with the learner when ``num_learners=0``), then each env runner,
    learner actor, evaluator and inference server; packed onto as few nodes as fit."""
    local_gpus = config.num_gpus_per_learner if config.num_learners == 0 else 0
    bundles = [{"CPU": config.num_cpus_for_main_process, "GPU": local_gpus}]
    bundles += [{"CPU": config.num_cpus_per_env_runner}] * config.num_env_runners
    bundles += [{"CPU": config.num_cpus_per_learner, "GPU": config.num_gpus_per_learner}] * config.num_learners
    bundles += [{"CPU": config.num_cpus_per_env_runner}] * config.evaluation_num_env_runners
    from pipeline.config.inference import inference_settings

    inference = inference_settings(config) if config.num_env_runners > 0 else None
    if inference is not None:  # central inference servers (with runners in the driver, they are too)
        bundles += [{"CPU": inference.num_cpus_per_inference_server,
                     "GPU": inference.num_gpus_per_inference_server}] * inference.num_inference_servers
    return PlacementGroupFactory([{k: v for k, v in b.items() if v} or {"CPU": 0.01} for b in bundles],
                                 strategy="PACK")


# name -> algorithm class, registered again in every Ray session (see below)
_TRAINABLES: dict[str, type] = {}


def register_with_tune(name: str, algo_cls: type) -> None:
    """Make ``algo_cls`` a Tune trainable under ``name``, and its config class a valid ``param_space``."""
    _TRAINABLES[name] = algo_cls
    ray.tune.register_trainable(name, algo_cls, warn=False)
    # Tune turns a ``param_space`` into a dict only for subclasses of its (private) config base class,
    # an ABC: registering ours as a virtual subclass is the one hook it offers.
    config_base = getattr(getattr(ray.tune, "tune", None), "_Config", None)
    if config_base is not None and hasattr(config_base, "register"):
        config_base.register(algo_cls.config_class)
    else:  # a Ray version without it: dicts (config.to_dict()) still work
        log.debug("ray.tune has no config base class here; pass param_space=config.to_dict()")


def _register_in_this_session() -> None:
    # Tune keeps names registered before ray.init() and writes them into the first Ray session only:
    # after ray.shutdown() and a new ray.init() in the same process, tune.Tuner("PPO") would find no
    # "PPO". Ray runs these hooks after every ray.init() in the driver.
    for name, algo_cls in _TRAINABLES.items():
        ray.tune.register_trainable(name, algo_cls, warn=False)


_hooks = getattr(getattr(ray, "_private", None), "worker", None)
if _hooks is not None and isinstance(getattr(_hooks, "_post_init_hooks", None), list):
    _hooks._post_init_hooks.append(_register_in_this_session)
