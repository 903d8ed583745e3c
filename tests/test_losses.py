"""masked_bce: only known labels count, compared with torch's own BCE on those entries."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from cxrfl.nn.losses import masked_bce


def data():
    torch.manual_seed(0)
    logits = torch.randn(4, 3, requires_grad=True)
    targets = torch.tensor([[1.0, 0.0, float("nan")], [0.0, 1.0, 1.0], [-1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 1, 1], [1, 0, 0]])
    return logits, targets, mask


def test_unknown_entries_do_not_contribute():
    logits, targets, mask = data()
    known = mask.bool()
    expected = F.binary_cross_entropy_with_logits(logits[known], targets[known])
    loss = masked_bce(logits, targets, mask)
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert torch.all(logits.grad[~known] == 0) and torch.all(logits.grad[known] != 0)
    # whatever the unknown targets are (NaN, -1, 0 or 1), the loss is the same
    other = torch.where(known, targets, torch.tensor(1.0))
    torch.testing.assert_close(masked_bce(logits, other, mask.bool()), expected)
    torch.testing.assert_close(
        masked_bce(logits, targets, mask, reduction="sum"),
        F.binary_cross_entropy_with_logits(logits[known], targets[known], reduction="sum"),
    )
    none = masked_bce(logits, targets, mask, reduction="none")
    assert none.shape == (4, 3) and torch.all(none[~known] == 0)


def test_pos_weight_and_class_weight_by_hand():
    logits, targets, mask = data()
    pos_weight = torch.tensor([2.0, 1.0, 0.5])
    class_weight = torch.tensor([1.0, 3.0, 0.25])
    known = mask.bool()
    y = torch.nan_to_num(targets)
    per = -(pos_weight * y * F.logsigmoid(logits) + (1 - y) * F.logsigmoid(-logits)) * class_weight
    expected = per[known].sum() / known.sum()
    got = masked_bce(logits, targets, mask, pos_weight=pos_weight, class_weight=class_weight)
    torch.testing.assert_close(got, expected)


def test_nothing_known_gives_zero_with_grad():
    logits, targets, _ = data()
    loss = masked_bce(logits, targets, torch.zeros(4, 3))
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()
    assert torch.equal(logits.grad, torch.zeros(4, 3))


def test_bad_arguments():
    logits, targets, mask = data()
    with pytest.raises(ValueError, match="same shape"):
        masked_bce(logits, targets[:, :2], mask)
    with pytest.raises(ValueError, match="reduction"):
        masked_bce(logits, targets, mask, reduction="avg")
