"""``cxrfl bench hostile`` (issue 40 point 6): the hostile site's attacks and the report, without training."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cxrfl.bench.hostile import CLAIMED, HostileBenchSettings, HostileHost, format_report, robust_effects, summarise
from cxrfl.errors import ConfigError


class Honest:
    """A site host that adds 1 to every float array it receives and reports 10 images."""

    tasks = ("train", "validate")

    def handle(self, task, params, meta):
        out = {k: v + 1 if v.dtype.kind == "f" else v for k, v in params.items()}
        out["classifier.weight"] = np.full((1, 2), 2.0, np.float32)  # a warm-up row (nothing received)
        return out, {"num_samples": 10, "metrics": {}}


RECEIVED = {"w": np.full(3, 5.0, np.float32), "n": np.array(7, np.int64), "bn.running_var": np.full(2, 1.0, np.float32)}


@pytest.mark.parametrize("attack, w, row", [("scale", 105.0, 200.0), ("sign", 4.0, -2.0)])
def test_scale_and_sign_act_on_the_update_not_on_the_weights(attack, w, row):
    out, meta = HostileHost(Honest(), attack).handle("train", dict(RECEIVED), {})
    torch.testing.assert_close(torch.as_tensor(out["w"]), torch.full((3,), w))  # 5 + factor * (6 - 5)
    torch.testing.assert_close(torch.as_tensor(out["classifier.weight"]), torch.full((1, 2), row))  # from zero
    assert out["n"] == 7 and out["n"].dtype == np.int64 and meta["num_samples"] == 10
    # running variances as trained (altered ones are negative and rejected: not an attack that counts)
    torch.testing.assert_close(torch.as_tensor(out["bn.running_var"]), torch.full((2,), 2.0))


def test_nan_and_count_attacks_and_other_tasks():
    out, _ = HostileHost(Honest(), "nan").handle("train", dict(RECEIVED), {})
    assert np.isnan(out["w"]).all() and out["n"] == 7
    out, meta = HostileHost(Honest(), "count").handle("train", dict(RECEIVED), {})
    assert meta["num_samples"] == CLAIMED and out["w"][0] == 6.0
    out, _ = HostileHost(Honest(), "nan").handle("validate", dict(RECEIVED), {})
    assert out["w"][0] == 6.0  # only train answers are altered


def test_settings_refuse_unknown_options_and_too_few_sites():
    with pytest.raises(ConfigError, match="unknown attack"):
        HostileBenchSettings(attacks=("scale", "boom"))
    with pytest.raises(ConfigError, match=r"bench.sites must be >= 3, got 2"):
        HostileBenchSettings(sites=2)


def test_report_compares_each_cell_with_the_honest_run_of_its_seed():
    settings = HostileBenchSettings(seeds=2, attacks=("none", "scale"), robust=("none", "clip"))
    runs = {}
    for seed, honest in ((0, 0.70), (1, 0.80)):
        for attack, robust, auroc, rejected in (
            ("none", "none", honest, 0),
            ("none", "clip", honest - 0.01, 0),
            ("scale", "none", 0.5, 0),
            ("scale", "clip", honest - 0.02, 1),
        ):
            runs[f"{attack}/{robust}/{seed}"] = {
                "attack": attack,
                "robust": robust,
                "seed": seed,
                "mean_auroc": auroc,
                "rejected": rejected,
            }
    results = {"settings": vars(settings), "profile": "p", "hostile": "site-1", "runs": runs}
    cells = summarise(results)
    assert cells["scale/none"]["change"] == pytest.approx(-0.25) and cells["scale/clip"]["rejected"] == 2
    assert cells["none/clip"]["change"] == pytest.approx(-0.01)
    report = format_report(results)
    assert "| scale | 0.500 (-0.250; 0 rejected) | 0.730 (-0.020; 2 rejected) |" in report


def test_a_run_the_attack_stops_is_recorded_and_scored_not_fatal(tmp_path, monkeypatch):
    # seen: a x100 update with no robust option made every site fail in round 2; RunStopped ended the benchmark
    import cxrfl.bench.hostile as hostile
    from cxrfl.common.server import RunStopped
    from cxrfl.nn.models import build_model, save_checkpoint

    def stopped_run(hosts, config, out_dir, **kw):
        (out_dir / "cxrfl").mkdir(parents=True)
        (out_dir / "cxrfl" / "rounds.jsonl").write_text('{"round": 1, "mean_val_loss": 0.3, "rejected": {}}\n')
        broken = build_model(config.model_config, 1).state_dict()
        broken["classifier.bias"][0] = float("nan")
        save_checkpoint(out_dir / "best_FL_global_model.pt", broken, classes=["x"], model_config=config.model_config)
        raise RunStopped("round 2 had fewer than min_clients=2 valid site results")

    monkeypatch.setattr(hostile, "run_surgical", stopped_run)
    monkeypatch.setattr(hostile, "make_hosts", lambda *a, **k: {"site-1": Honest()})
    data = type("Data", (), {"sites": [type("Site", (), {"site": "site-1"})()]})()
    settings = HostileBenchSettings(image_size=32, arch="densenet-tiny")  # the network is not the subject
    run = hostile._run_one(settings, data, {}, "scale", "none", 0, tmp_path, warmups=None)
    assert run["stopped"].startswith("round 2") and run["rounds"] == 1 and run["val_loss"] == [0.3]
    assert hostile._kept_model(tmp_path / "nothing") == (None, [])
    assert hostile.mean_auroc(None, [], {"ext": type("T", (), {"classes": ["a", "b"]})()}) == 0.5  # no model: no skill
    report = format_report(
        {
            "settings": vars(HostileBenchSettings(seeds=1, attacks=("scale",), robust=("none",))),
            "profile": "p",
            "hostile": "site-1",
            "runs": {"scale/none/0": {**run, "mean_auroc": 0.5}},
        }
    )
    assert "1 of 1 stopped" in report


def _runs(table):
    return {
        f"{attack}/{robust}/{seed}": {
            "attack": attack,
            "robust": robust,
            "seed": seed,
            "mean_auroc": auroc,
            "rejected": 0,
            "best_round": 3,
            "rounds": 6,
            "seconds": 60.0,
        }
        for (attack, robust), aurocs in table.items()
        for seed, auroc in enumerate(aurocs)
    }


def test_robust_options_are_compared_with_none_paired_by_seed_and_holm_adjusted():
    from scipy import stats

    table = {
        ("none", "none"): [0.70, 0.72, 0.68],
        ("none", "median"): [0.69, 0.70, 0.69],  # -0.01, -0.02, +0.01
        ("scale", "none"): [0.50, 0.49, 0.51],
        ("scale", "median"): [0.68, 0.65, 0.71],  # +0.18, +0.16, +0.20
    }
    settings = HostileBenchSettings(seeds=3, attacks=("none", "scale"), robust=("none", "median"))
    results = {"settings": vars(settings), "profile": "p", "hostile": "site-1", "runs": _runs(table)}
    effects = robust_effects(results)
    p_none = stats.ttest_rel([0.69, 0.70, 0.69], [0.70, 0.72, 0.68]).pvalue
    p_scale = stats.ttest_rel([0.68, 0.65, 0.71], [0.50, 0.49, 0.51]).pvalue
    assert p_scale < p_none
    assert effects["scale/median"]["difference"] == pytest.approx(0.18)
    assert effects["none/median"]["difference"] == pytest.approx(-0.02 / 3)
    # Holm by hand: the smaller p times 2; the larger times 1, never below the first
    assert effects["scale/median"]["holm_p"] == pytest.approx(2 * p_scale)
    assert effects["none/median"]["holm_p"] == pytest.approx(max(p_none, 2 * p_scale))
    assert effects["scale/median"]["detectable"] > 0
    report = format_report(results)
    assert "| scale | median | +0.180 (+0.180, +0.160, +0.200) | " in report
    assert "| none | median | 2 | 0.690 | 3 / 6 | 0 | 1.0 | ? |" in report  # every run, with its machine


def test_attacks_that_reach_the_model_run_for_every_seed_first_each_run_stamped(tmp_path, monkeypatch):
    # a benchmark resumed over sessions first decides the robust options (none, scale, sign), then repeats
    # the four-site runs of the attacks validation rejects (nan, count); each run records its machine
    import cxrfl.bench.hostile as hostile

    data = type("Data", (), {"profile": "p", "notes": [], "sites": [type("Site", (), {"site": "site-1"})()]})()
    monkeypatch.setattr(hostile, "load_profile", lambda *a, **k: (data, {}))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    order = []

    def run_one(settings, data, tests, attack, robust, seed, work, *, warmups):
        order.append((attack, robust, seed))
        return {"attack": attack, "robust": robust, "seed": seed, "mean_auroc": 0.6, "rejected": 0, "best_round": 1}

    monkeypatch.setattr(hostile, "_run_one", run_one)
    settings = HostileBenchSettings(seeds=2, attacks=("none", "nan", "sign"), robust=("none", "clip"))
    results = hostile.run_hostile(settings, tmp_path, log=lambda _: None)
    assert order == [
        *[(a, r, 0) for a in ("none", "sign") for r in ("none", "clip")],
        *[(a, r, 1) for a in ("none", "sign") for r in ("none", "clip")],
        ("nan", "none", 0),
        ("nan", "clip", 0),
        ("nan", "none", 1),
        ("nan", "clip", 1),
    ]
    assert all(run["machine"]["cpu_capability"] and run["code"]["commit"] for run in results["runs"].values())
    assert "| nan | clip | 1 | 0.600 | 1 / None |" in (tmp_path / "report.md").read_text()
