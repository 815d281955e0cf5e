"""Training stages: warm-ups (spatial, frequency), DP-SGD, the single-site pipeline, checkpoints.

Each stage is a function of (model, released statistics, config) so the federation reuses it unchanged.
"""
