"""Real deployment on loopback: provisioned kits (real certificates), separate processes, FLARE API.

Fast tests check the pieces (kits, site configs, job variants, privacy filters). The two slow
scenarios run the whole path with the ``cxrfl deploy`` commands, as a project lead and the
hospitals would:

- production mode (``nvflare provision``): server, hospital-a and hospital-b as separate
  processes, each site with its own ``local/cxrfl_site.yaml`` (demo data, NIH-like 14 classes vs
  CheXpert-like 13); hospital-a's org admin submits ``jobs/surgical_agg`` in the pre-installed
  mode (no ``app/custom``) and is refused its download (the server's records name every site's
  classes: only the project admin downloads them), and the server refuses its ``vanilla_fl`` job
  (the union head would tell hospital-a hospital-b's classes); hospital-b's org admin is refused a
  bring-your-own-code job; then hospital-a's kit declares one GPU, and NVFlare schedules a GPU job
  that needs two sites nowhere and one that needs one site on hospital-a alone;
- POC mode (``nvflare poc prepare -i poc/project.yml`` / ``poc start`` / ``poc stop``): the lead
  submits the bring-your-own-code variant (package in ``app/custom``) with NVFlare's percentile
  privacy filter on.

Both check the union of classes, that nothing of hospital-b names a class only hospital-a
annotates, and that every process started is gone afterwards.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from conftest import names_in, nvflare_bin
from cxrfl.common.io import read_records
from cxrfl.data.labels import CHEXPERT_CLASSES, KNOWN_CLASSES, NIH_CLASSES, NIH_COLUMN_NAMES
from cxrfl.deploy.admin import COMPLETED
from cxrfl.deploy.jobs import build_job
from cxrfl.deploy.processes import find_processes, terminate
from cxrfl.deploy.provision import declare_gpus, install_site_config, prepare_kit, provision
from cxrfl.deploy.workspace import Deployment, free_port
from cxrfl.errors import CxrflError
from cxrfl.jobs import app_dirs
from cxrfl.synth import write_profile

NIH_ONLY = sorted(set(NIH_CLASSES) - set(CHEXPERT_CLASSES))
NIH_ONLY_SPELLINGS = NIH_ONLY + [k for k, v in NIH_COLUMN_NAMES.items() if v in NIH_ONLY]
CHEXPERT_ONLY = sorted(set(CHEXPERT_CLASSES) - set(NIH_CLASSES))
UNION = sorted(set(NIH_CLASSES) | set(CHEXPERT_CLASSES))
TINY = "densenet-tiny"  # the network is not the subject here (DenseNet121 goes through NVFlare in a simulator test)
SMALL = {
    "num_rounds": 2,
    "model_config.arch": TINY,
    "train_config.warmup_epochs": 1,
    "train_config.batch_size": 16,
    "train_config.max_steps_per_epoch": 3,
}
LEAD, PROJECT_ADMIN = "lead@cxrfl.example", "admin@cxrfl.example"
ORG_ADMIN_A, ORG_ADMIN_B = "it@hospital-a.example", "it@hospital-b.example"
IMAGE_SUFFIXES = {".png", ".jpg", ".jpeg", ".dcm"}


# ------------------------------------------------------------------------------- helpers
def cli_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CXRFL_SITE_CONFIG")}
    env["HOME"] = str(tmp / "userhome")  # must stay unused: deploy commands give NVFlare a HOME in WS
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def cxrfl(
    tmp: Path, *args: str, timeout: float = 600, check: bool = True, home: Path | None = None
) -> subprocess.CompletedProcess:
    cmd = [str(Path(sys.executable).with_name("cxrfl")), *args]
    env = cli_env(tmp)
    if home is not None:
        env["HOME"] = str(home)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=tmp)
    if check and proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def leaks(roots: list[Path], names: list[str]) -> dict[str, list[str]]:
    out = {}
    for root in roots:
        for p in root.rglob("*"):
            if p.is_file() and not p.is_symlink():
                hit = names_in(p, names)
                if hit:
                    out[str(p)] = hit
    return out


def live_processes_under(path: Path) -> list[str]:
    import psutil

    found = []
    for p in psutil.process_iter(["pid", "cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and str(path) in " ".join(p.info["cmdline"] or []):
                found.append(f"{p.pid}: {' '.join(p.info['cmdline'])[:200]}")
        except psutil.NoSuchProcess:
            continue
    return found


def site_data(tmp: Path) -> dict[str, Path]:
    configs = write_profile(
        "two-hospitals", tmp / "data", n_per_site=60, image_size=64, sites=["hospital-a", "hospital-b"]
    )
    return {p.stem: p for p in configs}


# ------------------------------------------------------------------------- fast: the pieces
def test_project_has_server_three_hospitals_and_distinct_roles(repo_root):
    project = yaml.safe_load((repo_root / "poc" / "project.yml").read_text())
    assert project["api_version"] == 3
    by_type = {}
    for p in project["participants"]:
        by_type.setdefault(p["type"], []).append(p)
    assert len(by_type["server"]) == 1
    assert [c["name"] for c in by_type["client"]] == ["hospital-a", "hospital-b", "hospital-c"]
    roles = {a["name"]: (a["role"], a["org"]) for a in by_type["admin"]}
    assert roles[PROJECT_ADMIN][0] == "project_admin" and roles[LEAD][0] == "lead"
    orgs = {c["name"]: c["org"] for c in by_type["client"]}
    for site, org in orgs.items():
        assert (f"it@{site}.example" in roles) and roles[f"it@{site}.example"] == ("org_admin", org)


def test_provision_writes_kits_into_the_workspace_only(tmp_path, repo_root, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "userhome"))
    port = free_port()
    dep = provision(repo_root / "poc" / "project.yml", tmp_path / "ws", server_host="localhost", port=port)
    assert dep.mode == "prod" and dep.port == port and dep.clients == ["hospital-a", "hospital-b", "hospital-c"]
    assert Path(dep.kits).is_relative_to(tmp_path / "ws")
    assert not (tmp_path / "userhome").exists()
    server = dep.kit("server")
    target = json.loads((server / "startup" / "fed_server.json").read_text())["servers"][0]["service"]["target"]
    assert target == f"localhost:{port}"  # listens on loopback only
    from nvflare.app_common.default_component_policy import DEFAULT_CLASS_ALLOW_LIST

    for name in (dep.server, *dep.clients):
        kit = dep.kit(name)
        res = json.loads((kit / "local" / "resources.json").read_text())
        assert "cxrfl." in res["class_allow_list"] and set(DEFAULT_CLASS_ALLOW_LIST) <= set(res["class_allow_list"])
        assert "/tmp/nvflare" not in json.dumps(res)
        policy = json.loads((kit / "local" / "authorization.json").read_text())["permissions"]
        assert policy["org_admin"]["byoc"] == "none" and policy["org_admin"]["submit_job"] == "any"
        assert policy["org_admin"]["download_job"] == "none"  # issue 40: never the server's records
        assert policy["lead"]["byoc"] == "any"
    res = json.loads((server / "local" / "resources.json").read_text())
    assert res["snapshot_persistor"]["args"]["storage"]["args"]["root_dir"].startswith(str(tmp_path / "ws"))
    admin = json.loads((dep.kit(LEAD) / "startup" / "fed_admin.json").read_text())["admin"]
    assert (admin["host"], admin["port"]) == ("localhost", port)
    assert Deployment.load(tmp_path / "ws").server == dep.server
    with pytest.raises(CxrflError, match="already holds a deployment"):
        provision(repo_root / "poc" / "project.yml", tmp_path / "ws")
    # preparing twice keeps one cxrfl. entry
    prepare_kit(dep.kit("hospital-a"))
    res = json.loads((dep.kit("hospital-a") / "local" / "resources.json").read_text())
    assert res["class_allow_list"].count("cxrfl.") == 1


def test_site_config_goes_into_the_kit_with_absolute_paths(tmp_path, repo_root, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "userhome"))
    monkeypatch.delenv("CXRFL_SITE_CONFIG", raising=False)
    dep = provision(repo_root / "poc" / "project.yml", tmp_path / "ws", server_host="localhost", port=free_port())
    configs = site_data(tmp_path)
    path = install_site_config(dep.kit("hospital-b"), configs["hospital-b"])
    assert path == dep.kit("hospital-b") / "local" / "cxrfl_site.yaml"
    cfg = yaml.safe_load(path.read_text())
    assert cfg["site"] == "hospital-b" and Path(cfg["dataset"]["labels"]).is_absolute()
    from cxrfl.fl.executor import resolve_site_config

    assert resolve_site_config("hospital-b", dep.kit("hospital-b") / "local")[0] == path
    with pytest.raises(CxrflError, match="describes site 'hospital-a'"):
        install_site_config(dep.kit("hospital-b"), configs["hospital-a"])


def _configs(job: Path) -> dict[str, dict]:
    configs = [p for app in app_dirs(job) for p in sorted((app / "config").glob("*.json"))]
    return {p.name: json.loads(p.read_text()) for p in [job / "meta.json", *configs]}


def test_job_variants_are_the_committed_jobs(tmp_path, repo_root):
    pre = build_job("surgical_agg", tmp_path / "pre", mode="preinstalled")
    byoc = build_job("surgical_agg", tmp_path / "byoc", mode="byoc")
    assert not (pre / "app" / "custom").exists()
    assert (byoc / "app" / "custom" / "cxrfl" / "fl" / "executor.py").is_file()
    assert not list((byoc / "app" / "custom").rglob("__pycache__"))
    committed = _configs(repo_root / "jobs" / "surgical_agg")
    assert _configs(pre) == committed and _configs(byoc) == committed
    small = build_job("surgical_agg_fedbn", tmp_path / "small", overrides=SMALL)
    args = _configs(small)["config_fed_server.json"]["workflows"][0]["args"]
    assert args["num_rounds"] == 2 and args["train_config"]["max_steps_per_epoch"] == 3 and args["batchnorm"] == "fedbn"
    with pytest.raises(CxrflError, match="unknown setting"):
        build_job("surgical_agg", tmp_path / "bad", overrides={"num_round": 2})
    for job in (pre, byoc, small):  # nothing about a site's data or classes in what the admin submits
        for p in job.rglob("*.json"):
            assert not names_in(p, list(KNOWN_CLASSES)) and "site_config" not in p.read_text()


def _component_paths(obj):
    if isinstance(obj, dict):
        if isinstance(obj.get("path"), str):
            yield obj["path"]
        for v in obj.values():
            yield from _component_paths(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _component_paths(v)


def test_every_job_builds_in_both_modes_and_passes_a_prepared_allow_list(tmp_path, repo_root):
    from cxrfl.jobs import JOBS
    from nvflare.app_common.default_component_policy import DEFAULT_CLASS_ALLOW_LIST
    from nvflare.app_common.widgets.component_path_authorizer import ComponentPathAuthorizer

    allow = [*DEFAULT_CLASS_ALLOW_LIST, "cxrfl."]  # what prepare-kit writes into local/resources.json
    for spec in JOBS:
        committed = repo_root / "jobs" / spec.name
        assert committed.is_dir(), spec.name
        pre = build_job(spec.name, tmp_path / "pre", mode="preinstalled")
        byoc = build_job(spec.name, tmp_path / "byoc", mode="byoc")
        assert _configs(pre) == _configs(committed) == _configs(byoc), spec.name
        assert not any((app / "custom").exists() for app in app_dirs(pre))
        assert all((app / "custom" / "cxrfl" / "__init__.py").is_file() for app in app_dirs(byoc))
        for path in _component_paths(_configs(pre)):
            assert any(ComponentPathAuthorizer._path_matches_prefix(path, p) for p in allow), (spec.name, path)
        # without cxrfl. a pre-installed job is refused (NVFlare's ComponentNotAuthorized)
        assert not all(
            any(ComponentPathAuthorizer._path_matches_prefix(path, p) for p in DEFAULT_CLASS_ALLOW_LIST)
            for path in _component_paths(_configs(pre))
        )


def test_privacy_options_are_off_by_default_and_written_explicitly(tmp_path, repo_root):
    for job in (repo_root / "jobs").iterdir():
        client = json.loads((app_dirs(job)[-1] / "config" / "config_fed_client.json").read_text())
        assert client["task_data_filters"] == [] and client["task_result_filters"] == []
    job = build_job(
        "surgical_agg_fedbn", tmp_path, privacy={"method": "svt", "args": {"epsilon": 0.5}}, exclude_batchnorm=True
    )
    client = json.loads((job / "app" / "config" / "config_fed_client.json").read_text())
    (data_chain,) = client["task_data_filters"]
    (result_chain,) = client["task_result_filters"]
    assert data_chain["tasks"] == ["train"] == result_chain["tasks"]
    exclude, svt = result_chain["filters"]
    assert exclude["path"] == "nvflare.app_common.filters.exclude_vars.ExcludeVars"
    assert (
        svt
        == data_chain["filters"][0]
        == {
            "path": "cxrfl.fl.privacy.UpdatePrivacy",
            "args": {
                "method": "svt",
                "args": {
                    "fraction": 0.9,
                    "epsilon": 0.5,
                    "noise_var": 100000,
                    "gamma": 1.0,
                    "tau": 1e-6,
                    "replace": False,
                },
            },
        }
    )
    from cxrfl.nn.models import ModelConfig, batchnorm_keys, build_model

    model = build_model(ModelConfig(image_size=64), 3)
    assert exclude["args"]["exclude_vars"] == batchnorm_keys(model)
    assert any(".norm0." in k for k in exclude["args"]["exclude_vars"])  # torchvision's names, selected by type
    with pytest.raises(CxrflError, match="exclude_batchnorm needs batchnorm"):
        build_job("surgical_agg", tmp_path / "x", exclude_batchnorm=True)
    with pytest.raises(CxrflError, match="unknown percentile privacy argument"):
        build_job("surgical_agg", tmp_path / "y", privacy={"method": "percentile", "args": {"epsilon": 1}})


def test_exclude_vars_filter_keeps_every_batchnorm_entry_on_the_site():
    from cxrfl.fl.recipes import batchnorm_state_keys
    from cxrfl.nn.models import ModelConfig, build_model
    from nvflare.apis.dxo import DXO, DataKind
    from nvflare.apis.fl_context import FLContext
    from nvflare.apis.shareable import Shareable
    from nvflare.app_common.filters.exclude_vars import ExcludeVars

    cfg = ModelConfig(image_size=64)
    state = {k: v.numpy() for k, v in build_model(cfg, 2).state_dict().items()}
    keys = batchnorm_state_keys(cfg)
    out = ExcludeVars(exclude_vars=keys).process_dxo(DXO(DataKind.WEIGHTS, dict(state)), Shareable(), FLContext())
    assert set(out.data) == set(state) - set(keys)
    assert not any("norm" in k.rsplit(".", 2)[-2] for k in out.data)


def test_update_privacy_filters_the_difference_not_the_weights():
    from cxrfl.fl.privacy import UpdatePrivacy
    from nvflare.apis.filter import FilterChainType, FilterContextKey
    from nvflare.apis.fl_constant import FLContextKey
    from nvflare.apis.fl_context import FLContext
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
    from nvflare.app_common.utils.fl_model_utils import FLModelUtils

    rng = np.random.default_rng(0)
    received = {"w": rng.normal(size=(50, 20)).astype(np.float32), "n": np.array(7)}
    result = {
        "w": received["w"] + rng.normal(scale=0.5, size=(50, 20)).astype(np.float32),
        "n": np.array(9),
        "classifier.weight": rng.normal(scale=2.0, size=(3, 20)).astype(np.float32),
    }
    data_f, result_f = (
        UpdatePrivacy("percentile", {"percentile": 50, "gamma": 0.5}),
        UpdatePrivacy("percentile", {"percentile": 50, "gamma": 0.5}),
    )
    data_f.set_prop(FilterContextKey.CHAIN_TYPE, FilterChainType.TASK_DATA_CHAIN)
    result_f.set_prop(FilterContextKey.CHAIN_TYPE, FilterChainType.TASK_RESULT_CHAIN)
    ctx = FLContext()
    ctx.set_prop(FLContextKey.TASK_ID, "task-1", private=True, sticky=False)
    task = FLModelUtils.to_shareable(FLModel(params_type=ParamsType.FULL, params=received, meta={"round": 1}))
    assert data_f.process(task, ctx) is task
    reply = FLModelUtils.to_shareable(FLModel(params_type=ParamsType.FULL, params=result, meta={"classes": ["a"]}))
    out = FLModelUtils.from_shareable(result_f.process(reply, ctx))
    diff = out.params["w"] - received["w"]
    assert np.abs(diff).max() <= 0.5 + 1e-6  # the update is clipped, not the weights
    assert np.abs(out.params["w"]).max() > 2.0
    assert 0.4 < float(np.mean(diff == 0)) < 0.6  # the smaller half of the differences is withheld
    assert out.params["w"].dtype == np.float32 and int(out.params["n"]) == 9
    assert np.abs(out.params["classifier.weight"]).max() <= 0.5 + 1e-6  # no received value: filtered from zero
    assert out.meta["classes"] == ["a"]


def _kit_component(kit: Path, cid: str):
    """The component ``cid`` of a kit's local/resources.json, built as NVFlare builds it at start."""
    comp = next(c for c in json.loads((kit / "local" / "resources.json").read_text())["components"] if c["id"] == cid)
    module, _, name = comp["path"].rpartition(".")
    return getattr(__import__(module, fromlist=[name]), name)(**comp.get("args", {}))


def test_a_site_offers_the_gpus_its_kit_declares_one_job_per_gpu(tmp_path, repo_root, monkeypatch):
    """Issue 46 point 1: each site's resource manager, built from its kit as NVFlare builds it, is asked
    for the committed GPU job's request the way NVFlare's scheduler asks it. A kit as NVFlare provisions
    it offers no GPU; one that declares two GPUs runs two such jobs, each pinned to its own GPU, and a
    third waits. Nothing checks the hardware here (a CPU machine declares GPU indices it does not have)."""
    from nvflare.utils.job_launcher_utils import get_resource_manager_spec

    monkeypatch.setenv("HOME", str(tmp_path / "userhome"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    dep = provision(repo_root / "poc" / "project.yml", tmp_path / "ws", server_host="localhost", port=free_port())
    assert declare_gpus(dep.kit("hospital-a"), [0, 1])["gpus"] == [0, 1]
    meta = json.loads((repo_root / "jobs" / "surgical_agg_gpu" / "meta.json").read_text())
    with_gpus, without = (
        _kit_component(dep.kit("hospital-a"), "resource_manager"),
        _kit_component(dep.kit("hospital-b"), "resource_manager"),
    )
    asked = get_resource_manager_spec(meta, "hospital-a")
    first, second, third = (with_gpus.check_resources(asked, None) for _ in range(3))
    assert first[0] and second[0] and not third[0]  # one job per GPU
    assert not without.check_resources(get_resource_manager_spec(meta, "hospital-b"), None)[0]
    assert without.check_resources({}, None)[0] and with_gpus.check_resources({}, None)[0]  # CPU jobs go everywhere
    consumer = _kit_component(dep.kit("hospital-a"), "resource_consumer")
    for token, gpu in ((first[1], "0"), (second[1], "1")):
        consumer.consume(with_gpus.allocate_resources(asked, token, None))
        assert os.environ["CUDA_VISIBLE_DEVICES"] == gpu  # the job process NVFlare starts next inherits it
    prepare_kit(dep.kit("hospital-a"))  # preparing the kit again keeps what the site declared
    assert _kit_component(dep.kit("hospital-a"), "resource_manager").check_resources(asked, None)[0]
    with pytest.raises(CxrflError, match="distinct GPU indices"):
        declare_gpus(dep.kit("hospital-b"), [0, 0])
    with pytest.raises(CxrflError, match="site kit"):
        declare_gpus(dep.kit("server"), [0])
    assert declare_gpus(dep.kit("hospital-a"), [])["gpus"] == []
    assert not _kit_component(dep.kit("hospital-a"), "resource_manager").check_resources(asked, None)[0]


def test_submit_reports_why_nvflare_has_not_scheduled_a_job():
    """Issue 46 point 1: a job no site can take waits in NVFlare's queue; `cxrfl deploy submit` said only
    that waiting timed out. It now gives NVFlare's reasons (the job's schedule_history) and the request."""
    from cxrfl.deploy.admin import not_scheduled

    class Session:
        def __init__(self, meta):
            self.meta = meta

        def get_job_meta(self, job_id):
            return self.meta

    spec = {"@default": {"num_of_gpus": 1}}
    history = [
        "2026-11-25 10:00:01: not enough sites have enough resources (ok sites 1 < min sites 2)",
        "2026-11-25 10:00:11: not enough sites have enough resources (ok sites 1 < min sites 2)",
        "2026-11-25 10:10:11: exceeded max schedule count 10",
    ]
    waiting = not_scheduled(
        Session({"status": "SUBMITTED", "schedule_history": history[:2], "resource_spec": spec}), "j"
    )
    assert waiting == {
        "not_scheduled": "not enough sites have enough resources (ok sites 1 < min sites 2)",
        "resource_spec": spec,
    }
    gave_up = not_scheduled(Session({}), "j", {"status": "FINISHED:CAN_NOT_SCHEDULE", "schedule_history": history})
    assert gave_up["not_scheduled"].endswith("(ok sites 1 < min sites 2); exceeded max schedule count 10")
    ran = {"status": "FINISHED:COMPLETED", "schedule_history": history[:1] + ["2026-11-25 10:00:21: scheduled"]}
    assert not_scheduled(Session(ran), "j") == {}


def test_deploy_cli_is_wired(tmp_path):
    proc = cxrfl(tmp_path, "deploy", "--help")
    for command in (
        "provision",
        "prepare-kit",
        "site-gpus",
        "site-config",
        "job",
        "start",
        "status",
        "submit",
        "download",
        "abort",
        "stop",
    ):
        assert command in proc.stdout


# ---------------------------------------------------------------------- slow: production mode
def _stop_and_check(tmp: Path, ws: Path) -> dict:
    """Stop everything the workspace runs (CLI, then signals as a fallback); returns stop's report."""
    report: dict = {}
    try:
        proc = cxrfl(tmp, "deploy", "stop", "--workspace", str(ws), "--timeout", "90", timeout=300, check=False)
        try:
            report = json_out(proc)
        except BaseException:  # pytest.fail inside a fixture's finally: keep cleaning up
            report = {"stdout": proc.stdout[-2000:], "stderr": proc.stderr[-2000:]}
        report["rc"] = proc.returncode
    finally:
        report["terminated_after_stop"] = terminate(ws)
        time.sleep(1)
        report["left_after"] = find_processes(ws) + live_processes_under(ws)
    return report


@contextlib.contextmanager
def phase(out: dict, name: str) -> Iterator[None]:
    """One phase of the production deployment: its failure is recorded for the tests that read it (see
    :func:`passed`) and the next phases still run, so one failure does not hide the others."""
    t = time.perf_counter()
    try:
        yield
    except (Exception, pytest.fail.Exception):
        out["failed"][name] = traceback.format_exc()[-4000:]
    finally:
        out["timings"][name] = time.perf_counter() - t


def passed(run: dict, name: str) -> dict:
    """The deployment's record once its phase ``name`` ran through; else the reading test fails with that error."""
    if name in run["failed"]:
        pytest.fail(f"the deployment's {name!r} phase failed: {run['failed'][name]}")
    return run


@pytest.fixture(scope="module")
def deployment(tmp_path_factory, repo_root):
    """Provision, configure, start; phase ``jobs``: submit (pre-installed; refused union and BYOC), download,
    evaluate, status; phase ``gpu``: a GPU job that cannot be scheduled, aborted, and one that runs; stop."""
    tmp = tmp_path_factory.mktemp("deploy_prod")
    ws = tmp / "ws"
    out: dict = {"tmp": tmp, "ws": ws, "timings": {}, "failed": {}}
    t0 = time.perf_counter()
    configs = site_data(tmp)
    port = free_port()
    cxrfl(
        tmp,
        "deploy",
        "provision",
        "--project",
        str(repo_root / "poc" / "project.yml"),
        "--workspace",
        str(ws),
        "--server-host",
        "localhost",
        "--port",
        str(port),
    )
    dep = Deployment.load(ws)
    out["dep"] = dep
    for site in ("hospital-a", "hospital-b"):
        cxrfl(tmp, "deploy", "site-config", "--workspace", str(ws), site, str(configs[site]))
    out["gpus"] = json_out(cxrfl(tmp, "deploy", "site-gpus", "--workspace", str(ws), "hospital-a", "0"))["gpus"]
    env = cli_env(tmp)
    env["HOME"] = str(ws / "home" / "cli")
    nvflare = nvflare_bin()
    out["preflight_server"] = subprocess.run(
        [nvflare, "preflight-check", "-p", str(dep.kit("server"))], env=env, capture_output=True, text=True, timeout=180
    )
    pre = build_job("surgical_agg", tmp / "jobs_pre", mode="preinstalled", overrides=SMALL)
    byoc = build_job("surgical_agg", tmp / "jobs_byoc", mode="byoc", overrides={**SMALL, "num_rounds": 1})
    union = build_job("vanilla_fl", tmp / "jobs_union", mode="preinstalled", overrides={**SMALL, "num_rounds": 1})
    out["jobs"] = {"pre": pre, "byoc": byoc, "union": union}
    gpu_both, gpu_one = _tiny_gpu_job(tmp / "jobs_gpu", 2), _tiny_gpu_job(tmp / "jobs_gpu", 1)
    out["timings"]["setup"] = time.perf_counter() - t0
    try:
        t = time.perf_counter()
        cxrfl(tmp, "deploy", "start", "--workspace", str(ws), "--only", "server", "--timeout", "240", timeout=400)
        # a site's preflight check logs in as the site: run it before the site starts, never while it runs
        out["preflight_site"] = subprocess.run(
            [nvflare, "preflight-check", "-p", str(dep.kit("hospital-b"))],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        cxrfl(
            tmp,
            "deploy",
            "start",
            "--workspace",
            str(ws),
            "--only",
            "hospital-a",
            "hospital-b",
            "--timeout",
            "240",
            timeout=400,
        )
        out["timings"]["start"] = time.perf_counter() - t
        with phase(out, "jobs"):
            t = time.perf_counter()
            proc = cxrfl(
                tmp,
                "deploy",
                "submit",
                str(pre),
                "--workspace",
                str(ws),
                "--admin",
                ORG_ADMIN_A,
                "--timeout",
                "600",
                "--download",
                str(tmp / "download"),
                timeout=900,
                check=False,
            )
            out["timings"]["preinstalled_job"] = time.perf_counter() - t
            out["submit_pre"] = proc
            job_id = json_out(proc).get("job_id", "none")
            out["download_project_admin"] = cxrfl(
                tmp,
                "deploy",
                "download",
                job_id,
                "--workspace",
                str(ws),
                "--out",
                str(tmp / "download_project_admin"),
                timeout=300,
                check=False,
            )
            t = time.perf_counter()
            out["submit_union_org_admin"] = cxrfl(
                tmp,
                "deploy",
                "submit",
                str(union),
                "--workspace",
                str(ws),
                "--admin",
                ORG_ADMIN_A,
                "--timeout",
                "300",
                "--download",
                str(tmp / "download"),
                timeout=400,
                check=False,
            )
            out["timings"]["union_refusal"] = time.perf_counter() - t
            t = time.perf_counter()
            out["submit_byoc_org_admin"] = cxrfl(
                tmp,
                "deploy",
                "submit",
                str(byoc),
                "--workspace",
                str(ws),
                "--admin",
                ORG_ADMIN_B,
                "--timeout",
                "300",
                timeout=400,
                check=False,
            )
            out["timings"]["byoc_refusal"] = time.perf_counter() - t
            t = time.perf_counter()
            out["submit_fedeval"] = cxrfl(
                tmp,
                "deploy",
                "submit",
                str(fedeval_job(tmp, repo_root)),
                "--workspace",
                str(ws),
                "--timeout",
                "300",
                "--download",
                str(tmp / "download_fedeval"),
                timeout=400,
                check=False,
            )
            out["timings"]["fedeval_job"] = time.perf_counter() - t
            out["status"] = cxrfl(tmp, "deploy", "status", "--workspace", str(ws), timeout=120, check=False)
        with phase(out, "gpu"):
            # a wait of 10 s: NVFlare's scheduler first tried (and refused) this job 0.2 s after submission (measured)
            out["gpu_waiting"] = cxrfl(
                tmp,
                "deploy",
                "submit",
                str(gpu_both),
                "--workspace",
                str(ws),
                "--timeout",
                "10",
                timeout=300,
                check=False,
            )
            out["gpu_aborted"] = cxrfl(
                tmp,
                "deploy",
                "abort",
                json_out(out["gpu_waiting"]).get("job_id", "none"),
                "--workspace",
                str(ws),
                timeout=300,
                check=False,
            )
            out["gpu_ran"] = cxrfl(
                tmp,
                "deploy",
                "submit",
                str(gpu_one),
                "--workspace",
                str(ws),
                "--timeout",
                "600",
                timeout=900,
                check=False,
            )
    finally:
        t = time.perf_counter()
        out["stop"] = _stop_and_check(tmp, ws)
        out["timings"]["stop"] = time.perf_counter() - t
    out["timings"]["total"] = time.perf_counter() - t0
    print(f"\ndeployment (production mode) timings: {json.dumps({k: round(v, 1) for k, v in out['timings'].items()})}")
    return out


@pytest.fixture
def prod(deployment):
    return passed(deployment, "jobs")


def fedeval_job(tmp: Path, repo_root: Path) -> Path:
    """The evaluation-only job (issue 45) for the two hospitals, carrying a model no job here trained."""
    from cxrfl.nn.models import ModelConfig, build_model, save_checkpoint

    torch.manual_seed(0)
    config = ModelConfig(image_size=64, arch=TINY)
    model = tmp / "external_model.pt"
    save_checkpoint(model, build_model(config, len(KNOWN_CLASSES)), classes=list(KNOWN_CLASSES), model_config=config)
    subprocess.run(
        [
            sys.executable,
            str(repo_root / "job_recipes" / "fedeval" / "job.py"),
            "--model",
            str(model),
            "--clients",
            "hospital-a,hospital-b",
            "--min_cell",
            "1",
            "--export",
            "--export-dir",
            str(tmp / "jobs_fedeval"),
        ],
        env={**cli_env(tmp), "HOME": str(tmp / "export_home")},  # the export may write caches: not the user's
        check=True,
        capture_output=True,
        timeout=300,
    )
    return tmp / "jobs_fedeval" / "fedeval"


def json_out(proc: subprocess.CompletedProcess) -> dict:
    """The JSON object a ``cxrfl deploy`` command printed."""
    text = proc.stdout
    start, end = text.find("\n{") + 1 if not text.startswith("{") else 0, text.rfind("}")
    try:
        return json.loads(text[start : end + 1])
    except json.JSONDecodeError:
        pytest.fail(f"no JSON in the output (rc={proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")


_submitted = json_out


def _server_app(result: dict) -> Path:
    return Path(result["result"]) / "workspace" / "app_server"


@pytest.mark.slow
def test_prod_evaluation_only_job_pools_each_class_over_the_sites_that_label_it(prod):
    # issue 45 point 1: the evaluation job in a provisioned (loopback) deployment, on a model it did not train
    result = json_out(prod["submit_fedeval"])
    assert result["status"] == COMPLETED, result
    report = json.loads((_server_app(result) / "cxrfl" / "evaluation.json").read_text())
    assert list(report["classes"]) == list(KNOWN_CLASSES)
    for c, entry in report["classes"].items():
        labelling = [s for s, own in (("hospital-a", NIH_CLASSES), ("hospital-b", CHEXPERT_CLASSES)) if c in own]
        assert entry["sites_labelling"] == labelling, c
    shared = set(NIH_CLASSES) & set(CHEXPERT_CLASSES)
    assert any(report["classes"][c]["sites_pooled"] == ["hospital-a", "hospital-b"] for c in shared)
    assert report["mean_auroc"] is not None


@pytest.mark.slow
def test_prod_kits_pass_preflight_check(prod):
    assert prod["preflight_server"].returncode == 0, prod["preflight_server"].stdout[-3000:]
    assert "overall: pass" in prod["preflight_site"].stdout, prod["preflight_site"].stdout[-3000:]


@pytest.mark.slow
def test_prod_preinstalled_job_completes_with_the_union_of_classes(prod):
    result = _submitted(prod["submit_pre"])
    assert result["status"] == COMPLETED, result
    assert result["bring_your_own_code"] is False and result["admin"] == ORG_ADMIN_A
    # the org admin's download is refused (issue 40): the project admin downloads the server's records
    result = json_out(prod["download_project_admin"])
    assert prod["download_project_admin"].returncode == 0 and result["admin"] == PROJECT_ADMIN, result
    ckpt = torch.load(_server_app(result) / "FL_global_model.pt", map_location="cpu", weights_only=False)
    assert ckpt["classes"] == UNION == list(KNOWN_CLASSES) and len(UNION) == 20
    assert ckpt["model"]["classifier.weight"].shape[0] == 20
    evaluation = json.loads((_server_app(result) / "cxrfl" / "evaluation.json").read_text())
    assert set(evaluation["sites"]) == {"hospital-a", "hospital-b"}
    # no privacy filter: few of the values a site sends equal the model it received (the control of the POC job's)
    records = [r for r in read_records(_server_app(result) / "cxrfl" / "rounds.jsonl") if r.get("round", 0) >= 1]
    shares = [r["unchanged_share"] for r in records if r.get("phase") == "train" and r.get("aggregated")]
    assert shares and all(v < 0.3 for s in shares for v in s.values()), shares


@pytest.mark.slow
def test_prod_status_lists_the_connected_sites(prod):
    status = json_out(prod["status"])
    assert status["clients"] == ["hospital-a", "hospital-b"]
    assert len(status["processes"]) >= 3


@pytest.mark.slow
def test_prod_sites_read_their_own_local_config(prod):
    dep = prod["dep"]
    for site in ("hospital-a", "hospital-b"):
        logs = "".join(p.read_text(errors="replace") for p in dep.kit(site).rglob("log.txt"))
        assert (
            f"reading site config {dep.kit(site) / 'local' / 'cxrfl_site.yaml'} (from the site's local/ folder)" in logs
        )


@pytest.mark.slow
def test_prod_metrics_reach_the_server_but_no_images(prod):
    result = json_out(prod["download_project_admin"])
    root = Path(result["result"])
    tb = root / "workspace" / "tb_events"
    for site in ("hospital-a", "hospital-b"):
        assert list((tb / site).rglob("events.out.tfevents.*")), f"no TensorBoard events from {site}"
    server_files = [p for p in [*root.rglob("*"), *prod["dep"].kit("server").rglob("*")] if p.is_file()]
    assert not [p for p in server_files if p.suffix.lower() in IMAGE_SUFFIXES]


@pytest.mark.slow
def test_prod_org_admin_is_refused_bring_your_own_code(prod):
    proc = prod["submit_byoc_org_admin"]
    result = _submitted(proc)
    assert result["bring_your_own_code"] is True and result["admin"] == ORG_ADMIN_B
    assert result["status"] == "FINISHED:FAILED_TO_RUN", result
    assert "BYOC not permitted" in result["refused"]
    assert proc.returncode == 1
    assert f"cxrfl: job refused for {ORG_ADMIN_B}: server: BYOC not permitted" in proc.stderr


@pytest.mark.slow
def test_prod_org_admin_of_hospital_a_gets_no_name_of_hospital_b_classes(prod):
    # issue 40 point 1: hospital-a's org admin submitted a job and downloaded the 20-class union, which sites hold
    # which class (rounds.jsonl) and every site's AUROC per class (evaluation.json); a vanilla_fl job it submitted
    # sent the union class list to hospital-a, where it reads it
    pre, union = prod["submit_pre"], prod["submit_union_org_admin"]
    result = json_out(pre)
    assert result["status"] == COMPLETED and "result" not in result, result
    assert "not authorized" in result["download_refused"].lower() and pre.returncode == 1, result
    assert f"download of job {result['job_id']} refused for {ORG_ADMIN_A}" in pre.stderr
    refused = json_out(union)
    assert refused["status"] == "FINISHED:EXECUTION_EXCEPTION" and union.returncode == 1, refused
    ws, dep, tmp = prod["ws"], prod["dep"], Path(prod["tmp"])
    import zipfile  # the job's server log, archived by NVFlare into its job store

    log = zipfile.ZipFile(ws / "storage" / "jobs-storage" / refused["job_id"] / "workspace").read("log.txt")
    assert (
        b"SurgicalAggregation sends every site class names other sites hold, and this job was submitted by role "
        b"'org_admin'" in log
    )
    # everything hospital-a's org admin received or can read at its own site
    roots = [
        tmp / "download",
        dep.kit("hospital-a"),
        ws / "home" / "hospital-a",
        ws / "tmp" / "hospital-a",
        dep.kit(ORG_ADMIN_A),
    ]
    files = [p for root in roots if root.exists() for p in root.rglob("*") if p.is_file()]
    assert len(files) > 10 and list(dep.kit("hospital-a").rglob("log.txt"))
    assert leaks(roots, CHEXPERT_ONLY) == {}
    # positive control: the same scan finds a hospital-b-only class planted in a copy of one of those files
    planted = tmp / "planted" / "log.txt"
    planted.parent.mkdir(exist_ok=True)
    planted.write_bytes(sorted(dep.kit("hospital-a").rglob("log.txt"))[0].read_bytes() + b"\nLung Opacity\n")
    assert leaks([planted.parent], CHEXPERT_ONLY) == {str(planted): ["Lung Opacity"]}
    # the server holds them (the project admin downloads them), in its owner-only job store
    assert leaks([_server_app(json_out(prod["download_project_admin"])) / "cxrfl"], CHEXPERT_ONLY)
    assert (ws / "storage" / "jobs-storage").stat().st_mode & 0o077 == 0


@pytest.mark.slow
def test_prod_hospital_b_never_sees_hospital_a_only_classes(prod):
    ws, dep = prod["ws"], prod["dep"]
    roots = [dep.kit("hospital-b"), ws / "home" / "hospital-b", ws / "tmp" / "hospital-b"]
    assert list(dep.kit("hospital-b").rglob("log.txt"))
    assert leaks(roots, NIH_ONLY_SPELLINGS) == {}
    # the scan does find these names where they are: hospital-a's label file and its site's logs
    assert leaks([Path(prod["tmp"]) / "data" / "hospital-a"], NIH_ONLY_SPELLINGS)


@pytest.mark.slow
def test_prod_every_process_is_stopped_and_nothing_written_outside(deployment):
    stop = deployment["stop"]
    assert stop.get("rc") == 0 and stop.get("left") == [], stop
    assert stop.get("graceful") == "ok", stop
    assert stop["left_after"] == []
    recorded = json.loads((deployment["ws"] / "cxrfl_processes.json").read_text())
    assert {e["name"] for e in recorded} == {deployment["dep"].server, "hospital-a", "hospital-b"}
    # a recorded pid counts as stopped when it is gone, a zombie, or reused by a process outside the workspace
    live = {int(line.split(":", 1)[0]) for line in live_processes_under(deployment["ws"])}
    assert not live & {e["pid"] for e in recorded}, live_processes_under(deployment["ws"])
    assert not (Path(deployment["tmp"]) / "userhome").exists()


# ----------------------------------------------------------------------------- slow: POC mode
@pytest.fixture(scope="module")
def poc(tmp_path_factory, repo_root):
    """nvflare poc prepare -i poc/project.yml; BYOC job with percentile privacy submitted by the lead."""
    tmp = tmp_path_factory.mktemp("deploy_poc")
    ws = tmp / "ws"
    out: dict = {"tmp": tmp, "ws": ws, "timings": {}}
    t0 = time.perf_counter()
    configs = site_data(tmp)
    cxrfl(
        tmp,
        "deploy",
        "provision",
        "--project",
        str(repo_root / "poc" / "project.yml"),
        "--workspace",
        str(ws),
        "--poc",
        "--port",
        str(free_port()),
    )
    dep = Deployment.load(ws)
    out["dep"] = dep
    for site in ("hospital-a", "hospital-b"):
        cxrfl(tmp, "deploy", "site-config", str(dep.kit(site)), str(configs[site]))  # by kit path, as a hospital would
    sets = [
        x
        for k, v in {**SMALL, "num_rounds": 1, "evaluate_test": False}.items()
        for x in ("--set", f"{k}={json.dumps(v)}")
    ]
    # building a job is not a workspace command (importing cxrfl's models lets matplotlib cache fonts in HOME)
    job = Path(
        cxrfl(
            tmp,
            "deploy",
            "job",
            "surgical_agg",
            "--mode",
            "byoc",
            "--out",
            str(tmp / "jobs"),
            *sets,
            "--privacy",
            "percentile",
            "--privacy-arg",
            "gamma=0.5",
            "--privacy-arg",
            "percentile=50",  # half of each update withheld: visible on the server (test_poc_lead_runs...)
            home=tmp / "buildhome",
        ).stdout.strip()
    )
    out["job"] = job
    out["timings"]["setup"] = time.perf_counter() - t0
    try:
        t = time.perf_counter()
        cxrfl(
            tmp,
            "deploy",
            "start",
            "--workspace",
            str(ws),
            "--only",
            "server",
            "hospital-a",
            "hospital-b",
            "--timeout",
            "240",
            timeout=400,
        )
        out["timings"]["start"] = time.perf_counter() - t
        t = time.perf_counter()
        out["submit"] = cxrfl(
            tmp,
            "deploy",
            "submit",
            str(job),
            "--workspace",
            str(ws),
            "--admin",
            LEAD,
            "--timeout",
            "600",
            "--download",
            str(tmp / "download"),
            timeout=900,
            check=False,
        )
        out["timings"]["byoc_job"] = time.perf_counter() - t
    finally:
        t = time.perf_counter()
        out["stop"] = _stop_and_check(tmp, ws)
        out["timings"]["stop"] = time.perf_counter() - t
    out["timings"]["total"] = time.perf_counter() - t0
    print(f"\ndeployment (POC mode) timings: {json.dumps({k: round(v, 1) for k, v in out['timings'].items()})}")
    return out


@pytest.mark.slow
def test_poc_workspace_comes_from_nvflare_poc_prepare(poc):
    dep = poc["dep"]
    assert dep.mode == "poc" and Path(dep.kits).is_relative_to(poc["ws"] / "poc")
    assert (poc["ws"] / "poc" / "project.yml").is_file()  # written by nvflare poc prepare
    assert (poc["ws"] / "home" / "cli" / ".nvflare" / "config.conf").is_file()  # NVFlare's config went into WS
    res = json.loads((dep.kit("server") / "local" / "resources.json").read_text())
    assert "/tmp/nvflare" not in json.dumps(res) and "cxrfl." in res["class_allow_list"]


@pytest.mark.slow
def test_poc_lead_runs_bring_your_own_code_with_privacy_filter(poc):
    result = _submitted(poc["submit"])
    assert result["status"] == COMPLETED, result
    assert result["bring_your_own_code"] is True and result["admin"] == LEAD
    ckpt = torch.load(_server_app(result) / "FL_global_model.pt", map_location="cpu", weights_only=False)
    assert ckpt["classes"] == UNION
    dep = poc["dep"]
    for site in ("hospital-a", "hospital-b"):
        run = [p for p in dep.kit(site).iterdir() if (p / f"app_{site}").is_dir()]
        assert len(run) == 1
        assert (
            run[0] / f"app_{site}" / "custom" / "cxrfl" / "fl" / "executor.py"
        ).is_file()  # the code came with the job
        log = (run[0] / "log.txt").read_text(errors="replace")
        assert "percentile privacy applied to" in log
    # what arrived, not what the sites say: the server found the smaller half of each site's round-1 changes
    # withheld (values equal to the model it sent; the unfiltered job of test_prod_preinstalled_job... far fewer)
    records = [r for r in read_records(_server_app(result) / "cxrfl" / "rounds.jsonl") if r.get("round", 0) >= 1]
    shares = [r["unchanged_share"] for r in records if r.get("phase") == "train" and r.get("aggregated")]
    assert shares and all(set(s) == {"hospital-a", "hospital-b"} for s in shares), records
    assert all(v >= 0.45 for s in shares for v in s.values()), shares


@pytest.mark.slow
def test_poc_hospital_b_never_sees_hospital_a_only_classes(poc):
    import cxrfl

    kit = poc["dep"].kit("hospital-b")
    assert list(kit.rglob("log.txt"))
    found = leaks([kit], NIH_ONLY_SPELLINGS)
    # The bring-your-own-code job ships the cxrfl package, whose label vocabulary (labels.py, the
    # demo generator) names every known class: public code, identical for every site, and what the
    # pre-installed mode has in site-packages. Only byte-identical copies of it are set aside.
    package = Path(cxrfl.__file__).resolve().parent
    code = {}
    for path in list(found):
        parts = Path(path).parts
        if "custom" in parts and parts[parts.index("custom") + 1 : parts.index("custom") + 2] == ("cxrfl",):
            rel = Path(*parts[parts.index("custom") + 2 :])
            if (package / rel).is_file() and (package / rel).read_bytes() == Path(path).read_bytes():
                code[str(rel)] = found.pop(path)
    assert found == {}
    assert "data/labels.py" in code


@pytest.mark.slow
def test_poc_every_process_is_stopped(poc):
    stop = poc["stop"]
    assert stop.get("rc") == 0 and stop.get("left") == [] and stop.get("graceful") == "ok", stop
    assert stop["left_after"] == []
    assert stop["killed"] == [] and stop["terminated_after_stop"] == []  # nvflare poc stop ended the watchdog loops
    assert not (Path(poc["tmp"]) / "userhome").exists()


# ------------------------------------------------------------------------ slow: GPU requests
def _tiny_gpu_job(out: Path, min_clients: int) -> Path:
    """A one-round CPU-sized surgical job (pre-installed mode) asking what jobs/surgical_agg_gpu asks of every site."""
    from cxrfl.fl.recipes import SurgicalAggregationRecipe
    from cxrfl.jobs import job_spec

    recipe = SurgicalAggregationRecipe(
        name=f"gpu_min{min_clients}",
        min_clients=min_clients,
        resources=job_spec("surgical_agg_gpu").resources,
        num_rounds=1,
        evaluate_test=False,
        model_config={"image_size": 64, "arch": TINY},
        custom="none",
        num_workers=0,
        train_config={"warmup_epochs": 1, "batch_size": 16, "max_steps_per_epoch": 3},
    )
    recipe.export(str(out))
    return out / recipe.name


@pytest.mark.slow
def test_gpu_job_goes_only_to_the_site_whose_kit_offers_a_gpu(deployment):
    """Issue 46 point 1, in the loopback production deployment (phase ``gpu``, after the other jobs):
    hospital-a's kit declares one GPU (``cxrfl deploy site-gpus hospital-a 0``), hospital-b's kit is as
    NVFlare provisions it (its GPUResourceManager offers no GPU). What this emulates: this machine has
    no GPU, and neither NVFlare's ListResourceManager nor the consumer checks the hardware, so GPU 0 of
    hospital-a exists only in its kit and the job trains on the CPU (device ``auto``). What is real is
    NVFlare's scheduling: the committed GPU job's request (``@default``: one GPU) in a tiny job, read by
    NVFlare's resolver and answered by each site's resource manager. A GPU job that needs both sites waits, and
    ``cxrfl deploy submit`` shows NVFlare's reason; one that needs one site runs on hospital-a alone."""
    run = passed(deployment, "gpu")
    assert run["gpus"] == [0]
    waiting, aborted, ran = run["gpu_waiting"], run["gpu_aborted"], run["gpu_ran"]
    waited = json_out(waiting)
    assert waiting.returncode == 1 and waited["status"] == "WAIT_FAILED", waited
    assert "not enough sites have enough resources (ok sites 1 < min sites 2)" in waited["not_scheduled"], waited
    assert waited["resource_spec"] == {"@default": {"num_of_gpus": 1}}
    assert "ok sites 1 < min sites 2" in waiting.stderr  # NVFlare's reason, on the submitter's terminal
    assert json_out(aborted)["status"] == "FINISHED:ABORTED"
    result = json_out(ran)
    assert result["status"] == COMPLETED, result
    dep, gpu_jobs = run["dep"], {waited["job_id"], result["job_id"]}
    runs = {  # the other phases' jobs ran on both sites; of the GPU jobs, only the one-site job ran, on hospital-a
        site: sorted(p.name for p in dep.kit(site).iterdir() if p.name in gpu_jobs and (p / f"app_{site}").is_dir())
        for site in ("hospital-a", "hospital-b")
    }
    assert runs == {"hospital-a": [result["job_id"]], "hospital-b": []}
