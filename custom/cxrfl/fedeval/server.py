"""The evaluation-only server loop, transport-free (the NVFlare job, the tests and benchmarks run it).

1. ``classes``: each site names the classes it labels (to the server only).
2. ``validate`` with a count request: each site receives the model's feature extractor and a head
   with one row per class of its own (a class the model lacks gets a zero row and is not counted),
   scores its split and answers, per evaluated class, binned counts of its positives' and negatives'
   scores, or nothing below the minimum cell size. Every answer is checked whole before use.
3. Per class, the counts of exactly the sites that label it are merged; a class whose pooled AUROC
   may differ from the AUROC of the raw scores by more than ``tolerance`` is counted once more in
   bins fitted to its pooled scores (:func:`cxrfl.clinical.counts.refine_bins`).
4. With ``calibration`` or ``target`` (on the validation split): a calibration map and an operating
   point per class from the pooled counts, written with the model to ``cxrfl/calibrated_model.pt``;
   then ``site_fit``: each site receives its copy (its own classes; per class the raw scores, the
   consortium's map or its own, whichever fits its counts best, :meth:`cxrfl.clinical.fitted.ClinicalFit.for_site`)
   and writes it with the model.
5. ``cxrfl/evaluation.json`` (owner-only): per class the pooled AUROC with its interval, the
   sensitivity and specificity at ``threshold``, the reliability diagram and ECE, and which sites
   were pooled or sent nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cxrfl.clinical.calibration import reliability
from cxrfl.clinical.counts import BinSpec, count_request
from cxrfl.clinical.fitted import CHECKPOINT_KEY, ClinicalFit
from cxrfl.clinical.pooling import Counts, count_at_sites, pooled, pooled_report
from cxrfl.common.io import owner_only
from cxrfl.common.server import RECORDS_DIR, RunStopped, ServerLoop
from cxrfl.common.transport import Message, Send
from cxrfl.core.updates import as_numpy
from cxrfl.fedeval.config import FedEvalConfig
from cxrfl.nn.models import HEAD_PREFIX, ModelConfig, save_checkpoint
from cxrfl.nn.training import TrainConfig
from cxrfl.surgical.host import CLASSES, SITE_FIT, VALIDATE

CALIBRATED_MODEL = "calibrated_model.pt"
"""The model with its calibration maps and operating points, under ``cxrfl/`` (runs that fit them)."""


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

        def send(wanted: Mapping[str, list[str]], bins: Mapping[str, BinSpec]) -> dict[str, Mapping[str, Any]]:
            payloads = {s: self._message(announced[s], ev, bins) for s, ev in wanted.items()}
            return {site: meta for site, (_, meta) in self.exchange(VALIDATE, payloads).items()}

        counts = count_at_sites(send, evaluated, cfg, info=self.info, warning=self.warning)
        report = {"split": cfg.split, **pooled_report(model_classes, evaluated, counts, cfg, self.info)}
        if cfg.fits:
            fit, report["fitted"] = self._fit(counts, report)
            if cfg.site_fits:
                report["fitted"]["sites"] = self._site_fits(counts, fit, announced, evaluated)
        self.write_evaluation(report)
        return report

    def _fit(self, counts: Counts, report: dict[str, Any]) -> tuple[ClinicalFit, dict[str, Any]]:
        """Calibration maps and operating points from the pooled counts, written with the model to
        ``cxrfl/calibrated_model.pt``; the fit and its report entry."""
        cfg, checkpoint = self.config, self.checkpoint
        # whole classes only: the subgroup targets (``"<class>|<field>=<group>"``) are audited, never fitted
        merged = {c: p for c, per in counts.items() if c in report["classes"] and (p := pooled(per)) is not None}
        on = {
            "split": cfg.split,
            "classes": {
                c: {"positives": p.n_pos, "negatives": p.n_neg, "sites": len(report["classes"][c]["sites_pooled"])}
                for c, p in merged.items()
            },
        }
        fit = ClinicalFit.fit(
            merged,
            calibration=cfg.calibration,
            target=cfg.target,
            value=cfg.target_value,
            fitted_on=on,
            alpha=cfg.calibration_alpha,
            rule=cfg.threshold_rule,
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
            report["classes"][c]["ece_calibrated"] = reliability(merged[c], m).ece
        self.info(
            f"calibration of {len(fit.calibration)} and operating points of {len(fit.operating_points)} "
            f"class(es) written with the model to {path}"
        )
        return fit, {"model": str(path.relative_to(self.out)), **fit.to_dict()}

    def _site_fits(
        self,
        counts: Counts,
        fit: ClinicalFit,
        announced: Mapping[str, list[str]],
        evaluated: Mapping[str, list[str]],
    ) -> dict[str, Any]:
        """Send each site its copy of the fit; per site whether it wrote it and how many maps are its own."""
        cfg = self.config
        payloads, own_maps = {}, {}
        for site, classes in evaluated.items():
            if not classes:
                continue
            mine = {c: n for c in classes if (n := counts.get(c, {}).get(site)) is not None}
            cases = {c: {"positives": n.n_pos, "negatives": n.n_neg} for c, n in mine.items()}
            on = {"split": cfg.split, "classes": cases}
            copy = fit.for_site(classes, mine, calibration=cfg.calibration, fitted_on=on)
            own_maps[site] = sum(copy.calibration.get(c) != fit.calibration.get(c) for c in classes)
            params, meta = self._message(announced[site], classes, None)
            payloads[site] = params, {**meta, "keep": classes, CHECKPOINT_KEY: copy.to_dict()}
        answers = self.exchange(SITE_FIT, payloads)
        for site, (_, meta) in answers.items():
            written = meta.get("written")
            self.info(f"site {site}: wrote its calibrated model ({own_maps[site]} map(s) of its own) to {written}")
        return {site: {"own_maps": own_maps[site], "written": site in answers} for site in payloads}

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

    def _message(self, own: Sequence[str], evaluated: Sequence[str], bins: Mapping[str, BinSpec] | None) -> Message:
        """A site's task: the feature extractor, one head row per own class, the count request (None: none)."""
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
        }
        if bins is not None:
            meta["counts"] = count_request(evaluated, bins, self.config.min_cell)
        return params, meta
