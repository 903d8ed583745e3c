"""Shared fixtures: where the real NIH data lives (../shared/data beside the checkout); the class-name leak
scan; the surgical job's NVFlare runs that several modules read (session-scoped: each runs once)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import pickletools
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
from cxrfl.common.cores import available_cores

if os.environ.get("PYTEST_XDIST_WORKER") and "OMP_NUM_THREADS" not in os.environ:
    # each xdist worker, and the NVFlare processes it starts, gets its share of the cores (set before torch is
    # imported): two workers with two torch threads each on 2 cores run 5-20x slower than one thread each
    os.environ["OMP_NUM_THREADS"] = str(max(1, available_cores() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import torch
from cxrfl.jobs import JobSpec, job_spec, write_job
from cxrfl.synth import write_profile

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"

TWO = ["hospital-a", "hospital-b"]  # NIH labels at a, CheXpert labels at b
DEMO = ["site-1", "site-2"]  # the simulator's demo sites: hospital-a's and hospital-b's data
DEMO_IMAGES = 200
"""Images per demo site (and of the external set) in the simulator runs of the demo sites: a 20-image
validation split, so that most classes have a defined validation AUROC."""
TINY_MODEL = {"arch": "densenet-tiny", "image_size": 32}
"""A job's ``model_config`` changes where the network is not the subject (one job keeps DenseNet121:
``tests/test_simulator_baselines.py``'s vanilla_fl run, so the product's 28 MB messages still cross NVFlare)."""


def tiny(name: str, **changes: Any) -> JobSpec:
    """A job of JOBS named ``tiny_<name>``, its settings changed (a dict value updates the nested settings)."""
    spec = job_spec(name)
    args = json.loads(json.dumps(spec.controller_args))
    for key, value in changes.items():
        if isinstance(value, dict):
            args[key].update(value)
        else:
            args[key] = value
    return dataclasses.replace(spec, name=f"tiny_{name}", controller_args=args)


SURGICAL = dataclasses.replace(
    tiny(
        "surgical_agg",
        num_rounds=2,
        model_config=TINY_MODEL,
        train_config={"warmup_epochs": 1, "batch_size": 8, "max_steps_per_epoch": 2},
    ),
    tracking=("tensorboard", "mlflow"),
)
"""jobs/surgical_agg made small, with TensorBoard and MLflow tracking: the job of ``surgical_simenv`` and
``surgical_sim``."""


def nvflare_bin() -> str:
    """The ``nvflare`` command of this Python's environment."""
    return str(Path(sys.executable).with_name("nvflare"))


def app_of(ws: Path) -> Path:
    """The server's app folder of a simulator workspace."""
    return ws / "server" / "simulate_job" / "app_server"


def require_data(present: bool, message: str) -> None:
    """Skip the calling test with ``message`` where its data is absent, but fail it when CI is set
    (a CI run that silently skipped the real-data tests would prove nothing about them).

    Args:
        present: whether the data the test needs is there.
        message: what is missing and where it was looked for.
    """
    if present:
        return
    if os.environ.get("CI"):
        pytest.fail(f"{message}; CI must have it")
    pytest.skip(message)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The real data folder; tests that need it skip with a clear message where it is absent (fail in CI)."""
    require_data(
        (SHARED_DATA / "nih1000").is_dir(),
        f"real NIH data not found at {SHARED_DATA} (the shared/ folder beside the checkout)",
    )
    return SHARED_DATA


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


def _texts(path: Path) -> list[bytes]:
    """The bytes a name could hide in: the file, each member of a zip (torch checkpoints are zips), and every
    string of a pickle (read with pickletools, never unpickled): in a pickle a string is followed by an opcode
    that may be a letter (``q``, BINPUT), so a whole-word search of the raw bytes misses it."""
    data = path.read_bytes()
    parts = [data]
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            parts += [z.read(name) for name in z.namelist()]
    for part in list(parts):
        if part[:1] == b"\x80":  # a pickle's PROTO opcode
            with contextlib.suppress(Exception):  # not a pickle after all: its raw bytes were searched
                parts += [
                    arg.encode() if isinstance(arg, str) else bytes(arg)
                    for _, arg, _ in pickletools.genops(part)
                    if isinstance(arg, (str, bytes, bytearray))
                ]
    return parts


def names_in(path: Path, names: list[str]) -> list[str]:
    """Class names (or their NIH underscore spellings) a file mentions as whole words (a torch checkpoint's
    and a pickle's strings included), in the order of ``names``. Each text is searched once: one pattern
    finds every place where some spelling ends a whole word, and each spelling is then checked there."""
    spellings = [dict.fromkeys((name, name.replace(" ", "_"))) for name in names]
    every = {s.encode() for both in spellings for s in both}
    if not every:
        return []
    any_spelling = re.compile(
        b"(?:" + b"|".join(re.escape(s) for s in sorted(every, key=len, reverse=True)) + rb")(?![A-Za-z])"
    )
    found: set[bytes] = set()
    for text in _texts(path):
        match = any_spelling.search(text)
        while match:
            at = match.start()
            if not text[at - 1 : at].isalpha():  # the same rule as ``(?<![A-Za-z])``: bytes.isalpha is ASCII only
                found.update(
                    s for s in every if text.startswith(s, at) and not text[at + len(s) : at + len(s) + 1].isalpha()
                )
            match = any_spelling.search(text, at + 1)
    return [s for both in spellings for s in both if s.encode() in found]


MAX_WORKERS = 4
"""xdist workers for ``-n auto`` at most: the deployment tests start a server and three sites each."""

SHARED_RUNS = {"test_simulator.py": "surgical_sim", "test_recipes_sim.py": "surgical_sim"}
"""Modules that read the same session-scoped NVFlare run: one xdist work unit, so the run happens once."""


SPLIT_UNITS = {("test_deploy.py", "test_poc_"): "poc_deployment"}
"""Tests of a module that read a module fixture of their own (``test_deploy.py``'s POC deployment, beside its
provisioned one): their own work unit, so that the two deployments run side by side."""

LONGEST_FIRST = ("tests/test_deploy.py", "tests/test_reliability_deploy.py", "surgical_sim", "poc_deployment")
"""The work units that take 2-6 minutes (measured with 2-4 workers, 2026-11-27), started first so that no worker
begins one when the others are nearly done."""


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: two workers more than the cores this process is given (a container's CPU quota included).

    With one worker per core the 2-core machine was busy 64 % of the time (user + sys over wall, 2026-11-27):
    the deployment tests wait on NVFlare (task timeouts, scheduling, process starts). A third worker filled
    that (14.0 -> 12.1 minutes); a fourth: see the README. Every worker's torch runs one thread, so no core is
    oversubscribed by threads.
    """
    return min(MAX_WORKERS, available_cores() + 2)


def _unit(nodeid: str) -> str:
    """The xdist work unit of a test: its module, the shared run's name for the modules in SHARED_RUNS, or the
    unit SPLIT_UNITS gives its name."""
    module, _, name = nodeid.partition("::")
    for (file, prefix), unit in SPLIT_UNITS.items():
        if Path(module).name == file and name.startswith(prefix):
            return unit
    return SHARED_RUNS.get(Path(module).name, module)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """``--dist loadscope`` by module, the modules of SHARED_RUNS in one unit: a module's fixtures (an NVFlare
    run, a deployment) run once, on one worker. (xdist's own ``loadgroup`` does not group on pytest 9.2,
    whose node ids ignore the group suffix xdist writes.)"""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return ModuleScheduling(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each work unit's tests together: LONGEST_FIRST, then the other units with slow tests, then the rest, so
    that the xdist workers finish together (``--no-loadscope-reorder`` keeps this order).

    Runs after pytest-randomly's shuffle (a wrapper); the sort is stable, so the shuffled order stands within
    each unit and among the slow and among the fast units.
    """
    units = [_unit(item.nodeid) for item in items]
    slow = {u for u, item in zip(units, items, strict=True) if item.get_closest_marker("slow")}
    first: dict[str, int] = {}
    for u in units:
        first.setdefault(u, len(first))
    rank = {u: LONGEST_FIRST.index(u) if u in LONGEST_FIRST else len(LONGEST_FIRST) + (u not in slow) for u in first}
    order = sorted(range(len(items)), key=lambda i: (rank[units[i]], first[units[i]]))
    items[:] = [items[i] for i in order]


_SESSION_DIRS: set[Path] = set()


def session_tmp(tmp_path_factory: pytest.TempPathFactory, name: str) -> Path:
    """A folder of a session fixture: ``module_tmp_cleanup`` leaves it to the modules that come later."""
    path = tmp_path_factory.mktemp(name)
    _SESSION_DIRS.add(path)
    return path


@pytest.fixture(scope="module", autouse=True)
def module_tmp_cleanup(request, tmp_path_factory):
    """Remove a module's ``tmp_path_factory`` folders once its tests all passed: the suite writes many
    DenseNet checkpoints (about 14 GB kept to the session's end otherwise, more than a CI disk may
    have free). Per-test ``tmp_path`` folders go right after a passing test
    (``tmp_path_retention_policy = "failed"`` in pyproject.toml); a failing module keeps everything."""
    base = tmp_path_factory.getbasetemp()
    before, failed = set(base.iterdir()), request.session.testsfailed
    yield
    if request.session.testsfailed == failed:
        for path in set(base.iterdir()) - before - _SESSION_DIRS:
            shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``): on a
    shared 2-core machine two threads make a tiny DenseNet step up to 20x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def two_hospitals(tmp_path_factory) -> Path:
    """Demo data of hospital-a and hospital-b (60 images each at 32 px; a larger validation split than the
    profile's, so that per-class validation AUROCs are defined): the folder of their site configs."""
    data = session_tmp(tmp_path_factory, "two_hospitals")
    for config in write_profile("two-hospitals", data, n_per_site=60, image_size=32, sites=TWO):
        config.write_text(config.read_text().replace("train: 0.7\n  val: 0.1", "train: 0.5\n  val: 0.3"))
        assert "val: 0.3" in config.read_text()
    return data


@pytest.fixture(scope="session")
def demo_env(tmp_path_factory) -> dict[str, str]:
    """Where the simulator's demo sites find their data: the embedded demo hospitals, generated on first use with
    ``DEMO_IMAGES`` images each (the external set too) into a session folder; a fresh ``HOME``; no site config."""
    tmp = session_tmp(tmp_path_factory, "demo")
    env = {k: v for k, v in os.environ.items() if k not in ("CXRFL_SITE_CONFIG", "CXRFL_SITE_CONFIG_DIR")}
    return {**env, "CXRFL_DEMO_DIR": str(tmp / "data"), "CXRFL_DEMO_IMAGES": str(DEMO_IMAGES), "HOME": str(tmp)}


def _ran(ws: Path, output: str = "") -> dict[str, Any]:
    """A finished run's folders and settings; fails the fixture (with the run's output) where it left no model."""
    if not (app_of(ws) / "FL_global_model.pt").is_file():
        pytest.fail(f"no global model under {app_of(ws)}:\n{output}")
    return {"ws": ws, "app": app_of(ws), "args": SURGICAL.controller_args}


@pytest.fixture(scope="session")
def surgical_simenv(tmp_path_factory, demo_env) -> dict[str, Any]:
    """SURGICAL as a recipe in NVFlare's SimEnv on the demo sites (``demo_env``): ``ws`` (its workspace), ``app``
    (the server's app folder), ``args`` (the job's settings)."""
    from nvflare.recipe import SimEnv

    tmp = session_tmp(tmp_path_factory, "surgical_simenv")
    with pytest.MonkeyPatch.context() as mp:
        for key in ("CXRFL_SITE_CONFIG", "CXRFL_SITE_CONFIG_DIR"):
            mp.delenv(key, raising=False)
        for key in ("CXRFL_DEMO_DIR", "CXRFL_DEMO_IMAGES", "HOME"):
            mp.setenv(key, demo_env[key])
        SURGICAL.recipe().execute(SimEnv(clients=DEMO, num_threads=len(DEMO), workspace_root=str(tmp / "sim")))
    return _ran(tmp / "sim" / SURGICAL.name)


def readme_demo_command(job: Path, ws: Path) -> str:
    """The README's first command after its set-up (the simulator run and the report), run with this Python's
    environment on ``job`` (instead of jobs/surgical_agg) into ``ws``."""
    first = re.search(r"```bash\n(.*?)\n```", (REPO / "README.md").read_text(), re.S)
    assert first, "README.md has no bash block"
    steps = [s for s in first.group(1).split(" && ") if not s.startswith("python3 -m venv") and "pip install" not in s]
    assert len(steps) == 2 and steps[0].startswith(".venv/bin/nvflare simulator jobs/surgical_agg -w workspace/demo ")
    assert steps[1].startswith(".venv/bin/cxrfl report workspace/demo "), steps
    command = " && ".join(steps).replace("jobs/surgical_agg", str(job)).replace("workspace/demo", str(ws))
    return command.replace(".venv/bin/", f"{Path(sys.executable).parent}/")


@pytest.fixture(scope="session")
def surgical_sim(tmp_path_factory, demo_env) -> dict[str, Any]:
    """The README's demo command (``readme_demo_command``: ``nvflare simulator`` with ``-n 2``, whose site-1 and
    site-2 fall back to the demo data, then ``cxrfl report --external demo``) on SURGICAL's exported job folder
    (``job``) and ``demo_env``: ``ws``, ``app``, ``args`` as for ``surgical_simenv``, and the command's ``rc`` and
    ``stdout``."""
    tmp = session_tmp(tmp_path_factory, "surgical_sim")
    job = write_job(SURGICAL, tmp / "exported")
    cmd = readme_demo_command(job, tmp / "ws")
    proc = subprocess.run(["bash", "-c", cmd], env=demo_env, cwd=tmp, capture_output=True, text=True, timeout=900)
    output = f"rc={proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return {**_ran(tmp / "ws", output), "job": job, "rc": proc.returncode, "stdout": proc.stdout, "output": output}


def fedfew_fedavg(server, results, expected, needed, *, reference, task):
    """A FedFew round's FedAvg of answers already collected, streamed as a round streams them
    (``FederatedRounds.round_stream``, ``take`` in site order, ``finish``): (aggregate or None, rejected, used)."""
    stream = server.round_stream(expected, reference=reference, task=task)
    for site, answer in sorted(results.items()):
        server.take(stream, site, answer)
    return server.finish(stream, needed)
