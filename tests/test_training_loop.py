"""The one local training loop (issue 43): ``nn/training.py`` ``train_steps`` with a loss hook, which the
masked-BCE epochs, FedFew's SimSiam rounds and its stage-2 rounds all run."""

from __future__ import annotations

import cxrfl.fedfew.energy_training as energy_module
import cxrfl.fedfew.ssl as ssl_module
import pytest
import torch
from cxrfl.fedfew.config import FedFewConfig
from cxrfl.nn.precision import as_compute
from cxrfl.nn.training import train_steps

CPU = as_compute(torch.device("cpu"))


def batches(n: int) -> list[tuple[torch.Tensor]]:
    return [(torch.full((i + 1, 1), float(i)),) for i in range(n)]


def test_one_step_per_batch_with_a_loss_and_none_skips_it():
    w = torch.nn.Parameter(torch.zeros(()))
    opt = torch.optim.SGD([w], lr=0.5)
    seen = []

    def loss(batch):
        seen.append(batch[0].shape[0])
        return None if batch[0].shape[0] == 2 else (w - 1.0) ** 2  # the batch of two images is skipped

    stats = train_steps(batches(4), opt, CPU, loss, epochs=2, max_steps=3)
    assert seen == [1, 2, 3] * 2  # max_steps caps each epoch at 3 batches
    assert (stats.steps, stats.skipped, stats.images) == (4, 2, 2 * (1 + 3))
    assert float(w) == pytest.approx(1.0)  # SGD on (w - 1)^2 with lr 0.5 reaches 1 in its first step
    assert stats.loss == pytest.approx((1.0 + 0 + 0 + 0) / 4)


def test_a_non_finite_loss_stops_with_the_name_it_was_given():
    w = torch.nn.Parameter(torch.zeros(()))
    with pytest.raises(FloatingPointError, match=r"^site x: SimSiam loss became nan at step 0$"):
        train_steps(
            batches(2), torch.optim.SGD([w], lr=0.1), CPU, lambda b: w * float("nan"), what="site x: SimSiam loss"
        )


def test_fedfew_trains_through_the_one_loop(monkeypatch):
    calls = []

    def spy(loader, optimizer, compute, step_loss, **kw):
        calls.append(kw["what"])
        return train_steps(loader, optimizer, compute, step_loss, **kw)

    monkeypatch.setattr(ssl_module, "train_steps", spy)
    monkeypatch.setattr(energy_module, "train_steps", spy)
    config = FedFewConfig(local_epochs=1)
    model = torch.nn.Linear(4, 3)  # logits of two CCs and the "no CC" output
    y = torch.zeros(4, 5)
    y[:, 0], y[:2, 2], y[2:, 3] = 1.0, 1.0, 1.0  # in and out images
    loader = [(torch.randn(4, 4), y, torch.ones(4, 5))]
    steps, skipped, _ = energy_module.energy_epochs(
        model, loader, n_cc=2, config=config, compute=CPU, energy_weight=0.1, m_in=-5.0, m_out=-1.0, site="x"
    )
    assert (steps, skipped) == (1, 0) and calls == ["site x: stage-2 loss"]
