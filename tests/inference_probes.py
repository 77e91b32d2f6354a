"""Functions the central-inference tests run inside env runner actors. Torch-free on purpose: a runner
under central inference imports this module (by reference, through Ray) and must stay torch-free."""
from __future__ import annotations

import os
import signal
import sys


def torch_loaded(runner) -> bool:
    """Whether the runner's process has imported torch (``foreach_env_runner``)."""
    return "torch" in sys.modules


def kill_server_once(pid_file: str, *, env_runner=None, **kwargs) -> None:
    """An ``on_episode_end`` hook: runner 1 kills the process whose pid ``pid_file`` holds, once, in the
    middle of its sampling (the file is claimed by renaming it, so nobody kills twice)."""
    if env_runner is None or env_runner.worker_index != 1:
        return
    claimed = pid_file + ".taken"
    try:
        os.rename(pid_file, claimed)
    except FileNotFoundError:
        return
    with open(claimed) as f:
        os.kill(int(f.read()), signal.SIGKILL)
