"""Cyclical weight transfer: the four optimizations against the paper's formulas, the relay, the sites."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from cwt_helpers import tiny_site
from cxrfl.common.io import params_digest
from cxrfl.cwt.config import BINARY_CLASS, CWTConfig, RelayConfig
from cxrfl.cwt.optimizations import (
    clr_rates,
    cwl_class_weights,
    cwl_loss_weights,
    default_local_steps,
    label_groups,
    label_warnings,
    lwms_sample_weights,
    plti_steps,
)
from cxrfl.cwt.relay import (
    Visit,
    load_optimizer_arrays,
    lr_factor,
    optimizer_arrays,
    relay_order,
    relay_plan,
    relay_sites,
    split_params,
)
from cxrfl.cwt.site import CWTSite, VisitSampler, binary_labels, global_classes, make_sites, pooled_loss
from cxrfl.errors import ConfigError
from cxrfl.nn.losses import masked_bce
from cxrfl.nn.models import ModelConfig, build_model
from cxrfl.nn.training import adam
from torch.optim.optimizer import register_optimizer_step_pre_hook

pytestmark = pytest.mark.usefixtures("one_thread")

MODEL = ModelConfig(arch="densenet-tiny", image_size=32)  # the network is not the subject here


# The paper's split 5 (Table 1), both labels: the most unequal sample sizes.
SPLIT5 = {"inst-1": 2880, "inst-2": 2026, "inst-3": 1174, "inst-4": 320}


# ------------------------------------------------------------------ PLTI
def test_plti_steps_are_proportional_to_training_size():
    # paper: iterations_i = s * n_i; with s = 1/b (b = 32) one cycle is one epoch over all data
    steps = plti_steps(SPLIT5, base_steps=6400 // (4 * 32))
    assert steps == {"inst-1": 90, "inst-2": 63, "inst-3": 37, "inst-4": 10}  # round(n_i / 32)
    assert sum(steps.values()) == 200  # = N / b: every image seen once per cycle
    assert default_local_steps(SPLIT5, 32) == 50  # vanilla: N / (k b) at every site, the same total


def test_plti_keeps_the_mean_and_handles_equal_and_empty_sites():
    steps = plti_steps({"a": 300, "b": 100}, base_steps=10)  # s = 10 * 2 / 400
    assert steps == {"a": 15, "b": 5}
    assert plti_steps({"a": 50, "b": 50, "c": 50}, base_steps=7) == {"a": 7, "b": 7, "c": 7}
    assert plti_steps({"a": 1000, "tiny": 1}, base_steps=2) == {"a": 4, "tiny": 1}  # at least one step
    assert plti_steps({"a": 10, "none": 0}, base_steps=3)["none"] == 0
    with pytest.raises(ValueError):
        plti_steps({"a": -1}, 3)


# ------------------------------------------------------------------- CLR
def test_clr_rate_is_proportional_to_size_and_averages_to_the_global_rate():
    lr = 0.0015  # the paper's CXR rate
    rates = clr_rates(SPLIT5, lr)
    for site, n in SPLIT5.items():
        assert rates[site] == pytest.approx(lr * 4 * n / 6400)  # lr_i = lr * k * n_i / N
    assert np.mean(list(rates.values())) == pytest.approx(lr)
    assert rates["inst-1"] / rates["inst-4"] == pytest.approx(2880 / 320)
    assert clr_rates({"a": 100, "b": 100, "c": 100}, lr) == {"a": lr, "b": lr, "c": lr}  # exactly


def test_relay_plan_switches_plti_and_clr_independently():
    counts = {"a": 300, "b": 100}
    base = CWTConfig(batch_size=25, lr=1e-3)  # default local steps: 400 / (2 * 25) = 8
    assert relay_plan(counts, base) == {"a": Visit(8, 1e-3), "b": Visit(8, 1e-3)}
    assert relay_plan(counts, CWTConfig(batch_size=25, lr=1e-3, plti=True)) == {
        "a": Visit(12, 1e-3),
        "b": Visit(4, 1e-3),
    }
    clr = relay_plan(counts, CWTConfig(batch_size=25, lr=1e-3, clr=True))
    assert (clr["a"].steps, clr["b"].steps) == (8, 8)
    assert (clr["a"].lr, clr["b"].lr) == pytest.approx((1.5e-3, 0.5e-3))
    assert relay_plan(counts, CWTConfig(local_steps=3)) == {"a": Visit(3, 1e-3), "b": Visit(3, 1e-3)}
    assert "empty" not in relay_plan({**counts, "empty": 0}, base)


# ------------------------------------------------------------------ LWMS
def test_lwms_weights_are_inverse_to_label_counts():
    y = np.array([1.0] * 90 + [0.0] * 10)  # paper: weight 1 / n_ij for an image of label j
    w = lwms_sample_weights(y)
    assert np.allclose(w[:90], 1 / (2 * 90)) and np.allclose(w[90:], 1 / (2 * 10))
    assert w.sum() == pytest.approx(1.0)
    assert w[y == 1].sum() == pytest.approx(0.5) and w[y == 0].sum() == pytest.approx(0.5)


def test_lwms_minibatches_are_label_balanced_over_many_draws():
    y = np.array([1.0] * 95 + [0.0] * 5)
    sampler = VisitSampler(len(y), lwms_sample_weights(y))
    batch, shares = 32, []
    for visit in range(300):
        sampler.start_visit(batch, seed=visit)
        idx = list(sampler)
        assert len(idx) == batch
        shares.append(y[idx].mean())
    assert np.mean(shares) == pytest.approx(0.5, abs=0.015)  # 9,600 draws: SD of the mean about 0.005
    plain = VisitSampler(len(y))
    plain.start_visit(100 * batch, seed=0)
    assert y[list(plain)].mean() == pytest.approx(0.95)  # without LWMS: the local share, every image equally
    # also usable with torch's own sampler
    torch_sampler = torch.utils.data.WeightedRandomSampler(
        lwms_sample_weights(y), 20000, generator=torch.Generator().manual_seed(0)
    )
    assert y[list(torch_sampler)].mean() == pytest.approx(0.5, abs=0.02)


def test_lwms_multilabel_groups_each_image_by_its_rarest_positive_label():
    t = np.array([[1, 0, 0], [1, 1, 0], [1, 0, 0], [0, 0, 0], [0, 0, np.nan], [np.nan, np.nan, np.nan]], dtype=float)
    groups = label_groups(t)
    # positives per class: 3, 1, 0 -> image 1 counts for class 1 (rarer), images 3-4 for "no positive" (3)
    assert groups.tolist() == [0, 1, 0, 3, 3, -1]
    w = lwms_sample_weights(t)
    for g in (0, 1, 3):
        assert w[groups == g].sum() == pytest.approx(1 / 3)
    assert w[5] == 0  # no known label: never drawn


# ------------------------------------------------------------------- CWL
def test_cwl_weights_are_inverse_to_the_local_label_share():
    w_pos, w_neg = cwl_class_weights([90, 50, 10], [100, 100, 40])
    p = np.array([0.9, 0.5, 0.25])  # paper: weight of label j inversely proportional to p_ij (times 1/L, L = 2)
    assert np.allclose(w_pos, 1 / (2 * p)) and np.allclose(w_neg, 1 / (2 * (1 - p)))
    assert (w_pos[1], w_neg[1]) == (1.0, 1.0)  # balanced site: the plain loss
    # the mean weight over the site's images is 1
    assert (90 * w_pos[0] + 10 * w_neg[0]) / 100 == pytest.approx(1.0)
    # one label only, or nothing known: unweighted
    w_pos, w_neg = cwl_class_weights([0, 7, 0], [5, 7, 0])
    assert w_pos.tolist() == [1.0, 1.0, 1.0] and w_neg.tolist() == [1.0, 1.0, 1.0]


def test_cwl_loss_equals_the_weighted_cross_entropy():
    torch.manual_seed(0)
    logits = torch.randn(8, 2)
    y = torch.tensor([[1, 0], [1, 1], [1, 0], [0, 1], [1, 0], [1, 1], [0, 0], [1, 0]], dtype=torch.float32)
    mask = torch.ones_like(y)
    pos_weight, class_weight = cwl_loss_weights([6, 3], [8, 8])
    w_pos, w_neg = cwl_class_weights([6, 3], [8, 8])
    p = torch.sigmoid(logits)
    expected = -(
        torch.as_tensor(w_pos, dtype=torch.float32) * y * torch.log(p)
        + torch.as_tensor(w_neg, dtype=torch.float32) * (1 - y) * torch.log(1 - p)
    ).mean()
    got = masked_bce(logits, y, mask, pos_weight=pos_weight, class_weight=class_weight)
    assert got.item() == pytest.approx(expected.item(), rel=1e-5)


# ------------------------------------------------------- single-label sites
def test_single_label_site_gets_a_clear_warning_for_lwms_and_cwl():
    msgs = label_warnings("hospital-x", [BINARY_CLASS], [0], [120], lwms=True, cwl=True)
    assert len(msgs) == 1
    assert "hospital-x" in msgs[0] and "only negative" in msgs[0] and "'Abnormal'" in msgs[0]
    assert "LWMS and CWL" in msgs[0]
    assert "LWMS" not in label_warnings("h", ["c"], [120], [120], lwms=False, cwl=True)[0]
    assert "only positive" in label_warnings("h", ["c"], [120], [120], lwms=False, cwl=True)[0]
    assert label_warnings("h", ["c"], [0], [120], lwms=False, cwl=False) == []
    assert label_warnings("h", ["c", "d"], [3, 0], [10, 0], lwms=True, cwl=True) == []  # 'd' not annotated: masked


# --------------------------------------------------------- relay and config
def test_relay_order_fixed_or_shuffled_reproducibly():
    sites = ["a", "b", "c", "d", "e"]
    assert relay_order(sites, 3, "fixed", 0) == sites
    orders = [relay_order(sites, c, "shuffled", 7) for c in range(1, 6)]
    assert all(sorted(o) == sites for o in orders)
    assert len({tuple(o) for o in orders}) > 1
    assert orders == [relay_order(sites, c, "shuffled", 7) for c in range(1, 6)]


def test_config_is_validated():
    assert CWTConfig(plti=True, cwl=True).method == "CWT+PLTI+CWL"
    assert CWTConfig.from_dict(CWTConfig(lwms=True).to_dict()) == CWTConfig(lwms=True)
    for bad in (
        {"task": "triage"},
        {"order": "random"},
        {"num_cycles": 0},
        {"lr": 0},
        {"plti": "yes"},
        {"local_steps": 0},
        {"optimizer_state": "keep"},
        {"lr_decay": 1.5},
        {"lr_decay": 0},
        {"lr_decay_every": 0},
        {"weight_decay": -1e-4},
    ):
        with pytest.raises(ConfigError):
            CWTConfig.from_dict(bad)
    with pytest.raises(ConfigError, match="unknown cwt setting"):
        CWTConfig.from_dict({"cycles": 3})
    with pytest.raises(ConfigError, match="cwt_relay.site_order must list distinct"):
        RelayConfig(site_order=("a", "b", "a"))
    with pytest.raises(ConfigError, match="cwt_relay.min_sites"):
        RelayConfig(min_sites=0)


def test_relay_sites_follow_site_order_then_names():
    assert relay_sites(["c", "a", "b"], None) == ["a", "b", "c"]
    assert relay_sites(["c", "a", "b", "d"], ["d", "b"]) == ["d", "b", "a", "c"]
    assert relay_sites(["a", "b"], ["x", "b"]) == ["b", "a"]  # a listed site that is absent is ignored


# ----------------------------------------------------- the paper's base recipe
def test_base_recipe_defaults_are_the_papers():
    # "an exponential learning rate decay with a decay rate of 0.99 every 200 training iterations",
    # "cross-entropy loss with an L2 regularization coefficient of 0.0001"
    cfg = CWTConfig()
    assert (cfg.lr_decay, cfg.lr_decay_every, cfg.weight_decay) == (0.99, 200, 1e-4)
    assert [lr_factor(t, cfg) for t in (0, 199, 200, 399, 400, 1000)] == pytest.approx(
        [1.0, 1.0, 0.99, 0.99, 0.99**2, 0.99**5]
    )
    assert lr_factor(10_000, CWTConfig(lr_decay=1.0)) == 1.0


def test_decay_goes_on_across_visits_and_multiplies_the_clr_rate(tmp_path):
    cfg = CWTConfig(lr=1e-2, lr_decay=0.5, lr_decay_every=2, clr=True, batch_size=2, augment=False)
    splits = ["train"] * 4 + ["val"] * 2
    site = CWTSite(tiny_site(tmp_path, "s", {"Mass": [1, 0, 1, 0, 1, 0]}, splits), cfg, MODEL)
    model = build_model(MODEL, 1)
    seen = []
    handle = register_optimizer_step_pre_hook(
        lambda opt, *_: seen.append((opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"]))
    )
    try:
        # first visit: CLR rate 1.5e-2 from iteration 0; second: CLR rate 0.5e-2 from iteration 3 (3 steps done)
        first = site.train_visit(model, adam(model, 1.0, cfg.weight_decay), Visit(3, 1.5e-2, iteration=0), cycle=1)
        second = site.train_visit(model, adam(model, 1.0, cfg.weight_decay), Visit(3, 0.5e-2, iteration=3), cycle=1)
    finally:
        handle.remove()
    # rate of iteration t: site rate * 0.5 ** (t // 2)
    expected = [1.5e-2, 1.5e-2, 1.5e-2 * 0.5] + [0.5e-2 * 0.5, 0.5e-2 * 0.25, 0.5e-2 * 0.25]
    assert [lr for lr, _ in seen] == pytest.approx(expected)
    assert {wd for _, wd in seen} == {1e-4}  # the L2 coefficient reaches Adam
    assert (first["lr"], second["lr"]) == pytest.approx((1.5e-2, 0.25e-2))  # the rate of each visit's first step
    assert (first["iteration"], second["iteration"]) == (0, 3)


def test_binary_label_is_any_finding_vs_no_finding():
    table = pd.DataFrame({"a": [1.0, 0.0, 0.0, np.nan, np.nan], "b": [0.0, 1.0, 0.0, 0.0, 1.0]})
    assert binary_labels(table, ["a", "b"]).tolist()[:3] == [1.0, 1.0, 0.0]
    out = binary_labels(table, ["a", "b"])
    assert math.isnan(out[3]) and out[4] == 1.0
    assert global_classes("binary", {"s": ["a"]}) == [BINARY_CLASS]
    assert global_classes("multilabel", {"s1": ["b", "a"], "s2": ["c", "a"]}) == ["a", "b", "c"]


def test_pooled_loss_is_the_loss_over_the_union():
    assert pooled_loss([(1.0, 10), (4.0, 30)]) == pytest.approx(3.25)
    assert pooled_loss([(1.0, 10), (math.nan, 5), (2.0, 0)]) == 1.0
    assert math.isnan(pooled_loss([]))


def test_optimizer_state_travels_exactly():
    torch.manual_seed(0)
    model = build_model(MODEL, 1)
    opt = adam(model, 1e-3)
    model(torch.randn(2, 3, 32, 32)).sum().backward()
    opt.step()
    arrays = optimizer_arrays(opt)
    weights, opt_part = split_params({**{k: v.numpy() for k, v in model.state_dict().items()}, **arrays})
    assert opt_part.keys() == arrays.keys() and not any(k.startswith("__") for k in weights)
    other = adam(model, 5e-4)
    load_optimizer_arrays(other, arrays)
    assert params_digest(optimizer_arrays(other)) == params_digest(arrays)
    assert other.param_groups[0]["lr"] == 5e-4  # the visit's rate is kept


# -------------------------------------------------------------- sites (tiny images)
@pytest.fixture
def two_sites(tmp_path):
    splits = ["train"] * 6 + ["val"] * 2 + ["test"] * 2
    a = tiny_site(
        tmp_path, "site-a", {"Effusion": [1, 0, 0, 1, 0, 0, 1, 0, 1, 0], "Mass": [0, 0, 1, 0, 0, 1, 0, 1, 0, 1]}, splits
    )
    b = tiny_site(
        tmp_path, "site-b", {"Mass": [1, 1, 0, 0, 0, 0, 1, 0, 0, 1], "Nodule": [0, 1, 0, 0, 1, 0, 0, 1, 1, 0]}, splits
    )
    return a, b


def test_multilabel_sites_share_a_masked_union_head(two_sites):
    cfg = CWTConfig(task="multilabel", batch_size=4, local_steps=1, optimizer_state="reset", augment=False)
    sites = make_sites(two_sites, cfg, MODEL)
    assert sites[0].classes == sites[1].classes == ["Effusion", "Mass", "Nodule"]
    assert sites[0].counts() == {"n_train": 6, "n_val": 2, "classes": ["Effusion", "Mass"]}
    assert sites[0].known.tolist() == [6, 6, 0]  # site-a does not annotate Nodule: masked
    torch.manual_seed(0)
    model = build_model(MODEL, 3)
    before = model.classifier.weight.detach().clone()
    sites[0].train_visit(model, adam(model, 1e-2), Visit(1, 1e-2), cycle=1)
    after = model.classifier.weight.detach()
    assert torch.equal(before[2], after[2])  # the masked class's row gets no gradient at site-a
    assert not torch.equal(before[0], after[0]) and not torch.equal(before[1], after[1])
    binary = make_sites(two_sites, CWTConfig(batch_size=4), MODEL)
    assert binary[0].classes == [BINARY_CLASS] and binary[0].counts() == {"n_train": 6, "n_val": 2}


def test_single_label_site_warns_and_still_trains(tmp_path):
    splits = ["train"] * 4 + ["val"] * 2
    only_normal = tiny_site(tmp_path, "only-normal", {"Mass": [0, 0, 0, 0, 1, 0]}, splits)
    site = CWTSite(only_normal, CWTConfig(lwms=True, cwl=True, batch_size=2, augment=False), MODEL)
    assert len(site.warnings) == 1 and "only negative" in site.warnings[0]
    assert np.allclose(site.sample_weights, 0.25)  # one label present: every image equally
    assert site.loss_weights[0].tolist() == [1.0] and site.loss_weights[1].tolist() == [1.0]
    model = build_model(MODEL, 1)
    out = site.train_visit(model, adam(model, 1e-3), Visit(1, 1e-3), cycle=1)
    assert out["steps"] == 1 and math.isfinite(out["train_loss"])


def test_the_cwt_job_exposes_every_optimization(repo_root):
    import inspect
    import json

    from cxrfl.fl.cwt import CyclicWeightTransfer

    server = json.loads((repo_root / "jobs" / "cwt" / "app" / "config" / "config_fed_server.json").read_text())
    workflow = server["workflows"][0]
    assert workflow["path"] == "cxrfl.fl.cwt.CyclicWeightTransfer"
    cwt = workflow["args"]["cwt_config"]
    assert {
        "plti",
        "clr",
        "lwms",
        "cwl",
        "order",
        "task",
        "patience",
        "lr_decay",
        "lr_decay_every",
        "weight_decay",
    } <= set(cwt)
    assert CWTConfig.from_dict(cwt).task == "binary"
    inspect.signature(CyclicWeightTransfer).bind(**workflow["args"])  # every exported argument is accepted
    assert {"min_sites", "min_sites_timeout", "retry_pause", "resume_from"} <= set(workflow["args"])
    client = json.loads((repo_root / "jobs" / "cwt" / "app" / "config" / "config_fed_client.json").read_text())
    assert client["executors"][0]["tasks"] == ["counts", "train", "validate"]
    assert client["executors"][0]["executor"]["path"] == "cxrfl.fl.cwt.CWTExecutor"


def test_the_nvflare_glue_runs_the_relay_server_and_the_site_host(two_sites, tmp_path):
    from cxrfl.cwt.host import CWTSiteHost
    from cxrfl.cwt.server import CWTServer
    from cxrfl.fl.cwt import CWTExecutor, CyclicWeightTransfer

    ctl = CyclicWeightTransfer(
        cwt_config={"plti": True}, site_order=["b", "a"], min_sites=2, retry_pause=1.5, resume_from="job-1"
    )
    server = ctl.make_server(send=lambda task, payloads: {}, sites=["a", "b"], out_dir=tmp_path, run_id="job-2")
    assert isinstance(server, CWTServer) and server.config.plti and server.resume_from == "job-1"
    assert server.relay == RelayConfig(site_order=("b", "a"), min_sites=2, retry_pause=1.5)
    with pytest.raises(ConfigError, match="site_order must list distinct site names"):
        CyclicWeightTransfer(site_order=["a", "a"])
    executor = CWTExecutor(num_workers=0)
    host = executor.make_host(two_sites[0], torch.device("cpu"), tmp_path)
    assert isinstance(host, CWTSiteHost) and host.tasks == ("counts", "train", "validate")
