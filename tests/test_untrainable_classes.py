"""Classes with one label value at a site (issue 41 point 2): what each method does with them.

A registry of one disease (every Hannover image is COVID-19) gives its head row only positives:
trained on them alone the row learns a constant. Every method's site leaves such a class out of its
training and validation loss (centralized training pools first: there other sites' images are its
negatives).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import require_data
from cxrfl.common.io import to_numpy
from cxrfl.data.site import SiteData, load_site, untrainable_classes
from cxrfl.errors import DataError
from cxrfl.nn.models import HEAD_PREFIX, ModelConfig, build_model
from cxrfl.nn.training import TrainConfig
from cxrfl.surgical.head_modes import payload_for
from cxrfl.surgical.learner import SiteLearner
from cxrfl.synth import write_profile

MODEL = ModelConfig(arch="densenet-tiny", image_size=32)
TRAIN = TrainConfig(lr=1e-2, warmup_epochs=1, batch_size=8, max_steps_per_epoch=2, augment=False, seed=0)
W, B = HEAD_PREFIX + "weight", HEAD_PREFIX + "bias"
REPO = Path(__file__).resolve().parents[1]
HANNOVER = REPO / "site_configs" / "real" / "hannover_mhh_covid.yaml"


@pytest.fixture(scope="module")
def registry(tmp_path_factory) -> SiteData:
    """A synthetic site whose first class is positive on every image (a registry of that disease)."""
    root = tmp_path_factory.mktemp("registry")
    (cfg,) = write_profile("two-hospitals", root, n_per_site=40, image_size=32, sites=["hospital-a"])
    site = load_site(cfg, check_images=False)
    train = site.split_table("train")
    both = [c for c in site.classes if 0 < (train[c] == 1.0).sum() < len(train)]
    assert both, "the synthetic site needs a class with both values in train"
    table = site.table[["path", "patient", "split", *both]].assign(**{"COVID-19": 1.0})
    return SiteData(site="registry", classes=["COVID-19", *both], table=table)


def zero_head_payload(learner: SiteLearner, classes: list[str]) -> dict[str, np.ndarray]:
    """The initial feature extractor with an all-zero head over ``classes`` (a row moves only if trained)."""
    torch.manual_seed(0)
    state = to_numpy(build_model(MODEL, len(classes)).state_dict())
    d = learner.model.num_features
    state.update({W: np.zeros((len(classes), d), np.float32), B: np.zeros(len(classes), np.float32)})
    return state


@pytest.mark.parametrize(
    ("head_mode", "missing"),
    [("surgical", "negative"), ("local", "negative"), ("union", "ignore"), ("union", "negative")],
)
def test_every_method_leaves_a_one_sided_class_out_of_the_loss(registry, tmp_path, caplog, head_mode, missing):
    covid, other = registry.classes[0], registry.classes[1:]
    with caplog.at_level(logging.WARNING):
        learner = SiteLearner(
            registry, tmp_path, model_config=MODEL, train_config=TRAIN, head_mode=head_mode, missing=missing
        )
    assert learner.untrainable == [covid]
    line = next(r.getMessage() for r in caplog.records if "one label value" in r.getMessage())
    assert f"site registry: class(es) {covid!r} (positive only)" in line and "left out" in line
    for split in ("train", "val"):
        assert learner.split_table(split)[covid].isna().all()
    assert (learner.split_table("test")[covid] == 1.0).all()  # evaluated as it is
    if head_mode == "local":  # the same tables feed its loss; its head never travels
        return
    # the row gets no gradient (Adam from zero state takes no step), the others do
    params, sent = payload_for(
        zero_head_payload(learner, registry.classes), registry.classes, registry.classes, head_mode=head_mode
    )
    update = learner.train_round(params, 1, classes=sent)
    np.testing.assert_array_equal(update.params[W][0], 0.0)
    assert update.params[B][0] == 0.0
    assert np.abs(update.params[W][1 : 1 + len(other)]).sum() > 0


def test_centralized_training_trains_the_row_against_the_other_sites_images(registry, tmp_path):
    from cxrfl.bench.profiles import pooled_site

    other = SiteData(site="other", classes=registry.classes[1:], table=registry.table.drop(columns=["COVID-19"]).copy())
    pooled = pooled_site([registry, other])
    assert untrainable_classes(pooled) == []  # the other site's images are COVID-19 negatives in its training split
    learner = SiteLearner(pooled, tmp_path, model_config=MODEL, train_config=TRAIN)
    train = learner.split_table("train")["COVID-19"]
    assert set(train.unique()) == {0.0, 1.0}


def test_a_site_without_a_negative_for_any_class_is_refused_in_one_line(registry, tmp_path):
    table = registry.table.copy()
    table[registry.classes] = 0.0  # no positive anywhere: nothing to learn to say yes
    none_positive = SiteData(site="screening", classes=list(registry.classes), table=table)
    with pytest.raises(DataError, match=r"site screening: .*\(negative only\).* nothing to train") as err:
        SiteLearner(none_positive, tmp_path, model_config=MODEL, train_config=TRAIN)
    assert "\n" not in str(err.value)


def test_the_real_registry_leaves_covid_out_and_trains_icu_admission():
    require_data(
        HANNOVER.is_file() and (REPO.parent / "shared" / "data" / "real" / "hannover_mhh_covid").is_dir(),
        "real data not found beside the checkout",
    )
    site = load_site(HANNOVER, check_images=False)
    assert untrainable_classes(site) == ["COVID-19"]
    train = site.split_table("train")["ICU admission"]
    assert 0 < (train == 1.0).sum() < len(train)  # both values: trained
