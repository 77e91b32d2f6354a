"""The one exception type that `protocols` raises for bad data."""


class ProtocolError(ValueError):
    """Raised for any frame, message or episode that does not satisfy the protocol.

    Decoding untrusted bytes raises only this (never a msgpack, lz4 or numpy error), so a
    receiver can count and drop a bad frame with a single ``except ProtocolError``.
    """
