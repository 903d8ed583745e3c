"""The files a surgical-aggregation run leaves, checked against their documented schema (issue 44
point 4): ``cxrfl/rounds.jsonl`` (one record per warm-up and round), ``cxrfl/evaluation.json`` and the
checkpoints. A key renamed, dropped or retyped fails here before it breaks a reader (``cxrfl
report``, the bundle's model card, the benchmarks)."""

from __future__ import annotations

import json
from numbers import Real

import pytest
from cxrfl.data.site import load_site
from cxrfl.nn.models import ModelConfig, load_checkpoint
from cxrfl.nn.training import TrainConfig
from cxrfl.surgical.config import SurgicalConfig
from cxrfl.surgical.inprocess import run_surgical
from cxrfl.synth import write_profile

pytestmark = pytest.mark.usefixtures("one_thread")

SITES = ["hospital-a", "hospital-b"]
NUMBER = (Real, type(None))  # a metric may be undefined (None)
ROUND_COMMON = {
    "round": int,
    "phase": str,
    "sites_answered": list,
    "sites_failed": list,
    "sites_aggregated": list,
    "contributors": dict,
    "rejected": dict,
    "aggregated": bool,
    "unchanged_share": dict,
    "update_norm": dict,
    "site_metrics": dict,
    "seconds": Real,
}
TRAIN_ROUND = {**ROUND_COMMON, "evaluated_round": int, "mean_val_loss": Real, "mean_val_auroc": NUMBER}
VALIDATE = {  # the last model's validation, after the last round
    "round": int,
    "phase": str,
    "sites_answered": list,
    "sites_failed": list,
    "evaluated_round": int,
    "mean_val_loss": Real,
    "mean_val_auroc": NUMBER,
    "site_metrics": dict,
}
SCHEMAS = {"warmup": ROUND_COMMON, "train": TRAIN_ROUND, "validate": VALIDATE}
SITE_TEST = {"split": str, "loss": Real, "auroc": dict, "mean_auroc": NUMBER, "n": int, "seconds": Real}
EVALUATION = {"classes": list, "shared_classes": list, "best_round": int, "sites": dict, "external": (dict, type(None))}
CHECKPOINT = {"model": dict, "classes": list, "model_config": dict, "format": str}


def conforms(record: dict, schema: dict, where: str) -> None:
    missing = sorted(set(schema) - set(record))
    assert not missing, f"{where}: missing {missing}"
    wrong = {k: type(record[k]).__name__ for k, t in schema.items() if not isinstance(record[k], t)}
    assert not wrong, f"{where}: wrong types {wrong}"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("schema")
    configs = write_profile("two-hospitals", root / "data", n_per_site=40, image_size=32, sites=SITES)
    sites = [load_site(p, check_images=False) for p in sorted(configs) if p.stem in SITES]
    train = TrainConfig(batch_size=8, max_steps_per_epoch=1, warmup_epochs=1, augment=False)
    config = SurgicalConfig(
        num_rounds=2,
        model_config=ModelConfig(arch="densenet-tiny", image_size=32),  # the network is not the subject here
        train_config=train,
        patience=5,
        min_clients_timeout=0,
        retry_pause=0,
    )
    run_surgical(sites, config, root / "server")
    return root / "server", {s.site: s.classes for s in sites}


def test_every_round_record_has_its_keys_and_types(run):
    out, classes = run
    records = [json.loads(line) for line in (out / "cxrfl" / "rounds.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in records] == ["warmup", "train", "train", "validate"]
    for r in records:
        conforms(r, SCHEMAS[r["phase"]], f"round {r['round']} ({r['phase']})")
        assert set(r["site_metrics"]) == set(SITES)
        for c, holders in r.get("contributors", {}).items():  # class -> the sites whose rows were averaged
            assert set(holders) == {s for s in SITES if c in classes[s]}, c


def test_the_evaluation_has_its_keys_and_one_entry_per_site(run):
    out, classes = run
    report = json.loads((out / "cxrfl" / "evaluation.json").read_text())
    conforms(report, EVALUATION, "evaluation.json")
    assert set(report["sites"]) == set(SITES)
    for site, entry in report["sites"].items():
        conforms(entry, SITE_TEST, f"evaluation.json site {site}")
        assert set(entry["auroc"]) == set(classes[site])  # a site's own classes only


@pytest.mark.parametrize("name", ["FL_global_model.pt", "best_FL_global_model.pt"])
def test_the_checkpoints_have_their_keys(run, name):
    out, classes = run
    checkpoint = load_checkpoint(out / name)
    conforms(checkpoint, CHECKPOINT, name)
    assert checkpoint["classes"] == sorted(set().union(*classes.values()))
    assert checkpoint["model"]["classifier.weight"].shape[0] == len(checkpoint["classes"])
