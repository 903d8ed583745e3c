"""A surgical job with 8-bit quantized messages runs in NVFlare's SimEnv and leaves a finite float32 global model
(slow: one tiny round on the session's demo data)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import SURGICAL, TWO, app_of
from cxrfl.common.io import read_records
from cxrfl.fl.quantization import round_trip
from cxrfl.nn.models import load_checkpoint

pytestmark = pytest.mark.slow


def test_a_blockwise8_surgical_job_finishes_with_a_finite_float32_model(tmp_path, monkeypatch, two_hospitals):
    from nvflare.recipe import SimEnv

    monkeypatch.setenv("CXRFL_SITE_CONFIG_DIR", str(two_hospitals))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    spec = dataclasses.replace(
        SURGICAL,
        name="tiny_quantized",
        quantize="blockwise8",
        tracking=(),
        controller_args={**SURGICAL.controller_args, "num_rounds": 1},
    )
    spec.recipe().execute(SimEnv(clients=TWO, num_threads=len(TWO), workspace_root=str(tmp_path / "sim")))
    app = app_of(tmp_path / "sim" / spec.name)
    rounds = read_records(app / "cxrfl" / "rounds.jsonl")
    assert rounds and not any(r.get("phase") == "stopped" or r.get("rejected") for r in rounds), rounds
    checkpoint = load_checkpoint(app / "FL_global_model.pt")
    assert checkpoint["round"] == 1  # the round ran on quantized messages, no update refused
    model = checkpoint["model"]
    # the tiny network's messages, too, travel quantized, if less compressed than DenseNet121's (about 61 % of
    # their bytes: most of its arrays are below the size at which 8 bits with their code table save anything)
    trip = round_trip(model, "blockwise8")
    assert trip.bytes_after < trip.bytes_before, trip[1:]
    for key, value in model.items():
        if key.endswith("num_batches_tracked"):
            assert value.dtype == torch.int64, key
        else:
            assert value.dtype == torch.float32 and torch.isfinite(value).all(), key
