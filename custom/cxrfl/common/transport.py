"""How a server loop talks to its sites, whatever carries the messages.

A message is ``(params, meta)``: a dict of arrays and a JSON-friendly dict. A server loop
(:mod:`cxrfl.surgical.server`, :mod:`cxrfl.cwt.server`, :mod:`cxrfl.fedfew.server`) only calls a
:class:`Send`: ``send(task, {site: message}) -> {site: answer}`` with the answers of the sites
that succeeded (a site that failed, timed out or is down is absent). With ``on_answer`` a loop
streams: each answer is handed to it as it arrives and the transport keeps only its meta (the
answer comes back as ``({}, meta)``), so a server holds one site's parameters at a time
instead of every site's (:class:`cxrfl.surgical.server.SurgicalServer` adds each to its running
sum). NVFlare's transport is
:meth:`cxrfl.fl.base.TaskController.send`; :func:`inprocess_transport` calls each site's
:class:`SiteHost` in this process (benchmarks and fast tests), copying arrays both ways as a
network would, so a site can never change what the server holds.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import numpy as np
import torch

log = logging.getLogger(__name__)

Message = tuple[dict[str, Any], dict[str, Any]]
"""``(params, meta)``: name -> array, and JSON-friendly settings or results."""

OnAnswer = Callable[[str, Message], None]
"""``on_answer(site, answer)``: called with each answer as it arrives (one call at a time)."""


class Send(Protocol):
    """``send(task, {site: message}) -> {site: answer}`` (answers of the sites that succeeded)."""

    def __call__(
        self, task: str, payloads: dict[str, Message], *, on_answer: OnAnswer | None = None
    ) -> dict[str, Message]:
        """Send one message per site and wait for the answers.

        Args:
            task: the task name.
            payloads: site -> its message.
            on_answer: called with each answer as it arrives; its params are then dropped (the
                returned answer is ``({}, meta)``). None: answers come back whole.
        """
        ...


class SiteHost(Protocol):
    """One site's endpoint of a method: answers tasks with the site's own data."""

    tasks: tuple[str, ...]
    """The task names it answers."""

    def handle(self, task: str, params: Mapping[str, Any], meta: Mapping[str, Any]) -> Message:
        """Answer one task (errors propagate: the transport leaves the site out)."""
        ...

    def describe(self, task: str, meta: Mapping[str, Any], answer: Mapping[str, Any]) -> str | None:
        """The operator's log line for an answered task (None: nothing to say)."""
        ...

    def scalars(self, task: str, answer: Mapping[str, Any]) -> tuple[dict[str, float], int] | None:
        """Metrics to track for an answered task, with their step (None: nothing)."""
        ...


def copy_params(params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Fresh numpy copies of every array (what arrives after serialisation).

    Args:
        params: name -> array or tensor.
    """
    return {
        k: (
            v.detach().to("cpu", memory_format=torch.contiguous_format, copy=True).numpy()
            if torch.is_tensor(v)
            else np.array(v, copy=True, order="C")
        )
        for k, v in params.items()
    }


def inprocess_transport(
    hosts: Mapping[str, SiteHost],
    warning: Callable[[str], None] = log.warning,
    info: Callable[[str], None] | None = None,
) -> Send:
    """A :class:`Send` that calls each site's host in turn, in this process.

    Args:
        hosts: site name -> its host.
        warning: where a failing site's message goes (the site is then left out of the answers).
        info: where each site's :meth:`SiteHost.describe` line goes (None: nowhere).
    """

    def send(task: str, payloads: dict[str, Message], *, on_answer: OnAnswer | None = None) -> dict[str, Message]:
        out: dict[str, Message] = {}
        for site, (params, meta) in payloads.items():
            host = hosts.get(site)
            if host is None:
                warning(f"site {site}: not connected; task {task} not sent")
                continue
            try:
                answer_params, answer_meta = host.handle(task, copy_params(params), dict(meta))
            except Exception as exc:  # one failing site must not stop the others
                warning(f"site {site}: task {task} failed: {type(exc).__name__}: {exc}")
                continue
            answer = (copy_params(answer_params), dict(answer_meta))
            if on_answer is not None:
                on_answer(site, answer)
                answer = ({}, answer[1])
            out[site] = answer
            if info is not None:
                line = host.describe(task, meta, answer_meta)
                if line:
                    info(line)
        return out

    return send
