"""Recorded experience on the driver side: recording a policy, importing datasets, off-policy estimation."""
