"""Tiny CWT sites and host wrappers for the fast tests of the relay (tests/test_cwt*.py)."""

from __future__ import annotations

import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from cxrfl.common.transport import SiteHost
from cxrfl.data.site import SiteData
from PIL import Image


def tiny_site(folder: Path, name: str, labels: dict[str, list[float]], splits: list[str]) -> SiteData:
    """A site of 32x32 noise images (seeded by the site name), one row per entry of ``splits``."""
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    rows = []
    for i, split in enumerate(splits):
        path = folder / f"{name}-{i}.png"
        Image.fromarray(rng.integers(0, 255, (32, 32), dtype=np.uint8)).save(path)
        rows.append(
            {"path": str(path), "patient": f"{name}-p{i}", "split": split, **{c: v[i] for c, v in labels.items()}}
        )
    return SiteData(site=name, classes=list(labels), table=pd.DataFrame(rows))


class Wrapper:
    """A site host around another one; subclasses change what ``handle`` does."""

    def __init__(self, host: SiteHost) -> None:
        self.host = host
        self.tasks = host.tasks

    def handle(self, task: str, params: Mapping[str, Any], meta: Mapping[str, Any]):
        return self.host.handle(task, params, meta)

    def describe(self, task: str, meta: Mapping[str, Any], answer: Mapping[str, Any]) -> str | None:
        return self.host.describe(task, meta, answer)

    def scalars(self, task: str, answer: Mapping[str, Any]):
        return self.host.scalars(task, answer)


class Recorder(Wrapper):
    """Keeps a copy of what each ``train`` task received and returned: ``log`` of (cycle, site, received, returned)."""

    def __init__(self, host: SiteHost, name: str, log: list) -> None:
        super().__init__(host)
        self.name = name
        self.log = log

    def handle(self, task, params, meta):
        params_in = {k: np.array(v, copy=True) for k, v in params.items()}
        out, answer = self.host.handle(task, params, meta)
        if task == "train":
            self.log.append((meta["cycle"], self.name, params_in, {k: np.array(v, copy=True) for k, v in out.items()}))
        return out, answer


class Failing(Wrapper):
    """Raises ``error`` on the tasks for which ``when(task, meta)`` is true (a site that is down)."""

    def __init__(
        self,
        host: SiteHost,
        when: Callable[[str, Mapping[str, Any]], bool],
        error: Callable[[], BaseException] = lambda: RuntimeError("site is down"),
    ) -> None:
        super().__init__(host)
        self.when = when
        self.error = error

    def handle(self, task, params, meta):
        if self.when(task, meta):
            raise self.error()
        return self.host.handle(task, params, meta)


class ScriptedLoss(Wrapper):
    """Answers ``validate`` on the val split with the loss ``losses[cycle]`` (the model is still evaluated)."""

    def __init__(self, host: SiteHost, losses: Mapping[int, float]) -> None:
        super().__init__(host)
        self.losses = losses

    def handle(self, task, params, meta):
        out, answer = self.host.handle(task, params, meta)
        if task == "validate" and meta.get("split") == "val":
            answer["metrics"]["loss"] = self.losses[meta["cycle"]]
        return out, answer


def chain(*makers: Callable[[str, SiteHost], SiteHost]) -> Callable[[str, SiteHost], SiteHost]:
    """One ``wrap`` for :func:`cxrfl.cwt.inprocess.run_cwt` from several (applied left to right)."""

    def wrap(name: str, host: SiteHost) -> SiteHost:
        for make in makers:
            host = make(name, host)
        return host

    return wrap
