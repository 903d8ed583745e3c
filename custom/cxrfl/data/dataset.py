"""A torch dataset over a site table: (image, target, mask) per image, and its data loader.

The loader runs the pipeline of :mod:`cxrfl.data.transforms`. Where the images come from:
the files (decoded every epoch), a site's preprocessing cache on disk (``cache_dir``,
:mod:`cxrfl.data.cache`: decoded once, then read back as small tensors) or an in-memory cache
(``cache``, for evaluation splits read every round). Where the rest runs: on a CPU device in the
loader's workers, one image at a time; on a CUDA device the workers only load, batches travel
from pinned memory without blocking, and augmentation and normalisation run on the GPU on whole
batches (:class:`cxrfl.data.transforms.BatchTransform`).

Workers: ``num_workers="auto"`` takes one per core this process may use, less one for training
(at most :data:`MAX_AUTO_WORKERS`); they stay alive across epochs and rounds while the loader
does (``persistent_workers``), each loading :data:`PREFETCH_FACTOR` batches ahead. MONAI's
DataLoader seeds the random transforms of each worker from the loader's seed (worker ``i`` of an
iterator gets ``base_seed + i``, ``base_seed`` drawn from the seeded generator; persistent workers
are seeded once and draw on across epochs), so the same seed and worker count give the same
augmented batches, and no two workers draw alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
from monai.data import CacheDataset
from monai.data import DataLoader as MonaiDataLoader
from monai.transforms import Compose
from torch.utils.data import DataLoader, Dataset, RandomSampler, Sampler

from cxrfl.common.cores import available_cores
from cxrfl.data.cache import disk_cache
from cxrfl.data.transforms import BatchTransform, augment_transforms, input_transforms, preprocess_transforms
from cxrfl.errors import ConfigError

MAX_AUTO_WORKERS = 8
"""Most loader workers ``num_workers="auto"`` starts (a warm cache needs few; see the README's GPU-site section)."""
PREFETCH_FACTOR = 2
"""Batches each worker loads ahead."""


def resolve_workers(value: int | str, cores: int | None = None) -> int:
    """Loader worker processes for a ``num_workers`` setting.

    Args:
        value: ``"auto"`` (one per available core less one for training, at most
            :data:`MAX_AUTO_WORKERS`; 0 on one core) or an integer >= 0.
        cores: the cores to size ``auto`` for (default: the cores this process is given,
            :func:`cxrfl.common.cores.available_cores`).

    Raises:
        ConfigError: anything else.
    """
    if value == "auto":
        return max(0, min((available_cores() if cores is None else cores) - 1, MAX_AUTO_WORKERS))
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"num_workers must be 'auto' or an integer >= 0, got {value!r}")
    return value


class CXRDataset(Dataset):
    """Images of a site table with their label targets and known-label masks.

    An item is ``(image, target, mask)``: ``transform(images[i])``, ``target`` float32 ``[K]``
    (1/0, unknown labels as 0) and ``mask`` float32 ``[K]`` (1 where the label is known).

    Args:
        table: rows with ``path`` and the class columns (1.0, 0.0 or NaN).
        classes: the class columns, in model output order.
        transform: image source item -> image tensor (None: the item as it is).
        images: where each row's image comes from (default: its path), e.g. a cache of
            preprocessed images (:func:`cxrfl.data.cache.disk_cache`).
        batch_transform: the steps a :class:`DeviceLoader` runs on whole batches (kept here so
            that seeding the dataset, ``monai.data.utils.set_rnd``, seeds them too).
    """

    def __init__(
        self,
        table: pd.DataFrame,
        classes: Sequence[str],
        transform: Callable[[Any], torch.Tensor] | None,
        *,
        images: Sequence | None = None,
        batch_transform: BatchTransform | None = None,
    ) -> None:
        labels = table[list(classes)].to_numpy(dtype=np.float32)
        self.masks = (~np.isnan(labels)).astype(np.float32)
        self.targets = np.nan_to_num(labels, nan=0.0)
        # plain attributes only: MONAI's DataLoader seeds random transforms by walking them
        self.images: Sequence = [str(p) for p in table["path"]] if images is None else images
        self.transform = transform
        self.batch_transform = batch_transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        image = self.images[index]
        image = image if self.transform is None else self.transform(image)
        return image, torch.from_numpy(self.targets[index]), torch.from_numpy(self.masks[index])


class DeviceLoader:
    """A data loader whose batches arrive on ``device``, finished there by the dataset's
    ``batch_transform``; copies leave pinned memory without blocking. Other attributes
    (``dataset``, ``sampler``, ``batch_size`` ...) are the wrapped loader's.

    Args:
        loader: yields ``(images [B, 1, H, W], targets, masks)`` on the CPU.
        device: where batches go.
    """

    def __init__(self, loader: DataLoader, device: torch.device) -> None:
        self.loader = loader
        self.device = device

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        if name == "loader":  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        finish = self.loader.dataset.batch_transform
        for x, y, m in self.loader:
            x, y, m = (t.to(self.device, non_blocking=True) for t in (x, y, m))
            yield finish(x), y, m


def _image_source(paths: list[str], image_size: int, cache: bool, cache_dir: str | Path | None) -> Sequence | None:
    """Preprocessed images from a disk or memory cache, or None (read from the files)."""
    if cache_dir is not None:
        return disk_cache(paths, image_size, cache_dir)
    if cache:
        return CacheDataset(paths, preprocess_transforms(image_size), cache_rate=1.0, num_workers=None, progress=False)
    return None


def _transforms(
    image_size: int, train: bool, in_channels: int, cached: bool, on_device: bool
) -> tuple[Compose | None, BatchTransform | None]:
    """The per-image transform after the image source, and the batch transform (on the device; seeded by
    :func:`reseed`)."""
    steps = [] if cached else [preprocess_transforms(image_size)]
    if not on_device:
        steps += ([augment_transforms()] if train else []) + [input_transforms(in_channels)]
        return Compose(steps).flatten(), None
    return (Compose(steps).flatten() if steps else None), BatchTransform(in_channels, augment=train)


def make_loader(
    table: pd.DataFrame,
    classes: Sequence[str],
    *,
    image_size: int,
    train: bool,
    batch_size: int,
    num_workers: int | str = 0,
    seed: int = 0,
    cache: bool = False,
    sampler: Sampler | None = None,
    in_channels: int = 3,
    cache_dir: str | Path | None = None,
    device: torch.device | str | None = None,
    device_transforms: bool | None = None,
) -> DataLoader | DeviceLoader:
    """A data loader of ``(images, targets, masks)`` batches for one split of a site.

    Training loaders shuffle (unless ``sampler`` is given) and augment; random order and
    augmentation are reproducible from ``seed``.

    Args:
        table: the split's rows (``path`` and the class columns).
        classes: the class columns, in model output order.
        image_size: model input size in pixels.
        train: shuffle and augment.
        batch_size: images per batch.
        num_workers: loader worker processes, or ``"auto"`` (:func:`resolve_workers`).
        seed: seed of shuffling and augmentation.
        cache: keep preprocessed images in memory (evaluation splits read every round) when
            there is no ``cache_dir``.
        sampler: a custom sampler (e.g. label-balanced minibatches); disables shuffling.
        in_channels: model input channels (3 or 1).
        cache_dir: the site's preprocessing cache on disk (:mod:`cxrfl.data.cache`), for every split.
        device: where the model runs; CUDA: pinned memory, and see ``device_transforms``.
        device_transforms: augment and normalise whole batches on ``device`` (a
            :class:`DeviceLoader`; batches arrive there). Default: on CUDA devices.
    """
    workers = resolve_workers(num_workers)
    device = torch.device(device) if device is not None else torch.device("cpu")
    on_device = device.type == "cuda" if device_transforms is None else device_transforms
    images = _image_source([str(p) for p in table["path"]], image_size, cache, cache_dir)
    transform, finish = _transforms(image_size, train, in_channels, images is not None, on_device)
    dataset = CXRDataset(table, classes, transform, images=images, batch_transform=finish)
    if on_device and train and sampler is None:
        # its own generator: the loader's also seeds worker processes, once per iterator (kept workers: once)
        sampler = RandomSampler(dataset, generator=torch.Generator())
    options: dict[str, Any] = {"persistent_workers": True, "prefetch_factor": PREFETCH_FACTOR} if workers else {}
    loader = MonaiDataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=train and sampler is None,
        sampler=sampler,
        # a last training batch of one image cannot train BatchNorm where the last feature map is 1x1 (48 px
        # inputs): it is left out, a different image each shuffled epoch
        drop_last=train and len(sampler if sampler is not None else dataset) % batch_size == 1,
        num_workers=workers,
        generator=torch.Generator().manual_seed(seed),
        collate_fn=torch.utils.data.default_collate,
        pin_memory=device.type == "cuda",
        **options,
    )
    if not on_device:
        return loader
    on = DeviceLoader(loader, device)
    reseed(on, seed)  # after MONAI's own seeding (which, without workers, draws from the generator)
    return on


def reseed(loader: DataLoader | DeviceLoader, seed: int) -> None:
    """Seed a loader's order and augmentations: a kept training loader then gives what a new one
    made with ``seed`` gives (:func:`make_loader` ends with this call).

    Only for a loader whose workers draw nothing at random (a :class:`DeviceLoader`: augmentation
    is its batch transform's, on the device): its sampler's generator (a shuffling one has its own)
    and the batch transform are seeded, persistent workers stay up.

    Args:
        loader: a training loader from :func:`make_loader` with device transforms.
        seed: the seed a fresh loader would get.
    """
    finish = loader.dataset.batch_transform
    if finish is None:
        raise ValueError("only a loader that augments on the device can be reseeded (its workers draw at random)")
    generator = getattr(loader.sampler, "generator", None)
    if generator is not None:  # a shuffling sampler
        generator.manual_seed(seed)
    finish.set_random_state(seed)
