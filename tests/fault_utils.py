"""What the fault-injection tests (tests/test_faults.py, tests/test_faults_inputs.py) share: the
proxy row, file digests, the CLI in this process, and the guard that nothing is spawned."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from recipes.cli import main as cli

ROW = "llama3_8b/table1/8gpu_fsdp"  # proxy: world 2, debug flavor, seq 256


def digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def invoke(*args):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


@pytest.fixture
def no_spawn(monkeypatch):
    def boom(*a, **k):
        raise AssertionError(f"spawned a process: {a}")

    monkeypatch.setattr(subprocess, "Popen", boom)
    monkeypatch.setattr(subprocess, "run", boom)
