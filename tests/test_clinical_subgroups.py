"""Subgroup audit (issue 45 point 4) from binned counts, against scikit-learn on the raw scores."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from cxrfl.clinical.counts import BinSpec, count_classes, count_request, count_scores, merge, split_name
from cxrfl.clinical.pooled import pooled_auroc
from cxrfl.clinical.pooling import PooledEvaluation, count_at_sites, pooled_report
from cxrfl.clinical.report import PooledRun, subgroup_table, write_clinical_report
from cxrfl.clinical.subgroups import GROUPS, memberships, subgroup_names, subgroup_report
from cxrfl.common.io import json_default
from cxrfl.errors import UpdateRejected
from sklearn.metrics import roc_auc_score

BINS = BinSpec()


def _table(n: int, rng: np.random.Generator) -> pd.DataFrame:
    sex = rng.choice(["F", "M", None], n, p=[0.45, 0.45, 0.1])
    age = rng.uniform(1, 95, n)
    age[rng.random(n) < 0.05] = np.nan
    view = rng.choice(["PA", "AP", "LL"], n)
    return pd.DataFrame({"sex": sex, "age": age, "view": view})


def test_memberships_follow_the_table_and_unknown_values_belong_to_no_group():
    t = pd.DataFrame(
        {"sex": ["F", "M", None, "F"], "age": [17.9, 18.0, np.nan, 80.0], "view": ["PA", "AP", "PA", None]}
    )
    m = memberships(t)
    assert m["sex=F"].tolist() == [True, False, False, True] and m["sex=M"].tolist() == [False, True, False, False]
    assert m["age=<18"].tolist() == [True, False, False, False] and m["age=18-39"].tolist() == [
        False,
        True,
        False,
        False,
    ]
    assert m["age=80+"].tolist() == [False, False, False, True]
    assert m["view=PA"].tolist() == [True, False, True, False] and not m["view=LL"].any()
    assert memberships(t[["sex"]]).keys() == {"sex=F", "sex=M"}  # a field the site lacks: no group
    assert split_name("Edema|sex=F") == ("Edema", "sex=F") and split_name("Edema") == ("Edema", None)


def test_a_site_counts_each_group_of_its_classes_and_nothing_below_the_minimum():
    rng = np.random.default_rng(0)
    n = 400
    table = _table(n, rng)
    labels = (rng.random((n, 2)) < 0.3).astype(float)
    labels[:20, 1] = np.nan
    scores = 1 / (1 + np.exp(-(labels * 1.5 + rng.normal(size=(n, 2)))))
    classes = ["Edema", "Mass"]
    targets = [*classes, *subgroup_names(["Edema"])]
    got = count_classes(
        scores, labels, classes, count_request(targets, {t: BINS for t in targets}, 5), groups=memberships(table)
    )
    assert set(got) == set(targets)  # Mass's subgroups were not asked
    groups = memberships(table)
    for g, rows in groups.items():
        want = count_scores(scores[rows, 0], labels[rows, 0], bins=BINS, min_cell=5)
        assert (got[f"Edema|{g}"] is None) == (want is None), g
        if want is not None:
            assert got[f"Edema|{g}"] == want.to_dict()
    # a site without ages sends nothing for the age groups
    no_age = count_classes(
        scores,
        labels,
        classes,
        count_request(targets, {t: BINS for t in targets}, 5),
        groups=memberships(table[["sex"]]),
    )
    assert all(no_age[f"Edema|age={g}"] is None for g in GROUPS["age"]) and no_age["Edema|sex=F"] is not None


def _site_counts(rng, n, shift_f, shift_m):
    table = _table(n, rng)
    y = (rng.random(n) < 0.4).astype(float)
    shift = np.where(table["sex"] == "F", shift_f, shift_m)
    s = 1 / (1 + np.exp(-(y * shift + rng.normal(size=n))))
    return table, y, s


def test_pooled_subgroups_equal_sklearn_on_the_pooled_scores_and_the_gap_shows_who_is_served_worse(tmp_path):
    rng = np.random.default_rng(1)
    sites = {name: _site_counts(rng, 600, 2.0, 0.5) for name in ("a", "b")}  # the model separates women better

    def send(wanted, bins):
        out = {}
        for site, targets in wanted.items():
            table, y, s = sites[site]
            counts = count_classes(
                s[:, None], y[:, None], ["Edema"], count_request(targets, bins, 10), groups=memberships(table)
            )
            out[site] = {"metrics": {"counts": counts}}
        return out

    settings = PooledEvaluation(min_cell=10, subgroups=True)
    evaluated = {"a": ["Edema"], "b": ["Edema"]}
    counts = count_at_sites(send, evaluated, settings, info=lambda m: None, warning=print)
    report = pooled_report(["Edema"], evaluated, counts, settings, lambda m: None)
    audit = report["subgroups"]["Edema"]
    table = pd.concat([sites[k][0] for k in "ab"], ignore_index=True)
    y = np.concatenate([sites[k][1] for k in "ab"])
    s = np.concatenate([sites[k][2] for k in "ab"])
    for g, rows in memberships(table).items():
        entry = audit["groups"][g]
        if entry is None:
            continue
        assert abs(entry["auroc"]["value"] - roc_auc_score(y[rows], s[rows])) <= 0.002, g
    gap = audit["largest_gap"]["sex"]
    assert (gap["higher"], gap["lower"]) == ("sex=F", "sex=M") and gap["low"] > 0  # the interval excludes 0
    f, m = (memberships(table)[k] for k in ("sex=F", "sex=M"))
    assert gap["value"] == pytest.approx(roc_auc_score(y[f], s[f]) - roc_auc_score(y[m], s[m]), abs=0.004)
    assert set(audit["largest_gap"]) == {"sex", "age", "view"}
    # the whole class is unchanged by the audit
    assert report["classes"]["Edema"]["auroc"]["value"] == pytest.approx(roc_auc_score(y, s), abs=0.002)
    # what the clinician reads: one row per class and field, the gap with its interval
    run = PooledRun(Path("evaluation.json"), report, "test", "a test", None)
    (row,) = [line for line in subgroup_table(run) if line.startswith("| Edema | sex |")]
    f_entry = audit["groups"]["sex=F"]["auroc"]
    assert f"F {f_entry['value']:.3f} ({f_entry['low']:.3f}-{f_entry['high']:.3f}), n {f_entry['n_pos']}/" in row
    assert row.endswith(f"| F - M: {gap['value']:+.3f} ({gap['low']:+.3f} to {gap['high']:+.3f}) |")
    # the clinician's files: the report and its forest plot of the gaps
    evaluation = tmp_path / "run" / "cxrfl" / "evaluation.json"
    evaluation.parent.mkdir(parents=True)
    evaluation.write_text(json.dumps({"split": "test", **report}, default=json_default))
    files = write_clinical_report(tmp_path / "run", tmp_path / "clinical")
    assert [f.name for f in files] == ["report.md", "roc.png", "reliability.png", "subgroup_gaps.png"]
    assert (
        files[-1].read_bytes().startswith(b"\x89PNG") and "![Subgroup gaps](subgroup_gaps.png)" in files[0].read_text()
    )


def test_a_site_answering_other_targets_than_asked_is_rejected_whole():
    from cxrfl.clinical.pooling import parse_counts

    c = count_scores(np.array([0.2, 0.8] * 10), np.array([0.0, 1.0] * 10), bins=BINS, min_cell=1)
    meta = {"metrics": {"counts": {"Edema": c.to_dict(), "Edema|sex=F": c.to_dict(), "Mass|sex=F": c.to_dict()}}}
    with pytest.raises(UpdateRejected, match="answered counts for"):
        parse_counts("a", meta, ["Edema", "Edema|sex=F"], {"Edema": BINS, "Edema|sex=F": BINS}, 1)


def test_subgroup_report_leaves_out_groups_without_counts():
    c = count_scores(np.array([0.2, 0.8] * 10), np.array([0.0, 1.0] * 10), bins=BINS, min_cell=1)
    report = subgroup_report(["Edema", "Mass"], {"Edema|sex=F": merge([c]), "Edema|sex=M": None})
    assert set(report) == {"Edema"} and report["Edema"]["groups"]["sex=M"] is None
    assert report["Edema"]["groups"]["sex=F"]["auroc"]["value"] == pooled_auroc(c).value == 1.0
    assert report["Edema"]["largest_gap"] == {}  # one group: no gap
