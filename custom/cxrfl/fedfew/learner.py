"""The site side of FedFew over a :class:`cxrfl.data.site.SiteData`, in plain PyTorch.

One :class:`FedFewSite` answers every FedFew task of one site; the NVFlare executor
(:mod:`cxrfl.fl.fedfew`) and the in-process benchmark (:mod:`cxrfl.bench.fedfew`) call the very
same methods. The site is stateless between tasks (every task brings the global weights and a
fresh Adam optimiser, as the paper's fixed-learning-rate Adam allows), so executors rebuilt per
task (NVFlare simulator with ``-t`` < ``-n``) lose nothing.

What leaves the site: model weights and the number of labelled images (FedAvg), its class
names with per-class label counts (to tell CCs from UCs), energy sums/ranges, each stage-2
round's mean energy per role, and per-threshold error counts (never an energy per image), and for
each of its UCs one detector (the two mean features, or a scorer's weights and threshold), only
when at least ``min_prototype_images`` positives and negatives stand behind it.

The roles of the site's images (CC-labelled, UC positive, UC negative, unlabelled) are
:mod:`cxrfl.fedfew.roles`'s. A local epoch of stage 2 passes over every labelled training image; a
batch without any loss term is skipped (no optimiser step; :mod:`cxrfl.fedfew.energy_training`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import torch

from cxrfl.clinical.subgroups import memberships
from cxrfl.common.io import params_digest, to_numpy
from cxrfl.data.dataset import make_loader
from cxrfl.data.site import SiteData
from cxrfl.errors import DataError
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.fedfew.detectors import Detector, evaluate_ucs, fit_detectors
from cxrfl.fedfew.energy import output_energy, threshold_counts
from cxrfl.fedfew.energy_training import energy_epochs
from cxrfl.fedfew.roles import ENERGY_GROUPS, hinge_energy_sums, role_table, threshold_examples
from cxrfl.fedfew.site_evaluation import cc_metrics, train_prevalence
from cxrfl.fedfew.ssl import simsiam_epochs, ssl_model
from cxrfl.fedfew.ssl_views import BatchViews, TwoViewDataset
from cxrfl.nn.models import CXRNet, ModelConfig, build_model
from cxrfl.nn.precision import compute_for

NO_CC = "No common class"
"""Name of the extra output (1 when the image holds none of the CCs)."""


def load_state(module: torch.nn.Module, params: Mapping[str, Any], what: str) -> None:
    """Load received weights strictly, with a clear message when they do not fit.

    Args:
        module: the model.
        params: name -> array or tensor.
        what: what the weights are, for the message.
    """
    own = module.state_dict()
    missing = sorted(set(own) - set(params))
    extra = sorted(set(params) - set(own))
    if missing or extra:
        raise ValueError(
            f"{what}: received weights do not fit the model (missing {missing[:3]}, unexpected {extra[:3]})"
        )
    state = {}
    for k, v in params.items():
        t = torch.as_tensor(np.asarray(v))
        if tuple(t.shape) != tuple(own[k].shape):
            raise ValueError(f"{what}: {k} has shape {tuple(t.shape)}, the model needs {tuple(own[k].shape)}")
        state[k] = t.to(own[k].dtype)
    module.load_state_dict(state)


def stage2_classes(cc_classes: Sequence[str]) -> list[str]:
    """Output order of the stage-2 network: the CCs, then the extra "no CC" output."""
    return [*cc_classes, NO_CC]


@dataclass
class StageUpdate:
    """A site's answer to a training task.

    Args:
        params: the locally trained weights (numpy).
        num_samples: FedAvg weight: images used for SSL, labelled images for stage 2.
        metrics: loss, steps, seconds ...
    """

    params: dict[str, np.ndarray]
    num_samples: int
    metrics: dict[str, Any] = field(default_factory=dict)


class FedFewSite:
    """One site's FedFew computations.

    Args:
        data: the site's data (its classes, images and splits).
        model_config: network settings (``pretrained`` is not read at sites: weights arrive).
        config: FedFew settings.
        device: torch device.
        num_workers: data-loader workers.
    """

    def __init__(
        self,
        data: SiteData,
        *,
        model_config: ModelConfig,
        config: FedFewConfig,
        device: torch.device | None = None,
        num_workers: int = 0,
    ) -> None:
        self.data = data
        self.model_config = ModelConfig.from_dict({**model_config.to_dict(), "pretrained": None})
        self.config = config
        self.device = device or torch.device("cpu")
        self.compute = compute_for(config, self.device)
        self.num_workers = num_workers
        self.cc_classes: list[str] = []
        self.uc_classes: list[str] = []
        self._net: CXRNet | None = None
        self._ssl_images: tuple[tuple, list[np.ndarray]] | None = None
        self._embed_cache: dict[tuple[str, str], tuple[np.ndarray, np.ndarray, pd.DataFrame]] = {}

    @property
    def site(self) -> str:
        return self.data.site

    # ------------------------------------------------------------------ info
    def info(self) -> dict[str, Any]:
        """What the server needs to plan the stages: counts only.

        Returns:
            ``classes`` (the site's class names), ``n_ssl`` (images for stage 1, labelled or
            not), ``n_labelled`` (training images with at least one known label),
            ``positives`` / ``negatives`` per class in the training split.
        """
        train = self.data.split_table("train")
        labels = train[self.data.classes] if self.data.classes else pd.DataFrame(index=train.index)
        return {
            "classes": list(self.data.classes),
            "n_ssl": int(self.data.table["split"].isin(self.config.ssl_splits).sum()),
            "n_labelled": int(labels.notna().any(axis=1).sum()) if len(labels.columns) else 0,
            "positives": {c: int((train[c] == 1.0).sum()) for c in self.data.classes},
            "negatives": {c: int((train[c] == 0.0).sum()) for c in self.data.classes},
        }

    def set_roles(self, cc_classes: Sequence[str], uc_classes: Sequence[str]) -> None:
        """The global CC order and which of this site's classes are UCs (sent by the server).

        Args:
            cc_classes: every CC, in the network's output order.
            uc_classes: the UCs this site labels (a subset of its classes).
        """
        foreign = [c for c in uc_classes if c not in self.data.classes]
        if foreign:
            raise ValueError(f"site {self.site}: told to hold UC(s) {foreign} that it does not label")
        if list(cc_classes) != self.cc_classes or list(uc_classes) != self.uc_classes:
            self.cc_classes, self.uc_classes = list(cc_classes), list(uc_classes)
            self._net = None
            self._embed_cache.clear()

    # --------------------------------------------------------------- tables
    def role_table(self, split: str) -> pd.DataFrame:
        """One split with the CC columns (NaN where the site does not label a CC), the site's
        UC columns and the role flags (:func:`cxrfl.fedfew.roles.role_table`).

        Args:
            split: ``train``, ``val`` or ``test``.
        """
        return role_table(self.data.split_table(split), self.cc_classes, self.uc_classes, self.config)

    def stage2_table(self) -> pd.DataFrame:
        """The labelled training rows (any CC or own-UC label known): a local epoch of stage 2
        passes over them; the UC negatives carry no loss (unless ``uc_negatives="in"`` or
        ``uc_energy_on="all"``) but keep the BatchNorm statistics of a UC site representative."""
        t = self.role_table("train")
        cols = [*self.cc_classes, *self.uc_classes]
        known = t[cols].notna().any(axis=1) if cols else pd.Series(False, index=t.index)
        return t[known].reset_index(drop=True)

    @property
    def n_labelled(self) -> int:
        """Training images with at least one known label (the stage-2 FedAvg weight)."""
        return int(self.info()["n_labelled"])

    # --------------------------------------------------------------- stage 1
    def ssl_round(self, params: Mapping[str, Any], round_num: int = 0) -> StageUpdate:
        """One round of local SimSiam training from the received SimSiam weights.

        Args:
            params: encoder, projector and predictor weights.
            round_num: the round (seeds shuffling and views).
        """
        cfg = self.config
        start = time.perf_counter()
        rows = self.data.table[self.data.table["split"].isin(cfg.ssl_splits)]
        if len(rows) < 2:
            raise DataError(
                f"site {self.site}: {len(rows)} image(s) in splits {list(cfg.ssl_splits)}; "
                "self-supervised training needs at least 2"
            )
        torch.manual_seed(cfg.seed + 1000 * round_num)
        model = self.compute.prepare(ssl_model(self.model_config, cfg))
        load_state(model, params, f"site {self.site} stage 1")
        paths = rows["path"].tolist()
        key = (tuple(paths), self.model_config.image_size)
        if self._ssl_images is None or self._ssl_images[0] != key:
            self._ssl_images = (key, TwoViewDataset.load_images(paths, self.model_config.image_size))
        seed = cfg.seed + 7919 * round_num
        views = BatchViews(self.model_config.in_channels) if self.device.type == "cuda" else None
        if views is not None:  # on a GPU the views are drawn there, on whole batches
            views.set_random_state(seed=seed)
        dataset = TwoViewDataset(
            paths,
            self.model_config.image_size,
            self.model_config.in_channels,
            seed=seed,
            images=self._ssl_images[1],
            batch_views=views is not None,
        )
        loss, steps = simsiam_epochs(
            model,
            dataset,
            config=cfg,
            compute=self.compute,
            num_workers=self.num_workers,
            round_num=round_num,
            site=self.site,
            views=views,
        )
        metrics = {
            "stage": 1,
            "round": round_num,
            "ssl_loss": loss,
            "steps": steps,
            "images": len(dataset),
            "seconds": time.perf_counter() - start,
        }
        return StageUpdate(to_numpy(model.state_dict()), len(dataset), metrics)

    # --------------------------------------------------------------- stage 2
    def network(self, params: Mapping[str, Any] | None = None) -> CXRNet:
        """The stage-2 network (CCs + "no CC" outputs), with ``params`` loaded when given."""
        if not self.cc_classes:
            raise ValueError(f"site {self.site}: the CC classes are not set (set_roles)")
        if self._net is None:
            self._net = self.compute.prepare(build_model(self.model_config, len(self.cc_classes) + 1))
        if params is not None:
            load_state(self._net, params, f"site {self.site} stage 2")
        return self._net

    def train_round(
        self,
        params: Mapping[str, Any],
        round_num: int,
        *,
        energy_weight: float,
        m_in: float | None,
        m_out: float | None,
    ) -> StageUpdate:
        """One round of energy-based multi-label training (Eqs. 3-7).

        CC-labelled images: masked BCE over the CC and "no CC" outputs + ``energy_weight`` *
        ``relu(E - m_in)^2``; UC images: ``energy_weight`` * ``relu(m_out - E)^2`` only.
        A batch with no loss term is skipped (no optimiser step). The metrics hold the mean
        training-time energy (train mode, augmented, as the weights move) of the in, out and UC
        negative images (``train_energy_in``/``_out``/``_uc_neg``; None without such images):
        whether the round opens the gap the threshold needs.

        Args:
            params: the global stage-2 weights.
            round_num: the round (seeds shuffling and augmentation).
            energy_weight: lambda (0 in warm-up rounds: BCE only).
            m_in: the in margin (needed when ``energy_weight > 0``).
            m_out: the out margin (needed when ``energy_weight > 0``).
        """
        cfg = self.config
        if energy_weight > 0 and (m_in is None or m_out is None):
            raise ValueError("the energy term needs both margins")
        start = time.perf_counter()
        table = self.stage2_table()
        n = len(table)
        if table.empty:
            raise DataError(f"site {self.site}: no labelled training image; it cannot take part in stage 2")
        torch.manual_seed(cfg.seed + 1000 * round_num + 1)
        model = self.network(params)
        k = len(self.cc_classes)
        loader = make_loader(
            table,
            [*self.cc_classes, *ENERGY_GROUPS.values()],
            image_size=self.model_config.image_size,
            train=cfg.augment,
            batch_size=cfg.batch_size,
            num_workers=self.num_workers,
            seed=cfg.seed + round_num,
            in_channels=self.model_config.in_channels,
            cache_dir=self.data.cache_dir,
            device=self.device,
        )
        steps, skipped, means = energy_epochs(
            model,
            loader,
            n_cc=k,
            config=cfg,
            compute=self.compute,
            energy_weight=energy_weight,
            m_in=m_in,
            m_out=m_out,
            site=self.site,
        )
        metrics = {
            "stage": 2,
            "round": round_num,
            "energy_weight": energy_weight,
            "steps": steps,
            "skipped_batches": skipped,
            "images": len(table),
            "seconds": time.perf_counter() - start,
            **means,
        }
        return StageUpdate(to_numpy(model.state_dict()), n, metrics)

    # ---------------------------------------------------- energies, features
    @torch.no_grad()
    def embed(self, params: Mapping[str, Any], split: str = "train") -> tuple[np.ndarray, np.ndarray, pd.DataFrame]:
        """Pooled features, joint energies and the role table of one split (cached per weights).

        Args:
            params: stage-2 weights.
            split: the split.

        Returns:
            (features [n, D], energies [n], role table [n rows]).
        """
        key = (params_digest(params), split)
        if key in self._embed_cache:
            return self._embed_cache[key]
        cfg = self.config
        model = self.network(params)
        model.eval()
        table = self.role_table(split)
        feats, energies = [], []
        if len(table):
            loader = make_loader(
                table,
                [*self.cc_classes],
                image_size=self.model_config.image_size,
                train=False,
                batch_size=cfg.eval_batch_size,
                num_workers=self.num_workers,
                in_channels=self.model_config.in_channels,
                cache_dir=self.data.cache_dir,
                device=self.device,
            )
            for x, _, _ in loader:
                x = self.compute.inputs(x)
                with self.compute.autocast():
                    f = model.features(x)
                    logits = model.classifier(model.dropout(model.hidden(f)))
                feats.append(f.float().cpu().numpy())
                e = output_energy(logits.float(), len(self.cc_classes), cfg.energy_outputs, cfg.temperature)
                energies.append(e.cpu().numpy())
        d = model.backbone.norm5.num_features
        out = (
            np.concatenate(feats) if feats else np.zeros((0, d), np.float32),
            np.concatenate(energies) if energies else np.zeros((0,), np.float32),
            table,
        )
        self._embed_cache = {key: out}
        return out

    def _in_out_energies(self, params: Mapping[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """Energies of the threshold's training examples: without a UC (the UC negatives, and
        with ``threshold_examples="all"`` the CC-labelled images) and with one (UC positives)."""
        _, energies, table = self.embed(params, "train")
        return threshold_examples(energies, table, self.uc_classes, self.config.threshold_examples)

    def energy_means(self, params: Mapping[str, Any]) -> dict[str, float | int]:
        """Sums and counts of the warm-up model's energies over the two hinge populations
        (to choose the margins).

        Returns:
            ``sum_in``/``n_in``: CC-labelled images without a UC; ``sum_out``/``n_out``: UC positives.
        """
        _, energies, table = self.embed(params, "train")
        return hinge_energy_sums(energies, table)

    def energy_range(self, params: Mapping[str, Any]) -> dict[str, float | int | None]:
        """Lowest and highest energy over the site's in and out training images (for the grid)."""
        e_in, e_out = self._in_out_energies(params)
        both = np.concatenate([e_in, e_out])
        return {
            "min": float(both.min()) if len(both) else None,
            "max": float(both.max()) if len(both) else None,
            "n_in": int(len(e_in)),
            "n_out": int(len(e_out)),
        }

    def threshold_counts(self, params: Mapping[str, Any], grid: Sequence[float]) -> dict[str, Any]:
        """Errors per candidate threshold (see :func:`cxrfl.fedfew.energy.threshold_counts`)."""
        e_in, e_out = self._in_out_energies(params)
        return threshold_counts(e_in, e_out, grid)

    # --------------------------------------------------------------- stage 3
    def detectors(self, params: Mapping[str, Any]) -> dict[str, Any]:
        """The detectors of the site's UCs (``config.detector``: dual prototypes or scorers),
        refused below ``min_prototype_images`` (see :func:`cxrfl.fedfew.detectors.fit_detectors`)."""
        feats, _, table = self.embed(params, "train")
        labels = {uc: table[uc].to_numpy(dtype=np.float64) for uc in self.uc_classes}
        return fit_detectors(self.config.detector, self.uc_classes, feats, labels, self.config, self.site)

    # ------------------------------------------------------------ evaluation
    def evaluate(
        self,
        params: Mapping[str, Any],
        *,
        threshold: float,
        detectors: Mapping[str, Sequence[Detector]],
        split: str = "test",
        counts: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A model on one split: the BCE over the CCs and "no CC" (``cc_loss``, mean over the
        ``cc_known`` known labels: stage 2's validation loss), AUROC of the CCs the site labels,
        and the detection metrics of each UC it labels with the detectors given
        (:func:`cxrfl.fedfew.detectors.evaluate_ucs`; F1 and precision also at the UC's
        prevalence among the site's training images).

        Args:
            params: stage-2 weights.
            threshold: the energy threshold.
            detectors: UC -> its detectors (only the site's own UCs are evaluated).
            split: the split.
            counts: a server's request for binned counts of the CC scores
                (:func:`cxrfl.clinical.counts.count_request`): the answer's ``counts`` then holds
                them per CC the site labels (the final test evaluation, pooled at the server).
        """
        feats, energies, table = self.embed(params, split)
        model = self.network(params)
        result: dict[str, Any] = {"split": split, "n": int(len(table))}
        own_cc = [c for c in self.cc_classes if c in self.data.classes]
        if own_cc and len(table):
            pooled = torch.as_tensor(feats).to(self.device)
            with torch.no_grad():
                logits = model.classifier(model.hidden(pooled)).float()
            # role_table keeps the split's row order
            groups = memberships(self.data.split_table(split)) if counts is not None else None
            result.update(cc_metrics(logits, table, self.cc_classes, own_cc, counts, groups))
        ucs = {u: d for u, d in detectors.items() if u in self.uc_classes and d}
        if ucs and len(table):
            result["uc"] = evaluate_ucs(
                self.config.detector,
                feats,
                energies,
                threshold,
                ucs,
                {uc: table[uc].to_numpy(dtype=np.float64) for uc in ucs},
                train_prevalence(self.role_table("train"), ucs),
            )
        return result
