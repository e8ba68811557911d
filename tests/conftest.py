"""Fixtures shared by kiln's test modules."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: on tiny tensors on a shared 2-core machine, every op
    with two threads can wait a scheduler tick."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
