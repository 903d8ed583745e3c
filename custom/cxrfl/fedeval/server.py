"""The evaluation-only server loop, transport-free (the NVFlare job, the tests and benchmarks run it).

1. ``classes``: each site names the classes it labels (to the server only).
2. ``validate`` with a count request: each site receives the model's feature extractor and a head
   with one row per class of its own (a class the model lacks gets a zero row and is not counted),
   scores its split and answers, per evaluated class, binned counts of its positives' and negatives'
   scores, or nothing below the minimum cell size. Every answer is checked whole before use.
3. Per class, the counts of exactly the sites that label it are merged; a class whose pooled AUROC
   may differ from the AUROC of the raw scores by more than ``tolerance`` is counted once more in
   bins fitted to its pooled scores (:func:`cxrfl.clinical.counts.refine_bins`).
4. ``cxrfl/evaluation.json`` (owner-only): per class the pooled AUROC with its interval, the
   sensitivity and specificity at ``threshold``, the reliability diagram and ECE, and which sites
   were pooled or sent nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cxrfl.clinical.calibration import reliability
from cxrfl.clinical.counts import BinSpec, ScoreCounts, count_request, merge, refine_bins
from cxrfl.clinical.fitted import CHECKPOINT_KEY, ClinicalFit
from cxrfl.clinical.pooled import at_threshold, pooled_auroc
from cxrfl.common.io import owner_only
from cxrfl.common.server import RECORDS_DIR, RunStopped, ServerLoop
from cxrfl.common.transport import Message, Send
from cxrfl.errors import UpdateRejected
from cxrfl.fedeval.config import FedEvalConfig
from cxrfl.nn.models import HEAD_PREFIX, ModelConfig, save_checkpoint
from cxrfl.nn.training import TrainConfig
from cxrfl.surgical.host import CLASSES, VALIDATE
from cxrfl.surgical.validation import as_numpy

CALIBRATED_MODEL = "calibrated_model.pt"
"""The model with its calibration maps and operating points, under ``cxrfl/`` (runs that fit them)."""

Counts = dict[str, dict[str, ScoreCounts | None]]
"""class -> site -> its counts (None: the site had too few cases and sent nothing)."""


class FedEvalServer(ServerLoop):
    """Scores one model at every site from binned counts; nothing is trained.

    Args:
        send: the transport.
        config: the run's settings.
        checkpoint: the model (:func:`cxrfl.nn.models.load_checkpoint`'s dict: ``model``, ``classes``,
            ``model_config``).
        loop: :class:`cxrfl.common.server.ServerLoop`'s arguments (sites, out_dir, run_id, loggers ...;
            an evaluation has nothing to resume).
    """

    def __init__(self, send: Send, *, config: FedEvalConfig, checkpoint: Mapping[str, Any], **loop: Any) -> None:
        super().__init__(send, **loop)
        self.config = config
        self.checkpoint = checkpoint
        # the model as numpy once: every site's message of every pass is cut from these
        arrays = {k: as_numpy(v) for k, v in checkpoint["model"].items()}
        self.head = arrays.pop(HEAD_PREFIX + "weight"), arrays.pop(HEAD_PREFIX + "bias")
        self.body = arrays
        self.rows = {c: i for i, c in enumerate(checkpoint["classes"])}

    def run(self) -> dict[str, Any]:
        """Evaluate the checkpoint at every site.

        Returns:
            the report written to ``cxrfl/evaluation.json``.

        Raises:
            RunStopped: fewer than ``min_sites`` sites answered.
        """
        cfg, checkpoint = self.config, self.checkpoint
        model_classes = list(checkpoint["classes"])
        self.write_run_config({"fedeval": cfg.to_dict(), "model_classes": model_classes})
        announced = self._announce()
        evaluated = {s: [c for c in own if c in model_classes] for s, own in announced.items()}
        bins = dict.fromkeys(model_classes, cfg.bins)
        counts = self._count(announced, evaluated, bins)
        fitted = {
            c: refine_bins(pooled)
            for c, per in counts.items()
            if (pooled := _pooled(per)) is not None and pooled_auroc(pooled).binning_bound > cfg.tolerance
        }
        if fitted:
            self.info(f"{len(fitted)} class(es) counted again in bins fitted to their pooled scores")
            again = {s: [c for c in ev if c in fitted] for s, ev in evaluated.items()}
            recount = self._count(announced, {s: v for s, v in again.items() if v}, {**bins, **fitted})
            for c in fitted:  # the second pass replaces the first only where the same sites answered
                if set(recount.get(c, {})) == set(counts[c]):
                    counts[c] = recount[c]
        report = self._report(model_classes, evaluated, counts)
        if cfg.fits:
            report["fitted"] = self._fit(counts, report)
        self.write_evaluation(report)
        return report

    def _fit(self, counts: Counts, report: dict[str, Any]) -> dict[str, Any]:
        """Calibration maps and operating points from the pooled counts; ``cxrfl/calibrated_model.pt``."""
        cfg, checkpoint = self.config, self.checkpoint
        pooled = {c: p for c, per in counts.items() if (p := _pooled(per)) is not None}
        on = {
            "split": cfg.split,
            "classes": {
                c: {"positives": p.n_pos, "negatives": p.n_neg, "sites": len(report["classes"][c]["sites_pooled"])}
                for c, p in pooled.items()
            },
        }
        fit = ClinicalFit.fit(
            pooled, calibration=cfg.calibration, target=cfg.target, value=cfg.target_value, fitted_on=on
        )
        path = self.path(RECORDS_DIR, CALIBRATED_MODEL)
        save_checkpoint(
            path,
            checkpoint["model"],
            classes=list(checkpoint["classes"]),
            model_config=ModelConfig.from_dict(checkpoint["model_config"]),
            extra={CHECKPOINT_KEY: fit.to_dict()},
        )
        owner_only(path)
        for c, m in fit.calibration.items():
            report["classes"][c]["ece_calibrated"] = reliability(pooled[c], m).ece
        self.info(
            f"calibration of {len(fit.calibration)} and operating points of {len(fit.operating_points)} "
            f"class(es) written with the model to {path}"
        )
        return {"model": str(path.relative_to(self.out)), **fit.to_dict()}

    def _announce(self) -> dict[str, list[str]]:
        """Each answering site's class names (checked: a list of distinct texts)."""
        answers = self.exchange(CLASSES, {s: ({}, {}) for s in self.sites})
        out: dict[str, list[str]] = {}
        for site, (_, meta) in answers.items():
            classes = meta.get("classes")
            if (
                not isinstance(classes, list)
                or not all(isinstance(c, str) for c in classes)
                or len(set(classes)) != len(classes)
            ):
                self.warning(f"site {site}: its class list is not a list of distinct names; left out")
                continue
            out[site] = classes
        if len(out) < self.config.min_sites:
            raise RunStopped(
                f"only {len(out)} site(s) answered (fedeval.min_sites is {self.config.min_sites}); "
                "check the sites' logs and run the evaluation again"
            )
        return out

    def _message(self, own: Sequence[str], evaluated: Sequence[str], bins: Mapping[str, BinSpec]) -> Message:
        """A site's task: the feature extractor, one head row per own class, the count request."""
        (weight, bias), rows = self.head, self.rows
        params = {
            **self.body,
            HEAD_PREFIX + "weight": np.stack([weight[rows[c]] if c in rows else np.zeros_like(weight[0]) for c in own]),
            HEAD_PREFIX + "bias": np.array([bias[rows[c]] if c in rows else 0 for c in own], dtype=bias.dtype),
        }
        meta = {
            "model_config": dict(self.checkpoint["model_config"]),
            "train_config": TrainConfig().to_dict(),
            "batchnorm": "fedavg",
            "head_mode": "surgical",
            "missing": "negative",
            "run_key": self.run_id,
            "split": self.config.split,
            "counts": count_request(evaluated, bins, self.config.min_cell),
        }
        return params, meta

    def _count(
        self,
        announced: Mapping[str, list[str]],
        evaluated: Mapping[str, list[str]],
        bins: Mapping[str, BinSpec],
    ) -> Counts:
        """One counting pass over the sites with classes to evaluate."""
        payloads = {s: self._message(announced[s], ev, bins) for s, ev in evaluated.items() if ev}
        out: Counts = {}
        for site, (_, meta) in self.exchange(VALIDATE, payloads).items():
            try:
                got = self._parse(site, meta, evaluated[site], bins)
            except UpdateRejected as exc:
                self.warning(f"rejected the counts of site {site}: {exc}")
                continue
            for c, value in got.items():
                out.setdefault(c, {})[site] = value
        return out

    def _parse(
        self, site: str, meta: Mapping[str, Any], classes: Sequence[str], bins: Mapping[str, BinSpec]
    ) -> dict[str, ScoreCounts | None]:
        """A site's answer checked whole: counts for exactly the classes asked, each valid."""
        counts = (meta.get("metrics") or {}).get("counts") if isinstance(meta.get("metrics"), Mapping) else None
        if not isinstance(counts, Mapping) or set(counts) != set(classes):
            named = sorted(map(str, counts))[:5] if isinstance(counts, Mapping) else type(counts).__name__
            raise UpdateRejected(f"site {site}: answered counts for {named}, asked for {len(classes)} class(es)")
        return {
            c: None
            if counts[c] is None
            else ScoreCounts.from_dict(
                counts[c], bins=bins[c], min_cell=self.config.min_cell, where=f"site {site}, class {c}"
            )
            for c in classes
        }

    def _report(
        self, model_classes: Sequence[str], evaluated: Mapping[str, list[str]], counts: Counts
    ) -> dict[str, Any]:
        """Per class pooled statistics (see the module docstring); one log line per class."""
        cfg, classes = self.config, {}
        for c in model_classes:
            per = counts.get(c, {})
            sent = {s: v for s, v in per.items() if v is not None}
            entry: dict[str, Any] = {
                "sites_labelling": sorted(s for s, ev in evaluated.items() if c in ev),
                "sites_pooled": sorted(sent),
                "sites_withheld": sorted(set(per) - set(sent)),
            }
            pooled = _pooled(per)
            if pooled is None:
                entry["auroc"] = None  # no site sent counts, or the pooled split has one label only
            else:
                auroc, diagram = pooled_auroc(pooled, level=cfg.level), reliability(pooled)
                entry.update(
                    auroc=auroc.to_dict(),
                    ece=diagram.ece,
                    reliability=diagram.to_dict(),
                    at_threshold=at_threshold(pooled, cfg.threshold, level=cfg.level).to_dict(),
                    bins=pooled.bins.to_dict(),
                )
                self.info(
                    f"{c}: pooled AUROC {auroc.value:.3f} ({auroc.low:.3f}-{auroc.high:.3f}) over "
                    f"{len(sent)} site(s), {auroc.n_pos} positives / {auroc.n_neg} negatives, ECE {diagram.ece:.3f}"
                )
            classes[c] = entry
        values = [e["auroc"]["value"] for e in classes.values() if e["auroc"] is not None]
        return {
            "split": cfg.split,
            "min_cell": cfg.min_cell,
            "level": cfg.level,
            "threshold": cfg.threshold,
            "classes": classes,
            "mean_auroc": float(np.mean(values)) if values else None,
            "not_labelled": [c for c, e in classes.items() if not e["sites_labelling"]],
        }


def _pooled(per: Mapping[str, ScoreCounts | None]) -> ScoreCounts | None:
    """The merged counts of the sites that sent some, when they hold positives and negatives (else None)."""
    sent = [v for v in per.values() if v is not None]
    pooled = merge(sent) if sent else None
    return pooled if pooled is not None and pooled.n_pos and pooled.n_neg else None
