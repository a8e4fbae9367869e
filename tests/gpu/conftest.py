"""The GPU tier: every test here needs CUDA and is skipped, with the reason, without it."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    here = __file__.rsplit("/", 1)[0]
    for item in items:
        if str(item.fspath).startswith(here + "/"):
            item.add_marker(skip)
