"""A site's preprocessing cache on disk: every image decoded, windowed and resized once.

MONAI's ``PersistentDataset`` over the deterministic steps (:func:`cxrfl.data.transforms.preprocess_transforms`:
read with the intensity policy, resize to the model's input size): the first epoch fills it,
later epochs, rounds and jobs read one small tensor per image instead of decoding a full-size
PNG or DICOM. Random augmentation runs on the cached tensors.

Where: a folder of the site's own workspace. NVFlare sites keep it in
``<site workspace>/cxrfl_state/image_cache`` (:data:`IMAGE_CACHE` under the executor's state
root); nothing is written anywhere else (MONAI's own writer stages files in the system temp
folder: :class:`DiskCache` writes in the cache folder itself), and nothing in it ever leaves the
site.

Layout: ``<root>/<size>px-<chain>/<item><chain>.pt``, one float32 ``[1, size, size]`` tensor per
image (``size**2 * 4`` bytes plus about 1.6 kB). The keys decide validity:

- item: SHA-256 of the image's absolute path, byte size and modification time (ns): a replaced,
  edited or re-exported image gets a new entry;
- chain: MONAI's ``pickle_hashing`` of the deterministic transforms, which carry the input
  size, the interpolation and a digest of the intensity policy's code: a new input size or
  policy starts a new folder. The :data:`KEEP_CHAINS` most recently used folders are kept.

The site config enters through the images it lists (paths and file identities); labels,
splits and class lists do not change pixels and keep the cache valid.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from monai.data import PersistentDataset
from monai.data.utils import pickle_hashing

from cxrfl.common.io import torch_save
from cxrfl.data.transforms import preprocess_transforms

log = logging.getLogger(__name__)

IMAGE_CACHE = "image_cache"
"""Folder of a site's preprocessing cache under its state root."""
KEEP_CHAINS = 2
"""Preprocessing chains (input sizes, policies) whose cached images are kept."""


def file_identity(path: str) -> bytes:
    """The cache key of one image: SHA-256 of its absolute path, size and modification time.

    Args:
        path: the image file (a missing one gets a key of its path; reading it then fails clearly).
    """
    try:
        st = os.stat(path)
        stamp = f"{st.st_size}:{st.st_mtime_ns}"
    except OSError:
        stamp = "missing"
    return hashlib.sha256(f"{os.path.abspath(path)}\0{stamp}".encode()).hexdigest().encode()


class DiskCache(PersistentDataset):
    """MONAI's ``PersistentDataset`` whose files are written only in ``cache_dir``.

    MONAI stages each new file in the system temp folder before moving it; here it is written
    atomically (temporary file and rename) inside the cache folder, so no preprocessed image is
    ever written outside the site's workspace. An unreadable cached file is computed again.
    """

    def _cachecheck(self, item_transformed: Any) -> Any:
        name = self.hash_func(item_transformed).decode("utf-8") + self.transform_hash
        path = self.cache_dir / f"{name}.pt"
        if path.is_file():
            try:
                return torch.load(path, weights_only=True)
            except (RuntimeError, EOFError, pickle.UnpicklingError) as exc:
                log.warning("cached image %s is unreadable (%s); computing it again", path, exc)
        out = self._pre_transform(item_transformed)
        torch_save(path, out)
        return out


def chain_folder(root: str | Path, image_size: int) -> Path:
    """The folder of one preprocessing chain under a cache root, marked as just used; older
    chains beyond :data:`KEEP_CHAINS` are removed.

    Args:
        root: the cache root (e.g. ``<state root>/image_cache``).
        image_size: the model's input size.
    """
    root = Path(root)
    chain = pickle_hashing(preprocess_transforms(image_size).flatten().transforms).decode()[:16]
    folder = root / f"{image_size}px-{chain}"
    folder.mkdir(parents=True, exist_ok=True)
    os.utime(folder)
    others = sorted(
        (p for p in root.iterdir() if p.is_dir() and p != folder), key=lambda p: p.stat().st_mtime, reverse=True
    )
    for old in others[KEEP_CHAINS - 1 :]:
        log.info("removing the preprocessing cache of an older chain: %s", old)
        shutil.rmtree(old, ignore_errors=True)
    return folder


def disk_cache(paths: Sequence[str], image_size: int, root: str | Path) -> DiskCache:
    """The images of ``paths`` preprocessed for ``image_size``, cached under ``root``.

    Args:
        paths: image files.
        image_size: the model's input size.
        root: the site's cache root.

    Returns:
        a dataset: index -> float32 ``[1, image_size, image_size]`` tensor in [0, 1].
    """
    return DiskCache(
        list(paths),
        preprocess_transforms(image_size),
        cache_dir=chain_folder(root, image_size),
        hash_func=file_identity,
        hash_transform=pickle_hashing,
    )


def cache_size(root: str | Path) -> tuple[int, int]:
    """Cached images and their bytes under a cache root (every chain).

    Args:
        root: the cache root.
    """
    files = [p for p in Path(root).rglob("*.pt") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)
