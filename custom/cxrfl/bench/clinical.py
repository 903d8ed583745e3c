"""``cxrfl bench clinical``: the evaluation-only federation's three targets (issue 45).

Per profile and seed, surgical aggregation's own server loop (:func:`cxrfl.surgical.inprocess.run_surgical`)
trains one model with the committed demo job's settings (:data:`cxrfl.jobs.DEMO_TRAIN`, from scratch) until
the mean validation loss stops improving (``patience``; ``rounds`` is a guard). The evaluation-only server
(:func:`cxrfl.fedeval.inprocess.run_fedeval`, sites in float32) then scores it twice: on the sites' test
splits (pooled AUROCs from binned counts), and on their validation splits, fitting calibration maps and an
operating point per class (``cxrfl/calibrated_model.pt``). Independently, ``cxrfl predict``'s code path
(:func:`cxrfl.predict.predict_images`, float32) scores every test image centrally. Measured:

1. per class, the federated pooled AUROC against scikit-learn's AUROC of the pooled raw scores of the same
   images (the sites pooled): met when every ``|difference|`` is at most :data:`AUROC_TOLERANCE`;
2. per site and class it labels, the expected calibration error of its test split before and after the
   map the site uses (its copy of the fit, :meth:`cxrfl.clinical.fitted.ClinicalFit.for_site`, written by
   the site; the consortium's map where a site has no copy) (the product's
   :func:`cxrfl.clinical.calibration.reliability` on its counts): met when every pair above
   :data:`ECE_LIMIT` comes to at most it and none gets worse; the consortium's map alone is reported too;
3. per class, the test sensitivity at the threshold chosen on validation (``cxrfl predict``'s decision,
   :meth:`cxrfl.clinical.fitted.ClinicalFit.decide`), pooled over the sites labelling it, with its Wilson
   interval: met when the interval holds the target.

Each (profile, seed) is written to ``results.json`` as it finishes (an interrupted benchmark resumes);
``report.md`` and ``learning_curves.png`` at the end.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from sklearn.metrics import roc_auc_score

from cxrfl.bench.clinical_report import LEVEL, format_report, plot_curves
from cxrfl.bench.inprocess import open_results, provenance, run_pending, surgical_config
from cxrfl.bench.profiles import PROFILE_NAMES, BenchData, prepare
from cxrfl.clinical.calibration import reliability
from cxrfl.clinical.counts import BinSpec, count_scores
from cxrfl.clinical.fitted import ClinicalFit
from cxrfl.clinical.pooled import wilson
from cxrfl.common.config import Config
from cxrfl.data.site import SiteData
from cxrfl.fedeval.config import FedEvalConfig
from cxrfl.fedeval.inprocess import run_fedeval
from cxrfl.jobs import DEMO_MODEL, DEMO_TRAIN, JOBS
from cxrfl.nn.models import ARCHS, load_checkpoint, save_checkpoint
from cxrfl.predict import predict_images
from cxrfl.surgical.config import SurgicalConfig
from cxrfl.surgical.host import SITE_MODELS
from cxrfl.surgical.inprocess import global_model, make_hosts, run_surgical

Log = Callable[[str], None]
Central = dict[str, tuple[list[str], np.ndarray, np.ndarray]]
"""site -> (its classes, [n, K] raw test probabilities, [n, K] labels: 1, 0 or NaN)."""

PROFILES = ("two-hospitals", "nih1000")
_DEMO = next(j for j in JOBS if j.name == "surgical_agg").controller_args


@dataclass(frozen=True)
class ClinicalBenchSettings(Config):
    """Settings of the clinical benchmark (training as the committed demo job; evaluation as ``job_recipes/fedeval``).

    Args:
        profiles: benchmark profiles (:func:`cxrfl.bench.profiles.prepare`).
        seeds: training seeds 0 ... seeds-1.
        image_size: model input size.
        arch: the network (:mod:`cxrfl.bench.arch`).
        rounds: most federated rounds after the warm-up, a guard the runs should not reach.
        patience: rounds without a better mean validation loss before stopping.
        target_sensitivity: the sensitivity the operating point is chosen for on validation data.
        calibration: ``platt`` or ``temperature``.
        min_cell: least positives and negatives of a class a site sends counts for (also the least a
            site's test split needs for its ECE to be measured).
        bins: logit bins of the first counting pass (:class:`cxrfl.clinical.counts.BinSpec`'s ``n``).
        external: the profile's fully annotated external test set(s) join the test evaluation as sites
            that only test (never fitted on).
        steps: cap on optimiser steps per local epoch and site (None: the whole split).
        threads: torch CPU threads.
    """

    SECTION: ClassVar[str] = "bench"
    profiles: tuple[str, ...] = PROFILES
    seeds: int = field(default=3, metadata={"ge": 1})
    image_size: int = field(default=DEMO_MODEL.image_size, metadata={"ge": 8})
    arch: str = field(default=DEMO_MODEL.arch, metadata={"choices": ARCHS})
    rounds: int = field(default=60, metadata={"ge": 1})
    patience: int = field(default=_DEMO["patience"], metadata={"ge": 1})
    target_sensitivity: float = field(default=0.9, metadata={"gt": 0, "lt": 1})
    calibration: str = field(default="platt", metadata={"choices": ("platt", "temperature")})
    min_cell: int = field(default=FedEvalConfig.min_cell, metadata={"ge": 1})
    bins: int = field(default=BinSpec.n, metadata={"ge": 1})
    external: bool = True
    steps: int | None = field(default=None, metadata={"ge": 1})
    threads: int = field(default=1, metadata={"ge": 1})

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = [p for p in self.profiles if p not in PROFILE_NAMES]
        if unknown or not self.profiles:
            self.fail("profiles", f"has unknown or no profile(s) {unknown}; known: {list(PROFILE_NAMES)}")
        object.__setattr__(self, "profiles", tuple(dict.fromkeys(self.profiles)))

    def server_config(self, seed: int) -> SurgicalConfig:
        """The training run's server settings (the demo job's training settings, this run's seed).

        Args:
            seed: the training seed.
        """
        train = replace(DEMO_TRAIN, max_steps_per_epoch=self.steps, seed=seed)
        return surgical_config(
            train, rounds=self.rounds, patience=self.patience, image_size=self.image_size, arch=self.arch
        )

    def fedeval_config(self, split: str) -> FedEvalConfig:
        """The evaluation's settings: ``test`` scores; ``val`` also fits the maps and operating points.

        Args:
            split: ``test`` or ``val``.
        """
        test = FedEvalConfig(split="test", min_cell=self.min_cell, bins=BinSpec(n=self.bins), subgroups=False)
        if split == "test":
            return test
        return replace(
            test, split=split, calibration=self.calibration, target="sensitivity", target_value=self.target_sensitivity
        )


def _key(profile: str, seed: int) -> str:
    return f"{profile}/{seed}"


def run_clinical(
    settings: ClinicalBenchSettings, out: str | Path, *, log: Log = print, data_dir: str | Path | None = None
) -> dict[str, Any]:
    """Run every (profile, seed) not in ``out/results.json`` yet; write ``report.md`` and ``learning_curves.png``.

    Args:
        settings: the benchmark's settings.
        out: output folder (an interrupted benchmark resumes there).
        log: progress callback.
        data_dir: where profile data is written (default ``out/data``).

    Returns:
        the results written to ``results.json``.
    """
    out = Path(out)
    path, results = open_results(out, settings)
    results.update(provenance())
    datas = {
        p: prepare(p, Path(data_dir) if data_dir else out / "data", image_size=settings.image_size)
        for p in settings.profiles
    }
    results["profiles"] = {p: {"notes": d.notes} for p, d in datas.items()}
    plan = (  # seed by seed: every profile has a result early
        (_key(profile, seed), partial(_run_one, settings, profile, data, seed, log=log))
        for seed in range(settings.seeds)
        for profile, data in datas.items()
    )
    run_pending(path, results, plan, describe=_describe, log=log, prefix="cxrfl-clinical-")
    (out / "report.md").write_text(format_report(results))
    plot_curves(results, out / "learning_curves.png")
    log(f"wrote {path}, {out / 'report.md'} and {out / 'learning_curves.png'}")
    return results


def _describe(run: Mapping[str, Any]) -> str:
    return (
        f"{run['profile']} seed {run['seed']}: best round {run['best_round']} of {run['rounds']}, "
        f"{len(run['auroc'])} classes pooled, {len(run['ece'])} ECE pairs"
    )


def _test_sites(data: BenchData, settings: ClinicalBenchSettings) -> list[SiteData]:
    """The sites whose test splits are evaluated: the training sites, then the external test sets."""
    return [*data.sites, *(data.external.values() if settings.external else ())]


def _fedeval(
    settings: ClinicalBenchSettings, sites: Sequence[SiteData], model: Path, split: str, folder: Path, log: Log
) -> dict[str, Any]:
    """One evaluation-only run over sites that score in float32 (as ``cxrfl predict --precision fp32`` centrally)."""
    hosts = make_hosts(sites, folder / "sites", train_overrides={s.site: {"precision": "fp32"} for s in sites})
    return run_fedeval(hosts, model, settings.fedeval_config(split), folder, info=lambda _: None, warning=log)


def _run_one(
    settings: ClinicalBenchSettings, profile: str, data: BenchData, seed: int, work: Path, *, log: Log
) -> dict[str, Any]:
    """Train one model, evaluate it federatedly (test; val with fitting) and centrally, measure the targets."""
    folder = work / f"{profile}-{seed}"
    config = settings.server_config(seed)
    started = time.perf_counter()
    result = run_surgical(data.sites, config, folder / "train", info=lambda _: None, warning=log)
    model = folder / "model.pt"
    save_checkpoint(
        model, global_model(result, config.model_config), classes=result.classes, model_config=config.model_config
    )
    tests = _test_sites(data, settings)
    test = _fedeval(settings, tests, model, "test", folder / "test", log)
    fitted = folder / "val" / _fedeval(settings, data.sites, model, "val", folder / "val", log)["fitted"]["model"]
    fit = _read_fit(fitted)
    copies = {s.site: _read_fit(folder / "val" / "sites" / s.site / SITE_MODELS / "fedeval.pt") for s in data.sites}
    central = central_scores(model, tests)
    training = [site.site for site in data.sites]
    external = {site: v for site, v in central.items() if site not in training}
    run = {
        "profile": profile,
        "seed": seed,
        "best_round": result.best_round,
        "rounds": result.rounds,
        "val_loss": result.curve("mean_val_loss"),
        "val_auroc": result.curve("mean_val_auroc"),
        "auroc": auroc_rows(test, central),
        "ece": ece_rows(central, fit, copies, BinSpec(n=settings.bins), settings.min_cell),
        "training_sites": training,
        "sensitivity": sensitivity_rows({site: central[site] for site in training}, fit),
        "sensitivity_external": sensitivity_rows(external, fit) if external else {},
        "seconds": time.perf_counter() - started,
    }
    shutil.rmtree(folder, ignore_errors=True)
    return run


def _read_fit(path: Path) -> ClinicalFit:
    """The fit a model written by the evaluation-only run carries."""
    fit = ClinicalFit.from_checkpoint(load_checkpoint(path), str(path))
    if fit is None:
        raise RuntimeError(f"the evaluation-only run left no calibration in {path}")
    return fit


def central_scores(model: Path, sites: Sequence[SiteData]) -> Central:
    """Every site's test images scored centrally by ``cxrfl predict``'s code path (float32, raw).

    Args:
        model: the checkpoint.
        sites: the sites.
    """
    out: Central = {}
    for site in sites:
        table = site.split_table("test")
        rows = predict_images(model, table["path"].tolist(), device="cpu", precision="fp32", raw=True)
        unread = [r for r in rows if "error" in r]
        if unread:
            raise RuntimeError(f"site {site.site}: cannot read test image {unread[0]['image']}: {unread[0]['error']}")
        scores = np.array([[r["probabilities"][c] for c in site.classes] for r in rows], dtype=float)
        out[site.site] = (list(site.classes), scores.reshape(len(rows), -1), table[site.classes].to_numpy(float))
    return out


def _pooled(central: Central, cls: str, sites: Sequence[str] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The raw scores and labels of ``cls`` pooled over ``sites`` (None: every site labelling it), known labels only."""
    scores, labels = [], []
    for site, (classes, s, y) in central.items():
        if cls in classes and (sites is None or site in sites):
            j = classes.index(cls)
            known = ~np.isnan(y[:, j])
            scores.append(s[known, j])
            labels.append(y[known, j])
    return np.concatenate(scores), np.concatenate(labels)


def auroc_rows(report: Mapping[str, Any], central: Central) -> dict[str, dict[str, Any]]:
    """Per class the evaluation pooled: its federated AUROC and sklearn's of the same images' pooled raw scores.

    Args:
        report: :func:`run_fedeval`'s report of the test split.
        central: :func:`central_scores`.
    """
    out = {}
    for c, entry in report["classes"].items():
        if entry["auroc"] is None:
            continue
        scores, labels = _pooled(central, c, entry["sites_pooled"])
        central_auroc = float(roc_auc_score(labels, scores))
        federated = float(entry["auroc"]["value"])
        out[c] = {
            "federated": federated,
            "central": central_auroc,
            "diff": abs(federated - central_auroc),
            "sites": len(entry["sites_pooled"]),
            "withheld": len(entry["sites_withheld"]),
            "positives": int(labels.sum()),
            "negatives": int((labels == 0).sum()),
        }
    return out


def ece_rows(
    central: Central, fit: ClinicalFit, copies: Mapping[str, ClinicalFit], bins: BinSpec, min_cell: int
) -> list[dict[str, Any]]:
    """Per site and class with at least ``min_cell`` positives and negatives in its test split: the ECE before and
    after the map the site uses (``after``: its copy's, else the consortium's) and after the consortium's
    (``after_consortium``); no map: the raw scores, as ``cxrfl predict`` shows them.

    Args:
        central: :func:`central_scores`.
        fit: the consortium's maps fitted on validation.
        copies: site -> its copy of the fit (the training sites).
        bins: the bins counted in.
        min_cell: least positives and negatives (as a site sends counts).
    """
    out = []
    for site, (classes, scores, labels) in central.items():
        for j, c in enumerate(classes):
            counts = count_scores(scores[:, j], labels[:, j], bins=bins, min_cell=min_cell)
            if counts is None or not counts.n_pos or not counts.n_neg:
                continue
            used = copies.get(site, fit).calibration.get(c)
            row = {
                "site": site,
                "class": c,
                "before": reliability(counts).ece,
                "after": reliability(counts, used).ece,
                "after_consortium": reliability(counts, fit.calibration.get(c)).ece,
                "mapped": used is not None,
                "own_map": used is not None and used != fit.calibration.get(c),
            }
            out.append({**row, "positives": counts.n_pos, "negatives": counts.n_neg})
    return out


def sensitivity_rows(central: Central, fit: ClinicalFit) -> dict[str, dict[str, Any]]:
    """Per class with an operating point and test positives: the test sensitivity of ``cxrfl predict``'s decision,
    pooled over the sites labelling it, with its Wilson interval.

    Args:
        central: :func:`central_scores`.
        fit: the operating points chosen on validation.
    """
    out = {}
    for c, point in fit.operating_points.items():
        scores, labels = _pooled(central, c)
        positives = scores[labels == 1]
        if not len(positives):
            continue
        decided = fit.decide(positives[:, None], [c])
        rate = wilson(sum(d[c] for d in decided), len(positives), level=LEVEL)
        out[c] = {"threshold": point["threshold"], "val_sensitivity": point["sensitivity"], **asdict(rate)}
    return out
