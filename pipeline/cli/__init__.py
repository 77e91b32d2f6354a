"""runnel's command line: ``runnel train``, ``evaluate``, ``record``, ``inspect``, ``import``, ``plot``."""
