"""Training plans: how an algorithm's stages are wired and how often each runs (synchronous plans live in the algorithm's own file)."""
