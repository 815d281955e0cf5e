"""Signed policies, signed jobs, keys and the `policy` / `job` commands."""
