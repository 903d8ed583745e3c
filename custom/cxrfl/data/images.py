"""Read one chest X-ray (PNG, JPEG or DICOM) as a 2-D float32 grayscale array in [0, 1].

One intensity policy for every format:

1. DICOM only: the modality LUT (Modality LUT Sequence, or RescaleSlope/RescaleIntercept), then the
   file's first VOI transform, both with pydicom's own functions (``apply_modality_lut``,
   ``apply_voi_lut``): a VOI LUT Sequence (preferred when both are present) or
   WindowCenter/WindowWidth under its ``VOILUTFunction`` (LINEAR, LINEAR_EXACT or SIGMOID). The
   VOI output range (a window's range as pydicom computes it; a VOI LUT's 0 .. 2**bits - 1 from its
   LUT Descriptor) becomes [0, 1].
2. Without a VOI transform (every PNG and JPEG; a DICOM without window or VOI LUT): the image's own
   range, minimum -> 0 and maximum -> 1 (a constant image is all 0), whatever the bit depth: a
   16-bit PNG of 12-bit data is not dark, and an 8-bit PNG and a DICOM written from it read alike.
3. MONOCHROME1 (DICOM) is inverted (x -> 1 - x) so that bone is bright in every output.

Colour images (RGB, RGBA, palette, YBR DICOM) become gray by ITU-R 601-2 luma (PIL's
``convert("L")``) before step 2. Every decoding failure becomes an :class:`ImageError` naming the
file, with a one-line reason.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pydicom
from PIL import Image
from pydicom.errors import InvalidDicomError
from pydicom.pixels import apply_color_lut, apply_modality_lut, apply_voi_lut, apply_windowing

from cxrfl.errors import DataError

_DICOM_SUFFIXES = (".dcm", ".dicom")
_PIL_GRAY_MODES = ("L", "I;16", "I;16B", "I;16L", "I", "F")
_LUMA = np.array([0.299, 0.587, 0.114])  # ITU-R 601-2, as PIL's convert("L")
_DECODE_ERRORS = (
    OSError,
    InvalidDicomError,
    ValueError,
    SyntaxError,
    AttributeError,
    KeyError,
    TypeError,
    IndexError,
    RuntimeError,
    EOFError,
    Image.DecompressionBombError,
)
"""What PIL and pydicom raise on corrupt, truncated, oversized or unsupported files (OSError covers
PIL's UnidentifiedImageError, RuntimeError pydicom's missing or failing decoders)."""


class ImageError(DataError):
    """An image that is missing or cannot be decoded.

    Args:
        path: the image file.
        reason: a short cause (``missing``, ``truncated ...``); white space is collapsed to one line.
    """

    def __init__(self, path: str | Path, reason: str) -> None:
        reason = " ".join(str(reason).split())
        super().__init__(f"cannot read image {path}: {reason}")
        self.path = str(path)
        self.reason = reason


def _is_dicom(path: Path) -> bool:
    if path.suffix.lower() in _DICOM_SUFFIXES:
        return True
    with path.open("rb") as fh:
        head = fh.read(132)
    return head[128:132] == b"DICM"


def _own_range(x: np.ndarray) -> np.ndarray:
    """Step 2 of the policy: the image's minimum -> 0, maximum -> 1, as float32."""
    lo, hi = x.min(), x.max()
    out = np.subtract(x, lo, dtype=np.float32)
    if hi > lo:
        np.divide(out, np.float32(hi) - np.float32(lo), out=out)
    return out


def _luma(rgb: np.ndarray) -> np.ndarray:
    return rgb[..., :3].astype(np.float64) @ _LUMA


def _voi(x: np.ndarray, ds: pydicom.Dataset) -> np.ndarray | None:
    """Step 1's VOI transform scaled to [0, 1], or None when the file has none."""
    out = apply_voi_lut(x, ds)
    if out is x:
        return None
    if out.dtype.kind == "u":  # a VOI LUT (pydicom returns uint8/uint16 for one, float64 for a window)
        lo, hi = 0.0, 2.0 ** int(ds.VOILUTSequence[0].LUTDescriptor[2]) - 1.0
    else:  # the window's output range, as pydicom computes it from BitsStored, signedness and rescale
        lo, hi = (float(v) for v in apply_windowing(np.array([-np.inf, np.inf]), ds))
    return np.clip((out.astype(np.float64) - lo) / (hi - lo), 0.0, 1.0)


def _read_dicom(path: Path) -> np.ndarray:
    ds = pydicom.dcmread(path, force=True)
    if "PixelData" not in ds:
        raise ValueError("DICOM file has no pixel data (not an image)")
    frames = int(ds.get("NumberOfFrames") or 1)
    if frames > 1:
        raise ValueError(f"multi-frame DICOM ({frames} frames); expected one radiograph per file")
    pixels = ds.pixel_array
    photometric = str(ds.get("PhotometricInterpretation", "MONOCHROME2")).strip().upper()
    if photometric == "PALETTE COLOR":
        pixels = apply_color_lut(pixels, ds)
    if pixels.ndim == 3:  # colour (pydicom returns YBR as RGB): no modality or VOI LUT applies
        return _own_range(_luma(pixels))
    x = apply_modality_lut(pixels, ds)
    voi = _voi(x, ds)
    out = _own_range(x) if voi is None else voi.astype(np.float32)
    return 1.0 - out if photometric == "MONOCHROME1" else out


def _read_pil(path: Path) -> np.ndarray:
    with Image.open(path) as img:
        img.load()  # decode fully: truncated files fail here
        gray = img if img.mode in _PIL_GRAY_MODES else img.convert("L")
        return _own_range(np.asarray(gray))


def read_image(path: str | Path) -> np.ndarray:
    """Read a PNG, JPEG or DICOM chest X-ray as grayscale (intensity policy: see the module docstring).

    Args:
        path: the image file.

    Returns:
        a 2-D float32 array with values in [0, 1].

    Raises:
        ImageError: (a :class:`DataError`) the file is missing, truncated, corrupt or not an image.
    """
    path = Path(path)
    if not path.is_file():
        raise ImageError(path, "not a file (a folder?)" if path.exists() else "missing")
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")  # pydicom/PIL chatter about odd but readable files
            x = _read_dicom(path) if _is_dicom(path) else _read_pil(path)
    except _DECODE_ERRORS as exc:
        raise ImageError(path, f"{type(exc).__name__}: {exc}") from exc
    if x.ndim != 2 or min(x.shape) < 1:
        raise ImageError(path, f"expected a 2-D grayscale image, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ImageError(path, "image has non-finite values")
    return np.asarray(x, dtype=np.float32)
