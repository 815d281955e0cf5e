"""Faults: full disks, torn writes, killed processes, resumed jobs."""
