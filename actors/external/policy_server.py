"""PolicyServer: external clients act and send experience through it, in an env runner's place.

One ZeroMQ ROUTER endpoint serves many clients (``protocols.client.PolicyClient``, or any program
that speaks ``protocols/EXTERNAL.md``). A server thread owns the socket:

* **remote inference** -- ``act`` requests of all clients are gathered as they arrive and answered
  from one batched forward pass (up to ``max_batch`` rows; ``batch_wait_s`` > 0 waits that long
  for a fuller batch, 0 runs as soon as no more requests are queued);
* **local inference** -- ``weights`` requests get the policy exported for numpy
  (``actors.modules.export``), cached per weights version;
* **experience** -- ``chunks`` messages are decoded with bounds, checked against the spaces,
  deduplicated by ``(episode_id, chunk_index)`` and held until the algorithm takes them.

The server implements the env runner role, so an ``EnvRunnerGroup`` hosts servers in its runner
slots (in the driver, or as Ray actors managed like any runner) and an algorithm's plan samples
from them unchanged: ``sample_encoded`` hands on the chunks clients sent (waiting at most
``sample_wait_s`` for them). The driver asking again means it has the previous answer, so that
is when the previous chunks are *committed*: their ids are written to the commit journal
(``actors.external.journal``) and acknowledged to the clients, which then drop them from their
spools. A recreated server is told by its group which chunks its predecessor handed on last
(``confirm_delivered``), so a kill between hand-off and acknowledgement duplicates nothing.
Streaming plans (IMPALA, APPO, the replay as a Ray actor) call ``start_streaming`` instead: a
thread (``actors.external.stream``) pushes the chunks to their receiver as an env runner's stream
does, and commits each frame once ZeroMQ took it.

Hostile or broken clients get error replies (see ``protocols.external``) and never reach the
algorithm: frames over ``max_frame_bytes`` make ZeroMQ drop the connection, every body is decoded
with the codec's bounds, and a client past ``max_protocol_errors`` is banned. Each connection may
hold ``max_open_episodes`` episodes and ``max_requests_in_flight`` act requests.

In a multi-agent run (``module_specs`` and ``policy_mapping_fn``, as ``MultiAgentEnvRunner`` takes
them) clients play multi-agent episodes that the server records itself (``multi_agent_acts``; protocol
version 2, EXTERNAL.md section 10): one policy copy per module, per-agent chunks tagged with agent and
module id, weights and metrics as a multi-agent runner's (``multi_agent_parts``).

This module holds the env runner role and puts the pieces together: the socket
(``actors.external.endpoint``), the server thread's loop (``actors.external.server_loop``), the
act path (``actors.external.acts``), the policy copy it acts with (``actors.external.inference``)
and the chunk intake (``actors.external.chunks``).
"""
from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
import uuid
from typing import Any, Callable
from urllib.parse import urlsplit

import torch
import zmq

from actors.core import EnvRunnerRole
from actors.env.process import set_log_level
from actors.env.settings import EnvRunnerSettings
from actors.env.streaming import SentTotals
from actors.external.acts import ActBatcher
from actors.external.chunks import ChunkIntake
from actors.external.endpoint import Conn, ServerEndpoint
from actors.external.inference import ServerPolicy
from actors.external.journal import CommitJournal
from actors.external.multi_agent_acts import MultiAgentActs
from actors.external.multi_agent_parts import log_multi_agent_samples, split_module_weights
from actors.external.security import ServerSecurity
from actors.external.server_loop import ServerLoop
from actors.external.settings import ExternalSettings
from actors.external.stream import ServerStream
from actors.metrics import MetricsLogger
from actors.offline.module_recorders import ModuleRecorders
from actors.offline.recorder import Recorder
from protocols.codec import encode
from actors.modules import ModuleSpec
from actors.modules.multi import SEP
from protocols.episode import EpisodeChunk
from protocols.multi_agent_episode import MultiAgentEpisode
from protocols.schema import ChunkSchema
from protocols.spaces import space_to_dict

log = logging.getLogger("runnel")

QUIET_LOG_S = 30.0
"""How often a server that receives no experience says so."""
COUNTS = ("num_actions_served", "num_inference_batches", "num_connects", "num_protocol_errors", "num_bad_chunks",
          "num_busy_replies", "num_duplicate_chunks", "num_chunks_received", "num_replies_dropped", "num_banned",
          "num_bad_values", "num_stale_chunks", "num_server_errors")
"""Counters the server thread keeps; ``get_metrics`` reports them under ``external/``."""


class PolicyServer(EnvRunnerRole):
    def __init__(self, settings: EnvRunnerSettings, worker_index: int = 0, recreated: bool = False,
                 external: ExternalSettings | None = None, module_specs: dict[str, ModuleSpec] | None = None,
                 policy_mapping_fn: Callable[[Any, Any], str] | None = None,
                 count_steps_by: str = "env_steps") -> None:
        """``module_specs`` and ``policy_mapping_fn`` (a multi-agent run, as ``MultiAgentEnvRunner`` takes
        them): clients play multi-agent episodes, which this server records (``multi_agent_acts``)."""
        self.s, self.x = settings, external or ExternalSettings()
        self.worker_index = worker_index
        if worker_index > 0:
            torch.set_num_threads(settings.torch_threads)
            set_log_level(settings.log_level)
        self.address = self.x.address_for(worker_index)
        self.server_id = uuid.uuid4().hex[:12]
        self.policies = {mid: ServerPolicy(settings, worker_index, self.x.inference_backend, spec=spec)
                         for mid, spec in (module_specs or {}).items()}
        """Multi-agent runs: each module's policy copy (empty otherwise)."""
        self.multi_agent = bool(self.policies)
        self.policy = (next(iter(self.policies.values())) if self.multi_agent else
                       ServerPolicy(settings, worker_index, self.x.inference_backend))
        self.observation_space, self.action_space = self.policy.observation_space, self.policy.action_space
        self.module, self.exploration = self.policy.module, self.policy.exploration  # as on any env runner
        recorder_class = ModuleRecorders if self.multi_agent else Recorder  # multi-agent: a recording per module
        self.recorder = recorder_class(settings.recording, f"server{worker_index:03d}") if settings.recording else None
        self.schema = ChunkSchema.for_spaces(self.observation_space, self.action_space, ("action_logp",))
        self.spaces = {"observation_space": space_to_dict(self.observation_space),
                       "action_space": space_to_dict(self.action_space)}
        self.metrics = MetricsLogger()
        self._lock = threading.Condition()  # pending chunks, delivered/committed ids, metrics
        self._counts: dict[str, int] = dict.fromkeys(COUNTS, 0)  # the server thread's counters
        self._counts_reported: dict[str, int] = dict.fromkeys(COUNTS, 0)
        for policy in self.policies.values() or [self.policy]:
            policy.refresh_export()
        journal_dir = self.x.journal_dir if self.x.journal_dir is not None else os.path.join(
            tempfile.gettempdir(), "runnel-journal")
        port = urlsplit(self.address).port
        self.journal = CommitJournal(os.path.join(journal_dir, f"policy-server-{port}.journal") if journal_dir else None)
        self._quiet_logged = 0.0
        self._stream: ServerStream | None = None
        self._sent = SentTotals()
        self._last_pushed_at = time.monotonic()  # the stream's last frame (the quiet warning while streaming)
        self._ctx = zmq.Context()
        self.security = ServerSecurity(self._ctx, self.address, self.x.server_secret_key, self.x.allowed_client_keys,
                                       self.x.allow_plaintext)
        self.endpoint = ServerEndpoint(self._ctx, self.address, self.x, self.security, self._counts)
        self._stopping = threading.Event()
        self.chunks = ChunkIntake(self._lock, self.endpoint, self.journal, self.metrics, self._counts, self.x,
                                  self.schema, self.module.dist_spec.input_dim, worker_index,
                                  weights_version=lambda: self.policy.weights_version,
                                  state_shape=self.policy.state_shape)
        conns: dict[bytes, Conn] = {}
        self._ma_ended: list[MultiAgentEpisode] = []  # multi-agent episodes ended since the last report
        modules = None
        if self.multi_agent:
            if policy_mapping_fn is None:
                raise ValueError("a multi-agent policy server needs the run's policy_mapping_fn")
            self.acts: ActBatcher = MultiAgentActs(self.endpoint, conns, self._counts, self.policies,
                                                   policy_mapping_fn, self.chunks, settings, self.x, worker_index,
                                                   on_episode_end=self._episode_ended)
            modules = {mid: {"observation_space": space_to_dict(p.observation_space),
                             "action_space": space_to_dict(p.action_space), "action_mapping": p.action_mapping()}
                       for mid, p in self.policies.items()}
        else:
            self.acts = ActBatcher(self.endpoint, conns, self._counts, self.policy, self.schema, settings, self.x)
        self.loop = ServerLoop(self.endpoint, self.acts, self.chunks, self.policy, conns=conns, counts=self._counts,
                               stopping=self._stopping, settings=settings, external=self.x, server_id=self.server_id,
                               spaces=self.spaces, worker_index=worker_index, modules=modules)
        self.loop.start()
        log.info("policy server %s listening on %s (%s)", self.server_id, self.address,
                 "CURVE" if self.security.curve else "plaintext")

    # --- the env runner role ------------------------------------------------------------------
    @property
    def error(self) -> BaseException | None:
        """What ended the server thread, if it failed."""
        return self.loop.error

    @property
    def weights_version(self) -> int:
        return self.policy.weights_version

    @property
    def num_env_steps_served(self) -> int:
        """Actions served (in a multi-agent run: by every module, one per agent step)."""
        return sum(p.num_env_steps_served for p in self.policies.values() or [self.policy])

    @property
    def timestep(self) -> int:
        return self.policy.timestep

    def commit(self) -> None:
        """Commit what the last ``sample()`` handed on (journaled, acknowledged to its clients, whose spools
        drop it), as the next ``sample()`` does first -- without waiting for more experience: for a driver
        that has stored those chunks and will not sample again soon."""
        with self._lock:
            self.chunks.commit_delivered()

    def confirm_delivered(self, keys: list) -> None:
        """The group received these chunks from this slot's previous server, which died before it
        acknowledged them: record them as committed so clients' resends are dropped."""
        with self._lock:
            self.chunks.commit([(str(k[0]), int(k[1])) for k in keys])

    def sample(self, num_timesteps: int | None = None, num_episodes: int | None = None,
               explore: bool | None = None) -> list[EpisodeChunk]:
        """Chunks clients sent, at least ``num_timesteps`` steps of them (less if ``sample_wait_s``
        passes first; at most one chunk more than needed), committing what the previous call handed on."""
        if self.error is not None:
            raise RuntimeError(f"policy server thread failed: {self.error!r}")
        if self.is_streaming():
            raise RuntimeError(f"policy server {self.worker_index} streams its chunks (start_streaming): "
                               f"call stop_streaming() before sampling from it")
        want = num_timesteps or 1
        deadline = time.monotonic() + self.x.sample_wait_s
        # with a lag limit (on-policy training), wait for experience from the current weights: a fast
        # client's backlog from the weights before would be taken first otherwise (it arrived first)
        fresh = self.x.max_policy_lag is not None
        self.acts.release()  # the driver asks again before new weights: it wants more experience, now
        with self._lock:
            self.chunks.commit_delivered()
            while (self.chunks.fresh_steps() if fresh else self.chunks.pending_steps) < want \
                    and not self._stopping.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
            chunks = self.chunks.take(want, freshest_first=fresh)
            if chunks and self.x.hold_acts_while_training:  # until set_weights brings what they train
                self.acts.hold()
            if not chunks:
                self._warn_quiet(self.x.sample_wait_s)
            self._log_chunks(chunks)
        if self.recorder is not None:  # written before the driver has them: a later crash cannot lose them
            self.recorder.record(chunks)
            self.recorder.flush()
        return chunks

    def _warn_quiet(self, quiet_s: float) -> None:
        """Say, at most every ``QUIET_LOG_S``, that training waits for clients (the caller holds the lock)."""
        if time.monotonic() - self._quiet_logged > QUIET_LOG_S:
            self._quiet_logged = time.monotonic()
            log.warning("policy server %s at %s: no experience arrived for %.0f s (%d client(s) connected); "
                        "training waits for clients", self.server_id, self.address, quiet_s, len(self.loop.conns))

    def _episode_ended(self, episode: MultiAgentEpisode) -> None:
        """A multi-agent episode ended (the server thread): its statistics go out with the next sample."""
        with self._lock:
            self._ma_ended.append(episode)

    def _log_chunks(self, chunks: list[EpisodeChunk]) -> None:
        if self.multi_agent:
            self._log_multi_agent(chunks)
            return
        m, w = self.metrics, self.s.metrics_window
        steps = sum(len(c) for c in chunks)
        m.log_value("num_env_steps_sampled", steps, reduce="sum")
        m.log_value("num_env_steps_sampled_lifetime", steps, reduce="lifetime_sum")
        finished = self.chunks.episodes.take_finished()
        m.log_episodes([r for r, _ in finished], [n for _, n in finished], w)

    def _log_multi_agent(self, chunks: list[EpisodeChunk]) -> None:
        """What a multi-agent runner reports for a sample (the caller holds the lock)."""
        env_steps = self.acts.env_steps_of(chunks)
        ended, self._ma_ended = self._ma_ended, []
        log_multi_agent_samples(self.metrics, self.s.metrics_window, chunks, env_steps, ended)

    def sample_encoded(self, num_timesteps: int | None = None, explore: bool | None = None,
                       compress: bool = False) -> tuple[bytes, dict[str, Any]]:
        chunks = self.sample(num_timesteps, explore=explore)
        return encode(chunks, compress=compress), self.get_metrics()

    def set_weights(self, weights: dict[str, Any], weights_version: int = 0, timestep: int | None = None) -> None:
        """Single-agent: the module's weights. Multi-agent: ``{"<module_id>/<param>": array}`` for the modules
        it names (the others keep theirs), as ``MultiAgentEnvRunner`` takes them."""
        if self.multi_agent:
            by_module = split_module_weights(weights, self.policies)
            for mid, policy in self.policies.items():
                if mid in by_module:
                    policy.set_weights(by_module[mid], weights_version, timestep)
                else:  # a frozen module keeps its weights under the run's version
                    policy.set_weights(policy.get_weights(), weights_version, timestep)
        else:
            self.policy.set_weights(weights, weights_version, timestep)
        self.acts.release()
        self.metrics.log_value("weights_version", weights_version, reduce="max")

    def get_weights(self) -> dict[str, Any]:
        if self.multi_agent:
            return {f"{mid}{SEP}{k}": v for mid, p in self.policies.items() for k, v in p.get_weights().items()}
        return self.policy.get_weights()

    def get_metrics(self) -> dict[str, Any]:
        if self.error is not None:
            raise RuntimeError(f"policy server thread failed: {self.error!r}")
        if self._stream is not None:
            self._stream.check_health()
            self._stream.log_counters()
        m = self.metrics
        counts = dict(self._counts)  # a snapshot: the server thread keeps counting
        delta = {k: counts[k] - self._counts_reported[k] for k in COUNTS}
        self._counts_reported = counts
        for key, value in delta.items():
            m.log_value(f"external/{key}", value, reduce="lifetime_sum")
        if delta["num_inference_batches"]:
            m.log_value("external/inference_batch_size_mean",
                        delta["num_actions_served"] / delta["num_inference_batches"])
        m.log_value("external/num_clients", len(self.loop.conns), reduce="max")
        m.log_value("external/num_refused_keys", self.security.refused, reduce="max")
        m.log_value("external/num_pending_env_steps", self.chunks.pending_steps, reduce="max")
        if self.recorder is not None:
            self.recorder.log_metrics(m)
        return m.export()

    def get_state(self) -> dict[str, Any]:
        return {"weights": self.get_weights(), "weights_version": self.weights_version,
                "num_env_steps_sampled_lifetime": self.num_env_steps_served,
                "timestep_offset": self.policy.timestep_offset, "exploration": self.exploration.get_state()}

    def set_state(self, state: dict[str, Any]) -> None:
        self.set_weights(state["weights"], state.get("weights_version", 0))
        self.policy.num_env_steps_served = state.get("num_env_steps_sampled_lifetime", 0)
        self.policy.timestep_offset = state.get("timestep_offset", 0)
        self.exploration.set_state(state.get("exploration", {}))
    def ping(self) -> str:
        return "ok"

    def apply(self, fn: Callable[["PolicyServer"], Any]) -> Any:
        return fn(self)

    # --- streaming (IMPALA, APPO, the replay as a Ray actor) -----------------------------------
    def start_streaming(self, address: str, hwm: int = 4, compress: bool = True, sndbuf: int = 0,
                        stall_timeout_s: float = 60.0, window: int | None = None) -> None:
        """Push the chunks clients send to the receiver at ``address`` from a thread of their own
        (``actors.external.stream``), as a streaming env runner pushes its fragments; each frame's
        chunks are committed once ZeroMQ took it. ``stall_timeout_s`` is unused: a server waiting for
        clients is not stalled."""
        if self.is_streaming() and self._stream.address == address:
            return
        self.stop_streaming()
        self._sent.retire(self._stream)  # a stream that would not stop in time is replaced all the same
        with self._lock:
            self.chunks.commit_delivered()  # what a sample call handed on before
        self._last_pushed_at = time.monotonic()
        self._stream = ServerStream(self, address, hwm=hwm, compress=compress, sndbuf=sndbuf, window=window)
        self._stream.start()

    def stop_streaming(self, timeout_s: float = 10.0) -> bool:
        """Stop the stream thread (a send blocked by back-pressure gives up and its chunks wait here
        again). True if it ended."""
        if self._stream is not None and self._stream.stop(timeout_s):
            self._sent.retire(self._stream)
            self._stream = None
        return self._stream is None

    def stream_totals(self) -> dict[str, int]:
        """Env steps this server has pushed to each receiver address over its life (ZeroMQ accepted them):
        when a learner dies, what its servers had sent it (``EnvRunner.stream_totals``)."""
        return self._sent.totals(self._stream)

    def is_streaming(self) -> bool:
        return self._stream is not None and self._stream.alive()

    def wake_stream(self) -> None:
        """Wake the stream thread if it waits for chunks (it is being stopped)."""
        with self._lock:
            self._lock.notify_all()

    def take_for_stream(self, stop: threading.Event) -> list[EpisodeChunk]:
        """The chunks of the stream's next frame: those pending, up to a runner's fragment
        (``fragment_length`` x ``num_envs_per_env_runner`` steps; the rest go in the next frames),
        waiting up to ``sample_wait_s`` for the first. Empty if none came or ``stop`` was set."""
        if self.error is not None:
            raise RuntimeError(f"policy server thread failed: {self.error!r}")
        with self._lock:
            if not self.chunks.pending_steps and not stop.is_set() and not self._stopping.is_set():
                self._lock.wait(self.x.sample_wait_s)
            if stop.is_set() or self._stopping.is_set():
                return []
            chunks = self.chunks.take(self.x.fragment_length * max(1, self.s.num_envs))
            quiet = time.monotonic() - self._last_pushed_at
            if not chunks and quiet >= self.x.sample_wait_s:
                self._warn_quiet(quiet)
        return chunks

    def pushed(self, chunks: list[EpisodeChunk]) -> None:
        """The stream handed ``chunks`` (the last ``take_for_stream``) on: count and record them, then
        commit them (journal, acknowledgements to their clients)."""
        self._last_pushed_at = time.monotonic()
        if self.recorder is not None:  # recorded before clients drop them: a crash cannot lose them
            self.recorder.record(chunks)
            self.recorder.flush()
        with self._lock:
            self._log_chunks(chunks)
            self.chunks.commit_delivered()

    def not_pushed(self, chunks: list[EpisodeChunk]) -> None:
        """The stream stopped before it could hand ``chunks`` (the last ``take_for_stream``) on: they
        wait for the next stream, or sample call, first in line."""
        with self._lock:
            self.chunks.untake(chunks)

    def stop(self) -> None:
        """Acknowledge what the driver already has, then close the socket."""
        if self._stopping.is_set():
            return
        self.stop_streaming()
        with self._lock:
            self.chunks.commit_delivered()
            self._stopping.set()
            self._lock.notify_all()
        self.endpoint.wake()
        self.loop.join(timeout=10.0)
        if self.recorder is not None:
            self.recorder.close()
        self.endpoint.close()
        self.security.stop()
        self.journal.close()
        self._ctx.term()
