"""ExternalSettings: how a policy server listens and what it allows (``config.external_clients(...)``).

Plain configuration, apart from the server itself, so the config layer can check and build it
without importing the server (torch, sockets).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


@dataclass
class ExternalSettings:
    """How a policy server listens and what it allows (``config.external_clients(...)``)."""

    address: str = "tcp://127.0.0.1:9900"
    """Where runner slot 1 (or the in-driver server) binds; slot ``i`` binds port + i - 1."""
    inference_mode: str = "remote"
    """What clients that do not choose get: "remote" (the server acts) or "local" (they act with exported weights)."""
    max_batch: int = 256
    """Most act requests answered by one forward pass."""
    batch_wait_s: float = 0.0
    """How long the first queued act request may wait for more to batch with (0: answer as soon as none are queued)."""
    spin_s: float = 0.0
    """After a message, poll this long without sleeping before blocking (lower latency for clients acting
    in a loop, at the cost of a busy core while they do; 0: always block)."""
    inference_backend: str = "auto"
    """Remote inference with "numpy" (the exported policy: far less per-call overhead than torch for
    small MLPs), "torch", or "auto" (numpy for exportable MLP policies, torch for CNNs and the rest)."""
    sample_wait_s: float = 5.0
    """How long one ``sample`` call waits for clients' chunks before returning what it has."""
    max_pending_steps: int = 200_000
    """Env steps of received, not yet handed-on chunks the server holds; beyond it clients are told "busy"."""
    max_unacked_steps: int | None = None
    """Env steps one client should have sent and not yet seen committed before it stops collecting
    (``welcome.limits``; the reference client waits there). None: the algorithm's train batch per
    server plus one fragment for synchronous on-policy algorithms (a client then collects about one
    batch per update, as an env runner does), ``max_pending_steps`` otherwise."""
    max_policy_lag: int | None = None
    """Refuse as ``stale`` a chunk acted on by weights more than this many versions older than the
    server's (and drop such chunks still waiting when the driver samples): an on-policy update on
    experience from long-gone weights undoes learning. None: 1 for synchronous on-policy algorithms
    (PPO), no limit otherwise (replay and V-trace correct for lag)."""
    hold_acts_while_training: bool | None = None
    """Answer no act from the moment the driver takes a train batch until it sends the weights
    trained on it (at most ``max_act_hold_s``), so remote-inference clients act only with fresh
    weights, as env runners do in a synchronous plan. Turn it off for simulators that cannot wait
    (real time). None: on for synchronous on-policy algorithms (PPO), off otherwise."""
    max_act_hold_s: float = 10.0
    """The longest an act waits under ``hold_acts_while_training`` (a driver that stopped training
    -- evaluating, checkpointing -- must not stall its clients for good)."""
    server_secret_key: str | None = None
    """Path of the server's ``.key_secret`` (``runnel keys server``): turns on CURVE encryption."""
    allowed_client_keys: Any = None
    """With CURVE: the clients' public keys -- a directory of ``.key`` files, or a list of files / z85 keys."""
    allow_plaintext: bool = False
    """Serve unencrypted on a non-loopback address (a warning is logged)."""
    max_clients: int = 1024
    """Connections served at once."""
    max_open_episodes: int = 1024
    """Episodes one connection may have started and not ended (remote inference)."""
    max_requests_in_flight: int = 256
    """Act requests of one connection waiting for their answer."""
    max_agents: int = 64
    """Multi-agent runs: the most agents one ``ma_act``/``ma_end`` may name, and one episode may hold.
    (The server records clients' episodes; all agents of one connection's open episodes together may
    hold at most ``max_pending_steps`` steps, ``fragment_length`` each, before new agents are refused.)"""
    max_frame_bytes: int = 64 << 20
    """Largest message part; ZeroMQ disconnects a peer that sends a bigger one."""
    max_chunk_steps: int = 100_000
    """Longest chunk accepted."""
    max_protocol_errors: int = 100
    """Malformed messages one connection may send before it is banned."""
    idle_timeout_s: float = 300.0
    """A connection silent this long is forgotten (its open episodes with it)."""
    journal_dir: str | None = None
    """Where the commit journal lives (default: the temp dir's ``runnel-journal``); "" disables it."""
    fragment_length: int = 200
    """Steps per chunk a client cuts (from ``rollout_fragment_length``); a longer chunk is refused."""
    allow_nonfinite_observations: bool = False
    """Accept NaN and infinities in Box observations (acts and chunks), for a module that handles
    them itself; by default they are refused (``bad_value``/``bad_chunk``): one NaN observation in a
    train batch turns every weight into NaN. The learners are told too (they refuse such batches
    otherwise). Integer spaces are always checked to be in range."""

    def address_for(self, slot: int) -> str:
        """The address of runner slot ``slot`` (0 = the in-driver server, like slot 1)."""
        if slot <= 1:
            return self.address
        parts = urlsplit(self.address)
        return f"{parts.scheme}://{parts.hostname}:{parts.port + slot - 1}"
