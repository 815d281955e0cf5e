"""User paths end to end with real processes: the documented how-tos, the federation, the GPU path."""
