"""Suite-wide settings.

Under pytest-xdist (the README's test command runs ``-n 2``) every worker is its own process on a machine
with as many cores as workers, so each keeps to one torch thread: two workers at two threads each would
contend for the same cores, and the suite's tiny models gain nothing from intra-op threads. Subprocesses
that tests start inherit the limit through the environment.
"""

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
