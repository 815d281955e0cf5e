"""Reading a site's images: folders, CSV labels, DICOM, .npz, procedural sets and the declared schema."""
