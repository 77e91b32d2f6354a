"""The roles of runnel's stages, declared in one place.

Each stage is a plain class implementing one role. A stage group (``actors.manager.ActorManager``)
hosts instances in this process or as Ray actors and calls the same methods either way, so a
stage is debugged in-process exactly as it runs on a cluster. The driver (``pipeline``) only wires
groups of these roles; it never reaches into a stage's private state.

What crosses between stages: chunks as codec frames (``protocols``), weights as ``{name: numpy
array}`` dicts (one ``ray.put``, many readers), metrics as ``MetricsLogger.export()`` plain data,
state as plain data and tensors (checkpoints load it with ``torch.load(weights_only=True)``).

Evaluators are env runners in a group of their own (their own weights sync, fault tolerance and
settings); an algorithm reading recorded experience uses a reader in the env runners' place.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable


class UserCodeError(RuntimeError):
    """An error in user code run by a stage (a callback, a function given to ``foreach_env_runner``).
    Restarting the stage would only repeat it, so a stage group hands it to the caller instead."""


def is_user_code_error(err: BaseException | None) -> bool:
    """Whether ``err`` is marked as the user's: a ``UserCodeError``, or an exception with ``runnel_user_code`` set
    (``call_user_fn``, ``MappingError``). Restarting the stage that raised it would only repeat it."""
    return isinstance(err, UserCodeError) or bool(getattr(err, "runnel_user_code", False))


class Stage(ABC):
    """What every stage offers its group."""

    @abstractmethod
    def ping(self) -> str:
        """Cheap liveness probe: "ok"."""

    @abstractmethod
    def apply(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(self)`` where the stage lives (``foreach_env_runner``, ``foreach_learner``)."""

    @abstractmethod
    def stop(self) -> None:
        """Release threads, sockets and environments."""


class Saveable(ABC):
    @abstractmethod
    def get_state(self) -> dict[str, Any]:
        """Everything needed to continue exactly (plain data, numpy arrays, torch tensors)."""

    @abstractmethod
    def set_state(self, state: dict[str, Any]) -> None:
        ...


class MetricsSource(ABC):
    @abstractmethod
    def get_metrics(self) -> dict[str, Any]:
        """What the stage logged since the last call (``MetricsLogger.export()``), for the driver's merge."""


class EnvRunnerRole(Stage, Saveable, MetricsSource):
    """Acts in environments with an inference-only module and emits episode chunks."""

    @abstractmethod
    def sample(self, num_timesteps: int | None = None, num_episodes: int | None = None,
               explore: bool | None = None) -> list[Any]:
        """Episode chunks of at least ``num_timesteps`` steps, or exactly ``num_episodes`` whole episodes."""

    @abstractmethod
    def sample_encoded(self, num_timesteps: int | None = None, explore: bool | None = None,
                       compress: bool = False) -> tuple[bytes, dict[str, Any]]:
        """``sample`` as one codec frame, with ``get_metrics()`` (one round trip per request)."""

    @abstractmethod
    def set_weights(self, weights: dict[str, Any], weights_version: int = 0, timestep: int | None = None) -> None:
        """New policy weights, stamped on the chunks sampled with them (applied between fragments
        while streaming); ``timestep``, the run's env steps so far, drives exploration schedules."""

    @abstractmethod
    def get_weights(self) -> dict[str, Any]:
        ...

    @abstractmethod
    def start_streaming(self, address: str, hwm: int = 4, compress: bool = True, sndbuf: int = 0,
                        stall_timeout_s: float = 60.0, window: int | None = None) -> None:
        """Sample forever in a background thread, pushing chunk frames to ``address`` (ZeroMQ), at most
        ``window`` frames ahead of what the receiver has read (None: bounded by ``hwm`` and ``sndbuf``)."""

    @abstractmethod
    def stop_streaming(self, timeout_s: float = 10.0) -> bool:
        ...

    @abstractmethod
    def is_streaming(self) -> bool:
        ...

    def stream_totals(self) -> dict[str, int]:
        """Env steps pushed to each receiver address over the runner's life (ZeroMQ accepted them): what was
        sent to a learner that died. A runner that never streams has sent nothing."""
        return {}

    def pop_connector_deltas(self) -> list[Any] | None:
        """What the runner's env-to-module connectors learned since the last call (None: nothing to share)."""
        return None

    def sync_connectors(self, state: list[dict[str, Any]]) -> None:
        """The driver's merged connector state (runners without stateful connectors ignore it)."""


class LearnerRole(Stage, Saveable):
    """Owns trainable modules, their optimizers and targets; turns batches into updates."""

    @abstractmethod
    def update(self, batch: Any, timestep: int) -> dict[str, float]:
        """One update from a batch (a list of chunks, or replayed transitions); returns its statistics."""

    @abstractmethod
    def get_weights(self, inference_only: bool = False) -> dict[str, Any]:
        ...

    @abstractmethod
    def set_weights(self, weights: dict[str, Any]) -> None:
        ...


class ReplayRole(Stage, Saveable, MetricsSource):
    """Stores experience and serves training batches under a replay-ratio limit (off-policy algorithms)."""

    @abstractmethod
    def add(self, chunks: list[Any]) -> None:
        """Insert episode chunks (may wait while the samples-per-insert limit holds inserts back)."""

    @abstractmethod
    def sample(self, batch_size: int) -> Any:
        """A training batch (may wait while the limit holds sampling back)."""

    @abstractmethod
    def update_priorities(self, indices: Any, priorities: Any) -> None:
        """New priorities for sampled rows (prioritized replay)."""


class InferenceRole(Stage, Saveable, MetricsSource):
    """Holds a module and answers env runners' observations with actions (central inference): requests
    from many runners batched into one forward pass, exploration applied per runner."""

    @abstractmethod
    def address(self) -> str:
        """Where runners connect (``tcp://<node ip>:<port>``)."""

    @abstractmethod
    def set_weights(self, weights: dict[str, Any], weights_version: int = 0, timestep: int | None = None) -> None:
        """New weights, used from the next batch on (and stamped on its answers); returns once applied."""

    @abstractmethod
    def get_weights(self) -> dict[str, Any]:
        ...


def call_user_fn(fn: Callable[[Any], Any], stage: Any) -> Any:
    """``fn(stage)``; an error it raises is marked as the user's (``runnel_user_code``), which a stage
    group hands to the caller instead of restarting the stage (it would only repeat)."""
    try:
        return fn(stage)
    except Exception as err:
        try:
            err.runnel_user_code = True
        except AttributeError:  # an exception class that takes no attributes: the method says it all
            pass
        raise
