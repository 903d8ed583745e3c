"""A surgical job with 8-bit quantized messages runs in NVFlare's SimEnv and leaves a finite float32 global model
(slow: one tiny round on demo data)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from cxrfl.common.io import read_records
from cxrfl.nn.models import load_checkpoint
from cxrfl.synth import write_profile
from test_recipes_sim import SPECS, TWO, app_of

pytestmark = pytest.mark.slow


def test_a_blockwise8_surgical_job_finishes_with_a_finite_float32_model(tmp_path, monkeypatch):
    from nvflare.recipe import SimEnv

    data = tmp_path / "data"
    write_profile("two-hospitals", data, n_per_site=30, image_size=32, sites=TWO)
    monkeypatch.setenv("CXRFL_SITE_CONFIG_DIR", str(data))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    spec = dataclasses.replace(SPECS["surgical"], name="tiny_quantized", quantize="blockwise8", tracking=())
    spec.recipe().execute(SimEnv(clients=TWO, num_threads=len(TWO), workspace_root=str(tmp_path / "sim")))
    app = app_of(tmp_path / "sim" / spec.name)
    rounds = read_records(app / "cxrfl" / "rounds.jsonl")
    assert rounds and not any(r.get("phase") == "stopped" or r.get("rejected") for r in rounds), rounds
    checkpoint = load_checkpoint(app / "FL_global_model.pt")
    assert checkpoint["round"] == 1  # the round ran on quantized messages, no update refused
    model = checkpoint["model"]
    for key, value in model.items():
        if key.endswith("num_batches_tracked"):
            assert value.dtype == torch.int64, key
        else:
            assert value.dtype == torch.float32 and torch.isfinite(value).all(), key
