"""Engine tests run tiny models on one torch thread (faster than two on a shared 2-core box, and
the draft worker thread and the target then each get a core); real-model tests keep the default."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _torch_threads(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("slow"):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
