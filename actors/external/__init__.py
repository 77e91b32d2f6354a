"""The server side of external environment clients: policy server, CURVE security, the commit journal."""
