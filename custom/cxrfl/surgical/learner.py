"""The site side of class-heterogeneous federated training, free of any FL framework.

A :class:`SiteLearner` holds one site's data and local model. It receives parameter dicts
(the feature extractor plus the head rows of its own classes only), warms the head up,
trains, evaluates, and returns updates in the form :func:`cxrfl.surgical.aggregation.surgical_aggregate`
takes. State that must survive between rounds (optimizer, local BatchNorm for FedBN, a local
head) lives on disk in ``state_dir``, so a process that is rebuilt every round (NVFlare
simulator with ``-t 1``) behaves like one that lives through the job.

Head modes (:data:`cxrfl.surgical.head_modes.HEAD_MODES`; the baselines of the papers differ from surgical aggregation
only here and in the label policy for classes a site does not annotate):

- ``surgical`` (default): the head has the site's own classes; it receives and sends only
  their rows. The site never sees another site's class names.
- ``union``: the head has every class of the federation (the server sends the class list
  with the rows); classes the site does not annotate are negatives (``missing="negative"``,
  vanilla FL) or left out of the loss (``missing="ignore"``, FL with partial loss). This
  breaks the privacy property above: every site learns every class name.
- ``local``: personalized FL. The head has the site's own classes, stays at the site (on disk
  between rounds) and is never sent; only the feature extractor travels.

What never travels (the head in ``local`` mode, BatchNorm under FedBN) is kept per evaluated
model round, and the optimizer state per trained round, in the site's state folder
(:class:`cxrfl.surgical.site_state.SiteState`).

The head warm-up is the same in every mode (own classes, feature extractor frozen): it is the
starting point that all methods share.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from cxrfl.clinical.counts import count_classes
from cxrfl.clinical.subgroups import memberships
from cxrfl.common.transport import copy_params
from cxrfl.data.dataset import DeviceLoader, make_loader, reseed
from cxrfl.data.site import SiteData, untrainable_classes
from cxrfl.nn.models import (
    HEAD_PREFIX,
    ModelConfig,
    batchnorm_keys,
    build_model,
    freeze_backbone,
    set_batchnorm_frozen,
)
from cxrfl.nn.precision import compute_for
from cxrfl.nn.training import EvalResult, TrainConfig, adam, evaluate, train_epochs
from cxrfl.surgical.head_modes import check_modes
from cxrfl.surgical.site_state import SiteState

log = logging.getLogger(__name__)

TRAINING = "train:augment"
"""Key of the kept training loader among the site's loaders (the evaluation loaders' keys are splits)."""


@dataclass
class SiteUpdate:
    """What a site returns after a task.

    Args:
        params: name -> numpy array (feature extractor and own head rows; no BatchNorm under FedBN).
        classes: the row order of the head in ``params``.
        num_samples: training images used.
        metrics: losses, per-class AUROC on the received model, timing.
    """

    params: dict[str, np.ndarray]
    classes: list[str]
    num_samples: int
    metrics: dict[str, Any]


class SiteLearner:
    """One site's local model, data and optimizer state.

    Args:
        data: the site's loaded data (its classes define its head rows).
        state_dir: folder for state kept across rounds (created).
        model_config: network settings.
        train_config: optimisation settings.
        batchnorm: ``fedavg``, ``fedbn`` (BatchNorm stays local) or ``fedbn+`` (frozen).
        device: torch device.
        num_workers: data-loader worker processes.
        head_mode: one of :data:`cxrfl.surgical.head_modes.HEAD_MODES` (see the module docstring).
        missing: ``negative`` (default) or ``ignore``: labels of classes the site does not
            annotate, for a ``union`` head (ignored in the other modes).
        selection: what its validation loss counts (:data:`cxrfl.surgical.head_modes.SELECTION_RULES`).
    """

    def __init__(
        self,
        data: SiteData,
        state_dir: str | Path,
        *,
        model_config: ModelConfig,
        train_config: TrainConfig,
        batchnorm: str = "fedavg",
        device: torch.device | None = None,
        num_workers: int = 0,
        head_mode: str = "surgical",
        missing: str = "negative",
        selection: str = "annotated",
    ) -> None:
        check_modes(head_mode, missing, batchnorm, selection)
        self.head_mode = head_mode
        self.missing = missing
        self.selection = selection
        self.data = data
        self.own_classes = list(data.classes)
        self.untrainable = untrainable_classes(data)  # one label value in training (issue 41): left out
        self.classes = list(data.classes)  # the head's row order (a union head: set_head_classes)
        self.state_dir = Path(state_dir)
        self.model_config = model_config
        self.train_config = train_config
        self.batchnorm = batchnorm
        self.device = device or torch.device("cpu")
        self.compute = compute_for(train_config, self.device)
        self.site_state = SiteState(self.state_dir, data.site, self.device)
        self.num_workers = num_workers
        torch.manual_seed(train_config.seed)
        self.model = self.compute.prepare(build_model(model_config, len(self.classes)))
        log.info("site %s: training and evaluating in %s", data.site, self.compute.describe())
        if batchnorm == "fedbn+":
            set_batchnorm_frozen(self.model)
        self.bn_keys = set(batchnorm_keys(self.model))
        self._loaders: dict[str, torch.utils.data.DataLoader] = {}

    # ----------------------------------------------------------------- data
    def loader(self, split: str) -> torch.utils.data.DataLoader:
        """An evaluation loader over one split of this site's data, built once (images cached).

        Args:
            split: ``train``, ``val`` or ``test``.
        """
        if split not in self._loaders:
            self._loaders[split] = self._make_loader(split, train=False, seed=self.train_config.seed)
        return self._loaders[split]

    def train_loader(self, round_num: int) -> torch.utils.data.DataLoader:
        """A shuffling, augmenting loader over the training split for one round (0: the warm-up):
        its order and augmentations depend on the seed and the round only, so a round trains alike
        after a warm-up taken from a cache, after an interruption, or in another process.

        Where augmentation runs on the device (CUDA), one loader is kept across rounds and seeded
        again, so its worker processes start once (starting them every round cost GPU sites half
        their throughput, BENCHMARKS.md "On a GPU"); elsewhere the workers augment, and each
        round gets a fresh loader whose workers are seeded by it.

        Args:
            round_num: the round number.
        """
        seed = int(np.random.SeedSequence([self.train_config.seed, round_num]).generate_state(1)[0])
        kept = self._loaders.get(TRAINING)
        if kept is not None:
            reseed(kept, seed)
            return kept
        loader = self._make_loader("train", train=True, seed=seed)
        if isinstance(loader, DeviceLoader):
            self._loaders[TRAINING] = loader
        return loader

    def split_table(self, split: str) -> pd.DataFrame:
        """One split with a column per head class; classes the site does not annotate (a union
        head) are 0.0 (``missing="negative"``) or NaN (``missing="ignore"``: masked out) in the
        training split, and in the others only with ``selection="head"`` (NaN otherwise: the
        validation loss that selects the model counts the site's own classes). The site's
        :attr:`untrainable` classes are NaN outside the test split.

        Args:
            split: ``train``, ``val`` or ``test``.
        """
        table = self.data.split_table(split)
        if self.untrainable and split != "test":
            table = table.assign(**{c: np.nan for c in self.untrainable})
        extra = [c for c in self.classes if c not in table.columns]
        if extra:
            negative = self.missing == "negative" and (split == "train" or self.selection == "head")
            fill = 0.0 if negative else np.nan
            table = table.assign(**{c: fill for c in extra})
        return table

    def set_head_classes(self, classes: list[str] | None) -> None:
        """Make the head predict ``classes`` (in this order); rows are filled by the next load.

        Only a ``union`` head may differ from the site's own classes; it must include them.

        Args:
            classes: the head's class order (None: keep the current one).
        """
        if classes is None or list(classes) == self.classes:
            return
        classes = list(classes)
        if self.head_mode != "union":
            raise ValueError(
                f"site {self.data.site}: a {self.head_mode} head predicts the site's own classes only; "
                f"received a head for {len(classes)} classes"
            )
        missing = [c for c in self.own_classes if c not in classes]
        if missing or len(set(classes)) != len(classes):
            raise ValueError(f"site {self.data.site}: the union head must hold each own class once; lacks {missing}")
        old = self.model.classifier
        self.model.classifier = torch.nn.Linear(old.in_features, len(classes)).to(
            device=old.weight.device, dtype=old.weight.dtype
        )
        self.model.num_classes = len(classes)
        self.classes = classes
        self._loaders.clear()

    def _make_loader(self, split: str, *, train: bool, seed: int) -> torch.utils.data.DataLoader:
        tc = self.train_config
        return make_loader(
            self.split_table(split),
            self.classes,
            image_size=self.model_config.image_size,
            train=train and tc.augment,
            batch_size=tc.batch_size,
            num_workers=self.num_workers,
            seed=seed,
            cache=not train,
            in_channels=self.model_config.in_channels,
            cache_dir=self.data.cache_dir,
            device=self.device,
        )

    @property
    def num_train(self) -> int:
        return len(self.data.split_table("train"))

    def _is_head(self, key: str) -> bool:
        return key.startswith(HEAD_PREFIX)

    # --------------------------------------------------------------- params
    def load_params(self, params: dict[str, Any], *, restore_local: bool = True) -> None:
        """Load received parameters; keys the server does not send (local BatchNorm, a local
        head) stay local: they come back from ``state_dir`` when stored there.

        Args:
            params: name -> array; head rows (if any) must be the head's classes in order.
            restore_local: bring back the stored local head (``local`` mode) when ``params``
                has none.
        """
        state = self.model.state_dict()
        missing = set(state) - set(params) - self.bn_keys
        if missing and any(not k.startswith(HEAD_PREFIX) for k in missing):
            raise KeyError(f"received parameters lack {sorted(missing)[:5]} ...")
        for k, v in params.items():
            if k not in state:
                raise KeyError(f"received unknown parameter {k!r}")
            t = torch.as_tensor(np.asarray(v))
            if tuple(t.shape) != tuple(state[k].shape):
                raise ValueError(f"received {k!r} with shape {tuple(t.shape)}, expected {tuple(state[k].shape)}")
            state[k] = t.to(state[k].dtype)
        if self.batchnorm == "fedbn":
            local_bn = self.site_state.load("local_bn.pt")
            if local_bn is not None:
                state.update(local_bn)
        if self.head_mode == "local" and restore_local and not any(self._is_head(k) for k in params):
            local_head = self.site_state.load("local_head.pt")
            if local_head is not None:
                state.update(local_head)
        self.model.load_state_dict(state)

    def outgoing_params(self) -> dict[str, np.ndarray]:
        """The parameters this site sends: everything but local BatchNorm under FedBN/FedBN+
        and, in ``local`` head mode, everything but the head (kept in ``state_dir``). Copies:
        later training does not change an update already returned."""
        state = self.model.state_dict()
        if self.batchnorm == "fedbn":
            self.site_state.save("local_bn.pt", {k: v.clone() for k, v in state.items() if k in self.bn_keys})
        local_head = self.head_mode == "local"
        if local_head:
            self.site_state.save("local_head.pt", {k: v.clone() for k, v in state.items() if self._is_head(k)})
        keep = {
            k: v
            for k, v in state.items()
            if (self.batchnorm == "fedavg" or k not in self.bn_keys) and not (local_head and self._is_head(k))
        }
        return copy_params(keep)

    # ---------------------------------------------------------------- tasks
    def validate(self, split: str = "val") -> EvalResult:
        """Evaluate the current model on one split.

        Args:
            split: the split name.
        """
        return evaluate(self.model, self.loader(split), self.classes, self.compute)

    def warmup(self, params: dict[str, Any]) -> SiteUpdate:
        """Head warm-up: feature extractor frozen, head trained, best validation loss kept.

        Args:
            params: the initial global feature extractor (no head rows).
        """
        tc = self.train_config
        start = time.perf_counter()
        if self.head_mode == "union":
            self.set_head_classes(self.own_classes)  # the warm-up trains the own rows in every mode
        torch.manual_seed(tc.seed)
        self.model.classifier.reset_parameters()
        self.load_params(params, restore_local=False)
        freeze_backbone(self.model, True)
        opt = adam(self.model, tc.warmup_lr, tc.weight_decay)
        train_loader = self.train_loader(0)
        best, best_state, last = float("inf"), None, None
        for epoch in range(tc.warmup_epochs):
            last = train_epochs(
                self.model,
                train_loader,
                opt,
                self.compute,
                max_steps=tc.max_steps_per_epoch,
                desc=f"{self.data.site} warm-up {epoch + 1}/{tc.warmup_epochs}",
                train_mode=False,
            )
            val = self.validate("val")
            if np.isfinite(val.loss) and val.loss < best:
                best = val.loss
                best_state = {k: v.clone() for k, v in self.model.state_dict().items()}
        if best_state is not None:
            self.model.load_state_dict(best_state)
        freeze_backbone(self.model, False)
        if self.batchnorm == "fedbn+":
            set_batchnorm_frozen(self.model)
        val = self.validate("val")
        metrics = {
            "phase": "warmup",
            "train_loss": last.loss if last else None,
            "images_per_second": last.images_per_second if last else None,
            "val_loss": val.loss,
            "val_auroc": val.aurocs,
            "val_mean_auroc": val.mean_auroc,
            "seconds": time.perf_counter() - start,
        }
        return SiteUpdate(self.outgoing_params(), self.classes, self.num_train, metrics)

    def adopt_warmup(self, state: dict[str, torch.Tensor], metrics: dict[str, Any]) -> SiteUpdate:
        """Take over a warm-up done before (same data, settings and initial model) instead of
        training it again.

        Args:
            state: the full model state right after that warm-up.
            metrics: its metrics.
        """
        if self.head_mode == "union":
            self.set_head_classes(self.own_classes)
        self.model.load_state_dict(state)
        if self.batchnorm == "fedbn+":
            set_batchnorm_frozen(self.model)
        return SiteUpdate(self.outgoing_params(), self.classes, self.num_train, dict(metrics))

    def warm_state(self) -> dict[str, torch.Tensor]:
        """A copy of the full model state (what :meth:`adopt_warmup` takes)."""
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def train_round(
        self, params: dict[str, Any], round_num: int, classes: list[str] | None = None, keep_rounds: Iterable[int] = ()
    ) -> SiteUpdate:
        """One federated round: evaluate the received global model (the model of round
        ``round_num - 1``), then train locally.

        Args:
            params: the global feature extractor and this site's head rows (``union``: the
                whole head; ``local``: no head).
            round_num: the round number (for logs and the optimizer state).
            classes: the row order of the received head (required by a ``union`` head).
            keep_rounds: model rounds whose local parts must stay on disk (the selected one).
        """
        tc = self.train_config
        start = time.perf_counter()
        torch.manual_seed(tc.seed + round_num)
        self.receive(params, classes, model_round=round_num - 1, keep_rounds=keep_rounds)
        received = self.validate("val")
        opt = adam(self.model, tc.lr, tc.weight_decay)
        self.site_state.restore_optimizer(opt, round_num)
        stats = train_epochs(
            self.model,
            self.train_loader(round_num),
            opt,
            self.compute,
            epochs=tc.local_epochs,
            max_steps=tc.max_steps_per_epoch,
            desc=f"{self.data.site} round {round_num}",
        )
        self.site_state.store_optimizer(opt, round_num)
        metrics = {
            "phase": "train",
            "round": round_num,
            "train_loss": stats.loss,
            "images_per_second": stats.images_per_second,
            "val_loss": received.loss,
            "val_auroc": received.aurocs,
            "val_mean_auroc": received.mean_auroc,
            "seconds": time.perf_counter() - start,
        }
        return SiteUpdate(self.outgoing_params(), self.classes, self.num_train, metrics)

    def _prepare_head(self, params: dict[str, Any], classes: list[str] | None) -> None:
        if self.head_mode == "union":
            if classes is None:
                raise ValueError(f"site {self.data.site}: a union head needs the class order of the received head")
            self.set_head_classes(list(classes))
        elif classes is not None and list(classes) != self.classes:
            raise ValueError(
                f"site {self.data.site}: received a head for other classes than its own ({self.head_mode} head)"
            )
        if self.head_mode == "local" and any(self._is_head(k) for k in params):
            raise ValueError(
                f"site {self.data.site}: personalized (local) heads are never received, but head rows arrived"
            )

    def receive(
        self,
        params: dict[str, Any],
        classes: list[str] | None = None,
        *,
        model_round: int | None = None,
        keep_rounds: Iterable[int] = (),
    ) -> None:
        """Load a received model; with ``model_round``, the site's own parts of that round.

        The first time a model round is received its local parts (head in ``local`` mode,
        BatchNorm under FedBN) are the current ones and are kept; later (e.g. to test the
        selected model) they come back from disk.

        Args:
            params: the global feature extractor and this site's head rows (see :meth:`train_round`).
            classes: the row order of the received head (required by a ``union`` head).
            model_round: the round the model comes from (None: the current local parts).
            keep_rounds: model rounds whose local parts stay on disk besides ``model_round``.
        """
        self._prepare_head(params, classes)
        self.load_params(params)
        local = self.local_keys()
        if model_round is None or not local:
            return
        state = self.model.state_dict()
        stored = self.site_state.local_parts(model_round, {k: v for k, v in state.items() if k in local}, keep_rounds)
        if stored is not None:
            state.update(stored)
            self.model.load_state_dict(state)

    def local_keys(self) -> set[str]:
        """The state entries that never travel: the head in ``local`` mode, BatchNorm under FedBN."""
        state = self.model.state_dict()
        return {
            k
            for k in state
            if (self.head_mode == "local" and self._is_head(k)) or (self.batchnorm == "fedbn" and k in self.bn_keys)
        }

    def evaluate_params(
        self,
        params: dict[str, Any],
        split: str,
        classes: list[str] | None = None,
        *,
        model_round: int | None = None,
        keep_rounds: Iterable[int] = (),
        counts: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Evaluate received parameters on one split.

        Args:
            params: the global feature extractor and this site's head rows (see :meth:`train_round`).
            split: ``val`` or ``test``.
            classes: the row order of the received head (required by a ``union`` head).
            model_round: the round the model comes from (see :meth:`receive`).
            keep_rounds: model rounds whose local parts stay on disk.
            counts: a server's request for binned score counts (:func:`cxrfl.clinical.counts.count_request`);
                the answer's ``counts`` then holds them per class (evaluation-only federation).
        """
        start = time.perf_counter()
        self.receive(params, classes, model_round=model_round, keep_rounds=keep_rounds)
        res = self.validate(split)
        out = {
            "split": split,
            "loss": res.loss,
            "auroc": res.aurocs,
            "mean_auroc": res.mean_auroc,
            "n": len(res.y_true),
            "seconds": time.perf_counter() - start,
        }
        if counts is not None:
            labels = np.where(res.mask > 0, res.y_true, np.nan)
            groups = memberships(self.split_table(split))  # the loader keeps the split's row order
            out["counts"] = count_classes(res.scores, labels, res.classes or list(self.classes), counts, groups=groups)
        return out
