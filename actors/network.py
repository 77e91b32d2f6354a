"""Where a stage that receives streams binds: this node's address as Ray sees it."""
from __future__ import annotations


def node_address() -> str:
    """This node's IP as Ray sees it (reachable from other nodes), else loopback."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except Exception:  # noqa: BLE001 - no Ray, or no node: a single machine
        pass
    return "127.0.0.1"
