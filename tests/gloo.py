"""How the tests' 2-process gloo runs start and end.

A process that reaches interpreter shutdown with gloo's worker threads still holding work (tensors with Python
references) can abort with "terminate called without an active exception" (SIGABRT), more often on a loaded machine:
pytorch/pytorch#179291. So each rank waits for the other, destroys the process group while Python is fully alive,
and leaves with ``os._exit``, skipping the finalizers that race those threads. Only on success: a failing rank raises
as usual, and its traceback reaches the test.
"""

from __future__ import annotations

import os
import socket
import sys

import torch.distributed as dist


def free_port() -> int:
    """A TCP port nothing listens on now, for MASTER_PORT or a tcp:// init method."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def leave() -> None:
    """End this rank's process with status 0 once both ranks are done with gloo."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, args: tuple, nprocs: int, timeout: float) -> None:
    """``torch.multiprocessing.spawn`` that fails the test after ``timeout`` seconds (a hang) instead of waiting on.

    On a time-out every process is killed and an AssertionError names the hang.
    """
    import time

    import torch.multiprocessing as mp

    context = mp.start_processes(fn, args=args, nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
        if time.monotonic() > deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            raise AssertionError(f"the processes did not finish within {timeout:.0f} s: a collective left waiting")
