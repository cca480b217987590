"""Proxy mode refuses a run whose ranks would not fit in this host's memory, by the dry-run's
accounting (core/dryrun/memory.py), before anything is spawned or written."""

from __future__ import annotations

import time

import pytest
from click.testing import CliRunner

from core.dryrun.memory import PROXY_RANK_BASE_GIB, proxy_host_gib
from recipes import modes, registry
from recipes.cli import main

pytestmark = pytest.mark.faults

ROW = "llama3_8b/table1/8gpu_fsdp"


def test_a_real_size_model_in_proxy_mode_is_refused_with_both_figures(tmp_path):
    t0 = time.perf_counter()
    res = CliRunner().invoke(
        main, ["run", ROW, "--set", "model.flavor=8B", "--out", str(tmp_path / "r")], catch_exceptions=False
    )
    assert res.exit_code == 2, res.output
    assert time.perf_counter() - t0 < 10
    assert "proxy mode needs about" in res.output and "GiB available" in res.output
    assert "model.flavor=8B" in res.output and "--skip-memory-check" in res.output
    assert not (tmp_path / "r").exists()


def test_the_estimate_is_the_accounting_per_rank_times_the_world():
    small = registry.resolve_config(registry.get(ROW), "proxy")
    big = registry.resolve_config(registry.get(ROW), "proxy", ["model.flavor=8B"])
    per_rank, total = proxy_host_gib(small)
    assert PROXY_RANK_BASE_GIB < per_rank < 2 and total == pytest.approx(per_rank * small.parallelism.world_size)
    big_rank, _ = proxy_host_gib(big)
    assert big_rank > 30  # 8B's fp32 weights, grads and AdamW states over 2 shards alone are ~60 GiB
    modes.ProxyMode().check_row(modes.Row(registry.get(ROW), small))  # the published proxy fits


def test_skip_memory_check_lets_a_user_who_knows_better_go_on(monkeypatch, tmp_path):
    ran = []
    monkeypatch.setattr(modes, "run_local_rows", lambda rows, mode: ran.extend(rows) or [])
    res = CliRunner().invoke(
        main,
        ["run", ROW, "--set", "model.flavor=8B", "--skip-memory-check", "--out", str(tmp_path / "r")],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    assert [r.recipe.id for r in ran] == [ROW]
