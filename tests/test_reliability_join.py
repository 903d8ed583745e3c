"""Late joins of surgical aggregation, in process (fast): a site that failed its head warm-up, or
was not connected at the start, gets the warm-up again in each round's exchange and joins once it
answers; its new classes enter the global head from then on, the existing rows stay as they were
(compared as tensors), the records and the resume state say when. The NVFlare path is shown by the
simulator run of ``tests/test_reliability.py`` (a site whose first warm-up raises).
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from cxrfl.common.io import read_records
from cxrfl.common.resume import ResumeStore
from cxrfl.common.server import RunAborted
from cxrfl.common.transport import inprocess_transport
from cxrfl.data.site import load_site
from cxrfl.nn.models import HEAD_PREFIX, ModelConfig, load_checkpoint
from cxrfl.nn.training import TrainConfig
from cxrfl.surgical.config import SurgicalConfig
from cxrfl.surgical.head_modes import site_payload
from cxrfl.surgical.inprocess import make_hosts, run_surgical
from cxrfl.surgical.join import add_classes
from cxrfl.surgical.server import SurgicalServer
from cxrfl.synth import write_profile

MODEL = ModelConfig(arch="densenet-tiny", image_size=32)  # the network is not the subject here
TRAIN = TrainConfig(lr=1e-3, warmup_lr=5e-3, warmup_epochs=1, batch_size=8, max_steps_per_epoch=1, augment=False)
W, B = HEAD_PREFIX + "weight", HEAD_PREFIX + "bias"
SITES = ["hospital-a", "hospital-b"]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    root = tmp_path_factory.mktemp("join")
    paths = {p.stem: p for p in write_profile("two-hospitals", root, n_per_site=40, image_size=32, sites=SITES)}
    return {s: load_site(paths[s], check_images=False) for s in SITES}


def settings(**kw) -> SurgicalConfig:
    base = {
        "num_rounds": 3,
        "min_clients": 1,
        "model_config": MODEL,
        "train_config": TRAIN,
        "patience": 10,
        "min_delta": 0.0,
        "min_clients_timeout": 0,
        "retry_pause": 0.01,
        "evaluate_test": False,
    }
    return SurgicalConfig.from_dict({**base, **kw})


class Flaky:
    """A real site host that fails its first ``warmup_failures`` warm-ups and notes every task and
    answer; ``losses`` (model round -> validation loss) replace the losses it reports."""

    def __init__(self, host, warmup_failures: int = 0, on_task=None, losses: dict[int, float] | None = None) -> None:
        self.host = host
        self.tasks = host.tasks
        self.failures_left = warmup_failures
        self.on_task = on_task
        self.losses = losses or {}
        self.log: list[tuple[str, dict, dict, dict | None]] = []  # task, meta, received, answered params

    def handle(self, task, params, meta):
        if self.on_task is not None:
            self.on_task(task, meta)
        entry = (task, dict(meta), dict(params), None)
        self.log.append(entry)
        if task == "train" and meta.get("phase") == "warmup" and self.failures_left > 0:
            self.failures_left -= 1
            raise RuntimeError("injected warm-up failure")
        out, answer = self.host.handle(task, params, meta)
        scored = meta.get("model_round") if task == "validate" else meta.get("round", 0) - 1
        if meta.get("phase") != "warmup" and scored in self.losses:
            answer["metrics"]["val_loss" if task == "train" else "loss"] = self.losses[scored]
        self.log[-1] = (*entry[:3], {k: np.array(v, copy=True) for k, v in out.items()})
        return out, answer

    def describe(self, task, meta, answer):
        return self.host.describe(task, meta, answer)

    def scalars(self, task, answer):
        return self.host.scalars(task, answer)


def body(params) -> dict:
    return {k: v for k, v in params.items() if not k.startswith(HEAD_PREFIX)}


def assert_equal_arrays(got, want, what: str) -> None:
    assert got.keys() == want.keys(), what
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=f"{what}: {k}")


# --------------------------------------------------------------------------- unit
def test_add_classes_appends_new_rows_and_keeps_the_existing_ones():
    rng = np.random.default_rng(0)
    params = {
        "f": rng.normal(size=3).astype(np.float32),
        W: rng.normal(size=(2, 3)).astype(np.float32),
        B: rng.normal(size=2).astype(np.float32),
    }
    joined = {"f": np.zeros(3, np.float32), W: rng.normal(size=(3, 3)), B: rng.normal(size=3)}
    out, classes, added = add_classes(params, ["b", "d"], joined, ["a", "b", "c"])
    assert classes == ["b", "d", "a", "c"] and added == ["a", "c"]
    np.testing.assert_array_equal(out[W][:2], params[W])  # existing rows: same values, same order
    np.testing.assert_array_equal(out[W][2:], joined[W][[0, 2]].astype(np.float32))
    np.testing.assert_array_equal(out[B], np.concatenate([params[B], joined[B][[0, 2]].astype(np.float32)]))
    assert out[W].dtype == np.float32 and out["f"] is params["f"]  # the feature extractor is not the joiner's
    same, same_classes, none = add_classes(params, ["b", "d"], joined, ["b"])
    assert same_classes == ["b", "d"] and none == [] and same[W] is params[W]


# ------------------------------------------------------------ failed warm-up, joins later
@pytest.fixture(scope="module")
def late(sites, tmp_path_factory):
    """hospital-b fails its warm-up twice (round 0, and again in round 1's exchange) and joins with
    the warm-up it answers in round 2's exchange; the run is aborted once round 3's results are in,
    then resumed."""
    tmp = tmp_path_factory.mktemp("late")
    hosts = make_hosts(list(sites.values()), tmp / "sites")
    a, b = Flaky(hosts["hospital-a"]), Flaky(hosts["hospital-b"], warmup_failures=2)

    def aborted() -> bool:
        return any(t == "train" and m.get("round") == 3 and m.get("phase") == "train" for t, m, _, _ in b.log)

    out = tmp / "first"
    with pytest.raises(RunAborted):
        run_surgical({"hospital-a": a, "hospital-b": b}, settings(), out, run_id="first", aborted=aborted)
    saved = ResumeStore.read(out / "cxrfl_resume" / "first" / "state.pt")
    first_log = {"hospital-a": list(a.log), "hospital-b": list(b.log)}
    a.log.clear()
    b.log.clear()
    second = tmp / "second"
    shutil.copytree(out / "cxrfl_resume" / "first", second / "cxrfl_resume" / "first")  # the store of the second run
    run_surgical({"hospital-a": a, "hospital-b": b}, settings(resume_from="first"), second, run_id="second")
    return {
        "out": out,
        "second": second,
        "saved": saved,
        "log": first_log,
        "resumed_log": {"hospital-a": a.log, "hospital-b": b.log},
        "sites": sites,
        "records": read_records(out / "cxrfl" / "rounds.jsonl"),
        "resumed_records": read_records(second / "cxrfl" / "rounds.jsonl"),
    }


def tasks(log, phase: str) -> list[tuple[str, dict, dict, dict | None]]:
    return [e for e in log if e[0] == "train" and e[1].get("phase") == phase]


def test_the_records_say_when_the_site_joined(late):
    phases = [(r["round"], r["phase"]) for r in late["records"]]
    assert phases == [(0, "warmup"), (1, "train"), (1, "join"), (2, "train"), (2, "join")]
    warmup, train1, join1, train2, join2 = late["records"]
    assert warmup["sites_failed"] == ["hospital-b"] and warmup["sites_aggregated"] == ["hospital-a"]
    assert (join1["sites_asked"], join1["sites_failed"], join1["joined"]) == (["hospital-b"], ["hospital-b"], [])
    assert (join2["sites_answered"], join2["joined"]) == (["hospital-b"], ["hospital-b"])
    assert train1["sites_answered"] == train2["sites_answered"] == ["hospital-a"]  # the warm-up is not a round result
    nih, chexpert = late["sites"]["hospital-a"].classes, late["sites"]["hospital-b"].classes
    assert join2["new_classes"] == sorted(set(chexpert) - set(nih))
    train3 = next(r for r in late["resumed_records"] if r["phase"] == "train")
    assert train3["round"] == 3 and train3["sites_aggregated"] == SITES
    for c in set(nih) & set(chexpert):
        assert train3["contributors"][c] == SITES
    for c in join2["new_classes"]:
        assert train3["contributors"][c] == ["hospital-b"]


def test_the_joiner_warms_up_on_the_current_global_feature_extractor(late):
    round1 = load_checkpoint(late["out"] / "cxrfl" / "checkpoints" / "round_001.pt")
    warmups = tasks(late["log"]["hospital-b"], "warmup")
    assert [e[1]["round"] for e in warmups] == [0, 1, 2]
    received = warmups[-1][2]  # in round 2's exchange: the model of round 1
    assert not any(k.startswith(HEAD_PREFIX) for k in received)  # no head row, no other site's class
    assert_equal_arrays(received, {k: v.numpy() for k, v in body(round1["model"]).items()}, "join warm-up")
    assert not np.array_equal(received["backbone.conv0.weight"], warmups[0][2]["backbone.conv0.weight"])


def test_its_classes_enter_the_global_head_and_the_existing_rows_stay(late):
    round2 = load_checkpoint(late["out"] / "cxrfl" / "checkpoints" / "round_002.pt")  # before the join
    saved = late["saved"]  # after it
    nih, chexpert = late["sites"]["hospital-a"].classes, late["sites"]["hospital-b"].classes
    new = sorted(set(chexpert) - set(nih))
    assert round2["classes"] == sorted(nih) and saved["classes"] == sorted(nih) + new
    warm = tasks(late["log"]["hospital-b"], "warmup")[-1][3]  # what hospital-b answered
    rows = [chexpert.index(c) for c in new]
    for key in (W, B):
        np.testing.assert_array_equal(saved["params"][key][: len(nih)], round2["model"][key].numpy())  # unchanged
        np.testing.assert_array_equal(saved["params"][key][len(nih) :], warm[key][rows])
    assert_equal_arrays(body(saved["params"]), {k: v.numpy() for k, v in body(round2["model"]).items()}, "body")
    for site, classes in (("hospital-a", nih), ("hospital-b", chexpert)):  # round 3: each site its own rows
        sent = next(e for e in tasks(late["log"][site], "train") if e[1]["round"] == 3)[2]
        assert_equal_arrays(sent, site_payload(saved["params"], saved["classes"], classes), f"{site} round 3")
    assert [e[1]["round"] for e in tasks(late["log"]["hospital-b"], "train")] == [3]


def test_the_resume_state_keeps_the_joined_site(late):
    saved = late["saved"]
    assert saved["round"] == 2 and saved["joined"] == {"hospital-b": 2}
    assert saved["announced"]["hospital-b"] == late["sites"]["hospital-b"].classes
    records = late["resumed_records"]
    assert [(r["round"], r["phase"]) for r in records] == [(2, "resumed"), (3, "train"), (3, "validate")]
    first = late["resumed_log"]["hospital-b"][0]
    assert (first[0], first[1]["phase"], first[1]["round"]) == ("train", "train", 3)  # not asked to warm up again
    assert load_checkpoint(late["second"] / "FL_global_model.pt")["classes"] == saved["classes"]


# ------------------------------------------------------------ not connected at the start
def test_a_site_down_at_the_start_joins_once_it_is_connected(sites, tmp_path):
    hosts = make_hosts(list(sites.values()), tmp_path / "sites")
    connected: dict = {}

    losses = {0: 0.1, 1: 0.5, 2: 0.6}  # the model of round 0 (without hospital-b's classes) scores best

    def comes_back(task, meta):  # hospital-b connects while hospital-a trains round 1 (its warm-up is sent next)
        if meta.get("round") == 1 and meta.get("phase") == "train":
            connected["hospital-b"] = Flaky(hosts["hospital-b"], losses=losses)

    connected["hospital-a"] = Flaky(hosts["hospital-a"], on_task=comes_back, losses=losses)
    warnings: list[str] = []
    server = SurgicalServer(
        inprocess_transport(connected, warning=warnings.append),
        config=settings(num_rounds=2),
        sites=SITES,
        out_dir=tmp_path / "run",
        warning=warnings.append,
    )
    outcome = server.run()
    records = read_records(tmp_path / "run" / "cxrfl" / "rounds.jsonl")
    assert [(r["round"], r["phase"]) for r in records] == [
        (0, "warmup"),
        (1, "train"),
        (1, "join"),
        (2, "train"),
        (2, "validate"),
    ]
    assert records[0]["sites_failed"] == ["hospital-b"] and records[2]["joined"] == ["hospital-b"]
    assert "site hospital-b: not connected; task train not sent" in warnings
    assert outcome.site_classes == {s: sites[s].classes for s in SITES}
    assert server.state.joined == {"hospital-b": 1}
    assert len(outcome.classes) == len(set(sites["hospital-a"].classes) | set(sites["hospital-b"].classes))
    b = connected["hospital-b"]
    assert [(e[1]["phase"], e[1]["round"]) for e in b.log if e[0] == "train"] == [("warmup", 1), ("train", 2)]
    assert records[3]["sites_aggregated"] == SITES
    # selection started again at the join: the first model scored with both sites, not the older, lower loss
    assert outcome.best_round == 1 and [p["round"] for p in outcome.curve] == [0, 1, 2]
