"""Evaluating a synthetic set: classifier, fidelity figures, protocol and labelled grids."""
