"""Copy a folder of PNG chest X-rays at a smaller size, for a GPU machine whose carry limit the originals exceed.

Every PNG under SRC is read and resized by cxrfl's own preprocessing (``preprocess_transforms``: the intensity
policy, then area interpolation) and written under DST at the same relative path as a PNG of BITS bits; every
other file (CSV, README) is copied as is. Reading the copy at SIZE then gives the model the same input, up to
the PNG's rounding (at most half a grey level of 2**BITS - 1).

    python benchmarks/gpu/shrink_images.py SRC DST --size 64 [--bits 8]
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import numpy as np
from cxrfl.data.transforms import preprocess_transforms
from PIL import Image


def shrink(src: Path, dst: Path, size: int, bits: int) -> int:
    """Write the smaller copy; return how many images were resized.

    Args:
        src: the folder as published.
        dst: where the copy goes (created).
        size: output height and width in pixels.
        bits: 8 or 16 bits per pixel.
    """
    prep = preprocess_transforms(size)
    top = (1 << bits) - 1
    n = 0
    for path in sorted(src.rglob("*")):
        out = dst / path.relative_to(src)
        if path.is_dir():
            continue
        out.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix.lower() != ".png":
            shutil.copy2(path, out)
            continue
        x = prep(str(path))[0].numpy()
        pixels = np.rint(np.clip(x, 0.0, 1.0) * top).astype(np.uint8 if bits == 8 else np.uint16)
        Image.fromarray(pixels).save(out, optimize=True)
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path)
    ap.add_argument("dst", type=Path)
    ap.add_argument("--size", type=int, default=64)
    ap.add_argument("--bits", type=int, choices=(8, 16), default=8)
    a = ap.parse_args()
    print(f"{shrink(a.src, a.dst, a.size, a.bits)} images written to {a.dst}")


if __name__ == "__main__":
    main()
