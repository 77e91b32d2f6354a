"""CURVE encryption and ZAP authentication for the policy server, and the key files ``runnel keys`` writes.

A server with a secret key encrypts every connection (CurveZMQ) and admits only clients whose
public keys are on its allow-list, checked by a ZAP handler thread before any message reaches the
server. Without a key the server speaks plaintext, which it allows only on a loopback address or
when the user opts in (``allow_plaintext=True``), with a warning.
"""
from __future__ import annotations

import ipaddress
import logging
import os
import socket
from typing import Any
from urllib.parse import urlsplit

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = logging.getLogger("runnel")


class SecurityError(ValueError):
    """A security setting that cannot work (a missing key, plaintext on a public address)."""


def make_keys(directory: str, name: str) -> tuple[str, str]:
    """Write a CURVE key pair ``NAME.key`` (public: give it to the other side) and
    ``NAME.key_secret`` (keep it) into ``directory``; returns both paths."""
    os.makedirs(directory, exist_ok=True)
    public, secret = zmq.auth.create_certificates(directory, name)
    os.chmod(secret, 0o600)
    return public, secret


def is_loopback(address: str) -> bool:
    """Whether a ``tcp://host:port`` (or ipc/inproc) address is reachable from this machine only."""
    parts = urlsplit(address)
    if parts.scheme in ("ipc", "inproc"):
        return True
    host = parts.hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        try:
            return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
        except OSError:
            return False


def public_keys(allowed: Any) -> set[bytes]:
    """The allow-list: a directory of ``.key`` files, a list of such files or z85 public keys."""
    if allowed is None:
        return set()
    items = [allowed] if isinstance(allowed, str) else list(allowed)
    keys: set[bytes] = set()
    for item in items:
        if isinstance(item, str) and os.path.isdir(item):
            keys |= {_public(os.path.join(item, f)) for f in sorted(os.listdir(item)) if f.endswith(".key")}
        elif isinstance(item, (str, bytes)) and len(item) == 40 and not os.path.exists(item):
            keys.add(item.encode("ascii") if isinstance(item, str) else bytes(item))
        else:
            keys.add(_public(item))
    return keys


def _public(path: Any) -> bytes:
    try:
        return zmq.auth.load_certificate(path)[0]
    except (OSError, ValueError) as err:
        raise SecurityError(f"cannot read a CURVE public key from {path!r}: {err}") from None


class _AllowList:
    def __init__(self, keys: set[bytes]) -> None:
        self.keys = keys
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        self.refused += 1
        log.warning("policy server refused a client with an unknown CURVE key %s", key.decode("ascii", "replace"))
        return False


class ServerSecurity:
    """Applies a server's security settings to its ROUTER socket; ``stop()`` ends the ZAP thread."""

    def __init__(self, ctx: zmq.Context, address: str, secret_key_file: str | None, allowed_client_keys: Any,
                 allow_plaintext: bool) -> None:
        self.curve = secret_key_file is not None
        self.auth: ThreadAuthenticator | None = None
        self.allow: _AllowList | None = None
        if not self.curve:
            if allowed_client_keys:
                raise SecurityError("allowed_client_keys needs server_secret_key (CURVE): without it "
                                    "clients cannot be authenticated")
            if not is_loopback(address):
                if not allow_plaintext:
                    raise SecurityError(
                        f"the policy server at {address} is reachable from other machines, so it needs CURVE: "
                        f"make keys with `runnel keys server` and `runnel keys CLIENT`, then set "
                        f"server_secret_key='server.key_secret' and allowed_client_keys=[...] -- or bind to "
                        f"127.0.0.1, or accept unencrypted, unauthenticated traffic with allow_plaintext=True")
                log.warning("policy server at %s accepts PLAINTEXT connections from any host "
                            "(allow_plaintext=True): anyone who reaches it can send experience", address)
            return
        try:
            public, secret = zmq.auth.load_certificate(secret_key_file)
        except (OSError, ValueError) as err:
            raise SecurityError(f"cannot read the server's CURVE key {secret_key_file!r}: {err}") from None
        if secret is None:
            raise SecurityError(f"{secret_key_file!r} holds no secret key: give the '.key_secret' file")
        keys = public_keys(allowed_client_keys)
        if not keys:
            raise SecurityError("CURVE is on but allowed_client_keys lists no client public keys; add the "
                                "clients' '.key' files (or a directory of them)")
        self.public, self.secret = public, secret
        self.allow = _AllowList(keys)
        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger("runnel.zap"))
        self.auth.start()
        self.auth.configure_curve_callback(domain="*", credentials_provider=self.allow)

    def apply(self, sock: zmq.Socket) -> None:
        if self.curve:
            sock.curve_secretkey = self.secret
            sock.curve_publickey = self.public
            sock.curve_server = True

    @property
    def refused(self) -> int:
        return self.allow.refused if self.allow is not None else 0

    def stop(self) -> None:
        if self.auth is not None:
            self.auth.stop()
            self.auth = None
