"""One seed of the FedFew benchmark, really trained (tiny network, one round per stage): a method that needs only
``fedfew``'s stage-1 encoder trains stage 1 and nothing more on a fresh work folder, a later method that needs
stage 2 goes on from that stage-1 file instead of training it again, and a variant of a variant
(``fedfew-no-ebm-prototype``) makes its source's stage files first and reuses them."""

from __future__ import annotations

import hashlib
from dataclasses import replace

from cxrfl.bench.fedfew import QUICK
from cxrfl.bench.fedfew.data import prepare_data
from cxrfl.bench.fedfew.seed import SeedRun
from cxrfl.common.io import read_records
from cxrfl.common.server import RECORDS_DIR
from cxrfl.fedfew.stages import STAGE_DIR, STAGE_FILES


def _stage_records(folder):
    return [r["stage"] for r in read_records(folder / RECORDS_DIR / "rounds.jsonl") if not r.get("status")]


def test_a_method_needing_stage_1_trains_only_it_and_a_later_one_goes_on_from_its_file(tmp_path):
    settings = replace(QUICK, arch="densenet-tiny", test_per_class=10)
    data = prepare_data(settings, tmp_path / "data", 0)
    seed = SeedRun(settings, 0, data, tmp_path / "work", lambda m: None)
    folder = tmp_path / "work" / "seed0" / "fedfew"
    stage1, stage2 = (folder / STAGE_DIR / STAGE_FILES[k] for k in (1, 2))

    nn = seed.run("nn-ssl")  # the stage-1 encoder's nearest neighbours: stage 1 only
    assert stage1.is_file() and not stage2.exists()
    assert set(_stage_records(folder)) == {1}
    assert all(0.0 <= nn["uc"][u]["auroc"] <= 1.0 for u in ("Edema", "Pneumonia", "Hernia"))
    first = hashlib.sha256(stage1.read_bytes()).hexdigest()
    ssl_rounds = len(_stage_records(folder))

    balanced = seed.run("fedfew-balanced")  # needs stage 2: trained from the stage-1 file that is there
    assert stage2.is_file()
    assert hashlib.sha256(stage1.read_bytes()).hexdigest() == first
    assert _stage_records(folder).count(1) == ssl_rounds and 2 in _stage_records(folder)
    assert set(balanced["uc"]) == {"Edema", "Pneumonia", "Hernia"}

    # the prototype scorers on fedfew-no-ebm's stage-2 model: that model is trained first (from the stage-1
    # file there, with FedFew's schedule and lambda = 0), then reused as it is
    ablation = seed.run("fedfew-no-ebm-prototype")
    no_ebm = tmp_path / "work" / "seed0" / "fedfew-no-ebm"
    no_ebm_stage2 = no_ebm / STAGE_DIR / STAGE_FILES[2]
    reused = tmp_path / "work" / "seed0" / "fedfew-no-ebm-prototype" / "reused" / STAGE_FILES[2]
    assert hashlib.sha256(reused.read_bytes()).hexdigest() == hashlib.sha256(no_ebm_stage2.read_bytes()).hexdigest()
    assert hashlib.sha256(stage1.read_bytes()).hexdigest() == first and _stage_records(folder).count(1) == ssl_rounds
    phases = [r.get("phase") for r in read_records(no_ebm / RECORDS_DIR / "rounds.jsonl") if r.get("stage") == 2]
    assert phases and set(phases) == {"warm-up", "bce"}
    assert ablation["detector"] == "scorer" and set(ablation["uc"]) == {"Edema", "Pneumonia", "Hernia"}
