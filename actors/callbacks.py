"""Callbacks: user code that runs at documented moments, in the process where the work happens.

Subclass ``Callbacks`` and override the hooks you need; the algorithm, its env runners, its
evaluators and its learners each build their own instance from the config's spec, so a hook runs
where its data lives (episode hooks inside the runner that steps the episode, ``on_learn_on_batch``
inside the learner). Hooks a class does not override cost nothing: the runner does not even build
episode views for callbacks that watch no episodes.

``CallbacksSpec`` is what travels in settings: classes (or import paths) and per-hook functions,
resolved in each process by ``build_callbacks``. An exception in a hook becomes a
``CallbackError`` naming the hook, the class or function, and where it ran; a stage group passes it
to the caller instead of restarting the stage (a restart would only repeat it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from actors.core import UserCodeError
from actors.imports import import_object

HOOKS = ("on_algorithm_init", "on_env_runners_recreated", "on_checkpoint_loaded", "on_environment_created",
         "on_sub_environment_created", "on_episode_created", "on_episode_start", "on_episode_step",
         "on_episode_end", "on_sample_end", "on_evaluate_start", "on_evaluate_end", "on_learn_on_batch",
         "on_postprocess_trajectory", "on_train_result")
EPISODE_HOOKS = ("on_episode_created", "on_episode_start", "on_episode_step", "on_episode_end")


class CallbackError(UserCodeError):
    """A callback raised; the message names the hook, the callback and the process it ran in."""


class Callbacks:
    """Every hook is a no-op here. Keyword arguments follow RLlib's; ``**kwargs`` keeps old
    signatures working when a hook gains an argument."""

    # --- driver -------------------------------------------------------------------------------
    def on_algorithm_init(self, *, algorithm: Any, metrics_logger: Any = None, **kwargs: Any) -> None:
        """At the end of the algorithm's set-up, before any training."""

    def on_env_runners_recreated(self, *, algorithm: Any, env_runner_group: Any, env_runner_indices: list[int],
                                 is_evaluation: bool, **kwargs: Any) -> None:
        """After failed env runners (training or evaluation ones) were recreated and restored."""

    def on_checkpoint_loaded(self, *, algorithm: Any, **kwargs: Any) -> None:
        """At the end of ``restore``/``from_checkpoint``."""

    def on_evaluate_start(self, *, algorithm: Any, metrics_logger: Any = None, **kwargs: Any) -> None:
        """At the start of ``evaluate()``."""

    def on_evaluate_end(self, *, algorithm: Any, evaluation_metrics: dict, metrics_logger: Any = None,
                        **kwargs: Any) -> None:
        """At the end of ``evaluate()``; may add keys to ``evaluation_metrics``."""

    def on_train_result(self, *, algorithm: Any, result: dict, metrics_logger: Any = None, **kwargs: Any) -> None:
        """At the end of ``train()``; may add keys to ``result``."""

    # --- env runners (and evaluators) ----------------------------------------------------------
    def on_environment_created(self, *, env_runner: Any, env: Any, env_context: Any, metrics_logger: Any = None,
                               **kwargs: Any) -> None:
        """After a runner built its vector of sub-environments."""

    def on_sub_environment_created(self, *, worker: Any, sub_environment: Any, env_context: Any,
                                   env_index: int | None = None, **kwargs: Any) -> None:
        """After each sub-environment was created (also one recreated after a crash)."""

    def on_episode_created(self, *, episode: Any, env_runner: Any = None, env: Any = None, rl_module: Any = None,
                           env_index: int, metrics_logger: Any = None, **kwargs: Any) -> None:
        """A new episode exists; its sub-environment is about to be reset."""

    def on_episode_start(self, *, episode: Any, env_runner: Any = None, env: Any = None, rl_module: Any = None,
                         env_index: int, metrics_logger: Any = None, **kwargs: Any) -> None:
        """After the reset: the episode holds its first observation."""

    def on_episode_step(self, *, episode: Any, env_runner: Any = None, env: Any = None, rl_module: Any = None,
                        env_index: int, metrics_logger: Any = None, **kwargs: Any) -> None:
        """After every step, the last one included, once the step is in the episode."""

    def on_episode_end(self, *, episode: Any, env_runner: Any = None, env: Any = None, rl_module: Any = None,
                       env_index: int, metrics_logger: Any = None, **kwargs: Any) -> None:
        """After the terminal or truncating step (and its ``on_episode_step``)."""

    def on_postprocess_trajectory(self, *, worker: Any, episode: Any, agent_id: Any, policy_id: str, policies: Any,
                                  postprocessed_batch: Any, original_batches: Any, **kwargs: Any) -> None:
        """Each chunk before it leaves the runner; may rewrite ``postprocessed_batch["rewards"]``."""

    def on_sample_end(self, *, env_runner: Any = None, samples: list, worker: Any = None, metrics_logger: Any = None,
                      **kwargs: Any) -> None:
        """At the end of a runner's ``sample()``; may change the list of chunks."""

    # --- learners -----------------------------------------------------------------------------
    def on_learn_on_batch(self, *, policy: Any = None, train_batch: Any, result: dict, learner: Any = None,
                          **kwargs: Any) -> None:
        """Before a learner updates on a batch; keys added to ``result`` join the learner's results."""


DefaultCallbacks = Callbacks
RLlibCallback = Callbacks


class _Functions(Callbacks):
    """Per-hook functions (``config.callbacks(on_episode_end=fn)``): each gets the hook's keyword arguments."""

    def __init__(self, functions: dict[str, list[Callable]]) -> None:
        self.functions = functions
        for hook, fns in functions.items():
            setattr(self, hook, _chain(fns))


def _chain(fns: list[Callable]) -> Callable:
    def call(**kwargs: Any) -> None:
        for fn in fns:
            fn(**kwargs)
    call.functions = fns  # type: ignore[attr-defined]
    return call


class MultiCallbacks(Callbacks):
    """Several callbacks as one: each hook calls every member's, in order."""

    def __init__(self, members: list[Callbacks]) -> None:
        self.members = members
        for hook in HOOKS:
            active = [m for m in members if overrides(m, hook)]
            if active:
                setattr(self, hook, _fan_out(hook, active))


def _fan_out(hook: str, members: list[Callbacks]) -> Callable:
    def call(**kwargs: Any) -> None:
        for m in members:
            _call_one(m, hook, kwargs)
    call.members = members  # type: ignore[attr-defined]
    return call


def make_multi_callbacks(callback_classes: Iterable[type]) -> type:
    """One callbacks class that runs each given class's hooks, in the given order."""
    classes = [resolve(c) for c in callback_classes]

    class _Multi(MultiCallbacks):
        def __init__(self) -> None:
            super().__init__([c() for c in classes])

    _Multi.__name__ = _Multi.__qualname__ = "MultiCallbacks[" + ", ".join(c.__name__ for c in classes) + "]"
    return _Multi


@dataclass
class CallbacksSpec:
    """What a stage needs to build its own callbacks: classes (or import paths) and per-hook functions."""

    classes: list = field(default_factory=list)
    functions: dict[str, list] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.classes or self.functions)


def resolve(cls: Any) -> type:
    """A class, or ``"pkg.module:Name"`` / ``"pkg.module.Name"`` -> the class."""
    if isinstance(cls, str):
        try:
            cls = import_object(cls)
        except (ImportError, AttributeError, ValueError) as err:
            raise ValueError(f"cannot import callbacks class {cls!r}: {err}") from None
    if not isinstance(cls, type):
        raise ValueError(f"callbacks must be classes (or import paths to them), got {cls!r}; pass functions "
                         f"per hook instead: config.callbacks(on_episode_end=fn)")
    return cls


def build_callbacks(spec: CallbacksSpec | None) -> Callbacks:
    """The callbacks object a stage calls: the classes' instances and the functions, as one."""
    if not spec:
        return Callbacks()
    members: list[Callbacks] = [resolve(c)() for c in spec.classes]
    if spec.functions:
        members.append(_Functions(spec.functions))
    return members[0] if len(members) == 1 else MultiCallbacks(members)


def overrides(callbacks: Any, hook: str) -> bool:
    """Whether ``callbacks`` does anything on ``hook`` (the base class's no-ops do not count)."""
    method = getattr(callbacks, hook, None)
    if method is None:
        return False
    func = getattr(method, "__func__", None)
    return func is None or func is not getattr(Callbacks, hook, None)


def call_hook(callbacks: Callbacks, hook: str, where: str, metrics: Any = None, **kwargs: Any) -> None:
    """Run one hook; an exception becomes a ``CallbackError`` naming the hook, the culprit and
    ``where`` (e.g. "env runner 2"), counted in ``metrics`` under ``callbacks/num_errors``."""
    try:
        _call_one(callbacks, hook, kwargs)
    except _Failed as failed:
        if metrics is not None:
            metrics.log_value("callbacks/num_errors", 1, reduce="lifetime_sum")
        err = failed.__cause__
        raise CallbackError(f"callback {hook} of {failed.culprit} raised {type(err).__name__}: {err} "
                            f"(in {where})") from err


class _Failed(Exception):
    def __init__(self, culprit: str) -> None:
        self.culprit = culprit


def _call_one(callbacks: Any, hook: str, kwargs: dict) -> None:
    method = getattr(callbacks, hook)
    if hasattr(method, "members") or hasattr(method, "functions"):  # fan-outs name their own culprit
        if hasattr(method, "members"):
            method(**kwargs)
            return
        for fn in method.functions:
            try:
                fn(**kwargs)
            except Exception as err:  # noqa: BLE001 - any user error is reported the same way
                raise _Failed(f"function {getattr(fn, '__qualname__', fn)!s}") from err
        return
    try:
        method(**kwargs)
    except _Failed:
        raise
    except Exception as err:  # noqa: BLE001
        raise _Failed(f"class {type(callbacks).__qualname__}") from err
