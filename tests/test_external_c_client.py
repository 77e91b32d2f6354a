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
