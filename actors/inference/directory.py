"""InferenceDirectory: where each inference server listens now, for runners to look up.

A recreated server binds a new address (possibly on another node). A runner waiting on a request
cannot be told so -- its actor is busy in that very call -- so it asks: after ``resend_after_s``
without an answer it looks its server up here and resends there. The driver's inference group
publishes each server's address when the server starts. Runners in the driver's process read the
object itself; remote runners read a small named Ray actor holding it. Torch-free.
"""
from __future__ import annotations

from typing import Any

from actors.inference.settings import InferenceClientSettings


class InferenceDirectory:
    def __init__(self) -> None:
        self.addresses: dict[int, str] = {}

    def publish(self, index: int, address: str) -> None:
        self.addresses[index] = address

    def lookup(self, index: int) -> str | None:
        return self.addresses.get(index)

    def ping(self) -> str:
        return "ok"


def lookup_address(settings: InferenceClientSettings, server: int, timeout_s: float) -> str | None:
    """Server ``server``'s address as the directory knows it (None: not published yet, or the
    directory did not answer within ``timeout_s``)."""
    directory: Any = settings.directory
    if not isinstance(directory, str):
        return directory.lookup(server)
    import ray
    from ray.exceptions import GetTimeoutError, RayError

    try:
        actor = ray.get_actor(directory, namespace=settings.namespace)
        return ray.get(actor.lookup.remote(server), timeout=timeout_s)
    except (GetTimeoutError, RayError, ValueError):  # ValueError: no actor of that name (being recreated)
        return None
