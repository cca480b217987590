"""Fixtures shared by the test modules, and how pytest-xdist splits the suite among workers."""

import os

import pytest
import torch.distributed as dist

from recipes.studies import parity as P
from recipes.studies import parity_layouts as PL
from tests.dist_utils import group_key, once_per_session

# The files by their time on 2 cores, longest first: pytest-xdist (--dist loadfile) hands each
# worker a whole file at a time in this order, so the long ones start first and the workers end
# together. Files not named follow in their usual order. Only the order depends on it.
LONGEST_FIRST = (
    "test_convergence.py",
    "test_parity.py",
    "test_faults_signals.py",
    "test_pp_static.py",
    "test_estimate.py",
    "test_fsdp.py",
    "test_realpath.py",
    "test_resume.py",
    "test_toggles.py",
    "test_checkpoint.py",
    "test_compile_cache.py",
    "test_checkpoint_checksums.py",
    "test_pipeline.py",
    "test_cli.py",
    "test_faults_inputs.py",
)
MAX_WORKERS = 4  # more would run more multi-rank tests side by side than a workstation has memory for


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file keeps its order


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per usable core, at most MAX_WORKERS (each runs multi-rank jobs)."""
    return max(1, min(len(os.sched_getaffinity(0)), MAX_WORKERS))


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

    def __init__(self, selected: set[tuple[str, str]], tmp_path_factory):
        self.selected, self.tmp_path_factory, self.rows = selected, tmp_path_factory, {}

    def get(self, name: str, dtype: str) -> dict:
        if (name, dtype) not in self.rows:
            world = PL.BY_NAME[name].world_size
            names = {
                n
                for n, d in self.selected | {(name, dtype)}
                if d == dtype and PL.BY_NAME[n].world_size == world and (n, d) not in self.rows
            }
            group = [layout for layout in PL.LAYOUTS if layout.name in names]
            key = group_key(f"parity_{dtype}", world, names)
            ran = once_per_session(key, self.tmp_path_factory, lambda out: {"rows": P.run_grouped(group, dtype, out)})
            for row in ran["rows"]:
                self.rows[(row["layout"], dtype)] = row
        return self.rows[(name, dtype)]


@pytest.fixture(scope="session")
def parity_runs(request, tmp_path_factory) -> _Runs:
    selected = set()
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.originalname in PARITY_READERS and "name" in params:
            selected.add((params["name"], params["dtype"]))
    return _Runs(selected, tmp_path_factory)
