"""FedFew against the paper's baselines on the synthetic ``fedfew`` profile, in-process.

Per seed (the seed draws the synthetic cohorts, the unlabelled share of the CC sites, the
weights and the augmentation):

* data: ``cxrfl.synth`` profile ``fedfew`` (:mod:`cxrfl.synth.fedfew_profile`): 3 CC sites,
  3 UC sites (Edema, Pneumonia, Hernia; ~20 positives and ~200 negatives each), 3 test sites.
  Training sites are split 90/10 (train/val) by patient; a share of every CC site's training
  images has its labels removed (the paper's partially labelled CC clients: those images only
  serve stage 1). Each UC is tested on a balanced sample of its test site (up to 100 positives
  and as many negatives); the CCs on all test images (mean AUROC over the 11 CCs);
* ``fedfew``: the three stages (:func:`cxrfl.fedfew.inprocess.run_fedfew`: the job's own
  workflow and site code), then the final model file read back as ``cxrfl predict`` does;
* ``fedfew-no-ebm`` (optional): the same with lambda = 0 (stage 1 reused through ``resume``);
* ``mlc`` / ``mlc-ssl``: the plain federated multi-label baseline: a head over all 14 classes,
  FedAvg weighted by labelled images, CheXNet's weighted BCE on the labels a site has,
  from scratch / from the stage-1 encoder; UC predicted positive when its probability >= 0.5;
* ``nn-ssl`` / ``nn-mlc-ssl``: the paper's hypothetical local nearest-neighbour classifier:
  each UC test image gets the label of its cosine-nearest training image of that UC's site
  (features of the stage-1 encoder / of ``mlc-ssl``); not federated (it needs the images).

Results: ``OUT/fedfew.json`` (settings, machine, per-seed runs, summary, target verdicts) and a
markdown section (:func:`format_markdown`). Finished seeds are reused when the settings match.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from cxrfl.surgical.aggregation import surgical_aggregate
from cxrfl.data.site_config import SplitConfig, load_site_config
from cxrfl.data.dataset import make_loader
from cxrfl.data.site import SiteData, load_site
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.fedfew.inprocess import run_fedfew
from cxrfl.common.io import to_numpy
from cxrfl.fedfew.learner import uc_metrics
from cxrfl.fedfew.model import FedFewModel
from cxrfl.fedfew.prototypes import cosine_distance
from cxrfl.fedfew.server import STAGE_DIR, STAGE_FILES
from cxrfl.fedfew.ssl import ENCODER_PREFIX
from cxrfl.nn.metrics import per_class_auroc
from cxrfl.nn.models import CXRNet, ModelConfig, build_model
from cxrfl.synth.fedfew_profile import FEDFEW_CCS, FEDFEW_UCS
from cxrfl.nn.training import adam, train_epochs

REPO = Path(__file__).resolve().parents[2]
METHODS = ("mlc", "mlc-ssl", "nn-ssl", "nn-mlc-ssl", "fedfew-no-ebm", "fedfew", "fedfew-balanced")
LABELS = {"mlc": "MLC w/o FSSL", "mlc-ssl": "MLC w/ FSSL", "nn-ssl": "NN (FSSL)", "nn-mlc-ssl": "NN (MLC w/ FSSL)",
          "fedfew-no-ebm": "FedFew w/o EBM", "fedfew": "FedFew w/ EBM",
          "fedfew-balanced": "FedFew w/ EBM, balanced threshold*"}
BASELINES = ("mlc", "mlc-ssl")


def _default_fedfew() -> dict[str, Any]:
    return FedFewConfig(ssl_rounds=1, ssl_max_steps=4, ssl_batch_size=32, ssl_proj_dim=512, ssl_pred_dim=128,
                        rounds=2, warmup_rounds=1, local_epochs=2, batch_size=32, lr=1e-3, min_prototype_images=10,
                        eval_batch_size=128).to_dict()


@dataclass(frozen=True)
class BenchSettings:
    """Everything that decides the numbers (stored with the results).

    Args:
        image_size: training input side (the images are written at ``data_image_size``).
        data_image_size: side of the written synthetic images.
        n_cc: images per CC site.
        cc_label_fraction: share of a CC site's training images that keep their labels.
        train_fraction: train share of the training sites (the rest is validation).
        fedfew: :class:`FedFewConfig` fields (the seed is set per run).
        mlc_rounds: federated rounds of the MLC baselines.
        mlc_local_epochs: their local epochs per round.
        mlc_lr: their Adam learning rate.
        mlc_batch_size: their minibatch size.
        test_per_class: at most this many positives (and as many negatives) per UC test set.
        methods: the methods to run (:data:`METHODS`).
        threads: torch CPU threads per seed.
        jobs: seeds run in parallel processes.
    """

    image_size: int = 32
    data_image_size: int = 64
    n_cc: int = 240
    cc_label_fraction: float = 0.75
    train_fraction: float = 0.9
    fedfew: dict[str, Any] = field(default_factory=_default_fedfew)
    mlc_rounds: int = 3
    mlc_local_epochs: int = 2
    mlc_lr: float = 1e-3
    mlc_batch_size: int = 32
    test_per_class: int = 100
    methods: tuple[str, ...] = ("mlc", "mlc-ssl", "nn-ssl", "nn-mlc-ssl", "fedfew", "fedfew-balanced")
    threads: int = 1
    jobs: int = 2

    def __post_init__(self) -> None:
        unknown = [m for m in self.methods if m not in METHODS]
        if unknown:
            raise ValueError(f"unknown method(s) {unknown}; available: {list(METHODS)}")
        object.__setattr__(self, "methods", tuple(self.methods))
        FedFewConfig.from_dict(self.fedfew)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["methods"] = list(self.methods)
        return d


QUICK = BenchSettings(n_cc=120, fedfew={**_default_fedfew(), "ssl_rounds": 1, "ssl_max_steps": 2, "rounds": 1,
                                        "local_epochs": 1, "min_prototype_images": 3}, mlc_rounds=1, mlc_local_epochs=1,
                      test_per_class=30, jobs=1)
"""A few-minute smoke setting (not for reporting)."""


# ------------------------------------------------------------------------------------------ data
@dataclass
class SeedData:
    """One seed's sites: training sites by name, and the UC test sets and the CC test set."""

    train: dict[str, SiteData]
    uc_test: dict[str, pd.DataFrame]
    cc_test: pd.DataFrame
    uc_site: dict[str, str]


def prepare_data(settings: BenchSettings, data_dir: Path, seed: int) -> SeedData:
    """Write (or reuse) the seed's synthetic profile and load its sites."""
    import cxrfl.synth.fedfew_profile as fp
    from cxrfl.synth import write_profile

    profile = fp.fedfew_profile(n_cc=settings.n_cc, name=f"fedfew-bench-{settings.n_cc}")
    fp.PROFILES.setdefault(profile.name, profile)
    configs = write_profile(profile.name, data_dir, image_size=settings.data_image_size, seed=seed)
    rng = np.random.default_rng([seed, 17])
    split = SplitConfig(train=settings.train_fraction, val=round(1.0 - settings.train_fraction, 6), test=0.0, seed=seed)
    train: dict[str, SiteData] = {}
    uc_test: dict[str, pd.DataFrame] = {}
    tests: dict[str, pd.DataFrame] = {}
    for path in configs:
        cfg = load_site_config(path)
        spec = profile.resolve(cfg.site)
        if spec.role == "test":
            tests[cfg.site] = load_site(cfg, check_images=False).table
            continue
        data = load_site(dataclasses.replace(cfg, split=split), check_images=False)
        if set(data.classes) & set(FEDFEW_CCS):  # a CC site: some training images lose their labels
            rows = np.flatnonzero((data.table["split"] == "train").to_numpy())
            drop = rng.choice(rows, size=int(round(len(rows) * (1 - settings.cc_label_fraction))), replace=False)
            data.table.loc[drop, data.classes] = np.nan
        train[cfg.site] = data
    test = pd.concat(list(tests.values()), ignore_index=True)
    uc_site = {}
    for uc in FEDFEW_UCS:
        t = tests[f"test-{fp.site_name(uc)}"]
        pos, neg = t[t[uc] == 1.0], t[t[uc] == 0.0]
        k = min(len(pos), len(neg), settings.test_per_class)
        uc_test[uc] = pd.concat([pos.sample(k, random_state=seed), neg.sample(k, random_state=seed)], ignore_index=True)
        uc_site[uc] = next(s for s, d in train.items() if d.classes == [uc])
    return SeedData(train, uc_test, test, uc_site)


# ------------------------------------------------------------------------------------ helpers
@torch.no_grad()
def _features_logits(model: CXRNet, table: pd.DataFrame, image_size: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    model.eval()
    loader = make_loader(table, [], image_size=image_size, train=False, batch_size=batch_size)
    feats, logits = [], []
    for x, _, _ in loader:
        f = model.features(x)
        feats.append(f.numpy())
        logits.append(model.classifier(model.hidden(f)).numpy())
    return np.concatenate(feats), np.concatenate(logits)


def _mean_auroc(y: np.ndarray, scores: np.ndarray, classes: Sequence[str]) -> tuple[float, dict[str, float | None]]:
    aurocs = per_class_auroc(y, scores, list(classes))
    defined = [v for v in aurocs.values() if v is not None]
    return (float(np.mean(defined)) if defined else float("nan")), aurocs


def _encoder_into(model: CXRNet, ssl_state: dict[str, np.ndarray]) -> None:
    enc = {k[len(ENCODER_PREFIX):]: torch.as_tensor(np.asarray(v)) for k, v in ssl_state.items() if k.startswith(ENCODER_PREFIX)}
    model.backbone.load_state_dict(enc)


def _chexnet_weights(table: pd.DataFrame, classes: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """CheXNet's weighted BCE: w+ = N/(P+N), w- = P/(P+N) per class over the known labels, as
    ``(class_weight = w-, pos_weight = w+/w-)`` for :func:`cxrfl.nn.losses.masked_bce` (1, 1 where undefined)."""
    cw, pw = [], []
    for c in classes:
        p, n = float((table[c] == 1.0).sum()), float((table[c] == 0.0).sum())
        if p == 0 or n == 0:
            cw.append(1.0)
            pw.append(1.0)
        else:
            cw.append(p / (p + n))
            pw.append(n / p)
    return torch.tensor(cw), torch.tensor(pw)


def train_mlc(data: SeedData, settings: BenchSettings, seed: int, ssl_state: dict[str, np.ndarray] | None,
              log: Callable[[str], None]) -> CXRNet:
    """The plain federated multi-label baseline: FedAvg of a 14-class network, weighted BCE on known labels."""
    classes = sorted([*FEDFEW_CCS, *FEDFEW_UCS])
    mc = ModelConfig(image_size=settings.image_size)
    torch.manual_seed(seed + 2)
    model = build_model(mc, len(classes))
    if ssl_state is not None:
        _encoder_into(model, ssl_state)
    state = to_numpy(model.state_dict())
    tables = {}
    for s, d in data.train.items():
        t = d.split_table("train").copy()
        for c in classes:
            if c not in t.columns:
                t[c] = np.nan
        t = t[t[classes].notna().any(axis=1)].reset_index(drop=True)
        if len(t) % settings.mlc_batch_size == 1:  # a last batch of one image breaks BatchNorm in training mode
            t = t.iloc[:-1]
        tables[s] = t
    for rnd in range(1, settings.mlc_rounds + 1):
        updates = []
        for s, t in tables.items():
            model.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()})
            cw, pw = _chexnet_weights(t, classes)
            loader = make_loader(t, classes, image_size=settings.image_size, train=True, batch_size=settings.mlc_batch_size,
                                 seed=seed * 1000 + rnd)
            train_epochs(model, loader, adam(model, settings.mlc_lr), torch.device("cpu"), epochs=settings.mlc_local_epochs,
                         class_weight=cw, pos_weight=pw)
            updates.append({"site": s, "classes": classes, "params": to_numpy(model.state_dict()), "num_samples": len(t)})
        state, _ = surgical_aggregate(updates, weighting="samples", classes=classes)
        log(f"  mlc{' (ssl)' if ssl_state is not None else ''} round {rnd}/{settings.mlc_rounds} done")
    model.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in state.items()})
    return model


def eval_mlc(model: CXRNet, data: SeedData, settings: BenchSettings) -> dict[str, Any]:
    classes = sorted([*FEDFEW_CCS, *FEDFEW_UCS])
    bs = int(settings.fedfew.get("eval_batch_size", 128))
    _, logits = _features_logits(model, data.cc_test, settings.image_size, bs)
    cc_idx = [classes.index(c) for c in FEDFEW_CCS]
    mean, aurocs = _mean_auroc(data.cc_test[list(FEDFEW_CCS)].to_numpy(float), logits[:, cc_idx], FEDFEW_CCS)
    ucs = {}
    for uc, t in data.uc_test.items():
        _, lg = _features_logits(model, t, settings.image_size, bs)
        prob = 1 / (1 + np.exp(-lg[:, classes.index(uc)]))
        ucs[uc] = uc_metrics(t[uc].to_numpy(), prob >= 0.5)
    return {"cc_mean_auroc": mean, "cc_auroc": aurocs, "uc": ucs}


def eval_nn(model: CXRNet, data: SeedData, settings: BenchSettings) -> dict[str, Any]:
    """Local 1-nearest-neighbour (cosine) per UC over the UC site's training images."""
    bs = int(settings.fedfew.get("eval_batch_size", 128))
    ucs = {}
    for uc, t in data.uc_test.items():
        train = data.train[data.uc_site[uc]].split_table("train")
        train = train[train[uc].notna()].reset_index(drop=True)
        f_train, _ = _features_logits(model, train, settings.image_size, bs)
        f_test, _ = _features_logits(model, t, settings.image_size, bs)
        d = cosine_distance(f_test[:, None, :], f_train[None, :, :])
        pred = train[uc].to_numpy()[d.argmin(axis=1)] == 1.0
        ucs[uc] = uc_metrics(t[uc].to_numpy(), pred)
    return {"cc_mean_auroc": None, "uc": ucs}


def eval_fedfew(final: Path, data: SeedData, settings: BenchSettings) -> dict[str, Any]:
    """The final model file, read back as ``cxrfl predict`` reads it, on the test sets."""
    model = FedFewModel.from_checkpoint(final)
    bs = int(settings.fedfew.get("eval_batch_size", 128))

    def run(table: pd.DataFrame) -> dict[str, Any]:
        loader = make_loader(table, [], image_size=settings.image_size, train=False, batch_size=bs)
        outs = [model.predict(x) for x, _, _ in loader]
        res = {"cc": np.concatenate([o["cc_probabilities"] for o in outs]), "energy": np.concatenate([o["energy"] for o in outs])}
        res["uc"] = {uc: np.concatenate([o["uc"][uc]["positive"] for o in outs]) for uc in model.uc_classes}
        res["margin"] = {uc: np.concatenate([o["uc"][uc]["margin"] for o in outs]) for uc in model.uc_classes}
        return res

    cc = run(data.cc_test)
    mean, aurocs = _mean_auroc(data.cc_test[model.cc_classes].to_numpy(float), cc["cc"], model.cc_classes)
    ucs, energy = {}, {}
    for uc, t in data.uc_test.items():
        r = run(t)
        y = t[uc].to_numpy()
        pred = r["uc"].get(uc, np.zeros(len(t), bool))
        ucs[uc] = uc_metrics(y, pred)
        ucs[uc]["flagged_positives"] = float((r["energy"][y == 1] > model.threshold).mean())
        ucs[uc]["flagged_negatives"] = float((r["energy"][y == 0] > model.threshold).mean())
        energy[uc] = {"positives": float(r["energy"][y == 1].mean()), "negatives": float(r["energy"][y == 0].mean()),
                      "energy_auroc": _auroc(y, r["energy"]),
                      "prototype_margin_auroc": _auroc(y, r["margin"][uc]) if uc in r["margin"] else None}
    return {"cc_mean_auroc": mean, "cc_auroc": aurocs, "uc": ucs, "threshold": model.threshold, "test_energy": energy,
            "uc_with_prototypes": model.uc_classes}


def _auroc(y: np.ndarray, score: np.ndarray) -> float | None:
    """AUROC of a score for a binary label (None with one label value): how well the energy or
    the prototype margin alone ranks a UC's positives above its negatives."""
    from sklearn.metrics import roc_auc_score

    return float(roc_auc_score(y, score)) if len(np.unique(y)) == 2 else None


def _summarise_run(run: dict[str, Any]) -> dict[str, Any]:
    f1 = [run["uc"][uc]["f1"] for uc in FEDFEW_UCS if uc in run["uc"]]
    run["mean_uc_f1"] = float(np.mean(f1)) if f1 else None
    return run


# ----------------------------------------------------------------------------------- one seed
def run_seed(settings: BenchSettings, seed: int, data_root: Path, work: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """Every method on one seed."""
    start = time.perf_counter()
    data = prepare_data(settings, data_root / f"seed{seed}", seed)
    counts = {s: {"train": int((d.table["split"] == "train").sum()),
                  "labelled": int(d.split_table("train")[d.classes].notna().any(axis=1).sum()),
                  "positives": d.positives("train")} for s, d in data.train.items()}
    log(f"seed {seed}: data ready ({time.perf_counter() - start:.0f}s): "
        + ", ".join(f"{s} {c['labelled']}/{c['train']} labelled" for s, c in counts.items()))
    mc = ModelConfig(image_size=settings.image_size)
    cfg = FedFewConfig.from_dict({**settings.fedfew, "seed": seed})
    runs: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    quiet = lambda msg: None  # noqa: E731
    t = time.perf_counter()
    out_dir = work / f"seed{seed}" / "fedfew"
    shutil.rmtree(out_dir, ignore_errors=True)
    outcome = run_fedfew(data.train, config=cfg, model_config=mc, out_dir=out_dir, info=lambda m: log("  " + m),
                         warning=lambda m: log("  WARNING " + m))
    seconds["fedfew"] = time.perf_counter() - t
    runs["fedfew"] = eval_fedfew(outcome.final_path, data, settings)
    runs["fedfew"].update(margins=outcome.margins, threshold_stats=outcome.threshold_stats,
                          prototypes={uc: [(p.n_positive, p.n_negative) for p in ps] for uc, ps in outcome.prototypes.items()})
    ssl_state = outcome.ssl_state
    if "fedfew-balanced" in settings.methods:  # stage 3 again on the same stage-2 model (resume), balanced rule
        t = time.perf_counter()
        d2 = work / f"seed{seed}" / "fedfew-balanced"
        shutil.rmtree(d2, ignore_errors=True)
        (d2 / STAGE_DIR).mkdir(parents=True)
        for k in (1, 2):
            shutil.copy2(out_dir / STAGE_DIR / STAGE_FILES[k], d2 / STAGE_DIR / STAGE_FILES[k])
        o2 = run_fedfew(data.train, config=cfg.replace(threshold_weighting="balanced"), model_config=mc, out_dir=d2,
                        info=quiet, warning=lambda m: log("  WARNING " + m))
        seconds["fedfew-balanced"] = time.perf_counter() - t
        runs["fedfew-balanced"] = eval_fedfew(o2.final_path, data, settings)
        runs["fedfew-balanced"].update(threshold_stats=o2.threshold_stats)
    if "fedfew-no-ebm" in settings.methods:
        t = time.perf_counter()
        d2 = work / f"seed{seed}" / "fedfew-no-ebm"
        shutil.rmtree(d2, ignore_errors=True)
        (d2 / STAGE_DIR).mkdir(parents=True)
        shutil.copy2(out_dir / STAGE_DIR / STAGE_FILES[1], d2 / STAGE_DIR / STAGE_FILES[1])
        o2 = run_fedfew(data.train, config=cfg.replace(energy_weight=0.0), model_config=mc, out_dir=d2, info=quiet,
                        warning=lambda m: log("  WARNING " + m))
        seconds["fedfew-no-ebm"] = time.perf_counter() - t
        runs["fedfew-no-ebm"] = eval_fedfew(o2.final_path, data, settings)
    if "nn-ssl" in settings.methods:
        t = time.perf_counter()
        enc = build_model(mc, 1)
        _encoder_into(enc, ssl_state)
        runs["nn-ssl"] = eval_nn(enc, data, settings)
        seconds["nn-ssl"] = time.perf_counter() - t
    for name, init in (("mlc", None), ("mlc-ssl", ssl_state)):
        if name not in settings.methods and not (name == "mlc-ssl" and "nn-mlc-ssl" in settings.methods):
            continue
        t = time.perf_counter()
        model = train_mlc(data, settings, seed, init, log)
        if name in settings.methods:
            runs[name] = eval_mlc(model, data, settings)
        seconds[name] = time.perf_counter() - t
        if name == "mlc-ssl" and "nn-mlc-ssl" in settings.methods:
            runs["nn-mlc-ssl"] = eval_nn(model, data, settings)
    for r in runs.values():
        _summarise_run(r)
    log(f"seed {seed} done in {time.perf_counter() - start:.0f}s: " + ", ".join(
        f"{LABELS[m]} F1 {runs[m]['mean_uc_f1']:.3f}" + (f" AUROC {runs[m]['cc_mean_auroc']:.3f}" if runs[m].get('cc_mean_auroc') is not None else "")
        for m in METHODS if m in runs))
    return {"seed": seed, "data": counts, "methods": runs, "seconds": {k: round(v, 1) for k, v in seconds.items()},
            "total_seconds": round(time.perf_counter() - start, 1)}


def _run_seed_quietly(settings: BenchSettings, seed: int, data_root: Path, work: Path) -> tuple[dict[str, Any], list[str]]:
    """One seed in a worker process; its log lines come back with the result."""
    torch.set_num_threads(settings.threads)
    lines: list[str] = []

    def log(msg: str) -> None:
        lines.append(f"[seed {seed}] {msg}")
        print(lines[-1], flush=True)

    return run_seed(settings, seed, data_root, work, log), lines


# ------------------------------------------------------------------------------------ summary
def _ms(values: list[float]) -> dict[str, float | None]:
    values = [v for v in values if v is not None and np.isfinite(v)]
    if not values:
        return {"mean": None, "sd": None, "n": 0}
    return {"mean": float(np.mean(values)), "sd": float(np.std(values, ddof=1)) if len(values) > 1 else None, "n": len(values)}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean and SD over seeds of every metric, and the target verdicts."""
    table: dict[str, Any] = {}
    for m in METHODS:
        rs = [r["methods"][m] for r in runs if m in r["methods"]]
        if not rs:
            continue
        entry: dict[str, Any] = {"label": LABELS[m], "mean_uc_f1": _ms([r["mean_uc_f1"] for r in rs]),
                                 "cc_mean_auroc": _ms([r.get("cc_mean_auroc") for r in rs]), "uc": {}}
        for uc in FEDFEW_UCS:
            entry["uc"][uc] = {k: _ms([r["uc"][uc][k] for r in rs if uc in r["uc"]]) for k in ("accuracy", "precision", "recall", "f1")}
        if m.startswith("fedfew"):
            entry["diagnostics"] = {uc: {k: _ms([r["test_energy"][uc].get(k) for r in rs if uc in r.get("test_energy", {})])
                                         for k in ("energy_auroc", "prototype_margin_auroc")} for uc in FEDFEW_UCS}
            entry["flagged"] = {uc: {k: _ms([r["uc"][uc].get(k) for r in rs if uc in r["uc"]])
                                     for k in ("flagged_positives", "flagged_negatives")} for uc in FEDFEW_UCS}
        table[m] = entry
    return {"methods": table, "targets": targets(table)}


def targets(table: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets on the ``fedfew`` profile, each with the numbers it is judged on."""
    out: dict[str, Any] = {}
    ff = table.get("fedfew")
    if ff is None:
        return out
    f1 = ff["mean_uc_f1"]["mean"]
    out["uc_f1_at_least_0.5"] = {"value": f1, "met": f1 is not None and f1 >= 0.5}
    for b in BASELINES:
        if b in table:
            bf1 = table[b]["mean_uc_f1"]["mean"]
            out[f"uc_f1_0.3_above_{b}"] = {"fedfew": f1, "baseline": bf1, "difference": (f1 - bf1) if None not in (f1, bf1) else None,
                                          "met": None not in (f1, bf1) and f1 - bf1 >= 0.3}
            a, ba = ff["cc_mean_auroc"]["mean"], table[b]["cc_mean_auroc"]["mean"]
            out[f"cc_auroc_within_0.01_of_{b}"] = {"fedfew": a, "baseline": ba, "difference": (a - ba) if None not in (a, ba) else None,
                                                  "met": None not in (a, ba) and a >= ba - 0.01}
    return out


def _machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "threads": torch.get_num_threads(), "cuda": torch.cuda.is_available(),
            "load_average_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


def run_fedfew_benchmark(out: str | Path = REPO / "benchmarks" / "results", seeds: int | Sequence[int] = 3, *,
                         settings: BenchSettings | None = None, data_root: str | Path | None = None,
                         work: str | Path | None = None, log: Callable[[str], None] = print,
                         resume: bool = True) -> dict[str, Any]:
    """Run the FedFew benchmark; write ``OUT/fedfew.json`` (and return it).

    Args:
        out: output folder.
        seeds: number of seeds (0, 1, ...) or the seeds themselves.
        settings: everything else (default: :class:`BenchSettings`).
        data_root: where the synthetic data is written (default ``$CXRFL_DEMO_DIR`` or
            ``~/.cache/cxrfl/fedfew-bench``); reused when already there.
        work: where the runs' stage files and models go (default: ``DATA_ROOT/runs``).
        log: progress lines.
        resume: reuse finished seeds of an earlier ``fedfew.json`` with the same settings.
    """
    settings = settings or BenchSettings()
    seeds = list(range(seeds)) if isinstance(seeds, int) else [int(s) for s in seeds]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "fedfew.json"
    data_root = Path(data_root or Path(os.environ.get("CXRFL_DEMO_DIR") or Path.home() / ".cache" / "cxrfl") / "fedfew-bench")
    work = Path(work) if work else data_root / "runs"
    torch.set_num_threads(settings.threads)
    start = time.perf_counter()
    runs: list[dict[str, Any]] = []
    previous_wall = 0.0
    if resume and json_path.is_file():
        old = json.loads(json_path.read_text())
        if old.get("settings") == json.loads(json.dumps(settings.to_dict())):
            runs = [r for r in old.get("runs", []) if r["seed"] in seeds]
            if runs:
                previous_wall = float(old.get("wall_seconds_total", old.get("wall_seconds", 0.0)))
                log(f"resuming: seed(s) {[r['seed'] for r in runs]} already in {json_path}")
    machine = _machine()

    def write(final: bool) -> dict[str, Any]:
        result = {
            "settings": settings.to_dict(), "seeds": seeds, "machine": machine,
            "command": f"cxrfl bench-fedfew --seeds {len(seeds)} --out {out}",
            "runs": sorted(runs, key=lambda r: r["seed"]), "complete": final,
            "wall_seconds": round(time.perf_counter() - start, 1),
            "wall_seconds_total": round(previous_wall + time.perf_counter() - start, 1),
        }
        if runs:
            result["summary"] = summarise(runs)
        tmp = json_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(result, indent=2, default=lambda o: o.item() if hasattr(o, "item") else str(o)))
        tmp.replace(json_path)
        return result

    todo = [s for s in seeds if s not in {r["seed"] for r in runs}]
    if settings.jobs > 1 and len(todo) > 1:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor, as_completed

        for seed in todo:  # write the data first, one seed at a time (the writer forks its own workers)
            prepare_data(settings, data_root / f"seed{seed}", seed)
        with ProcessPoolExecutor(min(settings.jobs, len(todo)), mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [pool.submit(_run_seed_quietly, settings, seed, data_root, work) for seed in todo]
            for fut in as_completed(futures):
                run, _ = fut.result()
                log(f"seed {run['seed']} finished ({run['total_seconds']:.0f}s)")
                runs.append(run)
                write(False)
    else:
        for seed in todo:
            runs.append(run_seed(settings, seed, data_root, work, log))
            write(False)
    result = write(True)
    log(f"wrote {json_path}")
    return result


# ----------------------------------------------------------------------------------- markdown
def _fmt(x: dict[str, Any] | None, digits: int = 2) -> str:
    if not x or x.get("mean") is None:
        return "-"
    sd = x.get("sd")
    return f"{x['mean']:.{digits}f}" + (f" ± {sd:.{digits}f}" if sd is not None else "")


def format_markdown(result: dict[str, Any], commit: str = "COMMIT") -> str:
    """The BENCHMARKS section of a result written by :func:`run_fedfew_benchmark`."""
    s = result["settings"]
    ff = s["fedfew"]
    summ = result.get("summary", {})
    table = summ.get("methods", {})
    lines = [
        "## FedFew: underrepresented classes held by few sites (synthetic `fedfew` profile)",
        "",
        f"Command: `{result['command']}` (also `python benchmarks/fedfew_bench.py`). Commit: {commit}. "
        f"Machine: {result['machine']['cpus']} CPU cores shared with other jobs, {s['threads']} torch thread(s), no GPU; "
        f"{len(result['runs'])} seed(s) ({', '.join(str(r['seed']) for r in result['runs'])}), {s.get('jobs', 1)} in parallel: "
        f"{result.get('wall_seconds_total', result.get('wall_seconds', 0)) / 60:.0f} min wall "
        f"({sum(r['total_seconds'] for r in result['runs']) / 60:.0f} min of seed time); "
        f"load average {result['machine'].get('load_average_at_start', 0):.1f} at the start (other jobs on the same cores)."
        + (f" {result['note']}" if result.get("note") else ""),
        "",
        f"Settings: DenseNet121 from scratch at {s['image_size']}x{s['image_size']} (images written at {s['data_image_size']}); "
        f"3 CC sites of {s['n_cc']} images ({s['cc_label_fraction']:.0%} of training images labelled), 3 UC sites of ~220 images "
        f"(~20 positives), 90/10 train/val; UC test sets balanced, up to {s['test_per_class']} positives + as many negatives; "
        f"CC AUROC on all 600 test images. FedFew: {ff['ssl_rounds']} SimSiam round(s) of <= {ff['ssl_max_steps']} steps/site, "
        f"{ff['warmup_rounds']} warm-up + {ff['rounds']} energy round(s) ({ff['local_epochs']} local epoch(s), batch {ff['batch_size']}, Adam {ff['lr']}), "
        f"T={ff['temperature']}, lambda={ff['energy_weight']}, margins from the warm-up (widen {ff['margin_widen']}), "
        f"min {ff['min_prototype_images']} images per prototype, threshold rule `{ff['threshold_weighting']}` on "
        f"`{ff['threshold_examples']}` examples. MLC: {s['mlc_rounds']} rounds x {s.get('mlc_local_epochs', 1)} local epoch(s), "
        f"CheXNet weighted BCE, batch {s['mlc_batch_size']}. These are CPU-sized settings, far below the paper's (100 SSL epochs, 224 px, thousands of images).",
        "",
        "| Method | Edema A / P / R / F1 | Pneumonia A / P / R / F1 | Hernia A / P / R / F1 | mean UC F1 | mean CC AUROC |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for m in METHODS:
        if m not in table:
            continue
        e = table[m]
        cells = []
        for uc in FEDFEW_UCS:
            u = e["uc"][uc]
            cells.append(" / ".join(_fmt(u[k]) for k in ("accuracy", "precision", "recall", "f1")))
        lines.append(f"| {e['label']} | {' | '.join(cells)} | {_fmt(e['mean_uc_f1'])} | {_fmt(e['cc_mean_auroc'], 3)} |")
    lines += ["", "Mean ± SD over seeds. A / P / R / F1: accuracy, precision, recall, F1 of each UC on its balanced test set."]
    if "fedfew-balanced" in table:
        lines.append("\\* Not the paper's rule: the same stage-2 model, stage 3 re-run (through `resume`) with "
                     "`threshold_weighting: balanced` instead of the most correctly classified training examples.")
    ff = table.get("fedfew")
    if ff and ff.get("diagnostics"):
        diag = "; ".join(f"{uc} {_fmt(d['energy_auroc'])} / {_fmt(d['prototype_margin_auroc'])}" for uc, d in ff["diagnostics"].items())
        flag = "; ".join(f"{uc} {_fmt(d['flagged_positives'])} / {_fmt(d['flagged_negatives'])}" for uc, d in ff["flagged"].items())
        lines += ["", f"Diagnostics of FedFew w/ EBM on the UC test sets: AUROC of the energy alone / of the prototype margin "
                      f"alone: {diag}. Share of positives / negatives flagged by the energy threshold: {flag}."]
    lines += ["", "Targets:", ""]
    t = summ.get("targets", {})
    if "uc_f1_at_least_0.5" in t:
        v = t["uc_f1_at_least_0.5"]
        lines.append(f"- FedFew mean F1 over the UCs >= 0.5: **{'met' if v['met'] else 'not met'}** ({v['value']:.3f}).")
    for b in BASELINES:
        k = f"uc_f1_0.3_above_{b}"
        if k in t:
            v = t[k]
            lines.append(f"- ... at least 0.3 above {LABELS[b]}: **{'met' if v['met'] else 'not met'}** "
                         f"({v['fedfew']:.3f} vs {v['baseline']:.3f}, difference {v['difference']:+.3f}).")
        k = f"cc_auroc_within_0.01_of_{b}"
        if k in t:
            v = t[k]
            lines.append(f"- Mean CC AUROC no worse than {LABELS[b]} by more than 0.01: **{'met' if v['met'] else 'not met'}** "
                         f"({v['fedfew']:.3f} vs {v['baseline']:.3f}, difference {v['difference']:+.3f}).")
    return "\n".join(lines) + "\n"
