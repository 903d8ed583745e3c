"""The FedFew benchmark's methods: the MLC baseline's training, the linear probe of stage 1's
encoder, and the evaluation of every method on one seed's test sets (UC accuracy, precision,
recall, F1; mean CC AUROC; for FedFew the diagnostics of each stage-3 step).

* ``fedfew`` and its variants: the final model file, read back as ``cxrfl predict`` reads it
  (:func:`eval_fedfew`);
* ``mlc`` / ``mlc-ssl``: the plain federated multi-label baseline: a head over all 14 classes,
  FedAvg weighted by labelled images, CheXNet's weighted BCE on the labels a site has, from
  scratch / from the stage-1 encoder, until the pooled validation loss (the same weighted BCE) stops improving; a UC is
  positive when its probability is >= 0.5;
* ``mlc-surgical`` / ``mlc-surgical-ssl``: the same network trained on the loss it is stopped on (masked
  BCE, unweighted), each head row averaged over only the sites that label its class (cxrfl's surgical
  aggregation), so a UC's row is its UC site's alone; from scratch / from the stage-1 encoder (FedFew's
  stage 2 with a head row per UC trained at its site: the fair baseline on FedFew's encoder);
* ``mlc-pooled``: the upper bound: the same masked BCE on every site's images pooled in one place
  (not federated: it needs the images);
* ``nn-ssl`` / ``nn-mlc-ssl``: the paper's hypothetical local nearest-neighbour classifier: each
  UC test image gets the label of its cosine-nearest training image of that UC's site (features
  of the stage-1 encoder / of ``mlc-ssl``); not federated (it needs the images).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from cxrfl.bench.fedfew.data import SeedData, cc_training_rows
from cxrfl.bench.fedfew.settings import FedFewBenchSettings
from cxrfl.common.io import to_numpy
from cxrfl.common.selection import EarlyStopping
from cxrfl.data.dataset import make_loader
from cxrfl.fedfew.model import FedFewModel
from cxrfl.fedfew.prototypes import cosine_distance
from cxrfl.fedfew.ssl import load_encoder
from cxrfl.nn.detection import detection_metrics
from cxrfl.nn.losses import masked_bce
from cxrfl.nn.metrics import per_class_auroc
from cxrfl.nn.models import HEAD_PREFIX, CXRNet, build_model
from cxrfl.nn.training import EvalResult, adam, evaluate, train_epochs
from cxrfl.surgical.aggregation import surgical_aggregate
from cxrfl.synth.fedfew_profile import FEDFEW_CCS, FEDFEW_UCS

REPORTED_PREVALENCE = 0.09
"""The UC prevalence F1 and precision are also reported at: about the UC sites' share of
positives (the UC test sets are balanced, which flatters precision)."""
MLC_CLASSES = sorted([*FEDFEW_CCS, *FEDFEW_UCS])
"""The MLC baselines' outputs: every CC and UC."""


@torch.no_grad()
def _features_logits(
    model: CXRNet, table: pd.DataFrame, settings: FedFewBenchSettings
) -> tuple[np.ndarray, np.ndarray]:
    """Features and logits of a table's images (in fp32, on the benchmark's device)."""
    model.to(settings.device).eval()
    bs = int(settings.fedfew.get("eval_batch_size", 128))
    loader = make_loader(table, [], image_size=settings.image_size, train=False, batch_size=bs, device=settings.device)
    feats, logits = [], []
    for x, _, _ in loader:
        f = model.features(x.to(settings.device))
        feats.append(f.cpu().numpy())
        logits.append(model.classifier(model.hidden(f)).cpu().numpy())
    return np.concatenate(feats), np.concatenate(logits)


def _mean_auroc(y: np.ndarray, scores: np.ndarray, classes: Sequence[str]) -> tuple[float, dict[str, float | None]]:
    aurocs = per_class_auroc(y, scores, list(classes))
    defined = [v for v in aurocs.values() if v is not None]
    return (float(np.mean(defined)) if defined else float("nan")), aurocs


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


def _mlc_tables(data: SeedData, split: str, batch_size: int = 0) -> dict[str, pd.DataFrame]:
    """Per site: its rows of ``split`` with a known label, every MLC class as a column (NaN: not annotated)."""
    tables = {}
    for s, d in data.train.items():
        t = d.split_table(split).copy()
        for c in MLC_CLASSES:
            if c not in t.columns:
                t[c] = np.nan
        t = t[t[MLC_CLASSES].notna().any(axis=1)].reset_index(drop=True)
        if batch_size and len(t) % batch_size == 1:  # a last batch of one image breaks BatchNorm in training mode
            t = t.iloc[:-1]
        if len(t):
            tables[s] = t
    return tables


def _validation(
    model: CXRNet,
    tables: dict[str, pd.DataFrame],
    settings: FedFewBenchSettings,
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> tuple[float | None, float | None]:
    """The sites' validation BCE pooled over their known labels, and the mean over the CC sites of their mean
    CC AUROC (as FedFew's stage 2 records it: rank-based, so calibration does not move it).

    Args:
        model: the network.
        tables: each site's validation rows.
        settings: image and batch sizes, device.
        weights: per site, the ``(class_weight, pos_weight)`` it trains with (:func:`_chexnet_weights`), so
            that a baseline stops on the loss it trains on; None: unweighted.
    """
    total = known = 0.0
    cc_aurocs = []
    for site, t in tables.items():
        loader = make_loader(
            t,
            MLC_CLASSES,
            image_size=settings.image_size,
            train=False,
            batch_size=int(settings.fedfew.get("eval_batch_size", 128)),
            device=settings.device,
        )
        ev = evaluate(model, loader, MLC_CLASSES, torch.device(settings.device))
        n = float(ev.mask.sum())
        loss = weighted_bce(ev, weights[site]) if weights is not None and site in weights and n else ev.loss
        if n and np.isfinite(loss):
            total, known = total + loss * n, known + n
        cc = [ev.aurocs[c] for c in FEDFEW_CCS if ev.aurocs.get(c) is not None]
        if cc:
            cc_aurocs.append(float(np.mean(cc)))
    return (total / known if known else None), (float(np.mean(cc_aurocs)) if cc_aurocs else None)


def weighted_bce(ev: EvalResult, weights: tuple[torch.Tensor, torch.Tensor]) -> float:
    """An evaluation's masked BCE under CheXNet's weights, over its known labels (from its probabilities).

    Args:
        ev: the evaluation (at least one known label).
        weights: ``(class_weight, pos_weight)`` (:func:`_chexnet_weights`).
    """
    logits = torch.logit(torch.as_tensor(ev.scores, dtype=torch.float64), eps=1e-7)
    cw, pw = (w.to(torch.float64) for w in weights)
    y, m = torch.as_tensor(ev.y_true, dtype=torch.float64), torch.as_tensor(ev.mask)
    return float(masked_bce(logits, y, m, pos_weight=pw, class_weight=cw, reduction="sum")) / float(ev.mask.sum())


MLC_MODES = ("fedavg", "surgical", "pooled")
"""How the MLC baselines train: ``fedavg`` (``mlc``, ``mlc-ssl``: CheXNet-weighted BCE, every site sends every
head row), ``surgical`` (``mlc-surgical``: masked BCE, a head row averaged over the sites that label its class)
and ``pooled`` (``mlc-pooled``: masked BCE on every site's images in one place)."""


def _mlc_round(
    model: CXRNet,
    state: dict[str, np.ndarray],
    tables: dict[str, pd.DataFrame],
    settings: FedFewBenchSettings,
    seed: int,
    mode: str,
) -> dict[str, Any]:
    """One round of an MLC baseline: every site trains from ``state``; the aggregate comes back."""
    classes, device = MLC_CLASSES, torch.device(settings.device)
    updates = []
    for s, t in tables.items():
        model.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()})
        weights = _chexnet_weights(t, classes) if mode == "fedavg" else (None, None)
        loader = make_loader(
            t,
            classes,
            image_size=settings.image_size,
            train=True,
            batch_size=settings.mlc_batch_size,
            seed=seed,
            device=settings.device,
        )
        train_epochs(
            model,
            loader,
            adam(model, settings.mlc_lr),
            device,
            epochs=settings.mlc_local_epochs,
            class_weight=weights[0],
            pos_weight=weights[1],
        )
        params = to_numpy(model.state_dict())
        own = classes if mode != "surgical" else [c for c in classes if t[c].notna().any()]
        rows = [classes.index(c) for c in own]
        for key in (HEAD_PREFIX + "weight", HEAD_PREFIX + "bias"):  # a site sends the rows of its own classes
            params[key] = params[key][rows]
        updates.append({"site": s, "classes": own, "params": params, "num_samples": len(t)})
    agg, _ = surgical_aggregate(updates, weighting="samples", classes=classes, reference=state)
    return {k: np.asarray(v) for k, v in agg.items()}


def train_mlc(
    data: SeedData,
    settings: FedFewBenchSettings,
    seed: int,
    ssl_state: dict[str, np.ndarray] | None,
    log: Callable[[str], None],
    mode: str = "fedavg",
) -> tuple[CXRNet, dict[str, Any]]:
    """An MLC baseline (:data:`MLC_MODES`), until the pooled validation loss stops improving
    (:class:`cxrfl.common.selection.EarlyStopping`, ``mlc_patience``; at most ``mlc_rounds``); the round of lowest
    loss is kept. The loss is the masked BCE it trains on (CheXNet-weighted in ``fedavg`` mode, unweighted
    otherwise); the patience ends it no earlier than FedFew's warm-up budget (:func:`mlc_min_rounds`).

    Args:
        data: the seed's sites.
        settings: rounds, patience, epochs, learning rate, batch size, device.
        seed: weights and batch order.
        ssl_state: stage 1's SimSiam weights (its encoder starts the network; None: from scratch).
        log: progress lines.
        mode: one of :data:`MLC_MODES`.

    Returns:
        the selected network and its training record (``rounds``, ``best_round``; per round ``val_loss`` and
        ``val_cc_auroc``, the CC sites' mean validation AUROC, which tells what the selection gave up).
    """
    if mode not in MLC_MODES:
        raise ValueError(f"mode must be one of {list(MLC_MODES)}, got {mode!r}")
    torch.manual_seed(seed + 2)
    model = build_model(settings.model_config(), len(MLC_CLASSES))
    if ssl_state is not None:
        load_encoder(model, ssl_state)
    state = best = to_numpy(model.state_dict())
    tables, val = _mlc_tables(data, "train", settings.mlc_batch_size), _mlc_tables(data, "val")
    if mode == "pooled":
        pooled = pd.concat(list(tables.values()), ignore_index=True)
        tables = {"pooled": pooled.iloc[: len(pooled) - (len(pooled) % settings.mlc_batch_size == 1)]}
    # a site stops on the loss it trains on: CheXNet-weighted in fedavg mode (its training labels' weights)
    weights = {s: _chexnet_weights(t, MLC_CLASSES) for s, t in tables.items()} if mode == "fedavg" else None
    stopper, curve, aurocs = EarlyStopping(settings.mlc_patience), [], []
    name = "mlc" + ("" if mode == "fedavg" else f" ({mode})") + (" (ssl)" if ssl_state is not None else "")
    for rnd in range(1, settings.mlc_rounds + 1):
        state = _mlc_round(model, state, tables, settings, seed * 1000 + rnd, mode)
        model.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()})
        loss, cc_auroc = _validation(model, val, settings, weights)
        curve.append(loss)
        aurocs.append(cc_auroc)
        if stopper.update(loss, rnd):
            best = state
        log(
            f"  {name} round {rnd}/{settings.mlc_rounds}: validation loss {loss if loss is None else round(loss, 4)}, "
            f"CC AUROC {cc_auroc if cc_auroc is None else round(cc_auroc, 4)} (best round {stopper.best_step})"
        )
        if stopper.should_stop and rnd >= mlc_min_rounds(settings):
            break
    model.load_state_dict({k: torch.as_tensor(v) for k, v in best.items()})
    return model, {"rounds": len(curve), "best_round": stopper.best_step, "val_loss": curve, "val_cc_auroc": aurocs}


def mlc_min_rounds(settings: FedFewBenchSettings) -> int:
    """The rounds an MLC baseline runs before its patience may end it: FedFew's warm-up budget
    (``fedfew.warmup_rounds``), which FedFew's classifier ran in full in every seed of issue 5's benchmark.

    From scratch, a federated model's validation loss is noisy for its first rounds: on seed 0 it was lowest
    at round 1 (CC AUROC 0.50) and below that only from round 12 on, while the CC AUROC climbed to 0.75
    by round 19, so a patience of 5 rounds ended the baselines in that noise (BENCHMARKS.md, FedFew).

    Args:
        settings: the benchmark settings.
    """
    return min(int(settings.fedfew["warmup_rounds"]), settings.mlc_rounds)


def linear_probe(ssl_state: dict[str, Any], data: SeedData, settings: FedFewBenchSettings) -> dict[str, Any]:
    """How well stage 1's encoder separates the CCs: a linear probe on its frozen features.

    One logistic regression per CC (scikit-learn, standardised features, L2 with C = 0.1) on the
    CC sites' labelled training images, scored by AUROC on the CC test set.

    Args:
        ssl_state: SimSiam weights.
        data: the seed's sites and test sets.
        settings: image and batch sizes.

    Returns:
        ``mean_auroc`` over the CCs with both labels in both sets, ``auroc`` per CC.
    """
    model = build_model(settings.model_config(), 1)
    load_encoder(model, ssl_state)
    train = cc_training_rows(data)
    f_train, _ = _features_logits(model, train, settings)
    f_test, _ = _features_logits(model, data.cc_test, settings)
    aurocs: dict[str, float | None] = {}
    for c in FEDFEW_CCS:
        y, yt = train[c].to_numpy(float), data.cc_test[c].to_numpy(float)
        k, kt = ~np.isnan(y), ~np.isnan(yt)
        if len(np.unique(y[k])) < 2 or len(np.unique(yt[kt])) < 2:
            aurocs[c] = None
            continue
        probe = make_pipeline(StandardScaler(), LogisticRegression(C=0.1, max_iter=2000))
        probe.fit(f_train[k], y[k])
        aurocs[c] = float(roc_auc_score(yt[kt], probe.predict_proba(f_test[kt])[:, 1]))
    defined = [v for v in aurocs.values() if v is not None]
    return {"mean_auroc": float(np.mean(defined)) if defined else None, "auroc": aurocs}


def eval_mlc(model: CXRNet, data: SeedData, settings: FedFewBenchSettings) -> dict[str, Any]:
    """An MLC network on the test sets: mean CC AUROC, and each UC positive at probability >= 0.5.

    Args:
        model: the 14-class network.
        data: the seed's test sets.
        settings: image and batch sizes.
    """
    classes = MLC_CLASSES
    _, logits = _features_logits(model, data.cc_test, settings)
    cc_idx = [classes.index(c) for c in FEDFEW_CCS]
    mean, aurocs = _mean_auroc(data.cc_test[list(FEDFEW_CCS)].to_numpy(float), logits[:, cc_idx], FEDFEW_CCS)
    ucs = {}
    for uc, t in data.uc_test.items():
        _, lg = _features_logits(model, t, settings)
        prob = 1 / (1 + np.exp(-lg[:, classes.index(uc)]))
        ucs[uc] = detection_metrics(t[uc].to_numpy(), prob, prob >= 0.5, prevalence=REPORTED_PREVALENCE)
    return {"mean_cc_auroc": mean, "cc_auroc": aurocs, "uc": ucs}


def eval_nn(model: CXRNet, data: SeedData, settings: FedFewBenchSettings) -> dict[str, Any]:
    """Local 1-nearest-neighbour (cosine) per UC over the UC site's training images.

    Args:
        model: the network whose features are compared.
        data: the seed's sites and test sets.
        settings: image and batch sizes.
    """
    ucs = {}
    for uc, t in data.uc_test.items():
        train = data.train[data.uc_site[uc]].split_table("train")
        train = train[train[uc].notna()].reset_index(drop=True)
        f_train, _ = _features_logits(model, train, settings)
        f_test, _ = _features_logits(model, t, settings)
        d = cosine_distance(f_test[:, None, :], f_train[None, :, :])
        pos = train[uc].to_numpy() == 1.0
        pred = pos[d.argmin(axis=1)]
        score = d[:, ~pos].min(axis=1) - d[:, pos].min(axis=1)  # > 0: the nearest image is a positive
        ucs[uc] = detection_metrics(t[uc].to_numpy(), score, pred, prevalence=REPORTED_PREVALENCE)
    return {"mean_cc_auroc": None, "uc": ucs}


def eval_fedfew(final: Path, data: SeedData, settings: FedFewBenchSettings) -> dict[str, Any]:
    """The final model file, read back as ``cxrfl predict`` reads it, on the test sets.

    Args:
        final: the FedFew model file.
        data: the seed's test sets.
        settings: image and batch sizes.
    """
    model = FedFewModel.from_checkpoint(final)
    model.net.to(settings.device)
    bs = int(settings.fedfew.get("eval_batch_size", 128))

    def run(table: pd.DataFrame) -> dict[str, Any]:
        loader = make_loader(
            table, [], image_size=settings.image_size, train=False, batch_size=bs, device=settings.device
        )
        outs = [model.predict(x.to(settings.device)) for x, _, _ in loader]
        res = {
            "cc": np.concatenate([o["cc_probabilities"] for o in outs]),
            "energy": np.concatenate([o["energy"] for o in outs]),
        }
        for key in ("positive", "score", "margin"):
            res[key] = {uc: np.concatenate([o["uc"][uc][key] for o in outs]) for uc in model.uc_classes}
        return res

    cc = run(data.cc_test)
    mean, aurocs = _mean_auroc(data.cc_test[model.cc_classes].to_numpy(float), cc["cc"], model.cc_classes)
    ucs, energy = {}, {}
    for uc, t in data.uc_test.items():
        r = run(t)
        y = t[uc].to_numpy()
        pred = r["positive"].get(uc, np.zeros(len(t), bool))
        score = r["score"].get(uc, np.zeros(len(t)))  # a UC without detectors is never flagged
        ucs[uc] = detection_metrics(y, score, pred, prevalence=REPORTED_PREVALENCE)
        ucs[uc]["flagged_positives"] = float((r["energy"][y == 1] > model.threshold).mean())
        ucs[uc]["flagged_negatives"] = float((r["energy"][y == 0] > model.threshold).mean())
        energy[uc] = {
            "positives": float(r["energy"][y == 1].mean()),
            "negatives": float(r["energy"][y == 0].mean()),
            "energy_auroc": _auroc(y, r["energy"]),
            "prototype_margin_auroc": _auroc(y, r["margin"][uc]) if uc in r["margin"] else None,
        }
    return {
        "mean_cc_auroc": mean,
        "cc_auroc": aurocs,
        "uc": ucs,
        "threshold": model.threshold,
        "test_energy": energy,
        "detector": model.detector,
        "uc_with_detectors": model.uc_classes,
    }


def _auroc(y: np.ndarray, score: np.ndarray) -> float | None:
    """AUROC of a score for a binary label (None with one label value): how well the energy or
    the prototype margin alone ranks a UC's positives above its negatives."""
    return float(roc_auc_score(y, score)) if len(np.unique(y)) == 2 else None


def mean_uc_f1(run: dict[str, Any]) -> dict[str, Any]:
    """Add ``mean_uc_f1`` (over the UCs a method was tested on) to a method's result.

    Args:
        run: the result of one method on one seed.
    """
    f1 = [run["uc"][uc]["f1"] for uc in FEDFEW_UCS if uc in run["uc"]]
    run["mean_uc_f1"] = float(np.mean(f1)) if f1 else None
    return run
