"""The CPU cores this process is given: what sizes a site's torch threads
(:func:`cxrfl.nn.threads.use_cores`) and its data-loader workers
(:func:`cxrfl.data.dataset.resolve_workers`)."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def _cgroup_cpus() -> int | None:
    """CPUs allowed by a cgroup v2 quota (``cpu.max``), None without a quota."""
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))


def available_cores() -> int:
    """The cores this process is given: ``OMP_NUM_THREADS`` when set, else its CPU affinity
    capped by a cgroup CPU quota (a container's ``--cpus``)."""
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_cpus()
    return max(1, min(cores, quota) if quota else cores)
