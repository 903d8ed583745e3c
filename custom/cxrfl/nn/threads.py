"""CPU threads: a site computes on the cores it is given; the server aggregates on one.

Oversubscribed OpenMP threads are what makes torch collapse on a busy machine (BENCHMARKS.md:
aggregating 10 DenseNet121 updates took 4.5 s with torch's default 2 threads on 2 busy cores, 0.26 s
with one). So:

- a site calls :func:`use_cores` once with its executor's ``num_threads`` (0: every core the
  process is given); simulated sites sharing a machine each get their share (``num_threads`` =
  cores / simulator threads ``-t``; the exported jobs use 1);
- the server runs validation and aggregation inside :func:`torch_threads` ``(1)`` (or
  :func:`single_threaded`), as NVFlare's numpy FedAvg does, whatever else runs on the machine.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

import torch
from threadpoolctl import threadpool_limits

from cxrfl.common.cores import available_cores

P = ParamSpec("P")
R = TypeVar("R")


def use_cores(num_threads: int) -> int:
    """Make torch and the BLAS/OpenMP libraries of this process use ``num_threads`` threads.

    Args:
        num_threads: threads (0: :func:`cxrfl.common.cores.available_cores`).

    Returns:
        the thread count now in use.
    """
    if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 0:
        raise ValueError(f"num_threads must be an integer >= 0 (0: all cores given), got {num_threads!r}")
    n = num_threads or available_cores()
    torch.set_num_threads(n)
    threadpool_limits(limits=n)
    return n


@contextlib.contextmanager
def torch_threads(n: int = 1) -> Iterator[None]:
    """Run a block with torch on ``n`` intra-op threads; the previous count comes back after.

    Args:
        n: threads inside the block.
    """
    before = torch.get_num_threads()
    if before != n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def single_threaded(fn: Callable[P, R]) -> Callable[P, R]:
    """Decorate ``fn`` to run inside :func:`torch_threads` ``(1)``.

    Args:
        fn: the function.
    """

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with torch_threads(1):
            return fn(*args, **kwargs)

    return wrapper
