"""`cxrfl bench fedfew`'s output contract: results.json (every method's mean_cc_auroc, mean_uc_f1 and per-UC
metrics, per seed and over seeds; FedFew's stage diagnostics; the targets with paired statistics), report.md
and plots; each (method, seed) kept as it finishes, so an interrupted run goes on with what is missing. The
methods are stand-ins with hand-chosen numbers."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace

import pytest
import torch
from cxrfl.bench.fedfew import format_markdown
from cxrfl.bench.fedfew import run as bench_run
from cxrfl.bench.fedfew.methods import mean_uc_f1
from cxrfl.bench.fedfew.report import run_code_text, selection_curve, summarise
from cxrfl.bench.fedfew.seed import SeedRun, stage2_summary
from cxrfl.bench.fedfew.settings import FedFewBenchSettings
from cxrfl.bench.protocol import code_version
from cxrfl.bench.selection_cost import run_cost
from cxrfl.common.server import RECORDS_DIR
from cxrfl.errors import ConfigError
from cxrfl.synth.fedfew_profile import FEDFEW_UCS
from scipy.stats import ttest_1samp

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# per (method, seed) the F1 of Edema, Pneumonia, Hernia; mean UC F1: fedfew 0.4 and 0.5, mlc 0.2 and 0.25
F1 = {
    ("fedfew", 0): (0.2, 0.4, 0.6),
    ("fedfew", 1): (0.3, 0.5, 0.7),
    ("mlc", 0): (0.1, 0.2, 0.3),
    ("mlc", 1): (0.15, 0.25, 0.35),
    ("fedfew-lambda1", 0): (0.5, 0.5, 0.5),
    ("fedfew-lambda1", 1): (0.6, 0.6, 0.6),
}
F1[("fedfew-scorer", 0)] = (0.7, 0.7, 0.5)
F1[("fedfew-scorer", 1)] = (0.8, 0.7, 0.6)
# balanced accuracy of Edema, Pneumonia, Hernia: the paper's recipe flags nothing (0.5), the scorers find the UCs
BA = {
    ("fedfew", 0): (0.50, 0.50, 0.50),
    ("fedfew", 1): (0.50, 0.50, 0.50),
    ("mlc", 0): (0.55, 0.55, 0.55),
    ("mlc", 1): (0.55, 0.55, 0.55),
    ("fedfew-scorer", 0): (0.80, 0.78, 0.60),
    ("fedfew-scorer", 1): (0.85, 0.76, 0.62),
}
UC_AUROC = {("fedfew-scorer", 0): (0.90, 0.84, 0.70), ("fedfew-scorer", 1): (0.92, 0.85, 0.72)}
PROBE = {0: [(0, 0.55), (5, 0.65)], 1: [(0, 0.57), (5, 0.71)]}
AUROC = {
    ("fedfew", 0): 0.70,
    ("fedfew", 1): 0.74,
    ("mlc", 0): 0.60,
    ("mlc", 1): 0.66,
    ("fedfew-lambda1", 0): 0.71,
    ("fedfew-lambda1", 1): 0.73,
    ("fedfew-scorer", 0): 0.70,  # the same stage-2 model as fedfew
    ("fedfew-scorer", 1): 0.74,
}


class FakeSeedRun:
    """Stands in for :class:`cxrfl.bench.fedfew.seed.SeedRun`; fails on ``fail`` (method, seed)."""

    calls: list[tuple[str, int]] = []
    fail: tuple[str, int] | None = None

    def __init__(self, settings, seed, data, work, log):
        self.seed = seed

    def run(self, method):
        if (method, self.seed) == FakeSeedRun.fail:
            raise RuntimeError("killed")
        FakeSeedRun.calls.append((method, self.seed))
        bas = BA.get((method, self.seed), (0.5, 0.5, 0.5))
        aucs = UC_AUROC.get((method, self.seed), (0.55, 0.55, 0.55))
        uc = {
            u: {
                "accuracy": 0.5,
                "precision": f,
                "recall": f,
                "f1": f,
                "f1_flag_all": 2 / 3,
                "at_prevalence": {"prevalence": 0.09, "f1": f / 2},
                "auroc": auc,
                "balanced_accuracy": ba,
                "mcc": 2 * ba - 1,
                "flagged_positives": 0.8,
                "flagged_negatives": 0.1,
            }
            for u, f, ba, auc in zip(FEDFEW_UCS, F1[method, self.seed], bas, aucs)
        }
        run = {"mean_cc_auroc": AUROC[method, self.seed], "uc": uc, "seconds": 1.0}
        if method == "fedfew":
            run["ssl_probe"] = [{"round": r, "mean_auroc": a} for r, a in PROBE[self.seed]]
            run["test_energy"] = {
                u: {"energy_auroc": 0.9, "prototype_margin_auroc": 0.6 + 0.1 * self.seed} for u in FEDFEW_UCS
            }
            run["stage2"] = {"warm-up": {"rounds": 8 + self.seed, "best_round": 3, "best_val_loss": 0.3}}
        elif method == "fedfew-lambda1":
            run["test_energy"] = {
                u: {"energy_auroc": 0.8 + 0.1 * self.seed, "prototype_margin_auroc": 0.7} for u in FEDFEW_UCS
            }
            run["stage2"] = {
                "energy": {"rounds": 10, "best_round": 12, "best_val_loss": 0.3, "uc_energy_gap": 0.2 + 0.2 * self.seed}
            }
        else:  # the lowest loss at round 1 while the AUROC climbs to 0.75: the rule gives up 0.25
            run["training"] = {
                "rounds": 10,
                "best_round": 1,
                "val_loss": [0.3 + 0.01 * k for k in range(10)],
                "val_cc_auroc": [0.5, 0.6, 0.7, 0.75, 0.74, 0.73, 0.72, 0.71, 0.7, 0.7],
            }
        return mean_uc_f1(run)


@pytest.fixture()
def fake_methods(monkeypatch):
    monkeypatch.setattr(bench_run, "SeedRun", FakeSeedRun)
    monkeypatch.setattr(bench_run, "prepare_data", lambda settings, folder, seed: None)
    monkeypatch.setattr(bench_run, "site_counts", lambda data: {"cc-1": {"train": 10, "labelled": 8, "positives": {}}})
    FakeSeedRun.calls, FakeSeedRun.fail = [], None
    return FakeSeedRun


SETTINGS = FedFewBenchSettings(methods=("mlc", "fedfew", "fedfew-scorer"), jobs=1)


def _cauchy_p(t: float) -> float:
    """One-sided p of a paired t-test over two seeds: Student's t with 1 d.f. is Cauchy."""
    return 0.5 - math.atan(t) / math.pi


def test_results_report_and_plots_and_an_interrupted_run_goes_on(tmp_path, fake_methods):
    out = tmp_path / "out"
    fake_methods.fail = ("mlc", 1)
    with pytest.raises(RuntimeError, match="killed"):
        bench_run.run_fedfew_benchmark(out, 2, settings=SETTINGS, data_root=tmp_path / "data", log=lambda m: None)
    assert fake_methods.calls == [("fedfew", 0), ("fedfew-scorer", 0), ("mlc", 0), ("fedfew", 1), ("fedfew-scorer", 1)]
    kept = json.loads((out / "results.json").read_text())
    assert not kept["complete"] and set(kept["runs"]["mlc"]) == {"0"} and set(kept["runs"]["fedfew"]) == {"0", "1"}

    fake_methods.fail, fake_methods.calls = None, []
    result = bench_run.run_fedfew_benchmark(out, 2, settings=SETTINGS, data_root=tmp_path / "data", log=lambda m: None)
    assert fake_methods.calls == [("mlc", 1)]  # only what was missing
    saved = json.loads((out / "results.json").read_text())
    assert saved["complete"] and saved["runs"] == result["runs"]
    assert saved["data"]["1"] == {"cc-1": {"train": 10, "labelled": 8, "positives": {}}}
    run = saved["runs"]["fedfew"]["1"]
    assert run["mean_uc_f1"] == pytest.approx(0.5) and run["mean_cc_auroc"] == 0.74 and run["uc"]["Hernia"]["f1"] == 0.7
    ff = saved["summary"]["methods"]["fedfew"]
    assert ff["mean_uc_f1"]["mean"] == pytest.approx(0.45) and ff["mean_uc_f1"]["sd"] == pytest.approx(0.1 / 2**0.5)
    assert ff["mean_cc_auroc"]["mean"] == pytest.approx(0.72) and ff["uc"]["Edema"]["f1"]["mean"] == pytest.approx(0.25)
    assert saved["summary"]["methods"]["mlc"]["mean_uc_f1"]["mean"] == pytest.approx(0.225)
    t = saved["summary"]["targets"]
    assert t["paper_cc_auroc_at_least_0.7"]["met"]
    # Edema vs the paper's recipe: differences 0.30 and 0.35 (mean 0.325, SE 0.025); against the 0.20
    # margin t = 5. The Holm family: 3 UCs x (paper, MLC); one-sided t per comparison (SE 0.025 or 0.01):
    # Pneumonia vs paper 7, Hernia vs paper -9, Edema vs MLC 11, Pneumonia vs MLC 22, Hernia vs MLC 6
    ts = {"Edema vs fedfew": 5, "Pneumonia vs fedfew": 7, "Hernia vs fedfew": -9}
    ts |= {"Edema vs mlc": 11, "Pneumonia vs mlc": 22, "Hernia vs mlc": 6}
    ps = sorted((_cauchy_p(v), k) for k, v in ts.items())
    adjusted, running = {}, 0.0
    for i, (p, k) in enumerate(ps):  # Holm's step-down by hand
        running = max(running, (len(ps) - i) * p)
        adjusted[k] = min(1.0, running)
    gain = t["Edema_balanced_accuracy_0.2_above_paper"]
    st = gain["stats"]
    assert st["per_seed"] == pytest.approx([0.30, 0.35]) and st["sd"] == pytest.approx(0.025 * math.sqrt(2))
    assert st["p_one_sided"] == pytest.approx(_cauchy_p(5))
    assert st["p"] == pytest.approx(2 * _cauchy_p(0.325 / 0.025))  # two-sided against 0
    for key, comparison in t["comparisons"].items():
        assert comparison["p_holm"] == pytest.approx(adjusted[key]), key
    # the difference clears 0.20 but two seeds cannot make it significant after Holm: not met
    assert gain["difference"] == pytest.approx(0.325) and gain["p_holm"] > 0.05 and not gain["met"]
    assert t["Edema_auroc_at_least_0.85"]["met"] and not t["Pneumonia_auroc_at_least_0.85"]["met"]
    assert t["Pneumonia_balanced_accuracy_at_least_0.75"]["met"]
    assert not t["Hernia_balanced_accuracy_at_least_0.75"]["judged"]
    assert t["cc_auroc_within_0.01_of_paper"]["met"] and t["cc_auroc_within_0.01_of_paper"]["difference"] == 0
    assert "uc_f1_at_least_0.5" not in t  # gameable: flagging everything scores 0.667
    probe = ff["ssl_probe"]
    assert probe["0"]["mean"] == pytest.approx(0.56) and probe["5"]["mean"] == pytest.approx(0.68)
    assert ff["diagnostics"]["Hernia"]["prototype_margin_auroc"]["mean"] == pytest.approx(0.65)
    assert ff["stage2"]["warm-up"]["rounds"]["mean"] == pytest.approx(8.5)
    report = (out / "report.md").read_text()
    assert "| FedFew, UC scorers* | 0.91 ± 0.01 / 0.82 ± 0.04 / 0.65 ± 0.07 |" in report
    assert "| FedFew w/ EBM | 0.25 ± 0.07 (0.67 ± 0.00) / 0.12 ± 0.04 |" in report  # F1, flagging all, at 9 %
    assert "| 0.720 ± 0.028 |" in report and "| MLC w/o FSSL |" in report
    assert "- Edema balanced accuracy >= 0.2 above the paper's recipe: **not met** (+0.325 [95% CI" in report
    assert f"Holm-adjusted p = {adjusted['Edema vs fedfew']:.3g}" in report
    assert "- Hernia balanced accuracy >= 0.75: reported, not judged (0.610;" in report
    assert "| Hernia | 0.90 ± 0.00 | 0.65 ± 0.07 | 0.80 ± 0.00 | 0.10 ± 0.00 | 0.65 ± 0.07 |" in report
    assert "| probe AUROC | 0.560 ± 0.014 | 0.680 ± 0.042 |" in report
    assert (
        "FedFew stage 2: warm-up 8.5 ± 0.7 round(s) (best: stage-2 round 3.0" in report
        and "MLC w/o FSSL 10.0 ± 0.0 round(s)" in report
    )
    assert saved["summary"]["methods"]["mlc"]["selection_cost"]["mean"] == pytest.approx(0.25)
    assert "| MLC w/o FSSL | 0.250 ± 0.000 (over the limit) |" in report
    assert "- Edema vs mlc (NOT A RESULT: selection gave up 0.250): " in report
    assert "NOT A RESULT: fedfew" not in report  # the fake FedFew runs recorded no curve
    assert saved["plots"] == ["uc_f1.png", "cc_auroc.png", "ssl_probe.png", "learning_curves.png"]
    assert "![learning curves](learning_curves.png)" in (out / "report.md").read_text()  # shown, not only named
    for name in saved["plots"]:
        assert (out / name).read_bytes().startswith(PNG_MAGIC)


def test_results_name_the_code_and_machine_that_ran_and_results_written_before_still_read(tmp_path, fake_methods):
    out = tmp_path / "out"
    bench_run.run_fedfew_benchmark(out, 1, settings=SETTINGS, data_root=tmp_path / "data", log=lambda m: None)
    saved = json.loads((out / "results.json").read_text())
    code = code_version()
    assert saved["code"] == code and len(code["commit"]) == 40
    m = saved["machine"]
    assert m["cores"] == os.cpu_count() and m["device"] == "cpu" and m["torch"] == torch.__version__
    assert len(m["load_average"]) == 3
    assert (
        f"load average {', '.join(f'{x:.1f}' for x in m['load_average'])} at the start."
        in (out / "report.md").read_text()
    )
    named = f"`{code['commit'][:7]}`" + (" with uncommitted changes" if code["dirty"] else "")
    assert f"Commit: {named}. Machine: {os.cpu_count()} CPU cores, " in (out / "report.md").read_text()
    # each run names its code too (a benchmark's runs may span commits); runs written before do not
    runs = {p.stem: json.loads(p.read_text()) for p in (out / "runs" / "seed0").glob("*.json") if p.stem != "data"}
    assert runs and all(r["code"] == code for r in runs.values())
    assert f"Runs by code: {named}: mlc (0), fedfew (0), fedfew-scorer (0)." in (out / "report.md").read_text()
    mixed = {"fedfew": {"0": {}, "1": {"code": {"commit": "a" * 40, "dirty": False}}}, "mlc": {"1": {"code": code}}}
    assert (
        run_code_text(mixed) == f"Runs by code: {named}: mlc (1); `aaaaaaa`: fedfew (1); 1 earlier run(s) record none."
    )
    assert run_code_text({"fedfew": {"0": {}}}) == ""
    # results.json as the benchmark wrote it before 2026-11-25
    old = {
        **{k: v for k, v in saved.items() if k != "code"},
        "commit": "`6b96718`",
        "machine": {"cpus": 2, "cuda": False, "load_average_at_start": 0.27},
    }
    report = format_markdown(old)
    assert "Commit: `6b96718`. Machine: 2 CPU cores, " in report and "no GPU" in report
    assert "load average 0.3 at the start." in report


def test_other_settings_are_refused_or_start_over(tmp_path, fake_methods):
    out = tmp_path / "out"
    bench_run.run_fedfew_benchmark(out, 1, settings=SETTINGS, data_root=tmp_path / "data", log=lambda m: None)
    other = FedFewBenchSettings(methods=("mlc", "fedfew"), jobs=1, mlc_rounds=1)
    with pytest.raises(ConfigError, match="holds runs of other settings.*--no-resume"):
        bench_run.run_fedfew_benchmark(out, 1, settings=other, data_root=tmp_path / "data", log=lambda m: None)
    fake_methods.calls = []
    bench_run.run_fedfew_benchmark(
        out, 1, settings=other, data_root=tmp_path / "data", log=lambda m: None, resume=False
    )
    assert fake_methods.calls == [("fedfew", 0), ("mlc", 0)]
    assert json.loads((out / "runs" / "settings.json").read_text())["mlc_rounds"] == 1


def test_a_variant_added_to_a_finished_benchmark_runs_alone_and_joins_its_report(tmp_path, fake_methods):
    out = tmp_path / "out"
    bench_run.run_fedfew_benchmark(out, 2, settings=SETTINGS, data_root=tmp_path / "data", log=lambda m: None)
    # a store written before the methods and jobs stopped counting (they were part of its settings.json)
    marker = out / "runs" / "settings.json"
    marker.write_text(json.dumps(SETTINGS.to_dict()))
    fake_methods.calls = []
    more = FedFewBenchSettings(methods=("fedfew-lambda1",), jobs=1)  # the stored methods are not named again
    result = bench_run.run_fedfew_benchmark(out, 2, settings=more, data_root=tmp_path / "data", log=lambda m: None)
    assert fake_methods.calls == [("fedfew-lambda1", 0), ("fedfew-lambda1", 1)]
    assert set(result["runs"]) == {"fedfew", "mlc", "fedfew-scorer", "fedfew-lambda1"} and result["complete"]
    table = result["summary"]["methods"]
    assert table["mlc"]["mean_uc_f1"]["mean"] == pytest.approx(0.225)  # the baseline stays in the report
    variant = table["fedfew-lambda1"]
    assert variant["label"] == "FedFew w/ EBM, lambda = 1*" and variant["mean_uc_f1"]["mean"] == pytest.approx(0.55)
    assert variant["stage2"]["energy"]["uc_energy_gap"]["mean"] == pytest.approx(0.3)
    report = (out / "report.md").read_text()
    assert (
        "| FedFew w/ EBM, lambda = 1* | 0.85 ± 0.07 | 0.85 ± 0.07 | 0.85 ± 0.07 | 0.30 ± 0.14 | 0.55 ± 0.07 "
        "| 0.720 ± 0.014 |"
    ) in report
    assert "| FedFew w/ EBM | 0.90 ± 0.00 | 0.90 ± 0.00 | 0.90 ± 0.00 | - | 0.45 ± 0.07 | 0.720 ± 0.028 |" in report
    assert "weighted by lambda = 1 instead of 0.1" in report
    assert "\\* FedFew w/ EBM, lambda = 1: labelled variants of stage 2" in report
    assert "jobs" not in json.loads(marker.read_text()) and "methods" not in json.loads(marker.read_text())


def test_methods_without_fedfew_run_alone_on_a_fresh_store(tmp_path, fake_methods):
    out = tmp_path / "out"
    only = FedFewBenchSettings(methods=("mlc",), jobs=1)  # a baseline that needs none of fedfew's stage files
    result = bench_run.run_fedfew_benchmark(out, 2, settings=only, data_root=tmp_path / "data", log=lambda m: None)
    assert fake_methods.calls == [("mlc", 0), ("mlc", 1)]
    assert set(result["runs"]) == {"mlc"} and result["complete"]
    assert result["summary"]["methods"]["mlc"]["mean_uc_f1"]["mean"] == pytest.approx(0.225)
    assert "| MLC w/o FSSL |" in (out / "report.md").read_text()


def test_only_seeds_run_now_and_the_results_keep_every_finished_seed(tmp_path, fake_methods):
    out, data = tmp_path / "out", tmp_path / "data"
    first = bench_run.run_fedfew_benchmark(out, 2, settings=SETTINGS, data_root=data, log=lambda m: None, only=[1])
    assert sorted(fake_methods.calls) == [("fedfew", 1), ("fedfew-scorer", 1), ("mlc", 1)]
    assert first["seeds_done"] == [1] and not first["complete"]
    interim = "**Interim**: the benchmark goes on, so no verdict below is final. Missing runs: mlc (0); fedfew (0); "
    assert interim + "fedfew-scorer (0)." in (out / "report.md").read_text()
    # the results written again from the stored runs, training nothing (seed 0 stays missing)
    (out / "results.json").unlink()
    fake_methods.calls = []
    again = bench_run.run_fedfew_benchmark(
        out, 2, settings=SETTINGS, data_root=data, log=lambda m: None, report_only=True
    )
    assert fake_methods.calls == [] and again["runs"] == first["runs"] and not again["complete"]
    assert (out / "results.json").is_file()
    with pytest.raises(ConfigError, match="--report-only reads the stored runs"):
        bench_run.run_fedfew_benchmark(out, 2, settings=SETTINGS, data_root=data, report_only=True, resume=False)
    fake_methods.calls = []
    done = bench_run.run_fedfew_benchmark(out, 2, settings=SETTINGS, data_root=data, log=lambda m: None)
    assert {seed for _, seed in fake_methods.calls} == {0}  # seed 1's runs are kept, not run again
    assert done["seeds_done"] == [0, 1] and done["complete"] and set(done["runs"]["mlc"]) == {"0", "1"}
    assert "Interim" not in (out / "report.md").read_text()
    with pytest.raises(ConfigError, match=r"--only-seeds \[2\] not among the seeds \[0, 1\]"):
        bench_run.run_fedfew_benchmark(out, 2, settings=SETTINGS, data_root=data, log=lambda m: None, only=[2])


def test_the_work_folder_is_kept_for_other_methods_and_emptied_for_other_settings(tmp_path):
    def kept(settings):
        SeedRun(settings, 0, None, tmp_path, lambda m: None)
        return (tmp_path / "seed0" / "stage.pt").is_file()

    SeedRun(SETTINGS, 0, None, tmp_path, lambda m: None)
    (tmp_path / "seed0" / "stage.pt").write_bytes(b"x")
    assert kept(FedFewBenchSettings(methods=("fedfew", "fedfew-neg-in"), jobs=2))
    (tmp_path / "seed0" / "settings.json").write_text(json.dumps(SETTINGS.to_dict(), sort_keys=True))  # an older marker
    assert kept(SETTINGS)
    stored = SETTINGS.to_dict()  # written before the ``uc_negatives`` option (default "none": the old behaviour)
    del stored["fedfew"]["uc_negatives"], stored["mlc_patience"], stored["arch"]  # and arch (DenseNet121)
    (tmp_path / "seed0" / "settings.json").write_text(json.dumps(stored))
    assert kept(SETTINGS)
    assert not kept(FedFewBenchSettings(fedfew={**SETTINGS.fedfew, "uc_negatives": "in"}))
    assert not kept(replace(SETTINGS, arch="densenet-tiny"))
    assert not kept(FedFewBenchSettings(methods=("mlc", "fedfew"), jobs=1, mlc_rounds=1))


def test_stage2_summary_reads_the_sites_training_energies_per_round(tmp_path):
    def site(**energies):
        return {f"train_energy_{k}": v for k, v in energies.items()}

    rounds = [
        {
            "stage": 2,
            "phase": "warm-up",
            "round": 1,
            "val_loss": 0.5,
            "site_validation": {"cc-1": {"cc_mean_auroc": 0.6}, "cc-2": {"cc_mean_auroc": 0.7}},
            "site_metrics": {"cc-1": site(**{"in": -2.0, "out": None, "uc_neg": None}), "cc-2": site(**{"in": -3.0})},
        },
        {
            "stage": 2,
            "phase": "energy",
            "round": 2,
            "val_loss": 0.4,
            "site_validation": {"cc-1": {"cc_mean_auroc": 0.8}, "cc-2": {"cc_mean_auroc": None}},
            "site_metrics": {
                "cc-1": site(**{"in": -2.5}),
                "uc-a": site(out=-1.0, uc_neg=-2.0),
                "uc-b": site(out=-2.0, uc_neg=-2.0),
            },
        },
        {
            "stage": 2,
            "phase": "energy",
            "round": 3,
            "val_loss": 0.45,
            "site_validation": {"cc-1": {"cc_mean_auroc": 0.9}, "cc-2": {"cc_mean_auroc": 0.92}},
            "site_metrics": {"uc-a": site(out=-0.5, uc_neg=-2.5)},
        },
        {"stage": 2, "phase": "energy", "round": 4, "status": "stopped"},
        {"stage": 3, "threshold": {}},
    ]
    (tmp_path / RECORDS_DIR).mkdir()
    (tmp_path / RECORDS_DIR / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rounds))
    phases = stage2_summary(tmp_path)
    assert phases["warm-up"] == {
        "rounds": 1,
        "best_round": 1,
        "best_val_loss": 0.5,
        "uc_energy_gap": None,
        "curve": [{"round": 1, "val_loss": 0.5, "val_cc_auroc": pytest.approx(0.65)}],
        "energy": [{"round": 1, "in": -2.5, "out": None, "uc_neg": None}],
    }
    energy = phases["energy"]
    assert (energy["rounds"], energy["best_round"], energy["best_val_loss"]) == (2, 2, 0.4)
    assert energy["energy"] == [
        {"round": 2, "in": -2.5, "out": -1.5, "uc_neg": -2.0},
        {"round": 3, "in": None, "out": -0.5, "uc_neg": -2.5},
    ]
    assert energy["uc_energy_gap"] == pytest.approx(0.5)  # at the kept round 2: -1.5 - (-2.0)
    assert [c["val_cc_auroc"] for c in energy["curve"]] == pytest.approx([0.8, 0.91])  # a site without: left out
    # the kept model is the energy phase's round 2 (0.8); the best round over stage 2 is round 3 (0.91)
    curve = selection_curve({"stage2": phases})
    assert curve is not None and (curve["curve_rounds"], curve["best_round"]) == ([1, 2, 3], 2)
    assert run_cost(curve) == pytest.approx(0.11)


def _hand_run(cc, ba, auroc=0.8):
    uc = {u: {"auroc": auroc, "balanced_accuracy": b} for u, b in zip(FEDFEW_UCS, ba)}
    return {"mean_cc_auroc": cc, "mean_uc_f1": 0.5, "uc": uc}


def test_a_post_hoc_design_is_judged_in_its_own_family_and_labelled_so_and_every_seed_is_listed():
    gains = {"Edema": (0.30, 0.32, 0.34), "Pneumonia": (0.21, 0.25, 0.22), "Hernia": (0.0, 0.05, 0.02)}
    runs = {
        "fedfew": {str(s): _hand_run(0.75, (0.5, 0.5, 0.5)) for s in range(3)},
        "fedfew-scorer": {str(s): _hand_run(0.75, (0.6, 0.6, 0.5)) for s in range(3)},
        "fedfew-prototype": {
            str(s): _hand_run(0.75, tuple(0.5 + gains[uc][s] for uc in FEDFEW_UCS), auroc=0.86) for s in range(3)
        },
    }
    summary = summarise(runs)
    post = summary["post_hoc"]["fedfew-prototype"]
    # its family is its own three comparisons with the paper's recipe (no baseline ran): Holm by hand
    p = {uc: ttest_1samp([g - 0.2 for g in gains[uc]], 0.0, alternative="greater").pvalue for uc in FEDFEW_UCS}
    order = sorted(FEDFEW_UCS, key=p.get)
    holm, running = {}, 0.0
    for i, uc in enumerate(order):
        running = max(running, min(1.0, (3 - i) * p[uc]))
        holm[uc] = running
    for uc in FEDFEW_UCS:
        got = post[f"{uc}_balanced_accuracy_0.2_above_paper"]
        assert got["p_holm"] == pytest.approx(holm[uc])
        assert got["met"] == (uc != "Hernia" and holm[uc] < 0.05) and got["judged"] == (uc != "Hernia")
    assert post["Edema_auroc_at_least_0.85"]["met"]
    # the pre-registered candidate's verdicts do not see it
    assert not any("prototype" in k for k in summary["targets"]["comparisons"])
    assert not summary["targets"]["Edema_balanced_accuracy_0.2_above_paper"]["met"]
    result = {
        "settings": FedFewBenchSettings().to_dict(),
        "machine": {"cores": 2},
        "command": "cxrfl bench fedfew",
        "seeds_done": [0, 1, 2],
        "runs": runs,
        "summary": summary,
    }
    report = format_markdown(result)
    assert "Post hoc, not pre-registered: FedFew, UC prototype scorers* held to the same targets" in report
    assert report.index("held to: FedFew, UC scorers*") < report.index("Post hoc, not pre-registered")
    assert "Balanced accuracy of FedFew, UC prototype scorers against" not in report  # no baseline ran
    assert "| 2 | FedFew, UC prototype scorers* | 0.750 | 0.860 / 0.840 | 0.860 / 0.720 | 0.860 / 0.520 |" in report
    assert report.count("| 1 | ") == 3  # every method of seed 1
