"""The committed job folders are exactly what cxrfl.jobs defines, and carry no site data."""

from __future__ import annotations

import json

from cxrfl.jobs import JOBS, export_all
from cxrfl.data.labels import KNOWN_CLASSES


def test_committed_jobs_match_their_python_definition(tmp_path, repo_root):
    export_all(tmp_path)
    for spec in JOBS:
        fresh = sorted(p.relative_to(tmp_path / spec.name) for p in (tmp_path / spec.name).rglob("*") if p.is_file())
        committed_root = repo_root / "jobs" / spec.name
        committed = sorted(p.relative_to(committed_root) for p in committed_root.rglob("*") if p.is_file())
        assert fresh == committed, f"jobs/{spec.name} differs: run `cxrfl jobs export --out jobs`"
        for rel in fresh:
            assert (tmp_path / spec.name / rel).read_text() == (committed_root / rel).read_text(), (
                f"jobs/{spec.name}/{rel} is stale: run `cxrfl jobs export --out jobs`"
            )


def test_jobs_name_no_class_and_no_data_path(repo_root):
    for spec in JOBS:
        for path in (repo_root / "jobs" / spec.name).rglob("*.json"):
            text = path.read_text()
            json.loads(text)
            for c in KNOWN_CLASSES:
                assert c not in text, f"{path} names class {c}"
            assert "site_config" not in text and ".csv" not in text


def test_gpu_job_states_its_gpu_need(repo_root):
    meta = json.loads((repo_root / "jobs" / "surgical_agg_gpu" / "meta.json").read_text())
    assert meta["resource_spec"]["@ALL"]["num_of_gpus"] == 1
    server = json.loads((repo_root / "jobs" / "surgical_agg_gpu" / "app" / "config" / "config_fed_server.json").read_text())
    assert server["workflows"][0]["args"]["model_config"]["image_size"] == 224
