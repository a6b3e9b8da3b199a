"""The GPU smoke suite: marked `cuda`, skipped where no CUDA device is visible (`python -m pytest tests/gpu`)."""

import pytest
import torch

CUDA = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible"),
]
"""Every module's `pytestmark`: the tests need one CUDA device (cuda:0)."""
