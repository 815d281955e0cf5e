import os

# Two cores in CI: more threads than cores only adds contention.
os.environ.setdefault("OMP_NUM_THREADS", "2")

try:
    import torch

    torch.set_num_threads(min(2, os.cpu_count() or 1))
except ImportError:  # the torch-free synthesis test runs without it
    pass
