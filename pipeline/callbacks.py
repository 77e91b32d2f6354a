"""RLlib-style callbacks (see ``actors.callbacks``): subclass ``Callbacks`` (alias ``DefaultCallbacks``,
``RLlibCallback``), override the hooks you need, and pass the class -- or a list of classes, or
functions per hook -- to ``config.callbacks(...)``."""
from actors.callbacks import (HOOKS, CallbackError, Callbacks, DefaultCallbacks, MultiCallbacks, RLlibCallback,
                              make_multi_callbacks)

__all__ = ["HOOKS", "CallbackError", "Callbacks", "DefaultCallbacks", "MultiCallbacks", "RLlibCallback",
           "make_multi_callbacks"]
