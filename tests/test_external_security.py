"""External clients: the server's limits (frame size, open episodes), CURVE and plaintext off loopback,
``runnel keys``, and the ``external_clients`` config group."""
from __future__ import annotations

import msgpack
import numpy as np
import pytest
import zmq

from actors.external.security import SecurityError, make_keys
from pipeline.config.base import ConfigError
from protocols.client import PolicyClient
from protocols.external import ServerError
from tests.test_external import CARTPOLE, free_port, make_server


def test_an_oversized_frame_drops_only_that_connection(tmp_path):
    server = make_server(tmp_path, max_frame_bytes=1 << 16)
    ctx = zmq.Context()
    bad = ctx.socket(zmq.DEALER)
    bad.linger = 0
    try:
        with PolicyClient(server.address, "remote", timeout_s=20) as good:
            bad.connect(server.address)
            bad.send_multipart([msgpack.packb({"op": "ping", "id": 1}), b"x" * (1 << 17)])
            eid = good.start_episode()
            assert good.get_action(eid, np.zeros(4, np.float32)) in (0, 1)
            assert server.error is None
    finally:
        bad.close()
        ctx.term()
        server.stop()


def test_too_many_open_episodes_is_an_error_reply(tmp_path):
    server = make_server(tmp_path, max_open_episodes=2)
    try:
        with PolicyClient(server.address, "remote", timeout_s=20) as client:
            client.start_episode()
            client.start_episode()
            with pytest.raises(ServerError, match="too_many_episodes"):
                client.start_episode()
    finally:
        server.stop()


def test_curve_admits_listed_keys_only(tmp_path):
    server_pub, server_secret = make_keys(str(tmp_path / "keys"), "server")
    _, good_secret = make_keys(str(tmp_path / "clients"), "good")
    _, stranger_secret = make_keys(str(tmp_path / "strangers"), "stranger")
    server = make_server(tmp_path, server_secret_key=server_secret, allowed_client_keys=str(tmp_path / "clients"))
    try:
        with PolicyClient(server.address, "remote", server_public_key=server_pub, client_key=good_secret,
                          timeout_s=20) as client:
            eid = client.start_episode()
            assert client.get_action(eid, np.zeros(4, np.float32)) in (0, 1)
        with pytest.raises(ConnectionRefusedError, match="allowed_client_keys"):  # told, not left to time out
            PolicyClient(server.address, "remote", server_public_key=server_pub, client_key=stranger_secret,
                         timeout_s=60)
        with pytest.raises(TimeoutError):  # plaintext to a CURVE server: no handshake either
            PolicyClient(server.address, "remote", timeout_s=2)
        assert server.get_metrics()["external/num_refused_keys"]["value"] >= 1
    finally:
        server.stop()


def test_plaintext_is_refused_off_loopback_unless_asked_for(tmp_path):
    with pytest.raises(SecurityError, match="CURVE"):
        make_server(tmp_path, address=f"tcp://0.0.0.0:{free_port()}")
    server = make_server(tmp_path, address=f"tcp://0.0.0.0:{free_port()}", allow_plaintext=True)
    server.stop()


def test_config_group_is_validated():
    from pipeline.algorithms.impala.config import IMPALAConfig
    from pipeline.algorithms.ppo.config import PPOConfig

    spaces = {"observation_space": CARTPOLE.observation_space, "action_space": CARTPOLE.action_space}
    with pytest.raises(ConfigError, match="observation_space"):
        PPOConfig().external_clients(address="tcp://127.0.0.1:9000").validate()
    with pytest.raises(ConfigError, match="did you mean 'max_batch'"):
        PPOConfig().environment(**spaces).external_clients(max_bacth=4).validate()
    with pytest.raises(ConfigError, match="tcp://HOST:PORT"):
        PPOConfig().environment(**spaces).external_clients(address="127.0.0.1").validate()
    with pytest.raises(ConfigError, match="CURVE"):
        PPOConfig().environment(**spaces).external_clients(address="tcp://0.0.0.0:9000").validate()
    IMPALAConfig().environment(**spaces).external_clients().validate()  # streaming plans take clients too
    with pytest.raises(ConfigError, match="no environment"):
        PPOConfig().validate()
    PPOConfig().environment(**spaces).external_clients(address="tcp://127.0.0.1:9000").validate()


def test_runnel_keys_writes_key_pairs(tmp_path, capsys):
    from pipeline.cli.main import main

    assert main(["keys", "server", "sim-1", "--dir", str(tmp_path)]) == 0
    for name in ("server.key", "server.key_secret", "sim-1.key", "sim-1.key_secret"):
        assert (tmp_path / name).exists()
    assert oct((tmp_path / "sim-1.key_secret").stat().st_mode & 0o777) == "0o600"
    assert main(["keys", "server", "--dir", str(tmp_path)]) == 2  # never overwrites a key silently
    assert "exists" in capsys.readouterr().err
