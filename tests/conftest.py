"""Fixtures shared by the test modules."""

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def pg():
    """A world-1 gloo group for in-process runs (a group already there is left as found)."""
    owned = not dist.is_initialized()
    if owned:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    assert dist.get_world_size() == 1
    yield
    if owned:
        dist.destroy_process_group()
