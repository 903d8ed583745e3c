"""DICOM decoding and the intensity policy, on real DICOM files no one here wrote.

The files are pydicom's own test data (``pydicom.data``) and the ``pydicom-data`` package (a test
dependency: ``pip install -e .[test]``): NEMA WG04 radiographs (CR, MONOCHROME1) and the same images
in every compressed transfer syntax, VOI LUT and modality LUT files, truncated and multi-frame files.
Expected intensities are computed here from the DICOM standard's formulas (PS3.3 C.11.2), not with
pydicom's LUT functions.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pydicom
import pytest
from cxrfl.data.images import ImageError, read_image
from pydicom import uid
from pydicom.data import get_testdata_file
from pydicom.pixels import get_decoder


def dicom_file(name: str) -> str:
    """A pydicom test file; pydicom-data is a test dependency, so a missing one fails."""
    path = get_testdata_file(name)
    assert path is not None, f"{name} not found: install the test extras (pip install -e '.[test]': pydicom-data)"
    return path


def pixels(name: str) -> tuple[pydicom.Dataset, np.ndarray]:
    ds = pydicom.dcmread(dicom_file(name))
    return ds, ds.pixel_array.astype(np.float64)


def own_range(x: np.ndarray) -> np.ndarray:
    return (x - x.min()) / (x.max() - x.min())


def linear_window(x: np.ndarray, center: float, width: float) -> np.ndarray:
    """PS3.3 C.11.2.1.2.1 (LINEAR), scaled to [0, 1]."""
    return np.clip((x - (center - 0.5)) / (width - 1.0) + 0.5, 0.0, 1.0)


# ------------------------------------------------------------------ transfer syntaxes (D2)

# (file, its transfer syntax, a file of the same image to compare with, largest allowed mean difference)
SYNTAXES = [
    ("MR_small_implicit.dcm", uid.ImplicitVRLittleEndian, "MR_small.dcm", 0.0),
    ("MR_small_bigendian.dcm", uid.ExplicitVRBigEndian, "MR_small.dcm", 0.0),
    ("image_dfl.dcm", uid.DeflatedExplicitVRLittleEndian, None, None),
    ("SC_rgb_jpeg_dcmtk.dcm", uid.JPEGBaseline8Bit, "SC_rgb.dcm", 0.005),
    ("JPGExtended.dcm", uid.JPEGExtended12Bit, "JPEG-LL.dcm", 0.02),  # NEMA NM1, lossy 76:1 vs lossless
    ("JPEG-LL.dcm", uid.JPEGLosslessSV1, "JPGExtended.dcm", 0.02),
    ("JPGLosslessP14SV1_1s_1f_8b.dcm", uid.JPEGLosslessSV1, None, None),
    ("SC_rgb_jpeg_gdcm.dcm", uid.JPEGLosslessSV1, "SC_rgb.dcm", 0.0),
    ("MR_small_jpeg_ls_lossless.dcm", uid.JPEGLSLossless, "MR_small.dcm", 0.0),
    ("JPEGLSNearLossless_16.dcm", uid.JPEGLSNearLossless, None, None),
    ("MR_small_jp2klossless.dcm", uid.JPEG2000Lossless, "MR_small.dcm", 0.0),
    ("RG3_J2KR.dcm", uid.JPEG2000Lossless, "RG3_UNCR.dcm", 0.0),  # CR, MONOCHROME1, 10 bit
    ("RG3_J2KI.dcm", uid.JPEG2000, "RG3_UNCI.dcm", 0.0),  # UNCI: the lossy J2K image, decoded
    ("JPEG2000.dcm", uid.JPEG2000, "JPEG2000_UNC.dcm", 0.0),
    ("MR_small_RLE.dcm", uid.RLELossless, "MR_small.dcm", 0.0),
]


@pytest.mark.parametrize(("name", "syntax", "reference", "tolerance"), SYNTAXES, ids=[s[0] for s in SYNTAXES])
def test_every_supported_transfer_syntax_decodes(
    name: str, syntax: str, reference: str | None, tolerance: float | None
) -> None:
    path = dicom_file(name)
    assert pydicom.dcmread(path, stop_before_pixels=True).file_meta.TransferSyntaxUID == syntax
    x = read_image(path)
    assert x.ndim == 2 and x.dtype == np.float32 and 0.0 <= x.min() and x.max() <= 1.0 and x.std() > 0.01
    if reference is not None:
        ref = read_image(dicom_file(reference))
        assert ref.shape == x.shape
        assert float(np.abs(x - ref).mean()) <= tolerance + 1e-7


PERMISSIVE_ONLY = [row for row in SYNTAXES if row[1] in uid.JPEGLSTransferSyntaxes or row[1] == uid.JPEGLosslessSV1]


@pytest.mark.parametrize(
    ("name", "syntax", "reference", "tolerance"), PERMISSIVE_ONLY, ids=[s[0] for s in PERMISSIVE_ONLY]
)
def test_jpeg_lossless_and_jpeg_ls_decode_with_the_default_permissive_decoder(
    name: str, syntax: str, reference: str | None, tolerance: float | None
) -> None:
    """Issue 40 point 11: these syntaxes needed pylibjpeg-libjpeg (GPL-3.0); GDCM (python-gdcm, BSD/Apache)
    is the default decoder now and gives the same pixels as whichever decoder pydicom picks."""
    from pydicom.pixels import pixel_array

    path = dicom_file(name)
    via_gdcm = pixel_array(path, decoding_plugin="gdcm")
    assert via_gdcm.std() > 0
    assert np.array_equal(via_gdcm, pydicom.dcmread(path).pixel_array)


def test_readme_lists_exactly_the_transfer_syntaxes_the_dependencies_decode(repo_root: Path) -> None:
    text = (repo_root / "README.md").read_text()
    section = text[text.index("### DICOM transfer syntaxes") :]
    section = section[: section.index("\n## ")]
    listed = set(re.findall(r"`(1\.2\.840\.10008\.1\.2[0-9.]*)`", section))
    tested = {syntax for _, syntax, _, _ in SYNTAXES}
    assert tested <= listed, f"README misses {tested - listed}"
    for syntax in listed:
        assert get_decoder(uid.UID(syntax)).is_available, f"{syntax} listed in README but no decoder is installed"


# ------------------------------------------------------------------ the intensity policy (D7)


def test_cr_monochrome1_window_is_applied_then_inverted() -> None:
    ds, raw = pixels("RG3_UNCR.dcm")  # a real CR: MONOCHROME1, 10 bits stored, window 550/1024
    assert ds.PhotometricInterpretation == "MONOCHROME1" and "VOILUTFunction" not in ds
    expected = 1.0 - linear_window(raw, float(ds.WindowCenter), float(ds.WindowWidth))
    np.testing.assert_allclose(read_image(dicom_file("RG3_UNCR.dcm")), expected, atol=1e-6)


def test_cr_without_a_window_uses_its_own_range_inverted(tmp_path: Path) -> None:
    ds, raw = pixels("RG3_UNCR.dcm")
    del ds.WindowCenter, ds.WindowWidth
    ds.save_as(tmp_path / "nowindow.dcm")
    np.testing.assert_allclose(read_image(tmp_path / "nowindow.dcm"), 1.0 - own_range(raw), atol=1e-6)


@pytest.mark.parametrize("function", ["LINEAR_EXACT", "SIGMOID"])
def test_voi_lut_function_is_honoured(tmp_path: Path, function: str) -> None:
    ds, raw = pixels("MR_small.dcm")  # signed 16 bit, values 127 .. 2145
    c, w = float(ds.WindowCenter), 40.0  # a narrow window tells the three functions apart
    ds.WindowWidth, ds.VOILUTFunction = w, function
    ds.save_as(tmp_path / "f.dcm")
    if function == "SIGMOID":  # PS3.3 C.11.2.1.3.1
        expected = 1.0 / (1.0 + np.exp(-4.0 * (raw - c) / w))
    else:  # PS3.3 C.11.2.1.3.2
        expected = np.clip((raw - c) / w + 0.5, 0.0, 1.0)
    out = read_image(tmp_path / "f.dcm")
    np.testing.assert_allclose(out, expected, atol=1e-6)
    assert np.abs(out - linear_window(raw, c, w)).max() > 0.005  # not the default LINEAR


def test_the_first_of_several_windows_is_used() -> None:
    ds, raw = pixels("MR-SIEMENS-DICOM-WithOverlays.dcm")  # windows 450/790 and 200/443
    centers, widths = [float(v) for v in ds.WindowCenter], [float(v) for v in ds.WindowWidth]
    assert len(centers) == 2
    out = read_image(dicom_file("MR-SIEMENS-DICOM-WithOverlays.dcm"))
    np.testing.assert_allclose(out, linear_window(raw, centers[0], widths[0]), atol=1e-6)
    assert not np.allclose(out, linear_window(raw, centers[1], widths[1]), atol=0.05)


def voi_lut_expected(ds: pydicom.Dataset, raw: np.ndarray) -> np.ndarray:
    """PS3.3 C.11.2.1.1: a VOI LUT maps stored values through its table; output 0 .. 2**bits - 1."""
    item = ds.VOILUTSequence[0]
    entries, first, bits = (int(v) for v in item.LUTDescriptor)
    table = np.asarray(item.LUTData, dtype=np.float64)
    return table[np.clip(raw.astype(np.int64) - first, 0, entries - 1)] / (2.0**bits - 1.0)


def test_voi_lut_sequence_is_applied_and_preferred_to_a_window(tmp_path: Path) -> None:
    ds, raw = pixels("vlut_04.dcm")  # a VOI LUT Sequence, no window
    expected = voi_lut_expected(ds, raw)
    np.testing.assert_allclose(read_image(dicom_file("vlut_04.dcm")), expected, atol=1e-6)
    ds.WindowCenter, ds.WindowWidth = 40, 20  # both: the LUT wins (pydicom's prefer_lut)
    ds.save_as(tmp_path / "both.dcm")
    np.testing.assert_allclose(read_image(tmp_path / "both.dcm"), expected, atol=1e-6)
    item = ds.VOILUTSequence[0]
    item.LUTData = list(reversed(item.LUTData))  # the file's table decides, not the pixel range
    ds.save_as(tmp_path / "reversed.dcm")
    np.testing.assert_allclose(read_image(tmp_path / "reversed.dcm"), voi_lut_expected(ds, raw), atol=1e-6)
    assert not np.allclose(voi_lut_expected(ds, raw), expected, atol=0.1)


def test_modality_lut_sequence_then_own_range() -> None:
    ds, raw = pixels("mlut_18.dcm")  # a Modality LUT Sequence on signed 12-bit data, no window
    item = ds.ModalityLUTSequence[0]
    entries, first, _ = (int(v) for v in item.LUTDescriptor)
    table = np.asarray(item.LUTData, dtype=np.float64)
    modality = table[np.clip(raw.astype(np.int64) - first, 0, entries - 1)]
    np.testing.assert_allclose(read_image(dicom_file("mlut_18.dcm")), own_range(modality), atol=1e-6)


def test_rgb_dicom_becomes_luma_like_pil() -> None:
    _, rgb = pixels("SC_rgb.dcm")
    luma = rgb @ np.array([0.299, 0.587, 0.114])
    np.testing.assert_allclose(read_image(dicom_file("SC_rgb.dcm")), own_range(luma), atol=1e-6)


# ------------------------------------------------------------------ files that cannot be used (D1)


@pytest.mark.parametrize(
    ("name", "reason"),
    [
        ("MR_truncated.dcm", "less than expected"),
        ("rtplan.dcm", "no pixel data"),
        ("rtdose.dcm", "multi-frame DICOM (15 frames)"),
        ("emri_small_jpeg_ls_lossless.dcm", "multi-frame DICOM (10 frames)"),
        ("JPEG-lossy.dcm", "Unable to decode"),  # NEMA NM1_JPLY: invalid SOS parameters (JPGExtended.dcm is its fix)
        ("JPEG2000-embedded-sequence-delimiter.dcm", "Unable to decode"),
    ],
)
def test_unusable_dicoms_are_one_line_image_errors(name: str, reason: str) -> None:
    path = dicom_file(name)
    with pytest.raises(ImageError) as info:
        read_image(path)
    assert reason in info.value.reason and info.value.path == path
    assert "\n" not in str(info.value) and path in str(info.value)
