"""Quantized messages (cxrfl.fl.quantization): what comes back, what stays exact, the error of each format
against a bound computed here, the bytes that travel, and the filters a recipe writes (fast, no job run)."""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch
from cxrfl.deploy.cli import add_parser
from cxrfl.deploy.jobs import build_job
from cxrfl.errors import ConfigError, CxrflError
from cxrfl.fl.job_script import add_run_arguments
from cxrfl.fl.job_settings import QUANTIZE_TYPES
from cxrfl.fl.quantization import ExactDequantizer, ExactQuantizer, round_trip
from cxrfl.fl.recipes import (
    CWTRecipe,
    FedEvalRecipe,
    FedFewRecipe,
    SurgicalAggregationRecipe,
)
from cxrfl.fl.wire import dumps, loads, model_message
from cxrfl.jobs import app_dirs
from cxrfl.nn.models import HEAD_PREFIX, ModelConfig, build_model
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.utils.fl_model_utils import FLModelUtils

BN_STATS = (".running_mean", ".running_var", ".num_batches_tracked")


def small_params(seed: int = 0) -> dict[str, np.ndarray | torch.Tensor]:
    """Every kind of entry a message may hold; BatchNorm variances tiny and positive (quantization could flip them)."""
    rng = np.random.default_rng(seed)
    return {
        "conv.weight": rng.normal(0, 0.05, (24, 8, 3, 3)).astype(np.float32),  # odd last dim
        "norm.weight": rng.normal(1, 0.1, 600).astype(np.float32),  # 1-D
        "norm.running_mean": rng.normal(0, 1e-3, 600).astype(np.float32),
        "norm.running_var": rng.uniform(1e-7, 1e-5, 600).astype(np.float32),
        "norm.num_batches_tracked": np.array(123456789, dtype=np.int64),
        "counts": np.arange(500, dtype=np.int32),
        "prototypes": rng.normal(0, 1, (4, 128)),  # float64
        "half": rng.normal(0, 1, 3000).astype(np.float16),
        "scalar": np.array(0.123456, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "tensor": torch.randn(40, 32, generator=torch.Generator().manual_seed(seed)),
        HEAD_PREFIX + "weight": rng.normal(0, 0.1, (3, 256)).astype(np.float32),
        HEAD_PREFIX + "bias": rng.normal(0, 0.1, 3).astype(np.float32),
    }


def exact_keys(params: dict) -> set[str]:
    """What must travel unquantized, decided here from the module's rules."""
    return {
        k
        for k, v in params.items()
        if k.endswith(BN_STATS) or str(v.dtype).removeprefix("torch.") not in ("float32", "float16") or v.ndim == 0
    }


def as_np(v) -> np.ndarray:
    return v.numpy() if isinstance(v, torch.Tensor) else np.asarray(v)


def same_bits(a, b) -> bool:
    return type(a) is type(b) and as_np(a).dtype == as_np(b).dtype and as_np(a).tobytes() == as_np(b).tobytes()


@pytest.mark.parametrize("fmt", QUANTIZE_TYPES)
def test_every_key_comes_back_in_its_dtype_and_shape_and_what_must_stay_exact_is_bit_exact(fmt):
    params = small_params()
    back = round_trip(params, fmt).params
    assert list(back) == list(params)
    for k, v in params.items():
        assert type(back[k]) is type(v) and back[k].dtype == v.dtype and back[k].shape == v.shape, k
    for k in exact_keys(params) | {"empty"}:
        assert same_bits(back[k], params[k]), k
    assert np.all(as_np(back["norm.running_var"]) > 0)
    for k in ("conv.weight", "norm.weight", "tensor", HEAD_PREFIX + "weight"):  # quantized, so not bit-exact
        assert not same_bits(back[k], params[k]), k
    assert same_bits(back["half"], params["half"]) == (fmt == "float16")  # float16 to float16 gains nothing


def bound(x: np.ndarray, fmt: str) -> np.ndarray:
    """Largest error each format allows per element, from its published definition (bitsandbytes' defaults).

    float16: round to nearest, 11 significant bits. blockwise8: blocks of 4096 values scaled by their absmax to
    [-1, 1], an 8-bit code no coarser than linear int8 (absmax / 127). float4 / normfloat4: blocks of 64, 16 code
    values whose widest gap is 1/3 of absmax (fp4: 2/3 to 1), so half a gap is absmax / 6.
    """
    if fmt == "float16":
        return np.maximum(np.abs(x) * 2.0**-11, 2.0**-25)
    flat, size = x.ravel(), 4096 if fmt == "blockwise8" else 64
    blocks = np.abs(np.pad(flat, (0, -len(flat) % size))).reshape(-1, size).max(axis=1)
    per = blocks / 127 if fmt == "blockwise8" else blocks / 6
    return np.repeat(per, size)[: len(flat)].reshape(x.shape) * (1 + 1e-6)


@pytest.mark.parametrize("fmt", QUANTIZE_TYPES)
def test_round_trip_errors_are_within_each_formats_bound(fmt):
    rng = np.random.default_rng(1)
    # scales that vary from block to block, so that a per-block bound is tighter than a global one
    x = (rng.normal(0, 1, (150, 128)) * np.repeat(np.logspace(-3, 1, 150), 128).reshape(150, 128)).astype(np.float32)
    back = round_trip({"w": x}, fmt).params["w"]
    err = np.abs(back.astype(np.float64) - x.astype(np.float64))
    assert err.max() > 0
    assert np.all(err <= bound(x, fmt)), float((err / bound(x, fmt)).max())


@pytest.fixture(scope="module")
def densenet_state() -> dict[str, np.ndarray]:
    """A DenseNet121 state dict (surgical head of 5 classes), float values randomised, statistics positive."""
    rng = np.random.default_rng(2)
    state = {}
    for k, v in build_model(ModelConfig(image_size=64), 5).state_dict().items():
        a = v.numpy()
        if a.dtype == np.float32:
            a = rng.uniform(1e-6, 2, a.shape) if k.endswith(".running_var") else rng.normal(0, 0.05, a.shape)
        state[k] = np.asarray(a, dtype=v.numpy().dtype)
    return state


def wire_bytes(params: dict, fmt: str | None) -> int:
    """Bytes of the serialised message (FOBS, as NVFlare sends it), quantized by the site's filter or not."""
    shareable = model_message(dict(params), {})
    if fmt is not None:
        shareable = ExactQuantizer(fmt).process(shareable, FLContext())
    return len(dumps(shareable))


@pytest.mark.parametrize("fmt", ["float16", "blockwise8"])
def test_densenet121_round_trip_and_8bit_bytes(densenet_state, fmt):
    trip = round_trip(densenet_state, fmt)
    for k, v in densenet_state.items():
        assert trip.params[k].dtype == v.dtype and trip.params[k].shape == v.shape, k
        if k.endswith(BN_STATS):
            assert same_bits(trip.params[k], v), k
        elif v.size > 4096:
            assert np.all(np.abs(trip.params[k] - v) <= bound(v, fmt)), k
    head = HEAD_PREFIX + "weight"
    assert not np.array_equal(trip.params[head], densenet_state[head])  # the head rows are quantized too
    assert trip.bytes_before == sum(v.nbytes for v in densenet_state.values())
    full, sent = wire_bytes(densenet_state, None), wire_bytes(densenet_state, fmt)
    assert trip.bytes_after <= sent < 1.06 * trip.bytes_after  # the helper counts what travels (FOBS adds little)
    assert full / sent >= (3.5 if fmt == "blockwise8" else 1.9), full / sent


def test_the_filters_carry_a_surgical_message_and_leave_its_metadata_alone():
    params = {k: v for k, v in small_params().items() if k != "tensor"}  # messages hold numpy arrays
    meta = {"classes": ["Atelectasis", "Edema", "Hernia"], "num_samples": 1234, "site": "hospital-a"}
    sent = ExactQuantizer("blockwise8").process(model_message(dict(params), dict(meta)), FLContext())
    arrived = ExactDequantizer().process(loads(dumps(sent)), FLContext())
    model = FLModelUtils.from_shareable(arrived)
    assert {k: v for k, v in model.meta.items() if k != "filter_history"} == meta  # NVFlare's own bookkeeping
    assert list(model.params) == list(params)
    assert all(same_bits(model.params[k], params[k]) for k in exact_keys(params))
    head = model.params[HEAD_PREFIX + "weight"]
    assert head.dtype == np.float32
    assert np.all(np.abs(head - params[HEAD_PREFIX + "weight"]) <= bound(params[HEAD_PREFIX + "weight"], "blockwise8"))


@pytest.mark.parametrize(
    "make",
    [
        lambda q: SurgicalAggregationRecipe(quantize=q),
        lambda q: CWTRecipe(quantize=q),
        lambda q: FedFewRecipe(quantize=q),
        lambda q: build_job("surgical_agg", "/nonexistent", quantize=q),
    ],
)
def test_a_bad_quantize_value_is_refused_in_one_line(make):
    with pytest.raises(CxrflError) as info:
        make("int8")
    (line,) = str(info.value).splitlines()
    assert line.startswith("job.quantize must be one of ['float16', 'blockwise8', 'float4', 'normfloat4'], got 'int8'")


def test_quantize_is_refused_for_an_evaluation_and_adaquant_by_the_filter(tmp_path):
    model = tmp_path / "m.pt"
    model.write_bytes(b"x")
    with pytest.raises(ConfigError, match="job.quantize must be unset for an evaluation"):
        FedEvalRecipe(model=model, quantize="float16")
    with pytest.raises(ValueError, match="quantization_type must be one of"):
        ExactQuantizer("adaquant")


def chains(config: dict, key: str) -> dict[frozenset[str], list[str]]:
    return {frozenset(c["tasks"]): [f["path"].rsplit(".", 1)[-1] for f in c["filters"]] for c in config[key]}


def configs(recipe, tmp_path) -> tuple[dict, dict]:
    recipe.export(str(tmp_path))
    apps = app_dirs(tmp_path / recipe.name)
    return (
        json.loads((apps[0] / "config" / "config_fed_server.json").read_text()),
        json.loads((apps[-1] / "config" / "config_fed_client.json").read_text()),
    )


@pytest.mark.parametrize("recipe", [SurgicalAggregationRecipe, CWTRecipe, FedFewRecipe])
def test_quantize_writes_the_filters_into_the_server_and_client_configs(recipe, tmp_path):
    server, client = configs(recipe(name="off"), tmp_path)
    assert server["task_data_filters"] == server["task_result_filters"] == []
    assert client["task_data_filters"] == client["task_result_filters"] == []

    tasks = frozenset(recipe.tasks)
    updates = frozenset(recipe.update_tasks)  # the privacy filter's tasks: "train"; FedFew's two weight updates
    server, client = configs(recipe(name="q", quantize="normfloat4", privacy={"method": "percentile"}), tmp_path)
    assert chains(server, "task_data_filters") == {tasks: ["ExactQuantizer"]}
    assert chains(server, "task_result_filters") == {tasks: ["ExactDequantizer"]}
    assert server["task_data_filters"][0]["filters"][0]["args"] == {"quantization_type": "normfloat4"}
    # a site dequantizes what arrives before privacy remembers it, and quantizes what leaves after privacy
    assert chains(client, "task_data_filters") == {
        updates: ["ExactDequantizer", "UpdatePrivacy"],
        tasks - updates: ["ExactDequantizer"],
    }
    assert chains(client, "task_result_filters") == {
        updates: ["UpdatePrivacy", "ExactQuantizer"],
        tasks - updates: ["ExactQuantizer"],
    }


def test_deploy_job_and_job_py_take_quantize(tmp_path):
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    args = parser.parse_args(["deploy", "job", "surgical_agg", "--out", str(tmp_path), "--quantize", "blockwise8"])
    assert args.func(args) == 0
    server = json.loads((app_dirs(tmp_path / "surgical_agg")[0] / "config" / "config_fed_server.json").read_text())
    assert server["task_data_filters"][0]["filters"][0] == {
        "path": "cxrfl.fl.quantization.ExactQuantizer",
        "args": {"quantization_type": "blockwise8"},
    }
    training, evaluation = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_run_arguments(training)
    add_run_arguments(evaluation, quantize=False)
    assert training.parse_args(["--quantize", "float4"]).quantize == "float4"
    assert training.parse_args([]).quantize is None
    assert not hasattr(evaluation.parse_args([]), "quantize")


@pytest.mark.parametrize("fmt", ["blockwise8", "normfloat4"])
def test_a_sender_cannot_name_any_torch_attribute_as_the_dtype(fmt):
    # the receiver looks the sender's dtype names up in torch: only float32/16/bf16 may be named
    from nvflare.apis.dxo import DXO, DataKind
    from nvflare.apis.shareable import Shareable

    w = np.linspace(-1, 1, 4096, dtype=np.float32).reshape(64, 64)
    sent = ExactQuantizer(fmt).process_dxo(DXO(DataKind.WEIGHTS, data={"f.w": w}), Shareable(), FLContext())
    sent.meta["source_datatype"] = {"f.w": "load"}
    with pytest.raises(ValueError, match="expected one of"):
        ExactDequantizer().process_dxo(sent, Shareable(), FLContext())


def test_fedfew_privacy_filters_see_its_weight_updates(tmp_path):
    # found while wiring quantization: the privacy filters were attached to the task named ``train`` only,
    # and FedFew's tasks are ``fedfew_*``: a FedFew job with privacy set sent unfiltered updates
    from cxrfl.fedfew.protocol import SSL, TRAIN
    from cxrfl.fl.recipes import FedFewRecipe

    _, client = configs(FedFewRecipe(name="p", privacy={"method": "percentile"}), tmp_path)
    assert chains(client, "task_result_filters") == {frozenset({SSL, TRAIN}): ["UpdatePrivacy"]}
    assert chains(client, "task_data_filters") == {frozenset({SSL, TRAIN}): ["UpdatePrivacy"]}
