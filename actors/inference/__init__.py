"""Central inference (SEED style): a stage that holds the module and acts for many env runners.

``server.InferenceServer`` (the role, torch), ``client.RemoteActing`` (a runner's side, torch-free),
``batching`` (the engine it shares with the external-client policy server), ``forward`` (the batched
forward pass every acting stage uses), ``streams`` (each runner's exploration on the server),
``directory`` (where servers listen now), ``settings``. Nothing is imported here, so a runner can
import the torch-free parts alone.
"""
