"""Part ``loading`` of ``cxrfl bench speed``: can the input pipeline keep the model busy?

Images/s of the training loader alone (:func:`cxrfl.data.dataset.make_loader`, augmentation on,
as a site's training split) from full-size files, for each worker count:

- ``files``: no cache, every image decoded every epoch (what a site did before the cache);
- ``cold``: the first epoch with an empty preprocessing cache (decode, resize, write);
- ``warm``: later epochs, reading the cache (:mod:`cxrfl.data.cache`);

for 1024x1024 8-bit PNGs (the size of NIH and CheXpert images) and 2500x2048 16-bit (12 bits
stored) MONOCHROME1 DICOMs with a VOI window (a CR/DX radiograph), both synthetic; next to the
model's own training images/s on the same machine from in-memory tensors (DenseNet121, the
default precision of the device: the upper bound a loader has to reach). Also the cache's disk
size per 1,000 images. On a CUDA device the loader's batches are finished on the GPU (copy,
augmentation, normalisation), as at a GPU site.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from cxrfl.bench.report_text import markdown_table
from cxrfl.common.config import Config

logger = logging.getLogger(__name__)

FORMATS = {"png": "1024x1024 8-bit PNG", "dicom": "2500x2048 16-bit MONOCHROME1 DICOM (12 bits stored, windowed)"}
WORKER_STEPS = (0, 1, 2, 4, 8, 16)
"""Worker counts measured by default, up to the cores of the machine (plus ``auto``'s)."""


@dataclass(frozen=True)
class LoadingSettings(Config):
    """What the loading part runs.

    Args:
        image_size: model input (the cache holds images at this size).
        batch_size: loader and model minibatch.
        n_images: synthetic images per format (every epoch reads them all).
        workers: loader worker counts (empty: :data:`WORKER_STEPS` up to the cores, and ``auto``'s).
        warm_epochs: epochs timed with the cache warm.
        model_steps: timed training steps of the model (after one warm-up step).
        threads: torch threads of the main process (0: torch's default).
        device: ``auto`` (CUDA when available), ``cpu`` or ``cuda[:N]``.
        formats: some of :data:`FORMATS`.
    """

    SECTION: ClassVar[str] = "bench"
    image_size: int = field(default=224, metadata={"ge": 32})
    batch_size: int = field(default=64, metadata={"ge": 1})
    n_images: int = field(default=128, metadata={"ge": 1})
    workers: tuple[int, ...] = ()
    warm_epochs: int = field(default=2, metadata={"ge": 1})
    model_steps: int = field(default=3, metadata={"ge": 1})
    threads: int = field(default=2, metadata={"ge": 0})
    device: str = "auto"
    formats: tuple[str, ...] = ("png", "dicom")

    def __post_init__(self) -> None:
        super().__post_init__()
        unknown = sorted(set(self.formats) - set(FORMATS))
        if unknown:
            self.fail("formats", f"has unknown image format(s) {unknown}; use some of {sorted(FORMATS)}")


def _smooth(rng: np.random.Generator, height: int, width: int) -> np.ndarray:
    """A smooth random field in [0, 1] (low-resolution noise scaled up), shared structure of a file set."""
    from PIL import Image

    low = Image.fromarray((rng.random((height // 64, width // 64)) * 255).astype(np.uint8))
    return np.asarray(low.resize((width, height), Image.BICUBIC), dtype=np.float32) / 255.0


def _write_dicom(path: Path, pixels: np.ndarray) -> None:
    import pydicom
    from pydicom.dataset import FileDataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = "1.2.840.10008.5.1.4.1.1.1"  # Computed Radiography Image Storage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = FileDataset(str(path), {}, file_meta=meta, preamble=b"\0" * 128)
    ds.SOPClassUID, ds.SOPInstanceUID, ds.Modality = meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID, "CR"
    ds.Rows, ds.Columns = pixels.shape
    ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME1"
    ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 12, 11, 0
    ds.WindowCenter, ds.WindowWidth = 2048, 3000
    ds.PixelData = pixels.astype(np.uint16).tobytes()
    pydicom.dcmwrite(path, ds, enforce_file_format=True)


def write_images(fmt: str, n: int, folder: Path, seed: int = 0) -> list[Path]:
    """``n`` distinct full-size images of one format (a smooth field plus per-image noise).

    Args:
        fmt: ``png`` or ``dicom``.
        n: how many.
        folder: where (created).
        seed: random seed.
    """
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    height, width = (1024, 1024) if fmt == "png" else (2500, 2048)
    base = _smooth(rng, height, width)
    paths = []
    for i in range(n):
        noisy = np.clip(base + rng.normal(0.0, 0.015, base.shape).astype(np.float32), 0.0, 1.0)
        path = folder / f"{i:05d}.{'png' if fmt == 'png' else 'dcm'}"
        if fmt == "png":
            Image.fromarray((noisy * 255).astype(np.uint8)).save(path)
        else:
            _write_dicom(path, (1.0 - noisy) * 4095)  # MONOCHROME1: bone is low
        paths.append(path)
    return paths


def worker_counts(s: LoadingSettings) -> list[int]:
    """The worker counts to measure (``s.workers``, else :data:`WORKER_STEPS` up to the cores, and ``auto``'s)."""
    from cxrfl.common.cores import available_cores
    from cxrfl.data.dataset import resolve_workers

    if s.workers:
        return sorted(set(s.workers))
    cores = available_cores()
    return sorted({w for w in WORKER_STEPS if w <= cores} | {resolve_workers("auto")})


def _epoch_rate(loader: Any, device: Any) -> float:
    import torch

    start, images = time.perf_counter(), 0
    for x, _, _ in loader:
        images += int(x.shape[0])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return images / (time.perf_counter() - start)


def loader_rates(
    paths: Sequence[Path], s: LoadingSettings, workers: int, device: Any, cache_root: Path
) -> dict[str, Any]:
    """Images/s of one worker count: ``files`` (no cache), ``cold`` (first epoch, empty cache), ``warm`` (later epochs).

    Args:
        paths: the image files.
        s: settings.
        workers: loader worker processes.
        device: where batches go (CUDA: finished on the GPU).
        cache_root: an empty folder for this run's cache.
    """
    import pandas as pd

    from cxrfl.data.dataset import make_loader

    table = pd.DataFrame({"path": [str(p) for p in paths], "A": 1.0})

    def loader(cache_dir: Path | None) -> Any:
        return make_loader(
            table,
            ["A"],
            image_size=s.image_size,
            train=True,
            batch_size=s.batch_size,
            num_workers=workers,
            cache_dir=cache_dir,
            device=device,
        )

    files = _epoch_rate(loader(None), device)
    cached = loader(cache_root)
    cold = _epoch_rate(cached, device)
    warm = [_epoch_rate(cached, device) for _ in range(s.warm_epochs)]
    return {"files": files, "cold": cold, "warm": warm, "warm_mean": statistics.mean(warm)}


def model_rate(s: LoadingSettings, device: Any) -> dict[str, Any]:
    """Training images/s of DenseNet121 on in-memory tensors at ``s.image_size`` (the upper bound).

    Args:
        s: settings.
        device: where it trains (the device's default precision and memory format).
    """
    import torch

    from cxrfl.nn.models import ModelConfig, build_model
    from cxrfl.nn.precision import resolve
    from cxrfl.nn.training import adam, train_epochs

    compute = resolve("auto", "auto", device)
    g = torch.Generator().manual_seed(0)
    batches = [
        (
            torch.randn(s.batch_size, 3, s.image_size, s.image_size, generator=g),
            (torch.rand(s.batch_size, 14, generator=g) > 0.8).float(),
            torch.ones(s.batch_size, 14),
        )
        for _ in range(s.model_steps)
    ]
    torch.manual_seed(0)
    model = build_model(ModelConfig(image_size=s.image_size), 14)
    opt = adam(model, 1e-4)
    train_epochs(model, batches[:1], opt, compute)  # kernels and allocator warmed up
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stats = train_epochs(model, batches, opt, compute)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {"images_per_second": stats.images / stats.seconds, "compute": compute.describe(), "steps": s.model_steps}


def loading_benchmark(s: LoadingSettings, work: Path, log: Callable[[str], None] = logger.info) -> dict[str, Any]:
    """The loading part: loader images/s per format and worker count, the model's images/s, cache size.

    Args:
        s: settings.
        work: scratch folder (images and caches are written there).
        log: progress callback.
    """
    import torch

    from cxrfl.data.cache import cache_size
    from cxrfl.data.dataset import resolve_workers
    from cxrfl.nn.models import select_device
    from cxrfl.nn.threads import torch_threads

    device = select_device(s.device)
    out: dict[str, Any] = {
        "settings": {**s.to_dict(), "workers": worker_counts(s)},
        "device": str(device),
        "auto_workers": resolve_workers("auto"),
        "formats": {},
    }
    with torch_threads(s.threads or torch.get_num_threads()):
        out["model"] = model_rate(s, device)
        log(f"loading: model trains at {out['model']['images_per_second']:.1f} images/s ({out['model']['compute']})")
        for fmt in s.formats:
            paths = write_images(fmt, s.n_images, work / fmt)
            rows: dict[str, Any] = {}
            for w in worker_counts(s):
                root = work / f"cache-{fmt}-{w}"
                rows[str(w)] = loader_rates(paths, s, w, device, root)
                r = rows[str(w)]
                log(
                    f"loading {fmt}, {w} worker(s): files {r['files']:.1f}, cold {r['cold']:.1f}, "
                    f"warm {r['warm_mean']:.1f} images/s"
                )
            files, size = cache_size(root)
            out["formats"][fmt] = {
                "description": FORMATS[fmt],
                "workers": rows,
                "file_mb_per_image": sum(p.stat().st_size for p in paths) / len(paths) / 1e6,
                "cache_mb_per_1000_images": size / files * 1000 / 1e6 if files else None,
            }
    return out


def _best(rows: dict[str, Any], auto: int) -> tuple[str, dict[str, Any]]:
    """The row of ``auto``'s worker count when measured, else the fastest warm one."""
    if str(auto) in rows:
        return str(auto), rows[str(auto)]
    key = max(rows, key=lambda k: rows[k]["warm_mean"])
    return key, rows[key]


def loading_summary(res: dict[str, Any]) -> dict[str, Any]:
    """Headline numbers: the model's images/s and, per format, files/cold/warm images/s at ``auto``'s workers.

    Args:
        res: :func:`loading_benchmark`'s result.
    """
    out: dict[str, Any] = {"model_img_s": res["model"]["images_per_second"], "device": res["device"]}
    for fmt, f in res["formats"].items():
        w, row = _best(f["workers"], res["auto_workers"])
        out[fmt] = {
            "workers": int(w),
            "files_img_s": row["files"],
            "cold_img_s": row["cold"],
            "warm_img_s": row["warm_mean"],
            "cache_mb_per_1000": f["cache_mb_per_1000_images"],
        }
    return out


def format_loading(res: dict[str, Any]) -> list[str]:
    """Markdown lines of the loading part (empty without one).

    Args:
        res: the whole speed result (its ``loading`` entry is used).
    """
    load = res.get("loading")
    if not load:
        return []
    s, model = load["settings"], load["model"]
    lines = [
        "### Loading: the input pipeline against the model",
        "",
        f"Training loader alone (augmentation on), {s['image_size']} px, batch {s['batch_size']}, {s['n_images']} "
        f"synthetic images per format, on {load['device']} (`auto` = {load['auto_workers']} worker(s) here); "
        f"the model (DenseNet121, {model['compute']}) trains at **{model['images_per_second']:.1f} images/s** "
        "from in-memory tensors. `files`: no cache (decoded every epoch); `cold`: first epoch, cache empty; "
        f"`warm`: later epochs (mean of {s['warm_epochs']}).",
        "",
    ]
    rows = [
        [
            fmt,
            str(w),
            f"{r['files']:.1f}",
            f"{r['cold']:.1f}",
            f"{r['warm_mean']:.1f}",
            f"{r['warm_mean'] / model['images_per_second']:.1f}x",
        ]
        for fmt, f in load["formats"].items()
        for w, r in f["workers"].items()
    ]
    lines.append(
        markdown_table(["images", "workers", "files (img/s)", "cold (img/s)", "warm (img/s)", "warm / model"], rows)
    )
    sizes = "; ".join(
        f"{fmt}: {f['file_mb_per_image']:.2f} MB per source file, cache "
        f"{f['cache_mb_per_1000_images']:.0f} MB per 1,000 images"
        for fmt, f in load["formats"].items()
        if f["cache_mb_per_1000_images"] is not None
    )
    return lines + ["", f"Disk: {sizes}.", ""]


def loading_verdicts(res: dict[str, Any]) -> list[str]:
    """The loading target (warm loader >= 3x the model's images/s at ``auto`` workers) and the cold rates.

    Args:
        res: the whole speed result (its ``loading`` entry is used).
    """
    load = res.get("loading")
    if not load:
        return []
    model = load["model"]["images_per_second"]
    out = []
    summary = loading_summary(load)
    for fmt in load["formats"]:
        row = summary[fmt]
        ratio = row["warm_img_s"] / model
        out.append(
            f"{fmt}: with the cache warm the loader ({row['workers']} worker(s)) delivers at least 3x the "
            f"model's training images/s on {load['device']}: {'**MET**' if ratio >= 3 else '**NOT MET**'} "
            f"({row['warm_img_s']:.1f} vs {model:.1f} images/s = {ratio:.1f}x; first epoch "
            f"{row['cold_img_s']:.1f}, without the cache {row['files_img_s']:.1f} images/s; cache "
            f"{row['cache_mb_per_1000']:.0f} MB per 1,000 images)."
        )
    return out
