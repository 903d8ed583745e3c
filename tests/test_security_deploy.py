"""Issue 40: who may learn which classes, and private keys after provisioning.

Fast: provisioning is offline and takes seconds (``nvflare provision``); the authorization a kit
gets is evaluated with NVFlare's own authorizer; the controllers' refusal and the modes of the
server's records are checked in process. The end-to-end deployment (hospital-a's org admin
submits, what it can get names none of hospital-b's classes) is the slow ``prod`` scenario of
``tests/test_deploy.py``.
"""

from __future__ import annotations

import json
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cxrfl.deploy.provision import prepare_kit
from cxrfl.deploy.workspace import Deployment, free_port

LEAD, PROJECT_ADMIN = "lead@cxrfl.example", "admin@cxrfl.example"
ORG_ADMIN_A = "it@hospital-a.example"


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(scope="module")
def provisioned(tmp_path_factory, repo_root) -> tuple[Deployment, subprocess.CompletedProcess]:
    """``cxrfl deploy provision`` (production mode, loopback) as a lead would run it."""
    tmp = tmp_path_factory.mktemp("provision")
    env = {"HOME": str(tmp / "home"), "PATH": str(Path(sys.executable).parent)}
    proc = subprocess.run(
        [
            str(Path(sys.executable).with_name("cxrfl")),
            "deploy",
            "provision",
            "--project",
            str(repo_root / "poc" / "project.yml"),
            "--workspace",
            str(tmp / "ws"),
            "--server-host",
            "localhost",
            "--port",
            str(free_port()),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Deployment.load(tmp / "ws"), proc


def test_provisioning_leaves_every_private_key_and_the_state_folder_owner_only(provisioned):
    # issue 40 point 4: prod/<project>/state/cert.json (root CA private key and every participant's key)
    # was left 0o644 in a 0o755 folder
    dep, proc = provisioned
    ws = dep.ws
    keys = sorted(ws.rglob("*.key"))
    states = sorted(p for p in ws.rglob("state") if p.is_dir())
    assert len(keys) == 1 + 3 + 5 and states  # server, three sites, five admins; the provisioning state
    for folder in states:
        assert mode(folder) == 0o700, folder
        files = [p for p in folder.rglob("*") if p.is_file()]
        assert any(p.name == "cert.json" for p in files)
        for p in files:
            assert mode(p) == 0o600, p
    for key in keys:
        assert mode(key) == 0o600, key
    holding_a_private_key = [p for p in ws.rglob("*") if p.is_file() and b"PRIVATE KEY" in p.read_bytes()]
    assert holding_a_private_key and all(mode(p) == 0o600 for p in holding_a_private_key), holding_a_private_key
    # NVFlare archives each finished job's server records (rounds.jsonl, evaluation.json, models) into its job store
    storage = ws / "storage"
    for folder in (storage, storage / "jobs-storage", storage / "snapshot-storage"):
        assert mode(folder) == 0o700, folder
    assert f"owner-only (files 0o600, folders 0o700): {len(keys)} key files, {len(states)} state folder" in proc.stderr


def _authorize(
    kit: Path,
    role: str,
    right: str,
    *,
    user: str,
    submitter: str,
    org: str = "hospital_a",
    submitter_org: str = "hospital_a",
    submitter_role: str | None = None,
) -> bool:
    from nvflare.fuel.sec.authz import AuthzContext, Person
    from nvflare.security.security import FLAuthorizer

    policy = json.loads((kit / "local" / "authorization.json").read_text())
    authorizer = FLAuthorizer("coordinator", policy)
    ctx = AuthzContext(
        right=right, user=Person(user, org, role), submitter=Person(submitter, submitter_org, submitter_role or role)
    )
    return authorizer.authorize(ctx)[0]


def test_org_admin_may_submit_pre_installed_jobs_but_download_no_result(provisioned, tmp_path):
    # issue 40 point 1: NVFlare's default (download_job: o:submitter) let hospital-a's org admin download the
    # server's records of its own job: the union class list, per-class contributing sites, per-site AUROC
    dep, _ = provisioned
    server = dep.kit(dep.server)
    for right in ("download_job", "download_job_components", "clone_job"):
        assert not _authorize(server, "org_admin", right, user=ORG_ADMIN_A, submitter=ORG_ADMIN_A), right
    assert _authorize(server, "org_admin", "submit_job", user=ORG_ADMIN_A, submitter=ORG_ADMIN_A)
    assert not _authorize(server, "org_admin", "byoc", user=ORG_ADMIN_A, submitter=ORG_ADMIN_A)
    assert _authorize(server, "org_admin", "abort_job", user=ORG_ADMIN_A, submitter=ORG_ADMIN_A)  # manages its own
    # the coordinators keep theirs: the lead its own jobs, the project admin every job
    assert _authorize(
        server, "lead", "download_job", user=LEAD, submitter=LEAD, org="coordinator", submitter_org="coordinator"
    )
    assert _authorize(
        server,
        "project_admin",
        "download_job",
        user=PROJECT_ADMIN,
        submitter=ORG_ADMIN_A,
        org="coordinator",
        submitter_role="org_admin",
    )
    # every site kit carries the same rule
    for site in dep.clients:
        assert not _authorize(dep.kit(site), "org_admin", "download_job", user=ORG_ADMIN_A, submitter=ORG_ADMIN_A)
    # --no-org-admin-jobs: org admins submit nothing (and still download nothing)
    import shutil

    kit = shutil.copytree(server, tmp_path / "server")
    prepare_kit(kit, storage=tmp_path / "storage", org_admin_jobs=False)
    assert not _authorize(kit, "org_admin", "submit_job", user=ORG_ADMIN_A, submitter=ORG_ADMIN_A)
    assert not _authorize(kit, "org_admin", "download_job", user=ORG_ADMIN_A, submitter=ORG_ADMIN_A)


# ------------------------------------------------------------- what a job's mode sends to every site
DISCLOSING = {"vanilla_fl", "fl_partial_loss", "cwt", "fedfew"}


def _controller(job: Path):
    import importlib

    from cxrfl.jobs import app_dirs

    server_config = next(p for a in app_dirs(job) if (p := a / "config" / "config_fed_server.json").is_file())
    wf = json.loads(server_config.read_text())["workflows"][0]
    module, name = wf["path"].rsplit(".", 1)
    return getattr(importlib.import_module(module), name)(**wf["args"])


class _Engine:
    def __init__(self, root: Path) -> None:
        from nvflare.apis.workspace import Workspace

        self.workspace = Workspace(root_dir=str(root), site_name="server")

    def get_workspace(self):
        return self.workspace


def _server_context(root: Path, job_id: str, meta: dict | None):
    from nvflare.apis.fl_constant import ReservedKey
    from nvflare.apis.fl_context import FLContext

    for folder in ("startup", "local"):  # what NVFlare's Workspace checks
        (root / folder).mkdir(parents=True, exist_ok=True)
    ctx = FLContext()
    ctx.set_prop(ReservedKey.ENGINE, _Engine(root), private=True, sticky=False)
    ctx.set_prop(ReservedKey.RUN_NUM, job_id, private=True, sticky=False)
    if meta is not None:
        (root / job_id).mkdir(parents=True, exist_ok=True)
        (root / job_id / "meta.json").write_text(json.dumps(meta))
    return ctx


@pytest.mark.parametrize("job", sorted(p.name for p in (Path(__file__).resolve().parents[1] / "jobs").iterdir()))
def test_controller_refuses_a_class_name_disclosing_job_from_an_org_admin(job, repo_root, tmp_path):
    # issue 40 point 1: a vanilla_fl (union head), CWT or FedFew job submitted by an org admin sent the union class
    # list to every site, where that org admin reads it; the server now refuses to run it before any task
    ctl = _controller(repo_root / "jobs" / job)
    assert ctl.discloses_class_names == (job in DISCLOSING)
    for role, meta in (
        ("org_admin", {"submitter_name": ORG_ADMIN_A, "submitter_role": "org_admin"}),
        ("lead", {"submitter_name": LEAD, "submitter_role": "lead"}),
        ("project_admin", {"submitter_name": PROJECT_ADMIN, "submitter_role": "project_admin"}),
        ("simulator", None),
    ):
        panics, started = [], []
        ctl.fl_ctx = _server_context(tmp_path / role, "job-1", meta)
        ctl.panic = panics.append
        ctl.sample_clients = lambda *a, **kw: ["hospital-a", "hospital-b"]
        ctl.get_app_dir = lambda: str(tmp_path / "app_server")
        ctl.make_server = lambda **kw: started.append(kw) or pytest.fail("server loop started")  # noqa: B023
        if role == "org_admin" and job in DISCLOSING:
            ctl.run()
            assert started == [] and len(panics) == 1
            assert "org_admin" in panics[0] and "docs/security.md" in panics[0]
        else:
            with pytest.raises(pytest.fail.Exception, match="server loop started"):
                ctl.run()
            assert panics == []


def test_surgical_aggregator_in_nvflare_workflows_refuses_an_org_admins_job(tmp_path):
    # issue 40 point 1: cxrfl's aggregator inside NVFlare's own FedAvg broadcasts classes and contributors to every site
    from cxrfl.fl.aggregator import SurgicalAggregator
    from nvflare.apis.event_type import EventType

    for role, refused in (("org_admin", True), ("lead", False)):
        agg, panics = SurgicalAggregator(), []
        agg.system_panic = lambda reason, fl_ctx: panics.append(reason)  # noqa: B023
        agg.handle_event(EventType.START_RUN, _server_context(tmp_path / role, "job-2", {"submitter_role": role}))
        # the surgical job's own workflow binds the component at its start: no refusal for that use (issue 43
        # point 7); NVFlare's FedAvg first resets it, then hands it results: refused there, once, with the line why
        agg.bind(warning=lambda _: None)
        assert panics == [], role
        agg.reset_stats()
        assert agg.accept_model(result_model("a", ["x"])) is not refused, role
        agg.reset_stats()
        assert len(panics) == int(refused), role
        assert not refused or ("org_admin" in panics[0] and "docs/security.md" in panics[0])


def result_model(site: str, classes: list[str]):
    import numpy as np
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

    rows = np.ones((len(classes), 2), np.float32)
    return FLModel(
        params_type=ParamsType.FULL,
        params={"body.w": np.ones(2, np.float32), "classifier.weight": rows, "classifier.bias": rows[:, 0].copy()},
        meta={"client_name": site, "classes": classes, "num_samples": 10},
    )


# ------------------------------------------------------------------------- the server's own records
def test_server_records_naming_sites_per_class_are_owner_only(tmp_path):
    # issue 40 point 1: rounds.jsonl (contributors), evaluation.json (per-site AUROC) and the global model were
    # written 0o644 in 0o755 folders
    import torch
    from cxrfl.common.server import RECORDS_DIR, ServerLoop
    from cxrfl.nn.models import ModelConfig, save_checkpoint

    loop = ServerLoop(
        lambda task, payloads, **kw: {}, sites=["hospital-a", "hospital-b"], out_dir=tmp_path / "app_server"
    )
    loop.record({"round": 1, "contributors": {"Hernia": ["hospital-a"]}})
    loop.record({"round": 2, "contributors": {"Hernia": ["hospital-a"]}})
    loop.write_evaluation({"sites": {"hospital-a": {"auroc": {"Hernia": 0.7}}}})
    loop.write_run_config({"num_rounds": 2})
    save_checkpoint(
        loop.path("FL_global_model.pt"),
        {"classifier.weight": torch.zeros(1, 2)},
        classes=["Hernia"],
        model_config=ModelConfig(image_size=64),
    )
    save_checkpoint(
        loop.path(RECORDS_DIR, "checkpoints", "round_001.pt"),
        {"classifier.weight": torch.zeros(1, 2)},
        classes=["Hernia"],
        model_config=ModelConfig(image_size=64),
    )
    out = tmp_path / "app_server"
    for folder in (out, out / RECORDS_DIR, out / RECORDS_DIR / "checkpoints"):
        assert mode(folder) == 0o700, folder
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {p.name for p in files} == {
        "rounds.jsonl",
        "evaluation.json",
        "run_config.json",
        "FL_global_model.pt",
        "round_001.pt",
    }
    for p in files:
        assert mode(p) == 0o600, p
