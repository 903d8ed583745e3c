"""SimSiam's batch views (GPU sites) against MONAI's per-image chain (CPU sites) and against plain tensor operations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.fedfew.ssl import simsiam_epochs, ssl_model
from cxrfl.fedfew.ssl_views import VIEW, BatchViews, TwoViewDataset, blur, view_transforms
from cxrfl.nn.models import ModelConfig
from cxrfl.nn.precision import resolve
from monai.transforms import GaussianSmooth


def _params(n: int, **changes: torch.Tensor) -> dict[str, torch.Tensor]:
    """Parameters of the identity view, with some changed."""
    p = {
        "scale": torch.ones(n, 2),
        "centre": torch.zeros(n, 2),
        "flip": torch.ones(n),
        "angle": torch.zeros(n),
    }
    return {**p, **changes}


@pytest.fixture
def images() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.rand(3, 1, 16, 16, generator=g)


def test_blur_is_monais_gaussian_smooth_for_each_images_own_sigmas(images):
    sigma_x, sigma_y = torch.tensor([0.1, 0.6, 1.0]), torch.tensor([0.9, 0.3, 0.1])
    got = blur(images, sigma_x, sigma_y)
    for i in range(3):
        want = GaussianSmooth(sigma=(float(sigma_x[i]), float(sigma_y[i])))(images[i])
        torch.testing.assert_close(got[i], torch.as_tensor(want), atol=1e-5, rtol=1e-5)


def test_geometry_identity_flip_crop_and_rotation_match_plain_tensor_operations(images):
    same = BatchViews.geometry(images, _params(3))
    torch.testing.assert_close(same, images, atol=1e-5, rtol=0)
    flipped = BatchViews.geometry(images, _params(3, flip=-torch.ones(3)))
    torch.testing.assert_close(flipped, torch.flip(images, dims=[3]), atol=1e-5, rtol=0)
    # the bottom-right quarter (rows and columns 8-15), resized back to 16: centre +0.5, half of each side
    crop = BatchViews.geometry(images, _params(3, scale=torch.full((3, 2), 0.5), centre=torch.full((3, 2), 0.5)))
    want = F.interpolate(images[:, :, 8:, 8:], size=(16, 16), mode="bilinear", align_corners=False)
    torch.testing.assert_close(crop[:, :, 1:-1, 1:-1], want[:, :, 1:-1, 1:-1], atol=1e-5, rtol=0)
    # only a crop of the rows: 10 rows from row 6 (centre (6 + 5 - 8) / 8 in normalised units)
    rows = BatchViews.geometry(
        images, _params(3, scale=torch.tensor([[10 / 16, 1.0]] * 3), centre=torch.tensor([[3 / 8, 0.0]] * 3))
    )
    want = F.interpolate(images[:, :, 6:, :], size=(16, 16), mode="bilinear", align_corners=False)
    torch.testing.assert_close(rows[:, :, 1:-1, :], want[:, :, 1:-1, :], atol=1e-5, rtol=0)
    quarter_turn = BatchViews.geometry(images, _params(3, angle=torch.full((3,), math.pi / 2)))
    turned = [torch.rot90(images, k, dims=(2, 3)) for k in (1, -1)]
    assert any(torch.allclose(quarter_turn, t, atol=1e-5) for t in turned)


def test_drawn_parameters_keep_the_views_ranges_and_probabilities():
    views = BatchViews(3)
    views.set_random_state(seed=1)
    p = views.draw(20000)
    assert ((p["scale"] >= VIEW.crop_scale) & (p["scale"] <= 1)).all()
    assert (p["centre"].abs() <= 1 - p["scale"] + 1e-6).all()  # the crop stays inside the image
    assert float((p["flip"] < 0).float().mean()) == pytest.approx(VIEW.flip_prob, abs=0.02)
    assert float((p["angle"] != 0).float().mean()) == pytest.approx(VIEW.rotate_prob, abs=0.02)
    assert float(p["angle"].abs().max()) <= math.radians(VIEW.rotate_degrees)
    assert float((p["gamma"] != 1).float().mean()) == pytest.approx(VIEW.contrast_prob, abs=0.02)
    assert float((p["sigma"][:, 0] > 0).float().mean()) == pytest.approx(VIEW.blur_prob, abs=0.02)
    assert float((p["noise"] > 0).float().mean()) == pytest.approx(VIEW.noise_prob, abs=0.02)
    lo, hi = VIEW.gamma
    on = p["gamma"] != 1
    assert float(p["gamma"][on].min()) >= lo and float(p["gamma"][on].max()) <= hi


def test_views_are_seeded_and_differ_between_calls(images):
    a, b = BatchViews(3), BatchViews(3)
    a.set_random_state(seed=5)
    b.set_random_state(seed=5)
    first = a(images)
    torch.testing.assert_close(first, b(images))
    assert first.shape == (3, 3, 16, 16) and torch.isfinite(first).all()
    assert not torch.allclose(first, a(images))


def test_batch_views_match_monais_per_image_chain_in_distribution():
    """The two implementations draw the same views: per-view brightness, contrast and sharpness quantiles agree."""
    rng = np.random.default_rng(0)
    yy, xx = np.mgrid[0:32, 0:32] / 31.0
    image = (0.2 + 0.6 * np.exp(-((yy - 0.4) ** 2 + (xx - 0.6) ** 2) / 0.05) + 0.05 * rng.random((32, 32)))[None]
    image = image.astype(np.float32)
    _, per_image = view_transforms(32, 1)
    per_image.set_random_state(seed=0)
    monai_views = torch.stack([per_image(image) for _ in range(1500)])
    views = BatchViews(1)
    views.set_random_state(seed=0)
    batch_views = views(torch.as_tensor(image)[None].expand(1500, -1, -1, -1).contiguous())

    def stats(v: torch.Tensor) -> torch.Tensor:
        grad = (v[..., 1:, :] - v[..., :-1, :]).abs().mean(dim=(1, 2, 3))
        return torch.stack([v.mean(dim=(1, 2, 3)), v.std(dim=(1, 2, 3)), grad], 1)

    q = torch.tensor([0.1, 0.25, 0.5, 0.75, 0.9])
    a, b = stats(monai_views).quantile(q, dim=0), stats(batch_views).quantile(q, dim=0)
    spread = stats(monai_views).std(dim=0)
    assert ((a - b).abs() / spread).max() < 0.15, (a - b) / spread


def test_simsiam_round_with_batch_views_trains_from_images(tmp_path):
    config = FedFewConfig(ssl_batch_size=4, ssl_max_steps=2, ssl_proj_dim=16, ssl_pred_dim=8)
    model_config = ModelConfig(arch="densenet-tiny", image_size=32)
    compute = resolve("fp32", False, "cpu")
    model = compute.prepare(ssl_model(model_config, config))
    images = [np.random.default_rng(i).random((1, 32, 32)).astype(np.float32) for i in range(8)]
    dataset = TwoViewDataset([str(i) for i in range(8)], 32, 3, images=images, batch_views=True)
    assert dataset[0][0].shape == (1, 32, 32) and len(dataset[0]) == 1
    views = BatchViews(3)
    views.set_random_state(seed=0)
    before = [p.detach().clone() for p in model.parameters()]
    seen = []
    forward = model.forward

    def spy(x1, x2):
        seen.append((x1.detach().clone(), x2.detach().clone()))
        return forward(x1, x2)

    model.forward = spy
    loss, steps = simsiam_epochs(
        model, dataset, config=config, compute=compute, num_workers=0, round_num=1, site="s", views=views
    )
    assert steps == 2 and loss is not None and math.isfinite(loss)
    for x1, x2 in seen:  # two different random views of each image, normalised, three channels
        assert x1.shape == x2.shape == (4, 3, 32, 32)
        assert not torch.allclose(x1, x2)
        assert float(x1.std()) > 0.3 and float(x2.std()) > 0.3
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
