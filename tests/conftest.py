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

# The suite's longest tests (the toy learning and collapse runs, minutes each) are collected first. pytest-xdist
# hands each worker a chunk of consecutive tests, so one worker starts on them while the other works through the
# rest, and both share what is left at the end; collected in file order they came last and ran side by side with
# nothing else left, about four minutes of the suite's wall-clock. The first worker running both learning tests
# also scores their common base once (tests/toy/test_toy_rl.py).
LONGEST_FIRST = ("tests/toy/test_toy_rl.py", "tests/toy/test_toy_collapse.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not item.nodeid.startswith(LONGEST_FIRST))  # stable: the rest keep their order
