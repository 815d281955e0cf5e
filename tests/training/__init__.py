"""Models, DP-SGD, warm-up stages, sampler starts and the single-site pipeline."""
