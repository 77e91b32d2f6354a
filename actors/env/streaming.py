"""RunnerStream: the sampling thread of a streaming env runner (asynchronous algorithms).

It samples one fragment (``rollout_fragment_length`` steps per sub-env) at a time with the
runner's own ``sample()``, sends the fragment's chunks as one codec frame over ZeroMQ
(``protocols.transport.ChunkSender``; at most ``window`` frames ahead of what the receiver has read)
and, between fragments, applies weights the actor's main thread received
(``EnvRunner.apply_pending_weights``). The actor's main thread stays free for
``ping``/``get_metrics``/``set_weights``.

A send that waits for credit or at the high-water mark is back-pressure, not a failure. A thread
that dies, or makes no progress while sampling for ``stall_timeout_s`` (a hung environment), is reported by
``check_health``, which the runner's ``get_metrics`` calls, so the driver recreates the runner.

``StreamingRunner`` is what a runner class mixes in to stream: ``start_streaming``/``stop_streaming``,
and weights that arrive while its thread samples held back until the next fragment. Both
``EnvRunner`` and ``MultiAgentEnvRunner`` use it, so the two stream alike.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from typing import Any

from actors.core import is_user_code_error
from protocols.transport import SENDER_COUNTERS, ChunkSender

log = logging.getLogger(__name__)


def stream_sender_id(worker_index: int) -> str:
    """How runner ``worker_index``'s frames name their sender (a receiver's drops and losses by sender)."""
    return f"env-runner-{worker_index}"


class RunnerStream:
    def __init__(self, runner: Any, address: str, *, hwm: int = 4, compress: bool = True, sndbuf: int = 0,
                 stall_timeout_s: float = 60.0, window: int | None = None) -> None:
        self.runner, self.address = runner, address
        self.hwm, self.compress, self.sndbuf, self.window = hwm, compress, sndbuf, window
        self.stall_timeout_s = stall_timeout_s
        self.sender_id = stream_sender_id(runner.worker_index)
        self._stop = threading.Event()
        self._sender: ChunkSender | None = None
        self._counters_lock = threading.Lock()
        self._reported = dict.fromkeys(SENDER_COUNTERS, 0)
        self.error: str | None = None
        self.exception: BaseException | None = None
        self.num_env_steps_sent = 0
        """Env steps of the frames ZeroMQ accepted for ``address`` (written by the sampling thread only)."""
        self._status = ("starting", time.monotonic())  # (state, since): one tuple, replaced atomically
        # torch.set_num_threads only reaches the thread that calls it (OpenMP's per-thread
        # setting): a new thread would run with one intra-op thread per core, which on a busy
        # machine makes each small forward pass dozens of times slower. Carry the setting over
        # (a runner under central inference has no torch to set).
        torch = sys.modules.get("torch")
        self._torch_threads = torch.get_num_threads() if torch is not None else None
        self._thread = threading.Thread(target=self._loop, name=f"runnel-stream-{runner.worker_index}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def _set_state(self, state: str) -> None:
        self._status = (state, time.monotonic())  # never a new state with the old time (see check_health)

    def _loop(self) -> None:
        try:
            if self._torch_threads is not None:
                sys.modules["torch"].set_num_threads(self._torch_threads)
            self._sender = ChunkSender(self.address, self.sender_id, hwm=self.hwm, compress=self.compress,
                                       sndbuf=self.sndbuf, window=self.window)
            while not self._stop.is_set() and self._step(self._sender):
                pass
            self._set_state("stopped")
        except BaseException as err:  # noqa: BLE001 - reported through check_health, which the driver polls
            self.error = f"{type(err).__name__}: {err}"
            self.exception = err
            self._set_state("failed")
            log.error("%s: sampling thread failed:\n%s", self.sender_id, traceback.format_exc())
        finally:
            if self._sender is not None:
                self.log_counters()
                self._sender.close()

    def _step(self, sender: ChunkSender) -> bool:
        """One fragment: sample it, record it, push it. False if stopped while the send waited
        (the policy server's stream, ``actors.external.stream``, pushes its clients' chunks instead)."""
        runner = self.runner
        runner.apply_pending_weights()
        self._set_state("sampling")
        chunks = runner.sample()
        if not chunks:
            return True
        runner.flush_recording()
        self._set_state("sending")
        sent = sender.send(chunks, self._stop)
        if sent:
            self.num_env_steps_sent += sum(len(c) for c in chunks)
        return sent

    def log_counters(self) -> None:
        """The sender's counters into the runner's logger, as deltas (the logger sums them up).

        The runner's ``get_metrics`` calls this before exporting: the sender counts a frame under
        a lock its ``counters()`` takes too, so whoever saw a frame arrive and then asks for
        metrics finds it counted."""
        sender = self._sender
        if sender is None:
            return
        with self._counters_lock:
            now = sender.counters()
            for key, value in now.items():
                delta = value - self._reported[key]
                if delta:
                    self.runner.metrics.log_value(f"stream/runner_{key}", delta, reduce="lifetime_sum")
            self._reported = now

    def check_health(self) -> None:
        """Raise RuntimeError if the thread died or sampled nothing for ``stall_timeout_s``."""
        if is_user_code_error(self.exception):  # the driver ends the run with it; a restart would repeat it
            raise self.exception
        if self.error is not None:
            raise RuntimeError(f"{self.sender_id}: sampling thread failed: {self.error}")
        if not self._thread.is_alive() and not self._stop.is_set():
            raise RuntimeError(f"{self.sender_id}: sampling thread is not running")
        state, since = self._status
        stalled = time.monotonic() - since
        if state == "sampling" and stalled > self.stall_timeout_s:  # blocked sending is back-pressure, not a stall
            raise RuntimeError(f"{self.sender_id}: no fragment sampled for {stalled:.0f} s (a hung environment?)")

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Stop sampling (a blocked send gives up) and join the thread. True if it ended."""
        self._stop.set()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


class SentTotals:
    """Env steps a sender's streams handed to ZeroMQ, per receiver address, over the sender's life (streams
    come and go as receivers move): when a learner dies, what its runners or policy servers had sent it."""

    def __init__(self) -> None:
        self._before: dict[str, int] = {}  # env steps sent per address by streams now ended

    def retire(self, stream: RunnerStream | None) -> None:
        """Fold an ended (or replaced) stream's count in."""
        if stream is not None:
            self._before[stream.address] = self._before.get(stream.address, 0) + stream.num_env_steps_sent

    def totals(self, current: RunnerStream | None) -> dict[str, int]:
        """The ended streams' counts plus ``current``'s so far."""
        totals = dict(self._before)
        if current is not None:
            totals[current.address] = totals.get(current.address, 0) + current.num_env_steps_sent
        return totals


class StreamingRunner:
    """Mixin of the env runners that stream. The runner calls ``init_streaming()`` in its constructor,
    implements ``_apply_weights`` (load weights now) and may override ``_checked_weights`` (reject
    bad weights in the caller's thread, not later in the sampling thread) and ``flush_recording``.
    ``RunnerStream`` also uses the runner's ``sample()``, ``metrics`` and ``worker_index``."""

    def init_streaming(self) -> None:
        # weights that arrive while a stream samples in another thread wait here for its next fragment
        self._weights_lock = threading.Lock()
        self._pending_weights: tuple[Any, int, int | None] | None = None
        self._stream: RunnerStream | None = None
        self._sent = SentTotals()

    def _apply_weights(self, weights: Any, weights_version: int, timestep: int | None) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement _apply_weights to stream")

    def _checked_weights(self, weights: Any) -> Any:
        return weights

    def flush_recording(self) -> None:
        """Returns once every chunk sampled so far is recorded (runners that record override it)."""

    def set_weights(self, weights: Any, weights_version: int = 0, timestep: int | None = None) -> None:
        """Apply now, or -- while a stream samples in its own thread -- before its next fragment
        (never in the middle of one). ``timestep``: the run's steps sampled so far, which drives
        exploration schedules (a runner alone sees only its share of them)."""
        weights = self._checked_weights(weights)
        with self._weights_lock:
            if self.is_streaming():
                self._pending_weights = (weights, weights_version, timestep)
                return
        self._apply_weights(weights, weights_version, timestep)

    def apply_pending_weights(self) -> bool:
        """Apply weights that arrived while streaming; the stream calls this between fragments."""
        with self._weights_lock:
            pending, self._pending_weights = self._pending_weights, None
        if pending is None:
            return False
        self._apply_weights(*pending)
        self.metrics.log_value("num_weight_updates_applied", 1, reduce="lifetime_sum")
        return True

    def check_stream(self) -> None:
        """While streaming: raise if the sampling thread failed or hangs (``get_metrics`` calls this, so the
        driver's stage group treats the runner as failed and recreates it), and log the sender's counters."""
        if self._stream is not None:
            self._stream.check_health()
            self._stream.log_counters()

    def start_streaming(self, address: str, hwm: int = 4, compress: bool = True, sndbuf: int = 0,
                        stall_timeout_s: float = 60.0, window: int | None = None) -> None:
        """Start (or keep) a thread that samples fragment after fragment and pushes each one's
        chunks to the receiver at ``address``, at most ``window`` fragments ahead of what the receiver
        has read (``protocols.transport``); the runner's other methods stay callable meanwhile."""
        stream = self._stream
        if stream is not None and stream.alive():
            if stream.address == address:
                return
            stream.stop()
        self._sent.retire(stream)
        self._stream = RunnerStream(self, address, hwm=hwm, compress=compress, sndbuf=sndbuf,
                                    stall_timeout_s=stall_timeout_s, window=window)
        self._stream.start()

    def stop_streaming(self, timeout_s: float = 10.0) -> bool:
        """Stop the sampling thread (a send blocked by back-pressure gives up). True if it ended."""
        stream = self._stream
        if stream is None:
            return True
        stopped = stream.stop(timeout_s)
        if stopped:
            self._sent.retire(stream)
            self._stream = None
            self.apply_pending_weights()  # what arrived for a fragment that never came
        return stopped

    def stream_totals(self) -> dict[str, int]:
        """Env steps this runner has sent to each receiver address over its life (ZeroMQ accepted them;
        whether they arrived is the receiver's count): when a learner dies, what its runners sent it."""
        return self._sent.totals(self._stream)

    def is_streaming(self) -> bool:
        stream = self._stream
        return stream is not None and stream.alive()
