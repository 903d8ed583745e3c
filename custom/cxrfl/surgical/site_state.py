"""A site's state folder for one run: what survives between rounds at the site.

:class:`cxrfl.surgical.learner.SiteLearner` keeps here what never travels and what a rebuilt process
(the NVFlare simulator with ``-t 1``, a resumed job) needs to train exactly as before:

- ``local_bn.pt`` / ``local_head.pt``: the site's own BatchNorm (FedBN) and head (``local`` mode);
- ``local_rounds/round_NNN.pt``: those parts per evaluated model round, so evaluating the model of
  round r later (the selected model, on the test split) uses them as they were in round r;
- ``optimizer_rounds/round_NNN.pt``: the optimizer state after each trained round (the last two):
  round r starts from the state after the latest earlier round, so a round redone after an
  interruption (or a retried task) trains exactly as the first time.

Every file holds tensors and plain values only and is read with ``weights_only`` (nothing in it is run).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from cxrfl.common.io import torch_load, torch_save
from cxrfl.errors import ConfigError

log = logging.getLogger(__name__)

LOCAL_ROUNDS = "local_rounds"
"""Sub-folder with the site's own parts per evaluated model round."""

OPTIMIZER_ROUNDS = "optimizer_rounds"
"""Sub-folder with the optimizer state after each trained round (the last two kept)."""


def round_file(folder: Path, round_num: int) -> Path:
    """The file of one round's state in ``folder``."""
    return folder / f"round_{int(round_num):03d}.pt"


def stored_rounds(folder: Path) -> dict[int, Path]:
    """The rounds stored in ``folder`` (none if it does not exist), by round number."""
    return {int(p.stem.split("_")[1]): p for p in folder.glob("round_*.pt")}


def prune_rounds(folder: Path, keep: set[int]) -> None:
    """Delete every round file in ``folder`` whose round is not in ``keep``."""
    for r, path in stored_rounds(folder).items():
        if r not in keep:
            path.unlink(missing_ok=True)


class SiteState:
    """One site's state folder (created).

    Args:
        folder: the folder (one per site and run).
        site: the site's name (for messages).
        device: where loaded tensors go.
    """

    def __init__(self, folder: str | Path, site: str, device: torch.device) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.site = site
        self.device = device

    def save(self, name: str, obj: Any) -> None:
        """Write ``obj`` (tensors and plain values) as ``name``."""
        torch_save(self.folder / name, obj)

    def load(self, name: str) -> Any:
        """What ``name`` holds (None when it does not exist)."""
        path = self.folder / name
        return self.read(path) if path.is_file() else None

    def read(self, path: Path, remedy: str | None = None) -> Any:
        """A file of the folder.

        Args:
            path: the file.
            remedy: what to do when it cannot be read (default: start this site's state afresh).

        Raises:
            ConfigError: damaged, or holding other objects (one line naming it).
        """
        remedy = remedy or f"delete {self.folder} (this site's state of the run) and run the job again"
        return torch_load(path, f"site {self.site} state", remedy, self.device)

    def restore_optimizer(self, opt: torch.optim.Optimizer, round_num: int) -> None:
        """Load the optimizer state stored after the latest round before ``round_num`` (if any; a
        file that cannot be read or does not fit: a warning, and the round starts with ``opt`` afresh).

        Args:
            opt: a fresh optimizer over the site's model.
            round_num: the round about to be trained.
        """
        stored = stored_rounds(self.folder / OPTIMIZER_ROUNDS)
        earlier = [r for r in stored if r < round_num]
        if not earlier:
            return
        path = stored[max(earlier)]
        try:
            opt.load_state_dict(self.read(path, "this round trains with a fresh optimizer"))
        except ConfigError as exc:
            log.warning("%s", exc)
        except (ValueError, KeyError):
            log.warning("site %s: stored optimizer state %s does not fit the model; starting afresh", self.site, path)

    def store_optimizer(self, opt: torch.optim.Optimizer, round_num: int) -> None:
        """Save the optimizer state after ``round_num``; keep it and the latest earlier one only.

        Args:
            opt: the optimizer after the round's training.
            round_num: the round just trained.
        """
        folder = self.folder / OPTIMIZER_ROUNDS
        torch_save(round_file(folder, round_num), opt.state_dict())
        earlier = [r for r in stored_rounds(folder) if r < round_num]
        prune_rounds(folder, {round_num, max(earlier, default=round_num)})

    def local_parts(
        self, model_round: int, current: Mapping[str, torch.Tensor], keep_rounds: Iterable[int] = ()
    ) -> dict[str, torch.Tensor] | None:
        """The site's own parts of ``model_round``: stored ones (returned), or ``current`` (stored, None returned)
        the first time that round is seen; rounds other than it and ``keep_rounds`` are deleted.

        Args:
            model_round: the round the received model comes from.
            current: the site's own parts now.
            keep_rounds: model rounds whose parts stay on disk besides ``model_round``.
        """
        folder = self.folder / LOCAL_ROUNDS
        path = round_file(folder, model_round)
        stored = None
        if path.is_file():
            stored = self.read(path)
        else:
            torch_save(path, {k: v.detach().clone() for k, v in current.items()})
        prune_rounds(folder, {int(model_round), *(int(r) for r in keep_rounds)})
        return stored
