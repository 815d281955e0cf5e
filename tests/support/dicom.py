"""Synthetic DICOM files for tests (pydicom); they carry fake PHI so tests can prove it never leaks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from pydicom.dataset import FileDataset, FileMetaDataset
from pydicom.uid import ExplicitVRLittleEndian, SecondaryCaptureImageStorage, generate_uid

PHI = {
    "PatientName": "Doe^Johanna^Q",
    "PatientID": "PID-7731-XQ",
    "PatientBirthDate": "19610417",
    "StudyDate": "20240229",
    "AccessionNumber": "ACC99281",
    "InstitutionName": "St Elsewhere General",
}


def write_dicom(
    path: Path,
    pixels: np.ndarray,
    *,
    bits_stored: int = 12,
    photometric: str = "MONOCHROME2",
    slope: float | None = None,
    intercept: float | None = None,
    window: tuple[float, float] | None = None,
    signed: bool = False,
    frames: int = 1,
    patient_id: str | None = None,
    phi: bool = True,
) -> Path:
    """Write ``pixels`` ((H, W) grey, (H, W, 3) colour, or (F, H, W) with ``frames`` > 1)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = SecondaryCaptureImageStorage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = FileDataset(str(path), {}, file_meta=meta, preamble=b"\0" * 128)
    ds.SOPClassUID = meta.MediaStorageSOPClassUID
    ds.SOPInstanceUID = meta.MediaStorageSOPInstanceUID
    if phi:
        for k, v in PHI.items():
            setattr(ds, k, v)
    if patient_id is not None:
        ds.PatientID = patient_id
    colour = pixels.ndim == 3 and frames == 1
    ds.Rows, ds.Columns = pixels.shape[-3:-1] if colour else pixels.shape[-2:]
    ds.SamplesPerPixel = 3 if colour else 1
    ds.PhotometricInterpretation = photometric
    if colour:
        ds.PlanarConfiguration = 0
    bits_alloc = 8 if pixels.dtype.itemsize == 1 else 16
    ds.BitsAllocated, ds.BitsStored, ds.HighBit = bits_alloc, bits_stored, bits_stored - 1
    ds.PixelRepresentation = 1 if signed else 0
    if frames > 1:
        ds.NumberOfFrames = frames
    if slope is not None:
        ds.RescaleSlope, ds.RescaleIntercept = slope, intercept or 0.0
    if window is not None:
        ds.WindowCenter, ds.WindowWidth = window
    ds.PixelData = np.ascontiguousarray(pixels).tobytes()
    ds.save_as(path, enforce_file_format=True)
    return path
