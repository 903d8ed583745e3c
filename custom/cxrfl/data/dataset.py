"""A torch dataset over a site table: (image, target, mask) per image, and its data loader."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import pandas as pd
import torch
from monai.data import CacheDataset
from monai.data import DataLoader as MonaiDataLoader
from torch.utils.data import DataLoader, Dataset, Sampler

from cxrfl.data.transforms import build_transforms


class CXRDataset(Dataset):
    """Images of a site table with their label targets and known-label masks.

    An item is ``(image, target, mask)``: the transformed image, ``target`` float32 ``[K]``
    (1/0, unknown labels as 0) and ``mask`` float32 ``[K]`` (1 where the label is known).

    Args:
        table: rows with ``path`` and the class columns (1.0, 0.0 or NaN).
        classes: the class columns, in model output order.
        transform: path -> image tensor (see :func:`cxrfl.data.transforms.build_transforms`).
        cache: keep the deterministic leading steps of ``transform`` (load, resize) in memory
            with a MONAI ``CacheDataset`` (filled by one thread per CPU); random steps still run
            on every access. ``transform`` must then be a MONAI ``Compose``.
    """

    def __init__(
        self,
        table: pd.DataFrame,
        classes: Sequence[str],
        transform: Callable[[str], torch.Tensor],
        *,
        cache: bool = False,
    ) -> None:
        labels = table[list(classes)].to_numpy(dtype=np.float32)
        self.masks = (~np.isnan(labels)).astype(np.float32)
        self.targets = np.nan_to_num(labels, nan=0.0)
        paths = [str(p) for p in table["path"]]
        # plain attributes only: MONAI's DataLoader seeds random transforms by walking them
        self.images: Sequence = (
            CacheDataset(paths, transform, cache_rate=1.0, num_workers=None, progress=False)
            if cache
            else paths
        )
        self.transform = None if cache else transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        image = self.images[index] if self.transform is None else self.transform(self.images[index])
        return image, torch.from_numpy(self.targets[index]), torch.from_numpy(self.masks[index])


def make_loader(
    table: pd.DataFrame,
    classes: Sequence[str],
    *,
    image_size: int,
    train: bool,
    batch_size: int,
    num_workers: int = 0,
    seed: int = 0,
    cache: bool = False,
    sampler: Sampler | None = None,
    in_channels: int = 3,
) -> DataLoader:
    """A data loader of ``(images, targets, masks)`` batches for one split of a site.

    Training loaders shuffle (unless ``sampler`` is given) and augment; random order and
    augmentation are reproducible from ``seed``.

    Args:
        table: the split's rows (``path`` and the class columns).
        classes: the class columns, in model output order.
        image_size: model input size in pixels.
        train: shuffle and augment.
        batch_size: images per batch.
        num_workers: loader worker processes.
        seed: seed of shuffling and augmentation.
        cache: cache loaded, resized images in memory (worth it for evaluation sets that are
            read every round).
        sampler: a custom sampler (e.g. label-balanced minibatches); disables shuffling.
        in_channels: model input channels (3 or 1).
    """
    dataset = CXRDataset(
        table, classes, build_transforms(image_size, train=train, in_channels=in_channels), cache=cache
    )
    return MonaiDataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=train and sampler is None,
        sampler=sampler,
        num_workers=num_workers,
        generator=torch.Generator().manual_seed(seed),
        collate_fn=torch.utils.data.default_collate,
    )
