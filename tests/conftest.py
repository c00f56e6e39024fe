import os
import sys

import pytest
from hypothesis import settings

sys.path.insert(0, os.path.dirname(__file__))

# Property tests draw the same examples on every run ("repeatable", the default), so a
# failure on one checkout is a failure on every checkout and reproduces as it is.  To
# look for new failures, draw fresh ones on each run (a failure prints the
# @reproduce_failure line that replays it):
#     python -m pytest --hypothesis-profile=explore tests/test_fuzz.py
settings.register_profile("repeatable", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile("repeatable")

try:  # one-process references compute small tensors: threads only contend with the ranks' processes
    import torch

    torch.set_num_threads(1)
except ImportError:
    pass


def pytest_collection_modifyitems(config, items):
    """GPU tests run only where CUDA is present."""
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
