"""The converged protocol of `cxrfl bench compare` on a tiny profile: early stopping really stops a run
whose validation loss has stopped improving (losses scripted by a host wrapper, the rest real
training), the learning curves reach results.json, and an interrupted comparison continues
where it stopped (finished runs kept, the run in progress resumed from its last round, other
settings refused)."""

from __future__ import annotations

import json
import subprocess

import cxrfl.bench.runs as runs
import pytest
from cxrfl.bench.compare import run_compare
from cxrfl.bench.protocol import RESULTS_PATH, CompareSettings, code_label, code_version, command_line, load_text
from cxrfl.errors import ConfigError
from cxrfl.nn.models import CXRNet

TINY = {
    "profile": "two-hospitals",
    "image_size": 32,
    "data_image_size": 32,
    "n_per_site": 30,
    "n_external": 24,
    "batch_size": 8,
    "n_boot": 10,
    "threads": 1,
    "arch": "densenet-tiny",
}
"""A tiny profile and network; otherwise the protocol's code path (whole training splits, max_rounds only a guard)."""


class ScriptedHost:
    """A real site host whose reported validation losses follow a script (by model round)."""

    def __init__(self, host, losses, calls: list, interrupt=None) -> None:
        self.host, self.losses, self.calls, self.interrupt = host, losses, calls, interrupt
        self.tasks = host.tasks

    def handle(self, task, params, meta):
        seed = meta["train_config"]["seed"]
        self.calls.append((seed, self.host.data.site, task, meta.get("phase"), meta.get("round")))
        if self.interrupt is not None and self.interrupt(seed, task, meta):
            raise KeyboardInterrupt  # Ctrl-C in the middle of a run
        out, answer = self.host.handle(task, params, meta)
        metrics = answer["metrics"]
        if task == "train" and meta.get("phase") == "train":
            metrics["val_loss"] = self.losses(int(meta["round"]) - 1)
        elif task == "validate" and meta.get("split") == "val":
            metrics["loss"] = self.losses(int(meta["model_round"]))
        return out, answer

    def describe(self, task, meta, answer):
        return self.host.describe(task, meta, answer)

    def scalars(self, task, answer):
        return self.host.scalars(task, answer)


REAL_MAKE_HOSTS = runs.make_hosts


def script(monkeypatch, losses, calls: list, interrupt=None) -> None:
    """Make the comparison's runs use scripted hosts."""

    def make_hosts(*args, **kwargs):
        return {k: ScriptedHost(h, losses, calls, interrupt) for k, h in REAL_MAKE_HOSTS(*args, **kwargs).items()}

    monkeypatch.setattr(runs, "make_hosts", make_hosts)


SCRIPT = {0: 1.0, 1: 0.9, 2: 0.8}  # then 0.85 for ever: the model of round 2 stays the best


def test_early_stopping_ends_every_run_and_the_curves_reach_results(tmp_path, monkeypatch):
    calls: list = []
    script(monkeypatch, lambda r: SCRIPT.get(r, 0.85), calls)
    settings = CompareSettings.from_dict({**TINY, "seeds": 1, "patience": 2, "methods": ["individual"]})
    assert settings.max_rounds == 40 and settings.steps is None  # the protocol's guard, whole splits
    res = run_compare(settings, tmp_path / "out", data_dir=tmp_path / "data", log=lambda m: None)
    assert set(res["methods"]) == {"individual:hospital-a", "individual:hospital-b", "surgical-fedavg"}
    for name, m in res["methods"].items():
        (run,) = m["runs"]
        # rounds 1-3 score models 0-2 (each better); rounds 4 and 5 score no improvement: patience 2 -> stop
        assert run["rounds"] == 5 and run["stopped_early"] is True, name
        assert run["best_round"] == 2
        assert run["curve_rounds"] == [0, 1, 2, 3, 4]
        assert run["val_loss"] == pytest.approx([1.0, 0.9, 0.8, 0.85, 0.85])
        assert len(run["val_auroc"]) == 5 and all(v is None or 0 <= v <= 1 for v in run["val_auroc"])
    trained = [c for c in calls if c[2] == "train" and c[3] == "train"]
    assert max(c[4] for c in trained) == 5  # no round 6 was asked of any site
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["methods"]["surgical-fedavg"]["runs"][0]["val_loss"] == pytest.approx([1.0, 0.9, 0.8, 0.85, 0.85])
    assert "learning_curves.png" in saved["plots"] and (tmp_path / "out" / "learning_curves.png").stat().st_size > 5000
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| FL + SA (FedAvg) | 5 | 2 | 1 of 1 |" in report


def test_an_interrupted_comparison_continues_where_it_stopped(tmp_path, monkeypatch):
    calls: list = []
    settings = CompareSettings.from_dict(
        {**TINY, "seeds": 2, "max_rounds": 3, "patience": 5, "methods": ["surgical-fedavg"], "steps": 1}
    )
    out, data = tmp_path / "out", tmp_path / "data"
    lines: list[str] = []

    def ctrl_c(seed, task, meta):  # seed 1 is interrupted when its round 2 starts (round 1 done and saved)
        return seed == 1 and task == "train" and meta.get("round") == 2 and meta.get("phase") == "train"

    script(monkeypatch, lambda r: 1.0 - 0.1 * r, calls, ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        run_compare(settings, out, data_dir=data, log=lines.append)
    store = runs.RunStore(out)
    assert store.done("surgical-fedavg", 0) and not store.done("surgical-fedavg", 1)
    assert any("run the same command again to continue" in line for line in lines)
    first = store.record_path("surgical-fedavg", 0).read_text()
    assert (store.work("surgical-fedavg", 1) / "cxrfl_resume" / "run" / "state.pt").is_file()

    calls.clear()
    script(monkeypatch, lambda r: 1.0 - 0.1 * r, calls)
    res = run_compare(settings, out, data_dir=data, log=lines.append)
    assert {c[0] for c in calls} == {1}  # seed 0 was not trained again
    seed1 = [(c[2], c[3], c[4]) for c in calls if c[1] == "hospital-a"]
    assert seed1 == [("train", "train", 2), ("train", "train", 3), ("validate", None, None)]  # no warm-up, no round 1
    assert store.record_path("surgical-fedavg", 0).read_text() == first
    rec = store.load("surgical-fedavg", 1)
    assert rec["rounds"] == 3 and rec["curve_rounds"] == [0, 1, 2, 3] and rec["resumed_after_seconds"] > 0
    assert rec["seconds"] > rec["resumed_after_seconds"]
    assert res["seeds"] == [0, 1] and len(res["methods"]["surgical-fedavg"]["test"]["hospital-a"]["auroc_by_seed"]) == 2
    assert not (out / "runs" / ".work").exists()  # nothing in progress any more

    with pytest.raises(ConfigError, match=r"other settings \(protocol.patience differ\).*--restart"):
        run_compare(settings.replace(patience=2), out, data_dir=data, log=lines.append)
    report_only = run_compare(settings.replace(seeds=3), out, data_dir=data, log=lines.append, report_only=True)
    assert report_only["seeds"] == [0, 1]  # seed 2 not trained: statistics over the finished seeds


def test_the_arch_setting_builds_every_network_of_a_run_and_is_recorded(tmp_path, monkeypatch):
    """``arch`` (``--arch``) is the network every model of a run is built as, and results.json and protocol.json
    record it; a protocol stored before it was recorded is DenseNet121's."""
    built: list[str] = []
    init = CXRNet.__init__

    def spy(self, config, *args, **kwargs):
        built.append(config.arch)
        init(self, config, *args, **kwargs)

    monkeypatch.setattr(CXRNet, "__init__", spy)
    settings = CompareSettings.from_dict(
        {**TINY, "seeds": 1, "max_rounds": 1, "steps": 1, "methods": ["surgical-fedavg"]}
    )
    out = tmp_path / "out"
    res = run_compare(settings, out, data_dir=tmp_path / "data", log=lambda m: None)
    assert built and set(built) == {"densenet-tiny"}  # the sites', the server's and the scored models
    assert res["settings"]["arch"] == json.loads((out / "results.json").read_text())["settings"]["arch"]
    assert res["settings"]["arch"] == "densenet-tiny"
    store, path = runs.RunStore(out), out / "runs" / runs.PROTOCOL_FILE
    stored = json.loads(path.read_text())
    assert stored["protocol"]["arch"] == "densenet-tiny"
    del stored["protocol"]["arch"]  # as written before arch was recorded: those runs trained DenseNet121
    path.write_text(json.dumps(stored))
    with pytest.raises(ConfigError, match=r"\(protocol.arch differ\)"):
        store.check(settings.protocol(), stored["data"], restart=False, log=print)
    store.check(settings.replace(arch="densenet121").protocol(), stored["data"], restart=False, log=print)


def test_restart_sets_runs_of_other_settings_aside(tmp_path):
    store = runs.RunStore(tmp_path)
    store.check({"patience": 5}, {"sites": 2}, restart=False, log=print)
    store.record_path("x", 0).parent.mkdir(parents=True)
    store.record_path("x", 0).write_text("{}")
    with pytest.raises(ConfigError, match="data.sites differ"):
        store.check({"patience": 5}, {"sites": 3}, restart=False, log=print)
    lines: list[str] = []
    store.check({"patience": 5}, {"sites": 3}, restart=True, log=lines.append)
    (aside,) = tmp_path.glob("runs-set-aside-*")
    assert (aside / "x" / "seed-0.json").is_file() and not store.done("x", 0)
    assert "moved to" in lines[0]
    assert json.loads((tmp_path / "runs" / "protocol.json").read_text())["data"] == {"sites": 3}


def test_runs_selected_by_the_other_rule_are_set_aside_where_the_rule_matters(tmp_path):
    """Issue 41 point 4: the selection rule decides vanilla FL and centralized only; their stored
    runs of the other rule (a record without ``selection`` is the old whole-head rule) move to
    ``superseded-selection-<rule>/`` and are trained again; every other run is kept."""
    from cxrfl.bench.methods import BY_NAME
    from cxrfl.bench.reselection import format_deltas, selection_deltas

    store = runs.RunStore(tmp_path)
    entries = [
        runs.Entry(n, n, BY_NAME[n]) for n in ("vanilla-fedavg", "centralized", "partial-fedavg", "surgical-fedavg")
    ]
    assert [e.method.selection_matters for e in entries] == [True, True, False, False]
    for e in entries:
        for seed, record in ((0, {}), (1, {"selection": "annotated"})):
            path = store.record_path(e.name, seed)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(record))
            path.with_suffix(".npz").write_bytes(b"scores")
    lines: list[str] = []
    store.set_aside_selection(entries, 2, "annotated", lines.append)
    kept = {(e.name, s) for e in entries for s in (0, 1) if store.done(e.name, s)}
    assert kept == {("vanilla-fedavg", 1), ("centralized", 1)} | {
        (n, s) for n in ("partial-fedavg", "surgical-fedavg") for s in (0, 1)
    }
    aside = tmp_path / "runs" / "superseded-selection-head"
    assert {p.relative_to(aside).as_posix() for p in aside.rglob("*.*")} == {
        "vanilla-fedavg/seed-0.json",
        "vanilla-fedavg/seed-0.npz",
        "centralized/seed-0.json",
        "centralized/seed-0.npz",
    }
    assert len(lines) == 2 and "vanilla-fedavg seed 0: selected by the 'head' rule" in lines[0]
    # retrained under the new rule: how far the model moved, per test set, over the seeds both rules ran
    old = {"best_round": 3, "auroc": {"hospital-a": {"*": {"x": 0.6, "y": 0.7}}, "external": {"*": {"x": 0.5}}}}
    old |= {"curve_rounds": [2, 3, 4], "val_auroc": [0.6, 0.7, 0.72]}  # the head rule gave up 0.02
    (aside / "vanilla-fedavg" / "seed-0.json").write_text(json.dumps(old))
    new = {
        "best_round": 9,
        "auroc": {"hospital-a": {"*": {"x": 0.7, "y": 0.8, "z": None}}, "external": {"*": {"x": 0.6}}},
        "curve_rounds": [8, 9, 10],
        "val_auroc": [0.5, 0.55, 0.8],  # the fair rule gave up 0.25
    }
    store.record_path("vanilla-fedavg", 0).write_text(json.dumps(new))
    deltas = selection_deltas(store, entries, [0, 1])
    assert set(deltas) == {"vanilla-fedavg"}  # centralized's seed 0 was not trained again yet
    d = deltas["vanilla-fedavg"]
    assert d["before_rule"] == "head" and d["seeds"] == [0] and d["best_round"] == {"before": 3, "after": 9}
    assert d["cost"] == pytest.approx({"before": 0.02, "after": 0.25})
    a = d["mean_auroc"]["hospital-a"]
    assert {k: a[k] for k in ("before", "after", "change")} == pytest.approx(
        {"before": 0.65, "after": 0.75, "change": 0.1}
    )
    # per class too (the real federation's targets take the unique classes' share of the change from them)
    assert a["classes"]["x"] == pytest.approx({"before": 0.6, "after": 0.7})
    assert a["classes"]["y"] == pytest.approx({"before": 0.7, "after": 0.8})
    assert a["classes"]["z"] == {"before": None, "after": None}  # undefined under the new rule, absent before
    assert d["mean_auroc"]["external"]["change"] == pytest.approx(0.1)
    section = "\n".join(format_deltas(deltas, "annotated"))
    row = "| vanilla-fedavg (before: `head`) | hospital-a | 0.6500 | 0.7500 | +0.1000 | 3.0 → 9.0 | 0.0200 → 0.2500 |"
    assert row in section
    store.set_aside_selection(entries, 2, "head", lines.append)  # and back: the annotated runs move aside
    assert not store.done("vanilla-fedavg", 1) and (tmp_path / "runs" / "superseded-selection-annotated").is_dir()


def test_the_selection_rules_coincide_only_where_every_site_labels_every_class():
    """two-hospitals-shared: both sites label all classes, so a site's own classes are the whole head and the
    rules select the same model; its runs are kept, not trained again. A site lacking one class is enough to
    make the rules differ."""
    from types import SimpleNamespace

    from cxrfl.bench.profiles import BenchData

    def data(*classes: list[str]) -> BenchData:
        return BenchData("p", [SimpleNamespace(classes=c) for c in classes])  # type: ignore[misc]

    assert data(["a", "b"], ["b", "a"]).every_site_labels_every_class
    assert not data(["a", "b"], ["a"]).every_site_labels_every_class
    assert not data(["a"], ["b"]).every_site_labels_every_class


@pytest.mark.slow
def test_jobs_train_the_same_runs_in_worker_processes(tmp_path):
    """``--jobs 2``: the (method, seed) runs trained side by side in spawned workers (each repeating its
    seed's head warm-up) equal the runs of one process, score for score."""
    import numpy as np

    settings = CompareSettings.from_dict(
        {**TINY, "seeds": 1, "max_rounds": 2, "patience": 5, "steps": 2, "methods": ["individual"]}
    )
    lines: list[str] = []
    one = run_compare(settings, tmp_path / "one", data_dir=tmp_path / "data", log=lambda m: None)
    two = run_compare(settings.replace(jobs=2), tmp_path / "two", data_dir=tmp_path / "data", log=lines.append)
    assert any("training 3 in 2 worker process(es)" in line for line in lines)
    assert (
        set(two["methods"])
        == set(one["methods"])
        == {"individual:hospital-a", "individual:hospital-b", "surgical-fedavg"}
    )
    for name in one["methods"]:
        a, b = runs.RunStore(tmp_path / "one"), runs.RunStore(tmp_path / "two")
        assert a.load(name, 0)["val_loss"] == pytest.approx(b.load(name, 0)["val_loss"], rel=1e-6), name
        sa, sb = a.scores(name, 0), b.scores(name, 0)
        assert set(sa) == set(sb) and all(np.allclose(sa[k], sb[k], atol=1e-6, equal_nan=True) for k in sa), name
    assert (
        json.loads((tmp_path / "two" / "runs" / "protocol.json").read_text())["protocol"]
        == json.loads((tmp_path / "one" / "runs" / "protocol.json").read_text())["protocol"]
    )  # jobs decides no model


def test_a_run_is_trained_by_one_process_at_a_time(tmp_path, monkeypatch):
    """Two invocations on one folder (or --jobs workers) never train the same (method, seed) at once:
    the claim is an OS lock (released however its process ends); a held or stored run is left alone."""
    store = runs.RunStore(tmp_path)
    with store.claim("surgical-fedavg", 0) as first:
        assert first
        with store.claim("surgical-fedavg", 0) as second:  # a second open file description: another process's view
            assert not second
        with store.claim("surgical-fedavg", 1) as other_seed:
            assert other_seed
    with store.claim("surgical-fedavg", 0) as again:
        assert again

    def never(*args, **kwargs):
        raise AssertionError("trained a run another process holds or stored")

    monkeypatch.setattr(runs, "train_run", never)
    lines: list[str] = []
    kwargs = {"settings": None, "data": None, "tests": {}, "warmups": None, "store": store, "log": lines.append}
    with store.claim("surgical-fedavg", 0):
        assert runs.train_and_store(runs.Entry("surgical-fedavg", "FL + SA", None), 0, **kwargs) is None
    store.record_path("surgical-fedavg", 0).parent.mkdir(parents=True, exist_ok=True)
    store.record_path("surgical-fedavg", 0).write_text("{}")
    assert runs.train_and_store(runs.Entry("surgical-fedavg", "FL + SA", None), 0, **kwargs) is None
    assert lines == ["being trained by another process: left to it", "stored by another process"]


def test_the_recorded_commit_is_dirty_for_code_changes_but_not_for_stored_results(tmp_path):
    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "custom").mkdir()
    (tmp_path / RESULTS_PATH).mkdir(parents=True)
    (tmp_path / "custom" / "m.py").write_text("x = 1\n")
    (tmp_path / RESULTS_PATH / "r.json").write_text("{}\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "init")
    head = subprocess.run(
        ["git", "-C", str(tmp_path), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    assert code_version(tmp_path) == {"commit": head, "dirty": False}
    (tmp_path / RESULTS_PATH / "r.json").unlink()  # a benchmark rewrites or removes its stored runs
    (tmp_path / "new_untracked.txt").write_text("scratch\n")
    assert code_version(tmp_path) == {"commit": head, "dirty": False}
    (tmp_path / "custom" / "m.py").write_text("x = 2\n")
    assert code_version(tmp_path) == {"commit": head, "dirty": True}


def test_every_report_names_the_code_the_same_way():
    assert code_label({"commit": "0123456789abcdef", "dirty": False}) == "`0123456`"
    assert code_label({"commit": "0123456789abcdef", "dirty": True}, 10) == "`0123456789` with uncommitted changes"
    assert code_label({}) == "`unknown`"


def test_a_report_names_the_cxrfl_command_that_ran_it(monkeypatch):
    monkeypatch.setattr("sys.argv", ["/venv/bin/cxrfl", "bench", "cwt", "--seeds", "5", "--jobs", "2"])
    assert command_line() == "cxrfl bench cwt --seeds 5 --jobs 2"
    monkeypatch.setattr("sys.argv", ["cxrfl", "bench", "compare", "--profile", "p", "--report-only", "--jobs", "2"])
    assert command_line() == "cxrfl bench compare --profile p --jobs 2"  # the command that trained the runs
    monkeypatch.setattr("sys.argv", ["python", "benchmarks/cwt_splits.py"])  # not cxrfl: the caller names it
    assert command_line() is None


def test_reports_read_the_load_average_under_its_new_and_its_old_names():
    assert load_text({"load_average": [0.61, 1.0, 2.25]}) == "0.6, 1.0, 2.2"
    assert load_text({"load_average_at_start": [1, 2, 3]}) == "1.0, 2.0, 3.0"  # results written before 2026-11-25
    assert load_text({"load_average_at_start": 0.27}) == "0.3"  # FedFew's: the 1-min figure alone
    assert load_text({"load_average_at_start": 0.0}) == "0.0"  # an idle machine is not an unrecorded load
    assert load_text({"cpus": 2}) == "unknown"
