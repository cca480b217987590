"""Fixtures shared by the test modules."""

from pathlib import Path

import pytest
import torch.distributed as dist

from recipes.studies import parity as P
from recipes.studies import parity_layouts as PL

# The tests that read parity runs (name, dtype parameters): their cases share the torchruns.
PARITY_READERS = ("test_layout_loss_parity", "test_static_shapes_give_the_dynamic_losses")


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


class _Runs:
    """Runs each selected case once, all cases of one world size and dtype in one torchrun."""

    def __init__(self, selected: set[tuple[str, str]], root: Path):
        self.selected, self.root, self.rows = selected, root, {}

    def get(self, name: str, dtype: str) -> dict:
        if (name, dtype) not in self.rows:
            world = PL.BY_NAME[name].world_size
            names = {
                n
                for n, d in self.selected | {(name, dtype)}
                if d == dtype and PL.BY_NAME[n].world_size == world and (n, d) not in self.rows
            }
            group = [layout for layout in PL.LAYOUTS if layout.name in names]
            for row in P.run_grouped(group, dtype, self.root / dtype):
                self.rows[(row["layout"], dtype)] = row
        return self.rows[(name, dtype)]


@pytest.fixture(scope="session")
def parity_runs(request, tmp_path_factory) -> _Runs:
    selected = set()
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.originalname in PARITY_READERS and "name" in params:
            selected.add((params["name"], params["dtype"]))
    return _Runs(selected, tmp_path_factory.mktemp("parity"))
