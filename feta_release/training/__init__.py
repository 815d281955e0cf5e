"""Training engines: warm-ups (spatial, frequency), DP-SGD, checkpoints, progress.

Each stage is a function of (model, released statistics, config) so the federation reuses it unchanged.
"""
