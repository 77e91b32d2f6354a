"""Settings of central inference: the servers' (``InferenceSettings``) and what a runner needs to reach
its server (``InferenceClientSettings``). Torch-free: runners unpickle these."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MODES = ("local", "central")
RUNNER_BACKENDS = ("auto", "numpy", "torch")
PRECISIONS = ("float32", "bfloat16")


@dataclass
class InferenceSettings:
    """``config.inference(...)``'s keys (runnel's own; RLlib has no inference server)."""

    mode: str = "local"
    """"local": each env runner acts with its own copy of the module (RLlib's way); "central": runners
    send observations to inference servers, which batch them across runners and answer with actions."""
    runner_backend: str = "auto"
    """How a runner acting for itself evaluates the policy: "numpy" (the module exported to numpy; the runner
    process never imports torch), "torch", or "auto": numpy where the built-in module, exploration and
    callbacks allow (``actors.modules.export.acting_plan``), else torch. Under central inference the servers
    draw each runner's actions the way this picks, so central and local act alike."""
    precision: str = "float32"
    """The dtype the acting forward pass computes in, wherever it runs (a runner's own torch module, or the
    servers'): "float32", or "bfloat16" (a bfloat16 copy of the module under autocast, refreshed with every
    weights update; the recorded log-probabilities are the bfloat16 policy's, the one that acted). bfloat16
    halves the Nature CNN's cost on CPUs with bfloat16 units (Intel AMX or AVX512-BF16; ``lscpu`` lists
    ``amx_bf16``/``avx512_bf16``) and on GPUs, and costs several times more on CPUs without them. Numpy acting
    computes in float32 only: with bfloat16, "auto" runners act with torch, and runner_backend="numpy" is
    refused. Multi-agent runners run each module's forward methods under autocast instead of a copy (weights
    cast at every pass), each module alone (no fused pass)."""
    num_inference_servers: int = 1
    """Servers; env runner i asks server ``i % num_inference_servers``."""
    num_cpus_per_inference_server: float = 1
    """CPUs Ray reserves for each server actor (its torch intra-op threads use as many)."""
    num_gpus_per_inference_server: float = 0
    """GPUs per server; > 0 runs the module on CUDA."""
    max_batch: int = 256
    """Most observations (sub-env rows) one forward pass serves; a runner's request is never split."""
    max_wait_s: float = 0.0
    """How long the oldest queued request may wait for a fuller batch (0: serve what is queued at once;
    requests arriving during a forward pass form the next batch anyway)."""
    cuda_graphs: bool = True
    """A server on a GPU captures its module's forward pass as CUDA graphs (one per batch size bucket) and replays
    them: a small batch's pass costs a graph launch instead of dozens of kernel launches. False: eager."""
    shared_memory: bool = True
    """Runners on a server's node pass observation blocks of 32 kB or more a step (image observations) through
    shared memory (``/dev/shm``) instead of the socket; False: always inline."""
    double_buffer: bool = False
    """A runner splits its sub-envs in two halves and keeps a request out for each: one half steps while the
    server infers the other's actions (Sample Factory's double-buffered sampling). Used where the runner's loop
    allows it (``actors.env.split_sampling.split_problem``: two or more sub-envs stepped in its process, no
    connector pipelines, kept infos or recurrent state); elsewhere it steps all sub-envs at once. Off by
    default: measured slower both on 2 CPU cores (0.83x) and with servers on an H200 (0.80-0.89x), because a
    server's time goes mostly to per-request work, which twice the requests of half the size double. Seeded
    runs repeat exactly either way, but draw each half's noise separately (not the same actions as local
    inference at the same seed)."""
    resend_after_s: float = 5.0
    """A runner without an answer after this long asks where its server is now and resends (same
    request number: an answer arriving twice is used once)."""
    reply_timeout_s: float = 120.0
    """A runner without an answer after this long fails (its group recreates it)."""
    health_check_interval_s: float = 1.0
    """How often the driver pings the servers; a dead one is recreated and runners are told its address."""


@dataclass
class InferenceClientSettings:
    """What an env runner needs to ask for actions centrally (``EnvRunnerSettings.inference``)."""

    num_servers: int
    directory: Any
    """Where the servers' addresses are published: the ``InferenceDirectory`` itself (runners in the
    driver's process) or the name of its Ray actor."""
    namespace: str | None = None
    """The Ray namespace of the directory actor."""
    resend_after_s: float = 5.0
    reply_timeout_s: float = 120.0
    shared_memory: bool = True
    double_buffer: bool = False
    state_size: int | None = None
    """A recurrent module's ``lstm_cell_size``: the runner keeps its sub-envs' states ``[n, 2, state_size]`` and
    sends them with each request (None: the module is not recurrent)."""
    max_seq_len: int | None = None
    """A recurrent module's ``max_seq_len``: the runner cuts its chunks to sequences of at most this many steps."""

    @property
    def lanes(self) -> int:
        """Requests a runner may keep out at once."""
        return 2 if self.double_buffer else 1

    def server_of(self, worker_index: int) -> int:
        return worker_index % self.num_servers
