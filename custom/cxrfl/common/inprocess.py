"""What every method's in-process runner shares: one signature and one result type.

The runners (:func:`cxrfl.surgical.inprocess.run_surgical`, :func:`cxrfl.cwt.inprocess.run_cwt`,
:func:`cxrfl.fedfew.inprocess.run_fedfew`) run a method's server loop over
:func:`cxrfl.common.transport.inprocess_transport`: what the benchmarks and the fast tests call. Each
is ``run_<method>(sites, config, out_dir, *, run_id, resume_from, resume_root, info, warning,
aborted, ...)`` (:data:`RUNNER_PARAMETERS`; a method's own keywords follow) and returns a
:class:`RunResult` (a method may add fields).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

OutcomeT = TypeVar("OutcomeT")

RUNNER_PARAMETERS = (
    "sites",
    "config",
    "out_dir",
    "run_id",
    "resume_from",
    "resume_root",
    "info",
    "warning",
    "aborted",
)
"""The parameters every runner takes, in this order (the first three positional)."""


@dataclass
class RunResult(Generic[OutcomeT]):
    """A finished in-process run of any method.

    Args:
        outcome: what the method's server loop returned (its files are under the run's ``out_dir``).
        seconds: wall time.
    """

    outcome: OutcomeT
    seconds: float
