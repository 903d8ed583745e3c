"""``cxrfl bench quantize`` (issue 46 point 2): the sites behind the job's quantization filters, the bytes counted,
the report's statistics and targets, resuming, and the CLI; without training but for one slow smoke run."""

from __future__ import annotations

import json
from dataclasses import asdict
from functools import partial
from types import SimpleNamespace

import numpy as np
import pytest
from cxrfl.bench import quantize
from cxrfl.bench.intervals import holm
from cxrfl.bench.quantize import QuantizeBenchSettings, QuantizedHost, format_report, run_quantize, summarise
from cxrfl.errors import ConfigError
from cxrfl.fl.quantization import round_trip
from cxrfl.jobs import DEMO_MODEL
from scipy import stats

PARAMS = {
    "features.conv0.weight": np.linspace(-1, 1, 4096, dtype=np.float32).reshape(64, 64),
    "features.norm0.running_var": np.linspace(0.5, 2, 64, dtype=np.float32),
    "features.norm0.num_batches_tracked": np.array(7, np.int64),
    "classifier.weight": np.linspace(-0.3, 0.2, 2048, dtype=np.float32).reshape(2, 1024),
}
FLOATS = 4096 + 2048  # quantizable values
EXACT = 64 * 4 + 8  # running variance (float32) and counter (int64) travel as they are


class Recorder:
    """A site host that keeps what it received and answers with every float array + 0.25."""

    tasks = ("train", "validate")

    def __init__(self) -> None:
        self.received: dict[str, np.ndarray] = {}

    def handle(self, task, params, meta):
        self.received = dict(params)
        return {k: v + np.float32(0.25) if v.dtype.kind == "f" else v for k, v in params.items()}, {"num_samples": 5}


@pytest.mark.parametrize("fmt", ["blockwise8", "normfloat4"])
def test_the_site_and_the_server_get_round_trips_arrays(fmt):
    site, rows = Recorder(), []
    out, meta = QuantizedHost(site, "a", fmt, rows).handle("train", PARAMS, {"phase": "train", "round": 1})
    sent = round_trip(PARAMS, fmt).params
    for k, v in sent.items():  # what the site gets: exactly the filters' output, in its own dtype and shape
        np.testing.assert_array_equal(site.received[k], v)
        assert site.received[k].dtype == PARAMS[k].dtype and site.received[k].shape == PARAMS[k].shape
    assert not np.array_equal(site.received["features.conv0.weight"], PARAMS["features.conv0.weight"])  # lossy
    np.testing.assert_array_equal(site.received["features.norm0.running_var"], PARAMS["features.norm0.running_var"])
    answer = {k: v + np.float32(0.25) if v.dtype.kind == "f" else v for k, v in sent.items()}
    for k, v in round_trip(answer, fmt).params.items():  # what the server gets: the answer through the filters
        np.testing.assert_array_equal(out[k], v)
    assert meta == {"num_samples": 5} and rows[0]["site"] == "a" and rows[0]["round"] == 1
    assert rows[0]["down_before"] == rows[0]["up_before"] == 4 * FLOATS + EXACT
    assert rows[0]["down_after"] == round_trip(PARAMS, fmt).bytes_after < rows[0]["down_before"] / 2


def test_bytes_are_counted_by_hand_for_float16_and_unquantized():
    rows: list[dict] = []
    QuantizedHost(Recorder(), "a", "float16", rows).handle("train", PARAMS, {"phase": "train", "round": 2})
    assert (rows[0]["down_before"], rows[0]["down_after"]) == (4 * FLOATS + EXACT, 2 * FLOATS + EXACT)
    assert (rows[0]["up_before"], rows[0]["up_after"]) == (4 * FLOATS + EXACT, 2 * FLOATS + EXACT)
    site = Recorder()
    QuantizedHost(site, "b", None, rows).handle("validate", PARAMS, {})
    assert rows[1]["down_after"] == rows[1]["down_before"] == 4 * FLOATS + EXACT and rows[1]["seconds"] == 0
    for k, v in PARAMS.items():
        np.testing.assert_array_equal(site.received[k], v)
    measured = quantize.traffic(rows)  # only training rounds count as rounds
    assert measured["bytes"]["up_after"] == 2 * FLOATS + EXACT and measured["seconds_per_round"] == rows[0]["seconds"]


def test_settings_refuse_unknown_formats_and_put_the_reference_first():
    with pytest.raises(ConfigError, match="unknown format"):
        QuantizeBenchSettings(formats=("int8",))
    assert QuantizeBenchSettings(formats=("blockwise8",)).formats == ("none", "blockwise8")
    demo = QuantizeBenchSettings().server_config(2)
    assert demo.model_config == DEMO_MODEL and demo.model_config.arch == "densenet121"  # the demo job's, from scratch
    assert QuantizeBenchSettings(arch="densenet-tiny").server_config(2).model_config.arch == "densenet-tiny"
    with pytest.raises(ConfigError, match="arch must be one of"):
        QuantizeBenchSettings(arch="resnet50")
    assert demo.train_config.lr == 1e-3 and demo.train_config.batch_size == 32 and demo.train_config.seed == 2
    assert (demo.num_rounds, demo.patience, demo.seed) == (60, 3, 2)  # a guard above the demo job's 20


AUROC = {
    "none": [0.70, 0.75, 0.80],
    "float16": [0.701, 0.749, 0.802],  # within noise
    "blockwise8": [0.695, 0.742, 0.793],  # -0.0067 on average: misses the 0.005 target
}
SIZES = {  # (down after, up after) bytes per site and round; 28 MB before
    "none": (28e6, 28e6),
    "float16": (14e6, 14e6),
    "blockwise8": (7.2e6, 7.5e6),  # 3.89x / 3.73x: meets the 3.5x target
}


def fake_run(fmt: str, seed: int) -> dict:
    down, up = SIZES[fmt]
    return {
        "format": fmt,
        "seed": seed,
        "best_round": 2,
        "rounds": 4,
        "mean_auroc": AUROC[fmt][seed],
        "val_loss": [0.7, 0.6, 0.5, 0.55, 0.56],
        "val_auroc": [0.5, 0.6, 0.7, 0.69, 0.68],
        "bytes": {"down_before": 28e6, "down_after": down, "up_before": 28e6, "up_after": up},
        "seconds_per_round": 0.0 if fmt == "none" else 1.5,
        "code": {"commit": "abcdef0123", "dirty": False},
    }


def hand_made(settings: QuantizeBenchSettings) -> dict:
    runs = {f"{f}/{s}": fake_run(f, s) for f in settings.formats for s in range(settings.seeds)}
    return {"settings": asdict(settings), "profile": "two-hospitals", "tests": {"external": 300}, "runs": runs}


def test_report_paired_statistics_holm_and_targets(tmp_path):
    settings = QuantizeBenchSettings(formats=tuple(AUROC))
    (tmp_path / "results.json").write_text(json.dumps(hand_made(settings)))
    results = json.loads((tmp_path / "results.json").read_text())
    report, summary = format_report(results), summarise(results)
    # independently: scipy's paired tests on the same values, Holm's step-down by hand (2 formats compared)
    t = {f: stats.ttest_rel(AUROC[f], AUROC["none"]).pvalue for f in ("float16", "blockwise8")}
    w = {f: stats.wilcoxon(AUROC[f], AUROC["none"]).pvalue for f in ("float16", "blockwise8")}
    for p, key in ((t, "p_holm"), (w, "wilcoxon_p_holm")):
        low, high = sorted(p, key=p.get)
        expected = {low: min(1, 2 * p[low]), high: max(min(1, 2 * p[low]), p[high])}
        for f in p:
            assert summary[f]["versus_none"][key] == pytest.approx(expected[f])
            assert f"{p[f]:.3g} ({expected[f]:.3g})" in report
    eight = summary["blockwise8"]["versus_none"]
    assert eight["difference"] == pytest.approx(np.mean(np.subtract(AUROC["blockwise8"], AUROC["none"])))
    assert summary["blockwise8"]["ratio"]["down"] == pytest.approx(28 / 7.2)
    target = "| 8-bit (blockwise8) >= 3.5x fewer bytes per round than float32, each way |"
    assert f"{target} 3.89x / 3.73x (down / up) | MET |" in report
    assert "| 8-bit mean AUROC within 0.005 of unquantized (paired over seeds) | -0.0067 [95% CI" in report
    assert report.count("NOT MET") == 1 and "Code `abcdef0`" in report
    quantize.plot_curves(results, tmp_path / "curves.png")
    assert (tmp_path / "curves.png").stat().st_size > 10_000


def test_curves_are_compared_over_the_rounds_both_runs_ran(tmp_path):
    """A run stopped early is compared only over its own rounds; the per-seed means are averaged over seeds."""
    settings = QuantizeBenchSettings(formats=("none", "blockwise8"), seeds=2)
    results = hand_made(settings)
    # seed 0: two rounds fewer, each 0.02 lower in AUROC and 0.01 higher in loss; seed 1: 0.04 lower, same loss
    short = results["runs"]["blockwise8/0"]
    short.update(rounds=2, best_round=1, val_auroc=[0.48, 0.58, 0.68], val_loss=[0.71, 0.61, 0.51])
    results["runs"]["blockwise8/1"]["val_auroc"] = [0.46, 0.56, 0.66, 0.65, 0.64]
    row = quantize.matched_rounds(results)["blockwise8"]
    assert row["val_auroc"]["mean"] == pytest.approx(-0.03)
    assert row["val_auroc"]["ci"] == pytest.approx(stats.t.interval(0.95, 1, loc=-0.03, scale=0.01))
    assert row["val_loss"]["mean"] == pytest.approx(0.005)
    assert (row["rounds"], row["best_round"]) == (3.0, 1.5)
    assert quantize.matched_rounds(results)["none"] == {"rounds": 4.0, "best_round": 2.0}
    assert "| blockwise8 | 3.0 | 1.5 | -0.0300 [" in format_report(results)


def test_holm_leaves_untested_formats_out_of_the_family():
    assert holm({"a": 0.01, "b": None, "c": 0.04, "d": 0.03}) == pytest.approx(
        {"a": 0.03, "b": None, "c": 0.06, "d": 0.06}
    )


@pytest.fixture()
def no_training(monkeypatch):
    """The benchmark without data or training: each run is :func:`fake_run`; the calls are listed."""
    calls: list[tuple[str, int]] = []

    def one(settings, sites, tests, fmt, seed, work, *, log):
        calls.append((fmt, seed))
        return fake_run(fmt, seed)

    data = SimpleNamespace(profile="two-hospitals", notes=[], sites=[])
    monkeypatch.setattr(quantize, "load_profile", lambda *a, **k: (data, {}))
    monkeypatch.setattr(quantize, "_run_one", one)
    monkeypatch.setattr(quantize, "plot_curves", lambda results, path: None)
    return calls


def test_resume_runs_only_what_is_missing(tmp_path, no_training):
    settings = QuantizeBenchSettings(seeds=2, formats=("none", "blockwise8"))
    done = hand_made(settings)
    done["runs"] = {k: v for k, v in done["runs"].items() if k in ("none/0", "blockwise8/0")}
    del done["settings"]["arch"]  # written before arch was recorded: DenseNet121, the settings' default
    (tmp_path / "results.json").write_text(json.dumps(done))
    run_quantize(settings, tmp_path, log=lambda _: None)
    assert no_training == [("none", 1), ("blockwise8", 1)]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert sorted(saved["runs"]) == ["blockwise8/0", "blockwise8/1", "none/0", "none/1"]
    assert saved["settings"] == json.loads(json.dumps(asdict(settings))) and saved["settings"]["arch"] == "densenet121"
    assert saved["machine"]["torch_threads"] >= 1 and "code" in saved and (tmp_path / "report.md").is_file()
    run_quantize(settings, tmp_path, log=lambda _: None)
    assert len(no_training) == 2  # all done: nothing runs again


def test_results_of_other_settings_are_refused_in_one_line(tmp_path, no_training):
    (tmp_path / "results.json").write_text(json.dumps(hand_made(QuantizeBenchSettings(seeds=2, formats=tuple(AUROC)))))
    for other in ({"seeds": 3}, {"seeds": 2, "arch": "densenet-tiny"}):
        with pytest.raises(ConfigError, match="holds runs of other settings") as refused:
            run_quantize(QuantizeBenchSettings(**other, formats=tuple(AUROC)), tmp_path, log=lambda _: None)
        assert "\n" not in str(refused.value) and no_training == []


def test_cli_options_reach_the_benchmark(tmp_path, monkeypatch):
    from cxrfl.cli import build_parser

    seen = []
    monkeypatch.setattr(quantize, "run_quantize", lambda settings, out, **kw: seen.append((settings, out)))
    argv = ["bench", "quantize", "--out", str(tmp_path), "--seeds", "2", "--formats", "float16,blockwise8"]
    argv += ["--threads", "2", "--image-size", "32", "--rounds", "5", "--patience", "2", "--arch", "densenet-tiny"]
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0
    settings, out = seen[0]
    assert settings == QuantizeBenchSettings(
        seeds=2,
        formats=("none", "float16", "blockwise8"),
        threads=2,
        image_size=32,
        rounds=5,
        patience=2,
        arch="densenet-tiny",
    )
    assert out == tmp_path


@pytest.mark.slow
def test_smoke_two_formats_one_round(tmp_path, monkeypatch):
    """The whole benchmark, tiny: two-hospitals at 32 px (150 images a site, 100 external), 1 round of 1 step,
    unquantized and 8-bit, 1 seed."""
    from cxrfl.nn.models import HEAD_PREFIX, ModelConfig, build_model

    monkeypatch.setattr(quantize, "load_profile", partial(quantize.load_profile, n_per_site=150, n_external=100))
    settings = QuantizeBenchSettings(  # the network is not the subject: the benchmark's path and outputs are
        seeds=1, formats=("none", "blockwise8"), rounds=1, patience=1, image_size=32, arch="densenet-tiny", steps=1
    )
    results = run_quantize(settings, tmp_path, log=lambda _: None)
    none, eight = results["runs"]["none/0"], results["runs"]["blockwise8/0"]
    assert none["bytes"]["down_before"] == none["bytes"]["down_after"]

    def message(classes: int) -> dict:  # what a training message carries: this network with a site's own head rows
        net = build_model(ModelConfig(arch=settings.arch, image_size=32), classes)
        return {k: v.numpy() for k, v in net.state_dict().items()}

    extractor = sum(v.nbytes for k, v in message(1).items() if not k.startswith(HEAD_PREFIX))
    row = message(2)[HEAD_PREFIX + "weight"][0].nbytes + 4  # a float32 head row and its bias
    trained = [m for m in eight["messages"] if (m["task"], m["phase"]) == ("train", "train")]
    assert trained and eight["seconds_per_round"] > 0
    for m in trained:  # each way, exactly the bytes the 8-bit filter makes of this network's message (the >= 3.5x
        # of DenseNet121's is test_quantization's; a 17 k-parameter network's small arrays shrink less)
        sent = message(round((m["down_before"] - extractor) / row))
        assert m["down_before"] == m["up_before"] == sum(v.nbytes for v in sent.values())
        assert m["down_after"] == m["up_after"] == round_trip(sent, "blockwise8").bytes_after
    assert all(len(r["val_loss"]) == len(r["val_auroc"]) == 2 for r in (none, eight))  # warm-up model + round 1
    assert 0 <= eight["mean_auroc"] <= 1 and {m["task"] for m in eight["messages"]} >= {"train"}
    report = (tmp_path / "report.md").read_text()
    assert "## Targets (issue 46)" in report and (tmp_path / "learning_curves.png").stat().st_size > 10_000
    again = run_quantize(settings, tmp_path, log=lambda _: None)["runs"]["blockwise8/0"]
    assert again["seconds"] == eight["seconds"]  # resumed: not run again
