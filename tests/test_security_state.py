"""Issue 40 points 2, 9 and 12: state files are read without running code, resume_from and run_key
name nothing outside their store, and a damaged state or a full disk is one line naming the file."""

from __future__ import annotations

import errno
import os
import pickle
from pathlib import Path

import cxrfl.common.io as io_module
import numpy as np
import pytest
import torch
from cxrfl.common.io import torch_save
from cxrfl.common.resume import ResumeStore
from cxrfl.common.server import RunStopped, ServerLoop
from cxrfl.data.site import load_site
from cxrfl.errors import ConfigError, CxrflError
from cxrfl.fedfew.rounds import FederatedRounds, Progress
from cxrfl.nn.models import HEAD_PREFIX, ModelConfig, build_model, load_checkpoint
from cxrfl.nn.training import TrainConfig
from cxrfl.surgical.config import SurgicalConfig
from cxrfl.surgical.host import SurgicalSiteHost
from cxrfl.surgical.inprocess import make_hosts, run_surgical
from cxrfl.surgical.learner import SiteLearner
from cxrfl.surgical.site_state import OPTIMIZER_ROUNDS
from cxrfl.synth import write_profile

MODEL = ModelConfig(arch="densenet-tiny", image_size=32)  # the network is not the subject here
TRAIN = TrainConfig(lr=1e-3, warmup_lr=5e-3, warmup_epochs=1, batch_size=8, max_steps_per_epoch=1, augment=False)

pytestmark = pytest.mark.usefixtures("one_thread")


class Payload:
    """Unpickling it creates ``marker`` (what a crafted state file could do with any command)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def crafted(path: Path, marker: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"settings": {}, "round": 1, "x": Payload(marker)}, path)
    return path


def damaged(path: Path, how: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"settings": {}, "round": 1, "params": {"w": torch.ones(50)}}, path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if how == "truncated" else b"\x00garbage, not a torch file" * 3)
    return path


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert "\n" not in text, text
    assert "weights_only" not in text, text
    return text


@pytest.fixture(scope="module")
def sites(tmp_path_factory):
    root = tmp_path_factory.mktemp("security_state")
    paths = write_profile("two-hospitals", root, n_per_site=40, image_size=32, sites=["hospital-a", "hospital-b"])
    return [load_site(p, check_images=False) for p in paths]


# ------------------------------------------------------------ point 2: no code from state files
def test_a_crafted_resume_state_is_refused_without_running_it(tmp_path):
    # issue 40 point 2: ResumeStore.load unpickled state.pt with weights_only=False (a command ran)
    marker = tmp_path / "MARKER"
    path = crafted(tmp_path / "cxrfl_resume" / "job-1" / "state.pt", marker)
    with pytest.raises(ConfigError) as err:
        ResumeStore(tmp_path / "cxrfl_resume", "job-2").load("job-1", {}, [])
    assert str(path) in one_line(err.value) and "start a new run" in str(err.value)
    assert not marker.exists()


def test_a_crafted_fedfew_progress_is_not_run_and_the_stage_starts_over(tmp_path):
    # issue 40 points 2 and 9: FederatedRounds.load_progress unpickled state.pt with weights_only=False
    marker, warnings = tmp_path / "MARKER", []
    folder = crafted(tmp_path / "job-1" / "state.pt", marker).parent
    rounds = FederatedRounds(send=None, sites=[], out_dir=tmp_path / "app", warning=warnings.append)
    assert rounds.load_progress(folder, 1) is None
    assert not marker.exists()
    assert len(warnings) == 1 and str(folder / "state.pt") in one_line(warnings[0]) and "starts over" in warnings[0]


def test_crafted_site_state_is_refused_without_running_it(sites, tmp_path):
    # issue 40 point 2: SiteLearner._load unpickled local_head.pt / local_bn.pt with weights_only=False
    marker = tmp_path / "MARKER"
    learner = SiteLearner(sites[0], tmp_path / "state", model_config=MODEL, train_config=TRAIN, head_mode="local")
    crafted(learner.state_dir / "local_head.pt", marker)
    with pytest.raises(ConfigError) as err:
        learner.load_params({k: v for k, v in learner.model.state_dict().items() if not k.startswith(HEAD_PREFIX)})
    assert str(learner.state_dir / "local_head.pt") in one_line(err.value)
    assert not marker.exists()


@pytest.mark.parametrize("value", ["/abs/path", "../x", "a/b", "..", "job\\1"])
def test_resume_from_must_be_a_job_id_of_the_store(tmp_path, value):
    # issue 40 point 2: an absolute resume_from or one with '..' was followed out of the resume store
    elsewhere = tmp_path / "x"
    torch_save(elsewhere / "state.pt", {"settings": {}, "round": 1})
    store = ResumeStore(tmp_path / "cxrfl_resume", "job-2")
    with pytest.raises(ConfigError, match=r"^resume_from=.*job id"):
        store.load(value, {}, [])
    with pytest.raises(ConfigError, match=r"^resume_from="):  # refused when the run is built, before any work
        ServerLoop(
            lambda *a: {}, sites=[], out_dir=tmp_path / "app", resume_root=tmp_path / "cxrfl_resume", resume_from=value
        )


@pytest.mark.parametrize("run_key", ["../../x", "a/b", "/tmp/x", ".."])
def test_a_run_key_that_is_not_a_plain_name_is_refused_at_the_site(sites, tmp_path, run_key):
    # issue 40 point 2: the server-sent run_key was joined to the site's state folder as given
    root = tmp_path / "sites" / "hospital-a"
    host = SurgicalSiteHost(sites[0], root)
    before = sorted(tmp_path.rglob("*"))
    with pytest.raises(ConfigError) as err:
        host.handle(
            "train",
            {},
            {"phase": "warmup", "run_key": run_key, "model_config": MODEL.to_dict(), "train_config": TRAIN.to_dict()},
        )
    assert "run_key" in one_line(err.value) and repr(run_key) in str(err.value)
    assert sorted(tmp_path.rglob("*")) == before  # no folder made, nothing pruned


# ------------------------------------------------------------ point 9: damaged state, full disk
@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_a_damaged_resume_state_is_one_line_naming_the_file(tmp_path, how):
    # issue 40 point 9: a truncated or garbage state.pt raised torch's RuntimeError / UnpicklingError
    path = damaged(tmp_path / "cxrfl_resume" / "job-1" / "state.pt", how)
    with pytest.raises(ConfigError) as err:
        ResumeStore(tmp_path / "cxrfl_resume", "job-2").load("job-1", {}, [])
    text = one_line(err.value)
    assert str(path) in text and "damaged" in text and "without resume_from" in text


def test_a_resumed_surgical_run_with_a_damaged_state_stops_with_one_line(sites, tmp_path):
    # issue 40 point 9: the run stopped with a traceback of torch's error
    path = damaged(tmp_path / "out" / "cxrfl_resume" / "job-1" / "state.pt", "truncated")
    hosts = make_hosts(sites, tmp_path / "sites")
    config = SurgicalConfig.from_dict(
        {
            "num_rounds": 2,
            "min_clients": 2,
            "model_config": MODEL,
            "train_config": TRAIN,
            "min_clients_timeout": 0,
            "evaluate_test": False,
            "resume_from": "job-1",
        }
    )
    with pytest.raises(RunStopped) as err:
        run_surgical(hosts, config, tmp_path / "out", run_id="job-2")
    assert str(path) in one_line(err.value)
    assert not any(tmp_path.joinpath("sites").rglob("*.pt"))  # no site was asked to train


@pytest.mark.parametrize("how", ["truncated", "garbage"])
def test_a_damaged_optimizer_state_is_a_warning_and_the_site_trains_afresh(sites, tmp_path, caplog, how):
    # issue 40 point 9: a damaged optimizer state failed the site in every round
    learner = SiteLearner(sites[0], tmp_path / "state", model_config=MODEL, train_config=TRAIN)
    start = learner.warmup(
        {k: v.numpy() for k, v in build_model(MODEL, 1).state_dict().items() if not k.startswith(HEAD_PREFIX)}
    )
    path = damaged(learner.state_dir / OPTIMIZER_ROUNDS / "round_001.pt", how)
    update = learner.train_round(start.params, 2)
    assert np.isfinite(update.metrics["train_loss"])
    assert any(not np.array_equal(update.params[k], start.params[k]) for k in start.params)  # it trained
    warned = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
    assert len(warned) == 1 and "fresh optimizer" in one_line(warned[0])
    stored = torch.load(learner.state_dir / OPTIMIZER_ROUNDS / "round_002.pt", weights_only=True)
    assert {int(s["step"]) for s in stored["state"].values()} == {1}  # Adam started afresh in round 2


def full_disk(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("where", ["save", "replace"])
def test_a_full_disk_is_one_line_naming_the_file(tmp_path, monkeypatch, where):
    # issue 40 point 9: an OSError of a full disk reached NVFlare as a traceback
    path = tmp_path / "cxrfl_resume" / "job-1" / "state.pt"
    monkeypatch.setattr(
        *((io_module.torch, "save", full_disk) if where == "save" else (io_module.os, "replace", full_disk))
    )
    with pytest.raises(CxrflError) as err:
        ResumeStore(tmp_path / "cxrfl_resume", "job-1").save({"settings": {}, "round": 1})
    text = one_line(err.value)
    assert str(path) in text and "disk is full" in text
    assert not path.exists() and os.listdir(path.parent) == []  # no temporary file left


# ------------------------------------------------------------ what a state may hold
def test_resume_states_are_written_so_that_they_load_without_pickle_code(tmp_path):
    # issue 40 point 2: states hold numpy arrays and scalars, which weights_only=True refuses
    store = ResumeStore(tmp_path, "job-1")
    params = {"w": np.arange(6, dtype=np.float32).reshape(2, 3)}
    store.save(
        {
            "settings": {"lr": np.float64(0.5)},
            "params": params,
            "curve": [{"loss": np.float32(1.5)}],
            "best": None,
            "names": np.array(["a", "b"]),
            "shape": (2, 3),
        }
    )
    saved = torch.load(store.folder / "state.pt", weights_only=True)
    assert torch.equal(saved["params"]["w"], torch.as_tensor(params["w"]))
    assert saved["settings"] == {"lr": 0.5} and saved["curve"] == [{"loss": 1.5}] and saved["names"] == ["a", "b"]
    assert saved["shape"] == (2, 3) and saved["best"] is None
    progress = Progress(stage=2, params=params, margins={"m_in": np.float64(-3.0)})
    store.save({"settings": {}, **progress.to_state()})
    loaded = Progress.from_state(store.load("job-1", {}, []))
    np.testing.assert_array_equal(loaded.params["w"], params["w"])
    assert loaded.margins == {"m_in": -3.0}


def test_a_state_of_an_older_cxrfl_is_refused_with_one_line(tmp_path):
    # issue 40 point 2: states written before the change hold numpy arrays (refused, not run)
    path = tmp_path / "job-1" / "state.pt"
    path.parent.mkdir()
    torch.save({"settings": {}, "params": {"w": np.zeros(3)}}, path)
    with pytest.raises(ConfigError) as err:
        ResumeStore(tmp_path, "job-2").load("job-1", {}, [])
    assert str(path) in one_line(err.value) and "older cxrfl" in str(err.value)


# ------------------------------------------------------------ point 12: cxrfl's own line
@pytest.mark.parametrize("kind", ["pickle", "text"])
def test_a_file_that_is_no_checkpoint_is_one_cxrfl_line(tmp_path, kind):
    # issue 40 point 12: torch's advice to use weights_only=False reached the user
    path, marker = tmp_path / "model.pt", tmp_path / "MARKER"
    if kind == "pickle":
        path.write_bytes(pickle.dumps({"model": Payload(marker)}))
    else:
        path.write_text("not a model\n")
    with pytest.raises(ConfigError) as err:
        load_checkpoint(path)
    assert str(path) in one_line(err.value) and "checkpoint" in str(err.value)
    assert not marker.exists()


def test_a_site_task_that_hits_a_full_disk_fails_with_one_line_and_no_traceback(tmp_path, monkeypatch):
    # issue 40 point 9: TaskExecutor logged a full disk (any CxrflError) with log_exception, a traceback
    from cxrfl.fl.base import TaskExecutor
    from nvflare.apis.fl_constant import ReturnCode
    from nvflare.apis.fl_context import FLContext
    from nvflare.apis.signal import Signal
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
    from nvflare.app_common.utils.fl_model_utils import FLModelUtils

    class FullDisk:
        tasks = ("train",)

        def handle(self, task, params, meta):
            return {}, {"saved": str(torch_save(tmp_path / "site" / "optimizer.pt", {"step": 1}))}

    class Executor(TaskExecutor):
        def make_host(self, data, device, state_root):
            return FullDisk()

    monkeypatch.setattr(io_module.os, "replace", full_disk)
    executor, logged = Executor(num_workers=0), []
    executor.site, executor.host = "hospital-a", FullDisk()
    monkeypatch.setattr(executor, "log_error", lambda ctx, msg, *a, **k: logged.append(("error", msg)))
    monkeypatch.setattr(executor, "log_exception", lambda ctx, msg, *a, **k: logged.append(("exception", msg)))
    task = FLModelUtils.to_shareable(FLModel(params_type=ParamsType.FULL, params={}, meta={}))
    reply = executor.execute("train", task, FLContext(), Signal())
    assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION
    assert len(logged) == 1 and logged[0][0] == "error"
    assert str(tmp_path / "site" / "optimizer.pt") in one_line(logged[0][1]) and "disk is full" in logged[0][1]
