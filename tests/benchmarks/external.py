"""External clients: action round trips through a policy server (remote inference, CartPole MLP, loopback).

Prints one JSON object per line:
  {"bench": "machine", ...}
  {"bench": "zmq_floor", "p50_us", "p99_us"}     a bare ZeroMQ echo round trip between two processes
  {"bench": "latency", "system": "runnel", "security": "plaintext"|"curve", "p50_us", "p99_us", "n"}
  {"bench": "latency", ..., "security": "plaintext_spin"|"curve_spin", "spin_s"}   the same with spin_s on
        both sides (client and server poll that long before sleeping)
  {"bench": "throughput", "system": "runnel", "security": ..., "clients": N, "actions_per_s"}
  {"bench": "throughput_pipelined", ..., "clients": N, "client_processes": P, "actions_per_s"}
        the same N clients (a connection and an episode each, one request in flight each), each
        process's driven by one thread: send_action to all of them, then receive_action in turn
  {"bench": "throughput_batched", ..., "envs": N, "client_processes": P, "actions_per_s"}
        the same N envs driven by P clients, each acting for its N/P envs with one request (get_actions)
  {"bench": "latency"/"throughput", "system": "rllib", ...}       the anchor, or {"bench": "anchor", "skipped": why}
  {"bench": "summary", ...}                                          medians and ratios

The server runs in its own process (``PolicyServer`` with PPO's default CartPole module, as
``config.external_clients(...)`` builds it); each client is a ``PolicyClient`` calling
``get_action`` in a loop with a fixed observation, counted over ``--seconds`` after a warm-up.
Clients run in ``--client-procs`` processes (several clients per process as threads), so the
client side uses the machine's other core(s), as a fleet of simulators would. Repeats alternate
the systems (``--repeats``), and the summary takes medians.

The anchor is RLlib 2.60's ``PolicyClient`` (old API stack, HTTP, pickled payloads) in remote
mode. RLlib 2.60 no longer ships ``PolicyServerInput`` (the server side it was made for), so the
anchor's server is the smallest stand-in that does the same work: an HTTP server that unpickles
each request and computes the action with an RLlib-2.60 PPO torch policy
(``algo.get_policy().compute_single_action``). It runs in the anchors venv (``--anchors-python``);
without it the anchor is reported as skipped.

    python tests/benchmarks/external.py [--seconds 5] [--clients 1,16,64] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import numpy as np

ANCHORS_PYTHON = "/work/anchors-venv/bin/python"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- runnel ----------------------------------------------------------------------------------
def serve(port: int, keys: str | None, ready: mp.Event, stop: mp.Event, spin_s: float = 0.0) -> None:
    import gymnasium as gym
    import torch

    from actors.env import EnvRunnerSettings
    from actors.external.policy_server import ExternalSettings, PolicyServer

    torch.set_num_threads(1)
    env = gym.make("CartPole-v1")
    settings = EnvRunnerSettings(env_creator=None, observation_space=env.observation_space,
                                 action_space=env.action_space)
    x = ExternalSettings(address=f"tcp://127.0.0.1:{port}", journal_dir="", spin_s=spin_s,
                         server_secret_key=os.path.join(keys, "server.key_secret") if keys else None,
                         allowed_client_keys=os.path.join(keys, "clients") if keys else None)
    server = PolicyServer(settings, 0, external=x)
    ready.set()
    while not stop.wait(0.5):
        server.sample(1)  # what the algorithm does: take experience (clients here send almost none)
    server.stop()


def client_options(keys: str | None) -> dict:
    if not keys:
        return {}
    return {"server_public_key": os.path.join(keys, "server.key"),
            "client_key": os.path.join(keys, "clients", "bench.key_secret")}


def play(port: int, keys: str | None, n_clients: int, seconds: float, out: mp.Queue, latencies: bool,
         spin_s: float = 0.0) -> None:
    from protocols.client import PolicyClient

    clients = [PolicyClient(f"tcp://127.0.0.1:{port}", "remote", timeout_s=60, spin_s=spin_s, **client_options(keys))
               for _ in range(n_clients)]
    obs = np.array([0.01, -0.02, 0.03, 0.04], np.float32)
    barrier = threading.Barrier(n_clients)
    counts, lat = [0] * n_clients, []

    def loop(i: int) -> None:
        c = clients[i]
        eid = c.start_episode(training_enabled=False)  # acting only: no chunks to upload
        for _ in range(200):
            c.get_action(eid, obs)
        barrier.wait()
        t_end = time.perf_counter() + seconds
        n = 0
        if latencies:
            while time.perf_counter() < t_end:
                t0 = time.perf_counter_ns()
                c.get_action(eid, obs)
                lat.append(time.perf_counter_ns() - t0)
                n += 1
        else:
            while time.perf_counter() < t_end:
                c.get_action(eid, obs)
                n += 1
        counts[i] = n

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(n_clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for c in clients:
        c.close(flush=False)
    out.put((sum(counts), lat))


def play_batched(port: int, keys: str | None, n_envs: int, seconds: float, out: mp.Queue) -> None:
    """One client acting for ``n_envs`` episodes per request (``get_actions``)."""
    from protocols.client import PolicyClient

    client = PolicyClient(f"tcp://127.0.0.1:{port}", "remote", timeout_s=60, **client_options(keys))
    eids = [client.start_episode(training_enabled=False) for _ in range(n_envs)]
    obs = [np.array([0.01, -0.02, 0.03, 0.04], np.float32)] * n_envs
    for _ in range(50):
        client.get_actions(eids, obs)
    t_end, n = time.perf_counter() + seconds, 0
    while time.perf_counter() < t_end:
        client.get_actions(eids, obs)
        n += n_envs
    client.close(flush=False)
    out.put((n, []))


def play_pipelined(port: int, keys: str | None, n_clients: int, seconds: float, out: mp.Queue) -> None:
    """``n_clients`` clients (a connection and an episode each) driven by one thread: every client's
    request is sent (``send_action``) before any reply is read (``receive_action``), as a process
    hosting many simulators would; each client still has one request in flight at a time."""
    from protocols.client import PolicyClient

    clients = [PolicyClient(f"tcp://127.0.0.1:{port}", "remote", timeout_s=60, **client_options(keys))
               for _ in range(n_clients)]
    eids = [c.start_episode(training_enabled=False) for c in clients]
    obs = np.array([0.01, -0.02, 0.03, 0.04], np.float32)
    for _ in range(50):
        for c, eid in zip(clients, eids):
            c.get_action(eid, obs)
    pairs = list(zip(clients, eids))
    for c, eid in pairs:
        c.send_action(eid, obs)
    t_end, n = time.perf_counter() + seconds, 0
    while time.perf_counter() < t_end:
        for c, eid in pairs:  # collect each reply and ask again at once
            c.receive_action(eid)
            c.send_action(eid, obs)
        n += n_clients
    for c, eid in pairs:
        c.receive_action(eid)
        c.close(flush=False)
    out.put((n, []))


def runnel_round(n_clients: int, procs: int, seconds: float, keys: str | None, latencies: bool,
                 batched: bool = False, spin_s: float = 0.0, pipelined: bool = False) -> dict:
    ctx = mp.get_context("spawn")
    port = free_port()
    ready, stop = ctx.Event(), ctx.Event()
    server = ctx.Process(target=serve, args=(port, keys, ready, stop, spin_s))
    server.start()
    try:
        if not ready.wait(120):
            raise RuntimeError("the policy server did not start")
        procs = min(procs, n_clients)
        out = ctx.Queue()
        per = [n_clients // procs + (i < n_clients % procs) for i in range(procs)]
        players = [ctx.Process(target=play_batched, args=(port, keys, k, seconds, out)) if batched else
                   ctx.Process(target=play_pipelined, args=(port, keys, k, seconds, out)) if pipelined else
                   ctx.Process(target=play, args=(port, keys, k, seconds, out, latencies, spin_s)) for k in per]
        for p in players:
            p.start()
        results = [out.get(timeout=seconds + 300) for _ in players]
        for p in players:
            p.join()
    finally:
        stop.set()
        server.join(30)
        if server.is_alive():
            server.kill()
    total = sum(r[0] for r in results)
    lat = [x for r in results for x in r[1]]
    row = {"actions_per_s": total / seconds}
    if lat:
        row.update(p50_us=float(np.percentile(lat, 50)) / 1e3, p99_us=float(np.percentile(lat, 99)) / 1e3, n=len(lat))
    return row


# --- the transport's floor ------------------------------------------------------------------------
def echo(port: int, ready: mp.Event) -> None:
    import zmq

    sock = zmq.Context().socket(zmq.ROUTER)
    sock.bind(f"tcp://127.0.0.1:{port}")
    ready.set()
    while True:
        sock.send_multipart(sock.recv_multipart())


def zmq_floor(n: int = 3000) -> dict:
    """Round trips of an empty message to a ROUTER that only echoes (another process, loopback):
    what any ZeroMQ request costs on this machine before runnel does anything."""
    import zmq

    ctx = mp.get_context("spawn")
    port, ready = free_port(), ctx.Event()
    proc = ctx.Process(target=echo, args=(port, ready), daemon=True)
    proc.start()
    ready.wait(60)
    sock = zmq.Context().socket(zmq.DEALER)
    sock.connect(f"tcp://127.0.0.1:{port}")
    lat = []
    for i in range(n):
        t0 = time.perf_counter_ns()
        sock.send(b"x")
        sock.recv()
        if i >= 200:
            lat.append(time.perf_counter_ns() - t0)
    proc.kill()
    sock.close(linger=0)
    return {"p50_us": float(np.percentile(lat, 50)) / 1e3, "p99_us": float(np.percentile(lat, 99)) / 1e3}


# --- the RLlib anchor ------------------------------------------------------------------------------
ANCHOR_SERVER = textwrap.dedent('''
    import pickle, sys, threading, http.server, socketserver
    import ray
    from ray.rllib.algorithms.ppo import PPOConfig
    port = int(sys.argv[1])
    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="ERROR")
    config = (PPOConfig().api_stack(enable_rl_module_and_learner=False, enable_env_runner_and_connector_v2=False)
              .environment("CartPole-v1").env_runners(num_env_runners=0).framework("torch"))
    policy = config.build_algo().get_policy()
    episodes = set()

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, *a): pass
        def do_POST(self):  # PolicyServerInput's request handling, for remote inference
            req = pickle.loads(self.rfile.read(int(self.headers["Content-Length"])))
            cmd = getattr(req["command"], "name", req["command"])
            if cmd == "START_EPISODE":
                reply = {"episode_id": req["episode_id"] or str(len(episodes))}
                episodes.add(reply["episode_id"])
            elif cmd == "GET_ACTION":
                reply = {"action": policy.compute_single_action(req["observation"])[0]}
            else:
                reply = {}
            body = pickle.dumps(reply)
            self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
            self.wfile.write(body)

    class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
        daemon_threads = True
        request_queue_size = 256  # 64 clients connect at once (socketserver's default backlog is 5)
    server = Server(("127.0.0.1", port), Handler)
    print("ready", flush=True)
    server.serve_forever()
''')

ANCHOR_CLIENTS = textwrap.dedent('''
    import json, sys, threading, time
    import numpy as np
    from ray.rllib.env.policy_client import PolicyClient
    port, n_clients, seconds, latencies = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "1"
    obs = np.array([0.01, -0.02, 0.03, 0.04], np.float32)
    counts, lat, errors = [0] * n_clients, [], [0]
    def loop(i):
        c = PolicyClient(f"http://127.0.0.1:{port}", inference_mode="remote")
        t_end, n = time.perf_counter() + seconds, 0
        try:
            eid = c.start_episode(training_enabled=False)
            for _ in range(20):
                c.get_action(eid, obs)
            t_end = time.perf_counter() + seconds
            while time.perf_counter() < t_end:
                t0 = time.perf_counter_ns()
                c.get_action(eid, obs)
                if latencies:
                    lat.append(time.perf_counter_ns() - t0)
                n += 1
        except Exception:  # a refused or reset connection under load: counted, and that client stops
            errors[0] += 1
        counts[i] = n
    threads = [threading.Thread(target=loop, args=(i,)) for i in range(n_clients)]
    [t.start() for t in threads]; [t.join() for t in threads]
    print(json.dumps({"total": sum(counts), "lat": lat, "errors": errors[0]}))
''')


def anchor_round(python: str, n_clients: int, procs: int, seconds: float, latencies: bool) -> dict:
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        for name, code in (("server.py", ANCHOR_SERVER), ("clients.py", ANCHOR_CLIENTS)):
            with open(os.path.join(tmp, name), "w") as f:
                f.write(code)
        server = subprocess.Popen([python, os.path.join(tmp, "server.py"), str(port)], stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True)
        try:
            if server.stdout.readline().strip() != "ready":
                raise RuntimeError("the RLlib anchor server did not start")
            procs = min(procs, n_clients)
            per = [n_clients // procs + (i < n_clients % procs) for i in range(procs)]
            players = [subprocess.Popen([python, os.path.join(tmp, "clients.py"), str(port), str(k), str(seconds),
                                         "1" if latencies else "0"], stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True) for k in per]
            results = [json.loads(p.communicate(timeout=seconds + 300)[0]) for p in players]
        finally:
            server.kill()
            server.wait()
    total = sum(r["total"] for r in results)
    lat = [x for r in results for x in r["lat"]]
    row = {"actions_per_s": total / seconds, "client_errors": sum(r["errors"] for r in results)}
    if lat:
        row.update(p50_us=float(np.percentile(lat, 50)) / 1e3, p99_us=float(np.percentile(lat, 99)) / 1e3, n=len(lat))
    return row


def make_keys(directory: str) -> None:
    from actors.external.security import make_keys as write

    write(directory, "server")
    write(os.path.join(directory, "clients"), "bench")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--clients", default="1,16,64")
    p.add_argument("--client-procs", type=int, default=4, help="processes the clients are spread over")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--anchors-python", default=ANCHORS_PYTHON)
    p.add_argument("--no-anchor", action="store_true")
    p.add_argument("--spin-s", type=float, default=0.001,
                   help="also time one client's round trips with both sides polling this long before sleeping (0: skip)")
    args = p.parse_args()
    import ray
    import torch
    import zmq

    emit(bench="machine", cpus=os.cpu_count(), platform=platform.platform(), python=platform.python_version(),
         torch=torch.__version__, ray=ray.__version__, pyzmq=zmq.__version__, libzmq=zmq.zmq_version())
    emit(bench="zmq_floor", **zmq_floor())
    anchor = not args.no_anchor and os.path.exists(args.anchors_python)
    if not anchor:
        emit(bench="anchor", system="rllib", skipped=f"no anchors venv at {args.anchors_python}" if not args.no_anchor
             else "--no-anchor")
    counts = [int(c) for c in args.clients.split(",")]
    rows: dict = {}
    with tempfile.TemporaryDirectory() as keys:
        make_keys(keys)
        for r in range(args.repeats):
            setups = [("runnel", "plaintext"), ("runnel", "curve")] + ([("rllib", "plaintext")] if anchor else [])
            for system, security in setups:
                for n in counts:  # with one client, the round also times each round trip
                    if system == "runnel":
                        row = runnel_round(n, args.client_procs, args.seconds, keys if security == "curve" else None,
                                           latencies=n == 1)
                    else:
                        row = anchor_round(args.anchors_python, n, args.client_procs, args.seconds, latencies=n == 1)
                    if "p50_us" in row:
                        emit(bench="latency", system=system, security=security, repeat=r,
                             **{k: row[k] for k in ("p50_us", "p99_us", "n")})
                    emit(bench="throughput", system=system, security=security, clients=n, repeat=r,
                         **{k: v for k, v in row.items() if k in ("actions_per_s", "client_errors")})
                    rows.setdefault((system, security, n), []).append(row)
                    if system == "runnel" and n == 1 and args.spin_s > 0:  # the latency-minded setting
                        row = runnel_round(1, 1, args.seconds, keys if security == "curve" else None, latencies=True,
                                           spin_s=args.spin_s)
                        emit(bench="latency", system=system, security=f"{security}_spin", spin_s=args.spin_s,
                             repeat=r, **{k: row[k] for k in ("p50_us", "p99_us", "n")})
                        rows.setdefault((system, f"{security}_spin", n), []).append(row)
                    if system == "runnel" and n > 1:  # the same clients, each process's driven by one thread
                        row = runnel_round(n, args.client_procs, args.seconds, keys if security == "curve" else None,
                                           latencies=False, pipelined=True)
                        emit(bench="throughput_pipelined", system=system, security=security, clients=n,
                             client_processes=min(args.client_procs, n), repeat=r, actions_per_s=row["actions_per_s"])
                        rows.setdefault((system, security, f"{n}_pipelined"), []).append(row)
                    if system == "runnel" and n > 1:  # the same envs, one batched request per client process
                        row = runnel_round(n, args.client_procs, args.seconds, keys if security == "curve" else None,
                                           latencies=False, batched=True)
                        emit(bench="throughput_batched", system=system, security=security, envs=n,
                             client_processes=min(args.client_procs, n), repeat=r, actions_per_s=row["actions_per_s"])
                        rows.setdefault((system, security, f"{n}_batched"), []).append(row)
    summary = {}
    for (system, security, n), rs in rows.items():
        summary[f"{system}_{security}_{n}_actions_per_s"] = statistics.median(r["actions_per_s"] for r in rs)
        if any("p50_us" in r for r in rs):
            summary[f"{system}_{security}_p50_us"] = statistics.median(r["p50_us"] for r in rs if "p50_us" in r)
            summary[f"{system}_{security}_p99_us"] = statistics.median(r["p99_us"] for r in rs if "p99_us" in r)
    for n in counts:
        for how in ("", "_pipelined"):  # clients on threads of their own; clients driven by one thread per process
            base = summary.get(f"runnel_plaintext_{n}{how}_actions_per_s")
            if base and summary.get(f"runnel_curve_{n}{how}_actions_per_s"):
                summary[f"curve_cost_{n}{how}"] = 1 - summary[f"runnel_curve_{n}{how}_actions_per_s"] / base
            if base and summary.get(f"rllib_plaintext_{n}_actions_per_s"):
                summary[f"runnel_over_rllib_{n}{how}"] = base / summary[f"rllib_plaintext_{n}_actions_per_s"]
    emit(bench="summary", **summary)


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main()
