"""Environment and rendezvous port for a test's child process (the main job, a benchmark,
torchrun).

The pytest process may hold a gloo store on its own MASTER_PORT (the ``mcore_parallel``
fixture initialises torch.distributed), so a child that inherited the rendezvous variables would
try to listen on the same port (EADDRINUSE). ``child_env`` drops them."""

import os
import socket

RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                   "LOCAL_WORLD_SIZE")


def child_env(**extra: str) -> dict:
    """os.environ without the rendezvous variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARS}
    env.update(extra)
    return env


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (torchrun's --master_port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
