"""The comparison's statistics against scipy and hand-computed numbers; the targets and the method
selection on hand-made results; the FedBN+ and learning-rate rules of the surgical settings."""

from __future__ import annotations

import math

import numpy as np
import pytest
from cxrfl.bench.ablation_report import format_ablation
from cxrfl.bench.intervals import mean_ci, paired_comparison
from cxrfl.bench.methods import DEFAULT_METHODS, select
from cxrfl.bench.report import stars
from cxrfl.bench.statistics import View, ablation_summary, compare_cells, versus, view_cell
from cxrfl.bench.targets import evaluate_targets
from cxrfl.errors import ConfigError
from cxrfl.nn.models import ModelConfig
from cxrfl.nn.training import TrainConfig
from cxrfl.surgical.config import SurgicalConfig
from scipy import stats

A = {"c1": 0.8, "c2": 0.7, "c3": 0.75, "c4": 0.6}
B = {"c1": 0.7, "c2": 0.5, "c3": 0.45, "c4": 0.6}  # differences 0.1, 0.2, 0.3, 0.0


def test_paired_comparison_matches_scipy_and_hand_computed_effect_sizes():
    got = paired_comparison(A, B)
    x, y = np.array(list(A.values())), np.array(list(B.values()))
    t = stats.ttest_rel(x, y)
    assert got["n"] == 4 and got["keys"] == ["c1", "c2", "c3", "c4"]
    assert got["difference"] == pytest.approx(0.15)
    sd = math.sqrt((0.05**2 + 0.05**2 + 0.15**2 + 0.15**2) / 3)  # sample SD of 0.1, 0.2, 0.3, 0.0
    assert got["sd"] == pytest.approx(sd) and got["d_z"] == pytest.approx(0.15 / sd)
    assert got["t"] == pytest.approx(t.statistic) and got["p"] == pytest.approx(t.pvalue)
    half = stats.t.ppf(0.975, 3) * sd / 2  # t-interval of the mean difference, n = 4
    assert got["ci"] == pytest.approx((0.15 - half, 0.15 + half))
    # Wilcoxon signed-rank: the zero difference is dropped; ranks 1, 2, 3 all positive -> exact p = 2/8
    assert got["wilcoxon_p"] == pytest.approx(0.25) == pytest.approx(stats.wilcoxon(x, y).pvalue)
    assert got["shapiro_p"] == pytest.approx(stats.shapiro(x - y).pvalue)


def test_paired_comparison_edge_cases():
    one = paired_comparison({"a": 0.8, "b": None}, {"a": 0.7, "b": 0.6, "c": 0.5})
    assert one["n"] == 1 and one["keys"] == ["a"] and one["difference"] == pytest.approx(0.1)
    assert one["p"] is one["ci"] is one["d_z"] is one["shapiro_p"] is None
    equal = paired_comparison({"a": 0.8, "b": 0.6}, {"a": 0.8, "b": 0.6})
    assert equal["difference"] == 0 and equal["p"] is None and equal["wilcoxon_p"] is None and equal["sd"] == 0
    shifted = paired_comparison({0: 0.8, 1: 0.7}, {0: 0.7, 1: 0.6})  # the same difference twice: no t-test
    assert shifted["difference"] == pytest.approx(0.1) and shifted["p"] is None and shifted["d_z"] is None
    assert paired_comparison({}, {})["difference"] is None


def test_mean_ci_is_the_student_t_interval():
    got = mean_ci([0.70, 0.72, 0.71, None])
    assert got["n"] == 3 and got["mean"] == pytest.approx(0.71) and got["sd"] == pytest.approx(0.01)
    half = stats.t.ppf(0.975, 2) * 0.01 / math.sqrt(3)
    assert got["ci"] == pytest.approx((0.71 - half, 0.71 + half))
    assert mean_ci([0.5]) == {"mean": 0.5, "sd": None, "n": 1, "ci": None}
    assert mean_ci([0.5, 0.5])["ci"] == (0.5, 0.5) and mean_ci([])["mean"] is None


def cell(by_seed: list[dict[str, float | None]], knows: list[str]) -> dict:
    classes = list(by_seed[0])
    auroc = {
        c: None if any(s[c] is None for s in by_seed) else float(np.mean([s[c] for s in by_seed])) for c in classes
    }
    return {"auroc": auroc, "auroc_by_seed": by_seed, "model_knows": knows}


def test_compare_cells_pairs_classes_over_seed_means_and_seeds_over_class_means():
    a = cell([{"x": 0.9, "y": 0.7, "z": 0.8}, {"x": 0.7, "y": 0.7, "z": 0.6}], ["x", "y", "z"])
    b = cell([{"x": 0.6, "y": 0.6, "z": 0.7}, {"x": 0.6, "y": 0.5, "z": 0.6}], ["x", "y", "z"])
    got = compare_cells(a, b)
    # classes: seed-averaged AUROCs a = (0.8, 0.7, 0.7), b = (0.6, 0.55, 0.65): differences 0.2, 0.15, 0.05
    assert got["classes"]["difference"] == pytest.approx(0.4 / 3)
    assert got["classes"]["p"] == pytest.approx(stats.ttest_rel([0.8, 0.7, 0.7], [0.6, 0.55, 0.65]).pvalue)
    # seeds: per-seed means a = (0.8, 0.6667), b = (0.6333, 0.5667)
    assert got["seeds"]["keys"] == [0, 1] and got["seeds"]["difference"] == pytest.approx(
        ((0.8 - 1.9 / 3) + (2 / 3 - 1.7 / 3)) / 2
    )
    only_xy = compare_cells(a, b, ["x", "y"])
    assert only_xy["classes"]["keys"] == ["x", "y"] and only_xy["classes"]["difference"] == pytest.approx(0.175)
    lacks_z = cell([{"x": 0.5, "y": 0.5, "z": None}], ["x", "y"])
    assert compare_cells(a, lacks_z) is None  # its mean over x, y, z is not defined: no comparison
    assert compare_cells(a, lacks_z, ["x", "y"]) is not None


def test_versus_gives_reference_minus_method_on_all_shared_and_unique_classes():
    view = View("h", "h", ["x", "y", "z"], "h", "site", shared=["x"])
    ref = cell([{"x": 0.9, "y": 0.8, "z": 0.7}], ["x", "y", "z"])
    other = cell([{"x": 0.8, "y": 0.6, "z": 0.6}], ["x", "y", "z"])
    got = versus(other, ref, view)
    assert got["all"]["classes"]["difference"] == pytest.approx(0.4 / 3)
    assert got["shared"]["classes"]["keys"] == ["x"] and got["unique"]["classes"]["keys"] == ["y", "z"]
    assert got["unique"]["classes"]["difference"] == pytest.approx(0.15)


class NoScores:
    tests = {"h": type("T", (), {"classes": ["x", "y"]})()}

    def replicates(self, *args):
        return None


def test_view_cell_averages_over_seeds_and_marks_classes_the_model_lacks():
    view = View("h", "h", ["x", "y"], "h", "site", shared=["x"])
    records = [
        {"seed": 0, "models": {"*": ["x", "y"]}, "auroc": {"h": {"*": {"x": 0.8, "y": 0.6}}}},
        {"seed": 1, "models": {"*": ["x", "y"]}, "auroc": {"h": {"*": {"x": 0.6, "y": None}}}},
    ]
    got = view_cell("m", records, view, NoScores())
    assert got["auroc"] == {"x": pytest.approx(0.7), "y": None}  # undefined in one seed: undefined
    assert got["mean"] == pytest.approx(0.7) and got["mean_by_seed"] == [pytest.approx(0.7), pytest.approx(0.6)]
    assert got["mean_seed_ci"] == pytest.approx(mean_ci([0.7, 0.6])["ci"]) and got["ci"] == {"x": None, "y": None}
    lacking = [{"seed": 0, "models": {"*": ["x"]}, "auroc": {"h": {"*": {"x": 0.8}}}}]
    got = view_cell("m", lacking, view, NoScores())
    assert got["mean"] is None and got["unknown"] == ["y"] and got["shared"]["mean"] == pytest.approx(0.8)
    personal = [{"seed": 0, "models": {"other-site": ["x", "y"]}, "auroc": {"h": {}}}]
    assert view_cell("m", personal, view, NoScores())["mean"] is None  # no model of this method for the view


def results_for(profile: str, cells: dict[str, dict[str, dict]]) -> dict:
    views = {
        "h": {"kind": "site", "classes": ["c1", "c2", "c3"], "shared": ["c1"]},
        "ext": {"kind": "external", "classes": ["c1", "c2", "c3"], "shared": None},
    }
    methods = {name: {"label": name, "test": test} for name, test in cells.items()}
    return {"profile": profile, "reference": "surgical-fedavg", "views": views, "methods": methods}


def hand(values: list[float] | None, seeds: int = 2) -> dict:
    if values is None:
        return {
            "mean": None,
            "auroc": {"c1": None, "c2": None, "c3": None},
            "auroc_by_seed": [],
            "model_knows": [],
            "unique": {"mean": None},
            "shared": {"mean": None},
        }
    by_seed = [
        {c: v + (0.01 if s else -0.01) * (i + 1) for i, (c, v) in enumerate(zip(("c1", "c2", "c3"), values))}
        for s in range(seeds)
    ]
    c = cell(by_seed, ["c1", "c2", "c3"])
    c.update(
        mean=float(np.mean(values)),
        unique={"mean": float(np.mean(values[1:]))},
        shared={"mean": values[0]},
        mean_seed_ci=[0.0, 1.0],
    )
    return c


def test_targets_on_a_hand_made_result():
    res = results_for(
        "two-hospitals",
        {
            "surgical-fedavg": {"h": hand([0.80, 0.82, 0.78]), "ext": hand([0.75, 0.76, 0.74])},
            "individual:h": {"h": hand([0.81, 0.83, 0.79]), "ext": hand(None)},
            "centralized": {"h": hand([0.70, 0.71, 0.69]), "ext": hand([0.70, 0.69, 0.68])},
            "vanilla-fedavg": {"h": hand([0.80, 0.70, 0.72]), "ext": hand([0.70, 0.72, 0.66])},
            "partial-fedavg": {"h": hand([0.79, 0.85, 0.80]), "ext": hand([0.76, 0.77, 0.75])},
        },
    )
    by = {(t["target"][:15], t["method"], t["against"]): t for t in evaluate_targets(res)}
    learned = by[("the model learn", "individual:h", None)]
    assert learned["met"] is True and learned["value"] == pytest.approx(0.81)
    assert by[("the model learn", "centralized", None)]["met"] is False  # 0.70 < 0.72
    within = by[("site test split", "surgical-fedavg", "individual:h")]
    assert within["met"] is True and within["difference"] == pytest.approx(-0.01)  # within 0.02
    assert within["classes"]["difference"] == pytest.approx(-0.01) and within["seeds"]["n"] == 2
    unique = by[("unique classes:", "surgical-fedavg", "vanilla-fedavg")]
    assert unique["part"] == "unique" and unique["difference"] == pytest.approx(0.09)
    # 0.09 >= 0.05, but two unique classes with differences 0.12 and 0.06 give t-test p = 0.2: not met
    assert unique["classes"]["p"] == pytest.approx(stats.ttest_rel([0.82, 0.78], [0.70, 0.72]).pvalue)
    assert unique["met"] is False
    # Holm over the profile's comparisons: the smallest p times the family's size, and no adjusted p below its raw one
    compared = [t for t in evaluate_targets(res) if t["classes"] and t["classes"]["p"] is not None]
    smallest = min(compared, key=lambda t: t["classes"]["p"])["classes"]
    assert smallest["p_holm"] == pytest.approx(min(1.0, len(compared) * smallest["p"]))
    assert all(t["classes"]["p_holm"] >= t["classes"]["p"] for t in compared)
    # two classes cannot show a 0.09 difference: the detectable one is far larger (hence "not met")
    assert unique["classes"]["detectable"] > 0.5
    assert by[("unique classes:", "surgical-fedavg", "partial-fedavg")]["met"] is False  # below partial loss
    ext = {t["against"]: t for t in evaluate_targets(res) if t["view"] == "ext"}
    assert ext["centralized"]["met"] is True and ext["partial-fedavg"]["met"] is False
    assert ext["vanilla-fedavg"]["difference"] == pytest.approx(0.0566667, abs=1e-6)
    assert all(t["binding"] for t in evaluate_targets(res))
    assert not any(t["binding"] for t in evaluate_targets({**res, "profile": "nih1000"}))


def test_shared_profile_target_is_equality_with_fedavg():
    shared_views = results_for(
        "two-hospitals-shared",
        {
            "surgical-fedavg": {"h": hand([0.80, 0.82, 0.78]), "ext": hand([0.75, 0.76, 0.74])},
            "vanilla-fedavg": {"h": hand([0.80, 0.82, 0.78]), "ext": hand([0.70, 0.76, 0.74])},
        },
    )
    shared_views["views"]["h"]["shared"] = ["c1", "c2", "c3"]
    got = {t["view"]: t for t in evaluate_targets(shared_views)}
    assert got["h"]["met"] is True and got["h"]["difference"] == pytest.approx(0.0)
    assert got["ext"]["met"] is False and got["ext"]["difference"] == pytest.approx(0.05 / 3)
    assert stars(0.0005) == "***" and stars(0.004) == "**" and stars(0.04) == "*" and stars(0.2) == "ns"


def test_ablation_summary_pairs_settings_as_the_papers():
    def res(sa: list[float], other: list[float], fl_cost: float = 0.0) -> dict:
        def runs(cost: float) -> list[dict]:  # one run per seed, its selected round ``cost`` below its best
            return [{"curve_rounds": [0, 1], "val_auroc": [0.6, 0.6 + cost], "best_round": 0} for _ in sa]

        return {
            "views": {"nih-test": {"kind": "external"}},
            "methods": {
                "surgical-fedavg": {
                    "label": "SA",
                    "test": {"nih-test": {"mean": float(np.mean(sa)), "mean_by_seed": sa}},
                    "runs": runs(0.01),
                },
                "vanilla-fedavg": {
                    "label": "FL",
                    "test": {"nih-test": {"mean": float(np.mean(other)), "mean_by_seed": other, "vs_reference": None}},
                    "runs": runs(fl_cost),
                },
            },
        }

    runs = {
        "2": res([0.80, 0.82], [0.70, 0.74]),
        "4": res([0.78, 0.80], [0.72, 0.72]),
        "6": res([0.76, 0.78], [0.75, 0.73]),
        "10": res([0.75, 0.75], [0.70, 0.70], fl_cost=0.24),  # FL gave up 0.24 here: 0.06 over the settings
    }
    runs["4"]["selection_deltas"] = {  # vanilla FL's seed 0 trained again under the other rule
        "vanilla-fedavg": {
            "label": "FL",
            "before_rule": "head",
            "best_round": {"before": 2, "after": 6},
            "mean_auroc": {"nih-test": {"before": 0.70, "after": 0.72, "change": 0.02}},
        }
    }
    got = ablation_summary("sites", runs, "surgical-fedavg")
    vs = got["methods"]["vanilla-fedavg"]["vs_reference"]
    sa, fl = [0.81, 0.79, 0.77, 0.75], [0.72, 0.72, 0.74, 0.70]  # seed-averaged means per setting
    assert vs["settings"]["keys"] == ["10", "2", "4", "6"] and vs["settings"]["difference"] == pytest.approx(
        np.mean(sa) - np.mean(fl)
    )
    assert vs["settings"]["p"] == pytest.approx(stats.ttest_rel(sa, fl).pvalue)
    assert vs["setting_seeds"]["n"] == 8
    assert got["methods"]["vanilla-fedavg"]["by_value"]["2"]["over_seeds"]["mean"] == pytest.approx(0.72)
    text = format_ablation({**got, "profile": "synth-nih"})
    assert "| FL | 0.720 ± 0.028" in text and "smallest two-sided Wilcoxon p is 0.125" in text
    assert list(got["selection_deltas"]) == ["4"]  # the other settings set nothing aside
    assert "| 4 | FL (before: `head`) | nih-test | 0.7000 | 0.7200 | +0.0200 | 2.0 → 6.0 |" in text
    assert "## Selection rule" not in format_ablation({**got, "selection_deltas": {}, "profile": "synth-nih"})
    assert got["methods"]["vanilla-fedavg"]["by_value"]["10"]["selection_cost"] == pytest.approx(0.24)
    assert "| FL | 0.000 | 0.000 | 0.000 | 0.240 |" in text and "| SA | 0.010 | 0.010 | 0.010 | 0.010 |" in text
    assert "| FL (NOT A RESULT: selection gave up 0.060) | 0.060 |" in text  # its row of the effect table


# ------------------------------------------------------------------ method selection and settings rules
def test_default_methods_and_fedbn_plus_needs_a_pretrained_feature_extractor():
    assert [m.name for m in select(None)] == list(DEFAULT_METHODS)
    assert {"surgical-fedbn+", "vanilla-fedbn+", "partial-fedbn+"} <= {m.name for m in select(None, pretrained=True)}
    with pytest.raises(ConfigError, match="surgical-fedbn\\+ use FedBN\\+.*--pretrained"):
        select(["surgical-fedbn+"])
    fedbn = {m.name: m for m in select(["surgical-fedbn", "pfl-fedavg"])}
    assert fedbn["surgical-fedbn"].per_site_models and not fedbn["surgical-fedbn"].single_global_model
    assert fedbn["surgical-fedavg"].single_global_model  # the reference always runs


def test_surgical_config_refuses_fedbn_plus_from_scratch_and_warns_about_fine_tuning_rates():
    with pytest.raises(ConfigError, match=r"surgical.batchnorm 'fedbn\+' .* model_config.pretrained is null"):
        SurgicalConfig.from_dict({"batchnorm": "fedbn+", "model_config": {"pretrained": None}})
    assert SurgicalConfig(batchnorm="fedbn+", model_config=ModelConfig(pretrained="/weights.pt")).batchnorm == "fedbn+"
    scratch = SurgicalConfig(train_config=TrainConfig(lr=5e-5))
    assert "5e-05 is a fine-tuning rate" in scratch.rate_warning() and "use lr 0.001" in scratch.rate_warning()
    assert SurgicalConfig(train_config=TrainConfig(lr=1e-3)).rate_warning() is None
    assert (
        SurgicalConfig(train_config=TrainConfig(lr=5e-5), model_config=ModelConfig(pretrained="/w.pt")).rate_warning()
        is None
    )


def test_cli_settings_quick_preset_and_given_options():
    from cxrfl.bench.cli_compare import _compare_settings
    from cxrfl.bench.protocol import QUICK
    from cxrfl.cli import build_parser

    def settings(*argv: str):
        return _compare_settings(build_parser().parse_args(["bench", "compare", "--out", "x", *argv]))

    default = settings()
    assert (default.seeds, default.max_rounds, default.patience, default.steps, default.image_size) == (
        5,
        40,
        5,
        None,
        64,
    )
    assert (default.lr, default.batch_size, default.threads) == (1e-3, 32, None)
    quick = settings("--quick", "--seeds", "1", "--steps", "0")
    assert quick.seeds == 1 and quick.steps is None and quick.max_rounds == QUICK["max_rounds"]
    ablation = settings("--ablation", "sites", "--profile", "synth-nih", "--split", "0.6,0.1,0.3")
    assert ablation.seeds == 3 and ablation.split == (0.6, 0.1, 0.3)
    with pytest.raises(ConfigError, match="compare.patience must be >= 1"):
        settings("--patience", "0")


@pytest.mark.parametrize(("n", "alpha"), [(2, 0.05), (3, 0.05), (10, 0.05), (2, 0.005)])
def test_the_detectable_difference_is_found_with_80_percent_power(n, alpha):
    """(2, 0.005): a Holm family of 10 over 2 pairs; the difference is over 100 SDs (the sites ablation's
    4-site setting once stopped on it)."""
    from cxrfl.bench.intervals import detectable_difference

    d = detectable_difference(n, 0.05, alpha=alpha)
    rng = np.random.default_rng(n)
    x = rng.normal(d, 0.05, size=(40000, n))  # differences of that mean, sd 0.05
    t = x.mean(axis=1) / (x.std(axis=1, ddof=1) / np.sqrt(n))
    assert np.mean(np.abs(t) > stats.t.ppf(1 - alpha / 2, n - 1)) == pytest.approx(0.8, abs=0.01)
    assert detectable_difference(1, 0.05) is None and detectable_difference(n, 0.0) is None
