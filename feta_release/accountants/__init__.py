"""Privacy accountants of the mechanisms that are not subsampled Gaussians (Opacus style: one small file
each).

The subsampled-Gaussian history of a release is in :mod:`feta_release.accounting`; these modules give RDP
curves over the same orders (:data:`feta_release.accounting.RDP_ORDERS`) so that both compose by addition.
"""
