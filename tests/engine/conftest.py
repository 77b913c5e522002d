"""Engine tests run torch on one thread: tiny models gain nothing from more, and card runs two
busy Python threads (target and draft worker), which on a shared 2-core box then get a core each
instead of oversubscribing it (DESIGN.md §8: each model its own cores)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
