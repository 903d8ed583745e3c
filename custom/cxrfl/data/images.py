"""Read one chest X-ray (PNG, JPEG or DICOM) as a 2-D float32 grayscale array in [0, 1].

* PNG/JPEG: 8-bit images are divided by 255, 16-bit (``I;16``/``I``) by 65535; colour or alpha
  images (RGB, RGBA, LA, palette) are converted with PIL's luminance ``convert("L")``.
* DICOM (``.dcm``/``.dicom`` or a ``DICM`` preamble): the modality LUT (RescaleSlope and
  RescaleIntercept) is applied, then the first WindowCenter/WindowWidth (DICOM's linear VOI
  function) if present, otherwise the image's own min-max range; MONOCHROME1 is inverted so that
  bone is bright in every output.

Every decoding failure becomes an :class:`ImageError` naming the file.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pydicom
from PIL import Image
from pydicom.errors import InvalidDicomError
from pydicom.pixels import apply_modality_lut

from cxrfl.errors import DataError

_DICOM_SUFFIXES = (".dcm", ".dicom")
_DECODE_ERRORS = (
    OSError, InvalidDicomError, ValueError, SyntaxError, AttributeError, KeyError, TypeError, RuntimeError, EOFError
)
"""What PIL and pydicom raise on corrupt, truncated or unsupported files (OSError covers PIL's
UnidentifiedImageError, RuntimeError NotImplementedError for missing decoders)."""


class ImageError(DataError):
    """An image that is missing or cannot be decoded.

    Args:
        path: the image file.
        reason: a short cause (``missing``, ``truncated ...``).
    """

    def __init__(self, path: str | Path, reason: str) -> None:
        super().__init__(f"cannot read image {path}: {reason}")
        self.path = str(path)
        self.reason = reason


def _is_dicom(path: Path) -> bool:
    if path.suffix.lower() in _DICOM_SUFFIXES:
        return True
    with path.open("rb") as fh:
        head = fh.read(132)
    return head[128:132] == b"DICM"


def _min_max(x: np.ndarray) -> np.ndarray:
    lo, hi = float(x.min()), float(x.max())
    return (x - lo) / (hi - lo) if hi > lo else np.zeros_like(x)


def _first(value: object) -> float:
    """The first value of a possibly multi-valued DICOM element."""
    return float(value[0]) if isinstance(value, (list, tuple, pydicom.multival.MultiValue)) else float(value)


def _read_dicom(path: Path) -> np.ndarray:
    ds = pydicom.dcmread(path, force=True)
    if "PixelData" not in ds:
        raise ValueError("DICOM file has no pixel data")
    pixels = ds.pixel_array
    if int(ds.get("NumberOfFrames", 1) or 1) > 1:
        raise ValueError("multi-frame DICOM; expected one radiograph per file")
    if pixels.ndim == 3:  # RGB secondary capture
        pixels = pixels.mean(axis=-1)
    x = np.asarray(apply_modality_lut(pixels, ds), dtype=np.float64)
    if "WindowCenter" in ds and "WindowWidth" in ds:
        center, width = _first(ds.WindowCenter), max(_first(ds.WindowWidth), 2.0)
        x = np.clip((x - (center - 0.5)) / (width - 1.0) + 0.5, 0.0, 1.0)
    else:
        x = _min_max(x)
    if str(ds.get("PhotometricInterpretation", "MONOCHROME2")).upper() == "MONOCHROME1":
        x = 1.0 - x
    return x


def _read_pil(path: Path) -> np.ndarray:
    with Image.open(path) as img:
        img.load()  # decode fully: truncated files fail here
        if img.mode in ("I;16", "I;16B", "I;16L", "I"):
            return np.clip(np.asarray(img, dtype=np.float64) / 65535.0, 0.0, 1.0)
        if img.mode == "F":
            return _min_max(np.asarray(img, dtype=np.float64))
        gray = img if img.mode == "L" else img.convert("L")
        return np.asarray(gray, dtype=np.float64) / 255.0


def read_image(path: str | Path) -> np.ndarray:
    """Read a PNG, JPEG or DICOM chest X-ray as grayscale.

    Args:
        path: the image file.

    Returns:
        a 2-D float32 array with values in [0, 1].

    Raises:
        ImageError: (a :class:`DataError`) the file is missing, truncated, corrupt or not an image.
    """
    path = Path(path)
    if not path.is_file():
        raise ImageError(path, "missing")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pydicom/PIL chatter about odd but readable files
            x = _read_dicom(path) if _is_dicom(path) else _read_pil(path)
    except _DECODE_ERRORS as exc:
        raise ImageError(path, f"{type(exc).__name__}: {exc}") from exc
    if x.ndim != 2 or min(x.shape) < 1:
        raise ImageError(path, f"expected a 2-D grayscale image, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ImageError(path, "image has non-finite values")
    return x.astype(np.float32)
