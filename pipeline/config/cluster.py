"""Which Ray an algorithm runs on: the ``ray_address`` setting (``.resources(ray_address=...)``) and its rule.

Left to itself, Ray's ``ray.init()`` joins whatever cluster it finds (``RAY_ADDRESS``, else the latest
``ray start`` on the machine) and then refuses the ``num_cpus`` runnel sizes its own Ray with, so one
stray ``ray start --head`` made every build fail. runnel decides instead, by one rule:

- ``None`` (the default): join the cluster ``RAY_ADDRESS`` names when it is set (as ``ray job submit``
  runs a job's driver), else start runnel's own local Ray; a cluster merely found on the machine is
  never joined.
- ``"local"``: always runnel's own local Ray; ``RAY_ADDRESS`` and running clusters are ignored.
- ``"auto"``: join the running cluster, by Ray's own lookup: ``RAY_ADDRESS``, else the latest
  ``ray start`` on this machine, else any Ray running on it; an error when there is none.
- ``"host:port"`` or ``"ray://host:port"`` (Ray Client): join that cluster.

RLlib has no such setting (its actors join whatever ``ray.init()`` finds). These are pure functions of
the setting and the environment; ``pipeline.ray_cluster`` starts or joins Ray by them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

LOCAL = "local"
AUTO = "auto"
CLIENT_SCHEME = "ray://"
CHOICES = ("None (RAY_ADDRESS when set, else runnel's own local Ray)", "'local'", "'auto'", "'host:port'",
           "'ray://host:port'")
"""The values ``ray_address`` takes, as error messages list them."""


@dataclass(frozen=True)
class RayTarget:
    """Where ``ray.init`` goes: ``address`` as Ray takes it, and ``source``, what chose it (for messages)."""

    address: str
    source: str
    given_as: str = "ray_address"
    """Where ``address`` was written: the setting, or the ``RAY_ADDRESS`` environment variable."""

    @property
    def joins(self) -> bool:
        """A cluster that runs already (anything but runnel's own local Ray)."""
        return self.address != LOCAL


def address_problem(value: Any, name: str = "ray_address") -> str | None:
    """What is wrong with ``value`` as a Ray address named ``name``; None when it is one."""
    if value is None or value in (LOCAL, AUTO):
        return None
    if isinstance(value, str):
        rest = value[len(CLIENT_SCHEME):] if value.startswith(CLIENT_SCHEME) else value
        host, colon, port = rest.rpartition(":")
        if "://" not in rest and host and colon and port.isdigit() and 0 < int(port) < 65536:
            return None
    hint = (" (an http:// address is the dashboard's, which `ray job submit` takes; ray.init takes the "
            "cluster's host:port, 6379 by default)") if isinstance(value, str) and "://" in value else ""
    if name == "ray_address":
        return f"{name}={value!r} is not a Ray address{hint}; use one of {', '.join(CHOICES)}"
    return f"{name}={value!r} is not a Ray address{hint}; set it to the cluster's 'host:port' (or 'auto'), or unset it"


def ray_address_problems(config: Any) -> list[str]:
    problem = address_problem(config.ray_address)
    return [problem] if problem else []


def ray_target(setting: str | None, environ: Mapping[str, str]) -> RayTarget:
    """The Ray that ``ray_address=setting`` runs on, given the environment variables ``environ``."""
    from_env = environ.get("RAY_ADDRESS", "")
    if setting in (None, AUTO) and from_env:
        return RayTarget(from_env, f"RAY_ADDRESS={from_env!r} with ray_address={setting!r}", "RAY_ADDRESS")
    if setting is None:
        return RayTarget(LOCAL, "ray_address=None and no RAY_ADDRESS")
    return RayTarget(setting, f"ray_address={setting!r}")
