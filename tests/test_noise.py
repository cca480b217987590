"""Known library noise (core/noise.py): the messages torchao's import prints are dropped where the
trainer imports it, and nothing else is."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.dist_utils import ROOT

pytestmark = [pytest.mark.toggles]

KNOWN = ("Failed to load", "KernelPreference")  # torchao's prebuilt kernels; torch's Enum notice

# What a Float8 launch imports before it forks the ranks (core.train.before_fork), then what
# apply_float8 imports in each rank.
AS_THE_TRAINER = """
from core.config import load_config
from core.lazy_imports import import_for
import_for([load_config(None, ["float8.enabled=true", "compile.enabled=true"])])
import torchao.float8.float8_linear
"""
UNFILTERED = "import torchao.float8.float8_linear"


def _output(code: str, **env: str) -> str:
    """stdout + stderr of `code` in a fresh interpreter (torchao logs once, at its first import)."""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout + proc.stderr


@pytest.mark.slow
def test_torchao_import_noise_is_dropped_and_other_messages_still_show():
    unfiltered = _output(UNFILTERED)
    assert any(m in unfiltered for m in KNOWN), unfiltered  # else the filter has nothing left to drop
    filtered = _output(AS_THE_TRAINER)
    assert not [line for line in filtered.splitlines() if any(m in line for m in KNOWN)], filtered
    # another torchao message on the same logger still shows (torchao's own, asked for by its variable)
    skipped = _output(AS_THE_TRAINER, TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1")
    assert "Skipping import of cpp extensions due to TORCHAO_FORCE_SKIP_LOADING_SO_FILES=1" in skipped, skipped
    assert "KernelPreference" not in skipped, skipped
