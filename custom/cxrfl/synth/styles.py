"""Acquisition styles: how one hospital's equipment and processing turn attenuation into pixels.

Each site has its own exposure and gamma curve, contrast window, quantum noise and its texture,
detector blur, edge enhancement, heel effect, anti-scatter grid lines, collimation borders and
burned-in text (side markers, ``PORTABLE``/``SUPINE`` stamps on bedside images, an ID line).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import ndimage

from cxrfl.synth.draw import Array, blur

_FONT: dict[str, str] = {
    "A": "0e 11 11 1f 11 11 11",
    "B": "1e 11 11 1e 11 11 1e",
    "C": "0e 11 10 10 10 11 0e",
    "D": "1e 11 11 11 11 11 1e",
    "E": "1f 10 10 1e 10 10 1f",
    "G": "0e 11 10 17 11 11 0f",
    "H": "11 11 11 1f 11 11 11",
    "I": "0e 04 04 04 04 04 0e",
    "L": "10 10 10 10 10 10 1f",
    "M": "11 1b 15 15 11 11 11",
    "N": "11 11 19 15 13 11 11",
    "O": "0e 11 11 11 11 11 0e",
    "P": "1e 11 11 1e 10 10 10",
    "R": "1e 11 11 1e 14 12 11",
    "S": "0f 10 10 0e 01 01 1e",
    "T": "1f 04 04 04 04 04 04",
    "U": "11 11 11 11 11 11 0e",
    "V": "11 11 11 11 11 0a 04",
    "0": "0e 11 13 15 19 11 0e",
    "1": "04 0c 04 04 04 04 0e",
    "2": "0e 11 01 02 04 08 1f",
    "3": "1f 02 04 02 01 11 0e",
    "4": "02 06 0a 12 1f 02 02",
    "5": "1f 10 1e 01 01 11 0e",
    "6": "06 08 10 1e 11 11 0e",
    "7": "1f 01 02 04 08 08 08",
    "8": "0e 11 11 0e 11 11 0e",
    "9": "0e 11 11 0f 01 02 0c",
    "-": "00 00 00 1f 00 00 00",
    ":": "00 0c 0c 00 0c 0c 00",
    "/": "01 02 02 04 08 08 10",
    " ": "00 00 00 00 00 00 00",
}
"""A 5x7 bitmap font: seven rows of five bits (hex) per character."""


@dataclass(frozen=True)
class AcquisitionStyle:
    """One site's imaging chain.

    Sizes in pixels are for a 128-pixel-wide image and scale with the image; so does the
    per-pixel quantum noise (a smaller image averages more detector pixels).

    Args:
        name: style name.
        exposure: attenuation gain before the detector's exponential response.
        gamma: display gamma (> 1 darker mid-tones).
        window: (low, high) of the display window on the detector signal.
        auto_window: 0..1, how much the window follows the image's own percentiles.
        noise: quantum noise level (stronger in dense regions).
        texture: amplitude of spatially correlated noise.
        texture_px: correlation length of that noise.
        blur_px: detector / focal-spot blur.
        edge_enhance: unsharp-mask gain of the vendor's processing.
        heel: left-right exposure gradient (anode heel effect).
        grid_lines: amplitude of anti-scatter grid lines.
        collimation: probability of visible collimation borders.
        border: grey level outside the collimation (0 black, 1 white).
        marker: probability of a burned-in L/R side marker.
        portable_text: stamp ``PORTABLE`` (and ``SUPINE``/``AP``) on bedside (AP) images.
        id_text: probability of a burned-in ID/date line at the bottom.
        aspect: range of image height / width.
        jpeg_quality: JPEG quality when the site stores JPEG.
    """

    name: str
    exposure: float
    gamma: float
    window: tuple[float, float]
    auto_window: float
    noise: float
    texture: float
    texture_px: float
    blur_px: float
    edge_enhance: float
    heel: float
    grid_lines: float
    collimation: float
    border: float
    marker: float
    portable_text: bool
    id_text: float
    aspect: tuple[float, float] = (1.0, 1.0)
    jpeg_quality: int = 90


STYLES: dict[str, AcquisitionStyle] = {
    "nih": AcquisitionStyle(
        name="nih",
        exposure=1.15,
        gamma=1.0,
        window=(0.05, 0.78),
        auto_window=0.5,
        noise=0.012,
        texture=0.01,
        texture_px=1.5,
        blur_px=0.7,
        edge_enhance=0.25,
        heel=0.06,
        grid_lines=0.0,
        collimation=0.3,
        border=0.0,
        marker=0.7,
        portable_text=False,
        id_text=0.0,
    ),
    "chexpert": AcquisitionStyle(
        name="chexpert",
        exposure=0.95,
        gamma=1.35,
        window=(0.02, 0.7),
        auto_window=0.3,
        noise=0.025,
        texture=0.02,
        texture_px=0.8,
        blur_px=1.0,
        edge_enhance=0.5,
        heel=-0.04,
        grid_lines=0.0,
        collimation=0.6,
        border=0.85,
        marker=0.5,
        portable_text=True,
        id_text=0.0,
        aspect=(1.0, 1.25),
        jpeg_quality=85,
    ),
    "mimic": AcquisitionStyle(
        name="mimic",
        exposure=1.3,
        gamma=0.8,
        window=(0.1, 0.85),
        auto_window=0.8,
        noise=0.02,
        texture=0.025,
        texture_px=2.5,
        blur_px=0.8,
        edge_enhance=0.4,
        heel=0.03,
        grid_lines=0.012,
        collimation=0.4,
        border=0.0,
        marker=0.9,
        portable_text=True,
        id_text=0.6,
    ),
    "community": AcquisitionStyle(
        name="community",
        exposure=1.05,
        gamma=1.15,
        window=(0.0, 0.8),
        auto_window=0.2,
        noise=0.05,
        texture=0.03,
        texture_px=1.2,
        blur_px=1.3,
        edge_enhance=0.15,
        heel=0.08,
        grid_lines=0.02,
        collimation=0.7,
        border=0.0,
        marker=0.4,
        portable_text=False,
        id_text=0.9,
        aspect=(1.0, 1.1),
        jpeg_quality=75,
    ),
}
"""Named acquisition styles: ``nih`` (hospital-a), ``chexpert`` (hospital-b), ``mimic`` (external),
``community`` (a noisy, blurry fourth style for extra sites)."""


def get_style(style: AcquisitionStyle | str) -> AcquisitionStyle:
    """Look up a style by name (or pass a style through).

    Raises:
        KeyError: unknown style name.
    """
    if isinstance(style, AcquisitionStyle):
        return style
    if style not in STYLES:
        raise KeyError(f"unknown acquisition style {style!r}; known: {', '.join(STYLES)}")
    return STYLES[style]


def _text_mask(text: str, height_px: float) -> Array:
    """Anti-aliased mask (0..1) of ``text`` whose capitals are ``height_px`` pixels tall."""
    rows = []
    for ch in text.upper():
        glyph = [int(h, 16) for h in _FONT.get(ch, _FONT[" "]).split()]
        rows.append(np.array([[(g >> (4 - b)) & 1 for b in range(5)] + [0] for g in glyph], dtype=np.float64))
    bitmap = np.pad(np.concatenate(rows, axis=1), 1)
    up = np.kron(bitmap, np.ones((4, 4)))
    zoom = max(height_px, 1.0) / 28.0
    return np.clip(ndimage.zoom(up, zoom, order=1, grid_mode=True, mode="grid-constant"), 0.0, 1.0)


def _stamp(img: Array, text: str, row: float, col: float, height_px: float, value: float, boxed: bool = False) -> None:
    """Burn ``text`` into ``img`` in place at fractional position (row, col) of its top-left corner."""
    mask = _text_mask(text, height_px)
    if boxed:
        mask = np.maximum(mask, np.pad(np.zeros((mask.shape[0] - 2, mask.shape[1] - 2)), 1, constant_values=0.6))
    h, w = img.shape
    r0, c0 = int(row * h), int(col * w)
    mh, mw = min(mask.shape[0], h - r0), min(mask.shape[1], w - c0)
    if mh <= 0 or mw <= 0:
        return
    region = img[r0 : r0 + mh, c0 : c0 + mw]
    m = mask[:mh, :mw]
    img[r0 : r0 + mh, c0 : c0 + mw] = region * (1 - m) + value * m


def acquire(
    att: Array, style: AcquisitionStyle, rng: np.random.Generator, view: str = "PA", supine: bool = False
) -> np.ndarray:
    """Turn an attenuation map into a processed 8-bit radiograph of one acquisition style.

    Args:
        att: attenuation (bright = dense), (height, width).
        style: the site's acquisition style.
        rng: random generator.
        view: ``PA``, ``AP`` or ``LL`` (lateral).
        supine: lying patient (``SUPINE`` stamp on bedside images).

    Returns:
        uint8 image of the same shape.
    """
    h, w = att.shape
    f = w / 128.0
    k = style.exposure * rng.lognormal(0.0, 0.12)
    sig = 1.0 - np.exp(-k * att)
    sig = blur(sig, style.blur_px * f)
    cols = (np.arange(w) + 0.5) / w - 0.5
    sig = sig * (1.0 + style.heel * cols)[None, :]
    white = rng.standard_normal((h, w))
    sig = sig + style.noise * min(f, 2.0) * (0.3 + sig) * white
    if style.texture > 0:
        tex = ndimage.gaussian_filter(rng.standard_normal((h, w)), max(style.texture_px * f, 0.5))
        sig = sig + style.texture * tex / max(float(tex.std()), 1e-12)
    if style.grid_lines > 0:
        sig = sig + style.grid_lines * np.cos(2 * np.pi * np.arange(h) / 2.6)[:, None]
    if style.edge_enhance > 0:
        sig = sig + style.edge_enhance * (sig - blur(sig, 3.0 * f))
    lo_p, hi_p = np.percentile(sig, (1.0, 99.5))
    a = style.auto_window
    lo = (1 - a) * style.window[0] + a * lo_p + rng.normal(0, 0.01)
    hi = (1 - a) * style.window[1] + a * hi_p + rng.normal(0, 0.015)
    img = np.clip((sig - lo) / max(hi - lo, 1e-3), 0.0, 1.0) ** (style.gamma * rng.lognormal(0.0, 0.04))
    if rng.random() < style.collimation:
        m = rng.uniform(0.0, 0.07, 4)
        rows = (np.arange(h) + 0.5) / h
        inside = np.outer((rows > m[0]) & (rows < 1 - m[1]), (cols + 0.5 > m[2]) & (cols + 0.5 < 1 - m[3]))
        img = np.where(inside, img, style.border + rng.normal(0, 0.02))
    text_h = 0.05 * h
    if rng.random() < style.marker:
        right = rng.random() < 0.5
        _stamp(
            img,
            "R" if right else "L",
            0.05 + 0.05 * rng.random(),
            0.04 if right else 0.86,
            text_h * 1.2,
            0.97,
            boxed=True,
        )
    if style.portable_text and view == "AP":
        _stamp(img, "PORTABLE", 0.03, 0.05 + 0.3 * rng.random(), text_h, 0.95)
        if rng.random() < 0.7:
            _stamp(img, "SUPINE" if supine else "UPRIGHT", 0.1, 0.05, text_h * 0.9, 0.93)
    if rng.random() < style.id_text:
        digits = "".join(str(d) for d in rng.integers(0, 10, 8))
        _stamp(img, f"{digits[:2]}/{digits[2:4]} {digits[4:]}", 0.91, 0.04, text_h * 0.8, 0.9)
    return np.clip(np.floor(img * 255.0 + 0.5), 0, 255).astype(np.uint8)
