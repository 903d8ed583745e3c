"""The FedFew benchmark's MLC baselines: which head rows each site sends and how the round stitches them."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
from cxrfl.bench.fedfew import methods
from cxrfl.bench.fedfew.methods import MLC_CLASSES, _mlc_round
from cxrfl.bench.fedfew.settings import FedFewBenchSettings
from cxrfl.common.io import to_numpy
from cxrfl.data.dataset import make_loader
from cxrfl.nn.models import HEAD_PREFIX, build_model
from cxrfl.nn.precision import as_compute
from cxrfl.synth.fedfew_profile import FEDFEW_CCS
from PIL import Image
from sklearn.metrics import roc_auc_score

UC = "Edema"
CC = "Atelectasis"


def _table(tmp_path, name: str, n: int, labelled: list[str]) -> pd.DataFrame:
    """``n`` images of a site labelling only ``labelled`` (every other class unknown)."""
    rng = np.random.default_rng(len(name))
    rows = []
    for i in range(n):
        path = tmp_path / f"{name}-{i}.png"
        Image.fromarray(rng.integers(0, 255, (32, 32), dtype=np.uint8)).save(path)
        row = {"path": str(path), **{c: np.nan for c in MLC_CLASSES}}
        row.update({c: float(i % 2) for c in labelled})
        rows.append(row)
    return pd.DataFrame(rows)


@pytest.fixture
def sites(tmp_path):
    ccs = [c for c in MLC_CLASSES if c != UC and c != "Hernia" and c != "Pneumonia"]
    return {"cc-site": _table(tmp_path, "cc", 8, ccs), "uc-site": _table(tmp_path, "uc", 4, [UC])}


def _round(sites, mode, monkeypatch):
    sent = []
    real = methods.surgical_aggregate

    def spy(updates, **kwargs):
        sent.extend(updates)
        return real(updates, **kwargs)

    monkeypatch.setattr(methods, "surgical_aggregate", spy)
    settings = FedFewBenchSettings(arch="densenet-tiny", image_size=32, data_image_size=32, mlc_batch_size=4)
    torch.manual_seed(0)
    model = build_model(settings.model_config(), len(MLC_CLASSES))
    state = to_numpy(model.state_dict())
    return state, _mlc_round(model, state, sites, settings, 7, mode), {u["site"]: u for u in sent}


def _row(params, classes, c):
    return params[HEAD_PREFIX + "weight"][classes.index(c)]


def test_surgical_rows_come_from_exactly_the_sites_that_label_them(sites, monkeypatch):
    state, agg, sent = _round(sites, "surgical", monkeypatch)
    assert sent["uc-site"]["classes"] == [UC]
    assert UC not in sent["cc-site"]["classes"] and "Hernia" not in sent["cc-site"]["classes"]
    uc, cc = sent["uc-site"], sent["cc-site"]
    assert uc["params"][HEAD_PREFIX + "weight"].shape[0] == 1  # a site sends the rows of its own classes only
    np.testing.assert_array_equal(_row(agg, MLC_CLASSES, UC), _row(uc["params"], uc["classes"], UC))
    np.testing.assert_array_equal(_row(agg, MLC_CLASSES, CC), _row(cc["params"], cc["classes"], CC))
    np.testing.assert_array_equal(_row(agg, MLC_CLASSES, "Hernia"), _row(state, MLC_CLASSES, "Hernia"))
    key = next(k for k in agg if k.endswith("conv0.weight"))  # the feature extractor: weighted by images (8 and 4)
    want = (8 * cc["params"][key] + 4 * uc["params"][key]) / 12
    np.testing.assert_allclose(agg[key], want, rtol=1e-5, atol=1e-7)


def test_fedavg_mode_dilutes_a_uc_row_with_the_sites_that_do_not_label_it(sites, monkeypatch):
    state, agg, sent = _round(sites, "fedavg", monkeypatch)
    assert sent["cc-site"]["classes"] == MLC_CLASSES
    uc_row = _row(sent["uc-site"]["params"], MLC_CLASSES, UC)
    cc_sites_row = _row(sent["cc-site"]["params"], MLC_CLASSES, UC)
    np.testing.assert_allclose(_row(agg, MLC_CLASSES, UC), (8 * cc_sites_row + 4 * uc_row) / 12, rtol=1e-5, atol=1e-7)
    assert not np.allclose(_row(agg, MLC_CLASSES, UC), uc_row)


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="mode must be one of"):
        methods.train_mlc(None, FedFewBenchSettings(arch="densenet-tiny"), 0, None, print, mode="median")  # type: ignore[arg-type]


def _stopping(monkeypatch, warmup_rounds: int, losses: list[float]) -> dict:
    """``train_mlc``'s record when round k's pooled validation loss is ``losses[k - 1]`` (patience 2, 12 rounds)."""
    values = iter(losses)
    monkeypatch.setattr(methods, "_mlc_tables", lambda data, split, batch_size=0: {})
    monkeypatch.setattr(methods, "_mlc_round", lambda model, state, *args: state)
    monkeypatch.setattr(methods, "_validation", lambda model, val, settings, weights=None: (next(values), 0.5))
    base = FedFewBenchSettings(arch="densenet-tiny")
    settings = FedFewBenchSettings(
        arch="densenet-tiny", mlc_rounds=12, mlc_patience=2, fedfew={**base.fedfew, "warmup_rounds": warmup_rounds}
    )
    return methods.train_mlc(None, settings, 0, None, print)[1]  # type: ignore[arg-type]


def test_the_patience_ends_a_baseline_no_earlier_than_fedfews_warm_up_budget(monkeypatch):
    noisy = [0.2, 0.5, 0.6, 0.4, 0.3, 0.19, 0.7, 0.8, 0.9, 0.1, 0.1, 0.1]  # round 1 is lowest until round 6
    early = _stopping(monkeypatch, 0, noisy)  # no minimum: round 3 ends it with round 1 kept
    assert (early["rounds"], early["best_round"]) == (3, 1)
    late = _stopping(monkeypatch, 6, noisy)  # not before round 6: it finds round 6 and stops 2 rounds later
    assert (late["rounds"], late["best_round"]) == (8, 6)
    assert late["val_loss"] == noisy[:8]
    capped = _stopping(monkeypatch, 40, noisy)  # a warm-up beyond the budget: every round, the lowest kept
    assert (capped["rounds"], capped["best_round"]) == (12, 10)


@torch.no_grad()
def _logits(model, table, settings) -> np.ndarray:
    """The model's logits on a table's images at the precision the benchmark evaluates in (its device's auto)."""
    compute = as_compute(torch.device(settings.device))
    compute.prepare(model).eval()
    loader = make_loader(table, [], image_size=settings.image_size, train=False, batch_size=64)
    out = []
    for x, _, _ in loader:
        with compute.autocast():
            out.append(model(compute.inputs(x)).float().numpy())
    return np.concatenate(out)


def test_validation_pools_the_loss_and_averages_the_cc_sites_cc_auroc(sites):
    """The selection curve's CC AUROC: each site with CC labels scores its own CCs; the UC site none."""
    settings = FedFewBenchSettings(arch="densenet-tiny", image_size=32, data_image_size=32, mlc_batch_size=4)
    torch.manual_seed(0)
    model = build_model(settings.model_config(), len(MLC_CLASSES))
    cc_site = sites["cc-site"].copy()
    cc_site.loc[:3, "Atelectasis"] = 1.0 - cc_site.loc[:3, "Atelectasis"]  # two classes with other label orders
    cc_site.loc[1:4, "Mass"] = 1.0 - cc_site.loc[1:4, "Mass"]
    tables = {"cc-site": cc_site, "uc-site": sites["uc-site"]}
    loss, cc_auroc = methods._validation(model, tables, settings)

    logits = _logits(model, cc_site, settings)  # the expectation, by hand with sklearn
    ccs = [c for c in FEDFEW_CCS if cc_site[c].notna().any()]
    want = np.mean([roc_auc_score(cc_site[c], logits[:, MLC_CLASSES.index(c)]) for c in ccs])
    assert cc_auroc == pytest.approx(want, abs=1e-6)
    total = known = 0.0
    for t in tables.values():
        lg = _logits(model, t, settings)
        y = t[MLC_CLASSES].to_numpy(float)
        known_mask = ~np.isnan(y)
        bce = torch.nn.functional.binary_cross_entropy_with_logits(
            torch.tensor(lg), torch.tensor(np.nan_to_num(y)), reduction="none"
        ).numpy()
        total, known = total + bce[known_mask].sum(), known + known_mask.sum()
    assert loss == pytest.approx(total / known, rel=1e-4)


def test_a_weighted_baseline_is_validated_on_its_sites_training_weights(sites):
    """``mlc`` trains on CheXNet's weighted BCE, so it stops on that loss: each site's own weights."""
    settings = FedFewBenchSettings(arch="densenet-tiny", image_size=32, data_image_size=32, mlc_batch_size=4)
    torch.manual_seed(0)
    model = build_model(settings.model_config(), len(MLC_CLASSES))
    cc_site = sites["cc-site"].copy()
    cc_site.loc[:2, "Atelectasis"] = 1.0  # 5 of 8 positive: weights other than 1/2 and 1
    tables = {"cc-site": cc_site, "uc-site": sites["uc-site"]}
    weights = {s: methods._chexnet_weights(t, MLC_CLASSES) for s, t in tables.items()}
    loss, _ = methods._validation(model, tables, settings, weights)
    unweighted, _ = methods._validation(model, tables, settings)

    total = known = 0.0  # by hand: w- x (w+/w- x y log p + (1 - y) log(1 - p)) over the known labels
    for t in tables.values():
        y = t[MLC_CLASSES].to_numpy(float)
        known_mask = ~np.isnan(y)
        pos = (np.nan_to_num(y) == 1).sum(0)
        neg = (np.nan_to_num(y, nan=1) == 0).sum(0)
        defined = (pos > 0) & (neg > 0)
        cw = np.where(defined, pos / np.maximum(pos + neg, 1), 1.0)
        pw = np.where(defined, neg / np.maximum(pos, 1), 1.0)
        p = 1 / (1 + np.exp(-_logits(model, t, settings).astype(float)))
        yy = np.nan_to_num(y)
        bce = -cw * (pw * yy * np.log(p) + (1 - yy) * np.log(1 - p))
        total, known = total + bce[known_mask].sum(), known + known_mask.sum()
    assert loss == pytest.approx(total / known, rel=1e-3)
    assert abs(loss - unweighted) > 1e-3


def test_without_a_cc_site_there_is_no_cc_auroc(sites):
    settings = FedFewBenchSettings(arch="densenet-tiny", image_size=32, data_image_size=32, mlc_batch_size=4)
    model = build_model(settings.model_config(), len(MLC_CLASSES))
    loss, cc_auroc = methods._validation(model, {"uc-site": sites["uc-site"]}, settings)
    assert cc_auroc is None and loss is not None and np.isfinite(loss)
