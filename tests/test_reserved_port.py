"""Rank 0's port is reserved until rank 0's store binds it (recipes/reserved_port.py)."""

from __future__ import annotations

import datetime
import socket
import subprocess
import sys

from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import api

from recipes.paths import project_root
from recipes.reserved_port import reserved_port, use_reserved_ports


def _plain_bind_refused(port: int) -> bool:
    with socket.socket() as other:  # what another process's bind without SO_REUSEADDR does
        try:
            other.bind(("", port))
        except OSError:
            return True
    return False


def test_a_reserved_port_is_refused_to_others_and_taken_by_rank_0s_store():
    port = reserved_port()
    assert _plain_bind_refused(port), f"port {port} was free to anyone"
    store = TCPStore("localhost", port, 1, True, timeout=datetime.timedelta(seconds=10))
    store.set("rank0", "here")
    assert store.get("rank0") == b"here"


def test_the_launchers_rendezvous_hands_rank_0_a_reserved_port(monkeypatch):
    monkeypatch.setattr(api, "get_free_port", api.get_free_port)  # restored after the test
    use_reserved_ports()
    port = api.get_free_port()
    assert _plain_bind_refused(port)


AGENT_PROBE = """
import torch.distributed.run as run
from torch.distributed.elastic.rendezvous import api
run.main = lambda argv: print("agent:", api.get_free_port.__module__)
import recipes.agent
recipes.agent.main(["--standalone", "--nproc_per_node=1", "-m", "json"])
"""
FORKED_PROBE = """
import sys
import torch.distributed.launcher.api as launcher_api
from torch.distributed.elastic.rendezvous import api
launcher_api.elastic_launch = lambda config, fn: lambda *a: print("forked:", api.get_free_port.__module__)
import recipes.forked_run
recipes.forked_run.main(["--standalone", "--nproc_per_node=1", "-m", "json"])
"""


def test_both_launchers_reserve_rank_0s_port_before_their_agent_starts():
    """recipes.agent (torchrun) and recipes.forked_run (proxies) replace torch's choice in their own
    process before torch's agent runs its rendezvous (the agent itself stubbed out here)."""
    for probe, said in ((AGENT_PROBE, "agent:"), (FORKED_PROBE, "forked:")):
        out = subprocess.run(
            [sys.executable, "-c", probe], cwd=project_root(), capture_output=True, text=True, timeout=120
        )
        assert f"{said} recipes.reserved_port" in out.stdout, (out.stdout, out.stderr[-2000:])
