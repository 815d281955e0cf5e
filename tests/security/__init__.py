"""Attacks and side channels, each file named by the threat it pins."""
