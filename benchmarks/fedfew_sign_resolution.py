"""What a 64-px image keeps of FedFew's rare-class signs (issue 42, scope 5: "say what 64 px cannot show").

Renders the same patient with and without one finding (the generator's streams are split, so the
two images differ only by the sign) at several sizes, the NIH acquisition style of the FedFew
profile, severities drawn as the profile draws them (Beta(1.2, 1.6)). Per finding and size:

* ``rms``: root mean square of the difference image, in grey levels (0-255): the sign's contrast
  (with the small shift of the style's automatic window that any sign causes);
* ``beyond_nyquist``: the share of the sign's energy, measured at the largest size, at spatial
  frequencies a smaller image cannot hold (outside its Nyquist square): what that size loses.

Edema is also split into its Kerley B lines and the rest (the lines drawn, then not drawn), with
the lines' width in pixels at each size. No network is trained; it takes about 15 s::

    python benchmarks/fedfew_sign_resolution.py --out benchmarks/results/fedfew42/diagnostics/sign-resolution.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
from cxrfl.synth import findings as findings_module
from cxrfl.synth.anatomy import sample_anatomy
from cxrfl.synth.render import render_cxr
from cxrfl.synth.scene import build_scene

FINDINGS = ("Edema", "Pneumonia", "Hernia", "Consolidation", "Infiltration")  # the UCs, then two CCs they resemble
KERLEY_WIDTH = 0.004  # the stroke width of Edema's Kerley B lines in patient units (cxrfl.synth.findings._edema)
SEVERITY = (1.2, 1.6)  # the profile's Beta parameters of finding severities (cxrfl.synth.cohort.CaseMix)


@contextmanager
def _without_strokes() -> Iterator[None]:
    """Edema drawn without its Kerley B lines: the findings module's line drawing switched off."""
    original = findings_module.stroke
    findings_module.stroke = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        yield
    finally:
        findings_module.stroke = original  # type: ignore[assignment]


def _render(finding: dict[str, float], patient: int, seed: int, size: int) -> np.ndarray:
    anat = sample_anatomy(np.random.default_rng([seed, 1, patient]))
    return render_cxr(finding, "nih", np.random.default_rng([seed, 2, patient]), size, anatomy=anat).astype(float)


def _beyond(diff: np.ndarray, size: int) -> float:
    """Share of ``diff``'s energy at frequencies outside the Nyquist square of a ``size``-px image."""
    power = np.abs(np.fft.fftshift(np.fft.fft2(diff))) ** 2
    h, w = diff.shape
    ky, kx = np.abs(np.arange(h) - h // 2), np.abs(np.arange(w) - w // 2)  # cycles per image height / width
    inside = (ky[:, None] < size * h / w / 2) & (kx[None, :] < size / 2)  # a size-px wide image's Nyquist
    total = power.sum()
    return float(power[~inside].sum() / total) if total > 0 else 0.0


def _stats(diffs: list[np.ndarray], reference: list[np.ndarray], size: int, largest: int) -> dict[str, float]:
    out = {"rms": float(np.mean([np.sqrt(np.mean(d**2)) for d in diffs]))}
    if size < largest:
        out["beyond_nyquist"] = float(np.mean([_beyond(d, size) for d in reference]))
    return out


def measure(patients: int, sizes: list[int], seed: int) -> dict[str, Any]:
    """Per finding (and Edema's two parts) and size: the sign's contrast and what the size loses.

    Args:
        patients: patients per finding (each with its own anatomy and severity).
        sizes: image widths in pixels; the largest is the reference of ``beyond_nyquist``.
        seed: the seed of patients and severities.
    """
    largest = max(sizes)
    result: dict[str, Any] = {}
    # each patient's severity and normal image serve every finding: the same patient with and without it
    sev = np.clip(np.random.default_rng([seed, 3]).beta(*SEVERITY, patients), 0.03, 1.0)
    normals = {(size, i): _render({}, i, seed, size) for size in sizes for i in range(patients)}
    for f in FINDINGS:
        parts: dict[str, dict[int, list[np.ndarray]]] = {f: {}, f"{f}: Kerley B lines": {}, f"{f}: the rest": {}}
        for size in sizes:
            for i in range(patients):
                full, normal = _render({f: float(sev[i])}, i, seed, size), normals[size, i]
                parts[f].setdefault(size, []).append(full - normal)
                if f == "Edema":
                    with _without_strokes():
                        rest = _render({f: float(sev[i])}, i, seed, size)
                    parts[f"{f}: Kerley B lines"].setdefault(size, []).append(full - rest)
                    parts[f"{f}: the rest"].setdefault(size, []).append(rest - normal)
        for name, by_size in parts.items():
            if by_size:
                result[name] = {str(s): _stats(by_size[s], by_size[largest], s, largest) for s in sizes}
    anat = sample_anatomy(np.random.default_rng([seed, 1, 0]))
    result["kerley_width_px"] = {str(s): KERLEY_WIDTH / build_scene(anat, s, s).px for s in sizes}
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--patients", type=int, default=24)
    p.add_argument("--sizes", default="64,128,256")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON file to write (default: print only)")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    result = measure(args.patients, sizes, args.seed)
    for name, by_size in result.items():
        cells = "  ".join(
            f"{s}px " + " ".join(f"{k} {v:.3f}" for k, v in m.items()) if isinstance(m, dict) else f"{s}px {m:.2f}"
            for s, m in by_size.items()
        )
        print(f"{name:28s} {cells}")
    if args.out:
        Path(args.out).write_text(json.dumps({"settings": vars(args), "signs": result}, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
