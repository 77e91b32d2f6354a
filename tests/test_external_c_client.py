"""The C client of examples/c_client (written from protocols/EXTERNAL.md) plays against a policy server.

Built with the system's libzmq when its header is installed (``make c-client-deps`` installs it on
Debian/Ubuntu), else against the libzmq that pyzmq ships (declaring its functions itself). Skipped,
saying why, where there is no C compiler."""
from __future__ import annotations

import glob
import os
import shutil
import subprocess

import pytest
import zmq

from tests.test_external import ids, make_server

SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "c_client",
                      "cartpole_client.c")


def build(out: str) -> list[str]:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler (cc/gcc/clang) on this machine: the C client cannot be built here")
    system = subprocess.run([cc, "-O2", "-o", out, SOURCE, "-lzmq", "-lm"], capture_output=True, text=True)
    if system.returncode == 0:
        return [out]
    bundled = glob.glob(os.path.join(os.path.dirname(zmq.__file__), os.pardir, "pyzmq.libs", "libzmq*.so*"))
    if not bundled:
        pytest.skip(f"no libzmq to build against (system: {system.stderr.strip()[:200]}); run `make c-client-deps`")
    lib = os.path.abspath(bundled[0])
    fallback = subprocess.run([cc, "-O2", "-DRUNNEL_NO_ZMQ_H", "-o", out, SOURCE, lib, "-lm",
                               f"-Wl,-rpath,{os.path.dirname(lib)}"], capture_output=True, text=True)
    assert fallback.returncode == 0, fallback.stderr
    return [out]


def test_the_c_client_plays_and_uploads_episodes(tmp_path):
    command = build(str(tmp_path / "cartpole_client"))
    server = make_server(tmp_path, fragment_length=500)
    try:
        run = subprocess.run(command + [server.address, "3"], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr
        assert "3 chunks received by the server" in run.stdout
        got = []
        while len(got) < 3:
            got += server.sample(1)
        assert len(ids(got)) == 3 and all(c.is_done for c in got)
        for c in got:
            assert c.obs.shape == (len(c) + 1, 4) and c.extra["action_dist_inputs"].shape == (len(c), 2)
        assert server.get_metrics()["external/num_bad_chunks"]["value"] == 0
    finally:
        server.stop()


def test_the_c_client_cuts_episodes_at_the_fragment_length(tmp_path):
    """The server refuses chunks longer than the fragment_length its welcome announced: the C client
    cuts each episode into chunks of at most that many steps, which share their boundary rows."""
    command = build(str(tmp_path / "cartpole_client"))
    server = make_server(tmp_path, fragment_length=4)
    try:
        run = subprocess.run(command + [server.address, "3"], capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr
        steps = sum(int(line.split()[-2]) for line in run.stdout.splitlines() if line.startswith("episode "))
        got = []
        while sum(len(c) for c in got) < steps:
            got += server.sample(1)
        assert all(len(c) <= 4 for c in got) and len(got) > 3
        for eid in {c.episode_id for c in got}:
            chunks = sorted((c for c in got if c.episode_id == eid), key=lambda c: c.chunk_index)
            assert [c.chunk_index for c in chunks] == list(range(len(chunks))) and chunks[-1].is_done
            assert not any(c.is_done for c in chunks[:-1])
            for a, b in zip(chunks, chunks[1:]):
                assert (a.obs[-1] == b.obs[0]).all() and b.t_started == a.t_started + len(a)
        assert server.get_metrics()["external/num_bad_chunks"]["value"] == 0
    finally:
        server.stop()
