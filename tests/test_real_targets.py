"""Issue 41's targets for the real federation, judged on a hand-made result with known per-seed AUROCs."""

from __future__ import annotations

import numpy as np
import pytest
from cxrfl.bench.target_text import target_sentence
from cxrfl.bench.targets import evaluate_targets
from scipy import stats

NIH, KERMANY, HANNOVER = "nih1000", "kermany-pediatric", "hannover-mhh-covid"
CLASSES = {
    NIH: ["Atelectasis", "Pneumonia"],
    KERMANY: ["Pneumonia", "Bacterial Pneumonia", "Viral Pneumonia"],
    HANNOVER: ["COVID-19", "ICU admission"],  # every Hannover image is COVID-19: its AUROC is undefined there
}
SHARED = {NIH: ["Pneumonia"], KERMANY: ["Pneumonia"], HANNOVER: []}
NOISE = [0.010, -0.020, 0.000, 0.015, -0.005]  # one training seed's shift, the same for every class


def per_seed(base: dict[str, float], wobble: list[float]) -> list[dict[str, float | None]]:
    return [{c: None if c == "COVID-19" else v + w for c, v in base.items()} for w in wobble]


def cell(view: str, by_seed: list[dict[str, float | None]]) -> dict:
    classes = CLASSES[view]
    auroc = {c: None if by_seed[0][c] is None else float(np.mean([s[c] for s in by_seed])) for c in classes}
    defined = [c for c in classes if auroc[c] is not None]

    def mean(cs: list[str]) -> float | None:
        cs = [c for c in cs if c in defined]
        return float(np.mean([auroc[c] for c in cs])) if cs else None

    unique = [c for c in classes if c not in SHARED[view]]
    return {
        "auroc": auroc,
        "auroc_by_seed": by_seed,
        "model_knows": classes,
        "mean": mean(classes),
        "shared": {"mean": mean(SHARED[view])},
        "unique": {"mean": mean(unique)},
    }


def real_results(gain: dict[str, float], vanilla_unique: float = -0.05) -> tuple[dict, dict]:
    """A real-federation result: SA's AUROCs, each site's own model ``gain[site]`` below SA with a per-seed
    wobble, vanilla FL ``vanilla_unique`` away from SA on every class. Also returns each entry's per-seed
    AUROCs so that the tests compute their expectations from the raw numbers."""
    sa = {
        NIH: {"Atelectasis": 0.70, "Pneumonia": 0.66},
        KERMANY: {"Pneumonia": 0.92, "Bacterial Pneumonia": 0.80, "Viral Pneumonia": 0.72},
        HANNOVER: {"COVID-19": None, "ICU admission": 0.88},
    }
    raw: dict[str, dict[str, list]] = {"surgical-fedavg": {}, "vanilla-fedavg": {}}
    for v, base in sa.items():
        raw["surgical-fedavg"][v] = per_seed(base, NOISE)
        own_wobble = [-gain[v] + 0.004 * (s - 2) for s in range(5)]  # differences that vary: a defined t-test
        raw[f"individual:{v}"] = {v: per_seed(base, [n + w for n, w in zip(NOISE, own_wobble)])}
        raw["vanilla-fedavg"][v] = per_seed(base, [NOISE[s] + vanilla_unique + 0.003 * (-1) ** s for s in range(5)])
    methods = {
        name: {"label": name, "test": {v: cell(v, seeds) for v, seeds in by_view.items()}}
        for name, by_view in raw.items()
    }
    views = {v: {"kind": "site", "test": v, "classes": CLASSES[v], "shared": SHARED[v]} for v in CLASSES}
    return {"profile": "real", "reference": "surgical-fedavg", "views": views, "methods": methods}, raw


def seed_means(by_seed: list[dict[str, float | None]], classes: list[str]) -> list[float]:
    return [float(np.mean([s[c] for c in classes if s[c] is not None])) for s in by_seed]


def hand_holm(p: list[float]) -> list[float]:
    order = np.argsort(p)
    out, running = [0.0] * len(p), 0.0
    for i, k in enumerate(order):
        running = max(running, min(1.0, (len(p) - i) * p[k]))
        out[k] = running
    return out


def test_the_real_federations_targets_follow_the_issue_with_tests_over_seeds_and_holm():
    res, raw = real_results({NIH: 0.06, KERMANY: 0.002, HANNOVER: -0.01})
    targets = evaluate_targets(res)

    def by(start: str, view: str) -> dict:
        (found,) = [t for t in targets if t["target"].startswith(start) and t["view"] == view]
        return found

    own = by("Kermany's own model lear", KERMANY)
    # Kermany's own pneumonia AUROC: SA's 0.92 minus 0.002 on average (the wobble averages to zero)
    assert own["value"] == pytest.approx(0.918) and own["met"] is True and own["binding"]
    near = by("the federation's global ", KERMANY)
    assert near["difference"] == pytest.approx(0.002) and near["met"] is True
    # the seven comparisons' p-values from the raw per-seed AUROCs, then Holm by hand
    sa = raw["surgical-fedavg"]
    pairs = [(seed_means(sa[KERMANY], ["Pneumonia"]), seed_means(raw[f"individual:{KERMANY}"][KERMANY], ["Pneumonia"]))]
    pairs += [(seed_means(sa[v], CLASSES[v]), seed_means(raw[f"individual:{v}"][v], CLASSES[v])) for v in CLASSES]
    unique = {v: [c for c in CLASSES[v] if c not in SHARED[v]] for v in CLASSES}
    pairs += [(seed_means(sa[v], unique[v]), seed_means(raw["vanilla-fedavg"][v], unique[v])) for v in CLASSES]
    raw_p = [stats.ttest_rel(a, b).pvalue for a, b in pairs]
    adjusted = hand_holm(raw_p)
    judged = [near] + [by("the site gains from the f", v) for v in CLASSES]
    judged += [by("unique classes: SA at lea", v) for v in CLASSES]
    assert [t["seeds"]["p"] for t in judged] == pytest.approx(raw_p)
    assert [t["seeds"]["p_holm"] for t in judged] == pytest.approx(adjusted)
    gains = {v: by("the site gains from the f", v) for v in CLASSES}
    assert gains[NIH]["difference"] == pytest.approx(0.06) and gains[NIH]["met"] is True
    assert gains[KERMANY]["met"] is False and gains[HANNOVER]["met"] is False  # +0.002 not significant; -0.01 a loss
    # Hannover is judged on ICU admission alone: COVID-19 has no negatives in its test split
    assert gains[HANNOVER]["seeds"]["difference"] == pytest.approx(0.01 * -1)
    anyone = by("at least one real site g", "every site")
    assert anyone["met"] is True and f"`{NIH}` +0.060" in anyone["statement"]
    for v in CLASSES:
        versus = by("unique classes: SA at lea", v)
        # vanilla FL 0.05 below SA, then +0.003, -0.003, ... over the five seeds: 0.05 - 0.003 / 5
        assert versus["part"] == "unique" and versus["difference"] == pytest.approx(0.0494) and versus["met"] is True
        assert versus["old_rule"] is None  # vanilla FL never ran under another rule here
        assert target_sentence(versus, res["methods"]).startswith("unique classes: SA at least as high")
    assert "Holm-adjusted" in target_sentence(gains[NIH], res["methods"])


def test_no_site_gaining_is_said_with_the_gain_each_comparison_could_have_detected():
    res, _ = real_results({NIH: 0.001, KERMANY: 0.001, HANNOVER: 0.001})
    targets = evaluate_targets(res)
    anyone = next(t for t in targets if t["view"] == "every site")
    assert anyone["met"] is False
    for t in targets:
        if t["target"].startswith("the site gains"):
            s = t["seeds"]
            assert s["detectable"] > abs(t["difference"])  # five seeds cannot see a 0.001 gain
            assert (
                f"`{t['view']}` +0.001 (Holm p {s['p_holm']:.3g}, detectable with 80 % power {s['detectable']:.3g}"
                in (anyone["statement"])
            )
    assert "**NOT MET**" in target_sentence(anyone, res["methods"])


def test_the_unique_class_comparison_says_how_far_it_moved_from_the_old_selection_rule():
    res, _ = real_results({NIH: 0.06, KERMANY: 0.0, HANNOVER: 0.0}, vanilla_unique=-0.05)
    # under the old rule vanilla FL scored Bacterial 0.60 and Viral 0.50 on Kermany's test split (mean 0.55);
    # under the fair one 0.70 and 0.60 (0.65): SA - vanilla shrank by 0.10 from the old rule to the fair one
    res["selection_deltas"] = {
        "vanilla-fedavg": {
            "before_rule": "head",
            "seeds": [0, 1, 2, 3, 4],
            "mean_auroc": {
                KERMANY: {
                    "classes": {
                        "Pneumonia": {"before": 0.9, "after": 0.1},  # shared: not part of the unique classes
                        "Bacterial Pneumonia": {"before": 0.60, "after": 0.70},
                        "Viral Pneumonia": {"before": 0.50, "after": 0.60},
                    }
                }
            },
        }
    }
    by = {t["view"]: t for t in evaluate_targets(res) if t["target"].startswith("unique classes")}
    old = by[KERMANY]["old_rule"]
    assert old["rule"] == "head" and old["vanilla_before"] == pytest.approx(0.55)
    assert old["vanilla_after"] == pytest.approx(0.65) and old["difference_change"] == pytest.approx(-0.10)
    assert by[NIH]["old_rule"] is None  # no runs of the old rule on that test split
    assert "so the difference moved by -0.100" in target_sentence(by[KERMANY], res["methods"])


def test_other_profiles_keep_their_targets_and_the_real_one_is_binding():
    res, _ = real_results({NIH: 0.06, KERMANY: 0.0, HANNOVER: 0.0})
    assert all(t["binding"] for t in evaluate_targets(res))
    other = evaluate_targets({**res, "profile": "nih1000"})
    assert other and not any(t["binding"] for t in other)
    assert not any(t["target"].startswith("Kermany") for t in other)


def curve_run(seed: int, val_auroc: list[float], best_round: int) -> dict:
    return {"seed": seed, "curve_rounds": list(range(len(val_auroc))), "val_auroc": val_auroc, "best_round": best_round}


def test_a_comparison_whose_selection_gave_up_more_than_005_of_validation_auroc_is_not_a_result():
    res, _ = real_results({NIH: 0.06, KERMANY: 0.0, HANNOVER: 0.0}, vanilla_unique=-0.08)
    # vanilla FL's rule kept round 0 (0.52) while its validation AUROC later reached 0.74 and 0.70: it gave up
    # 0.22 and 0.20, 0.21 on average; SA's selection kept its best round in one seed and gave up 0.02 in the other
    res["methods"]["vanilla-fedavg"]["runs"] = [curve_run(0, [0.52, 0.6, 0.74], 0), curve_run(1, [0.5, 0.70, 0.6], 0)]
    res["methods"]["surgical-fedavg"]["runs"] = [curve_run(0, [0.6, 0.8, 0.78], 1), curve_run(1, [0.6, 0.8, 0.82], 1)]
    targets = evaluate_targets(res)
    versus = [t for t in targets if t["target"].startswith("unique classes")]
    assert len(versus) == 3
    for t in versus:
        assert t["selection_cost"] == {"vanilla-fedavg": pytest.approx(0.21)}
        assert t["rule_met"] is True and t["met"] is None  # SA 0.08 above: the numbers alone would meet it
        text = target_sentence(t, res["methods"])
        assert "**NOT A RESULT**" in text and "would say met" in text and "vanilla-fedavg 0.210" in text
    # the gains compare SA with the sites' own models, whose selections cost nothing here: still results
    gains = [t for t in targets if t["target"].startswith("the site gains")]
    assert all(t["selection_cost"] == {} for t in gains) and gains[0]["met"] is True
    # the same comparison is a result again once vanilla FL's rule gives up 0.05 or less
    res["methods"]["vanilla-fedavg"]["runs"] = [curve_run(0, [0.52, 0.6, 0.64], 2), curve_run(1, [0.5, 0.70, 0.65], 1)]
    again = [t for t in evaluate_targets(res) if t["target"].startswith("unique classes")]
    assert all(t["met"] is True and t["selection_cost"] == {} for t in again)
