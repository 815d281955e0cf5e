"""feta-release: differentially private synthetic image release (DP-FETA / FETA-Pro)."""

__version__ = "0.1.0"
