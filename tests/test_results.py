"""`run-recipe results`: gains, bubble, versions and skipped-toggle notes computed from records
only; the results index links what exists. No processes: records are written by hand here."""
from __future__ import annotations

import json

import pandas as pd
import pytest

from recipes import registry, results

pytestmark = pytest.mark.dryrun

T2 = "llama3_70b/table2/256gpu_fsdp_tp_compile_float8"
T2_ASYNC = T2 + "_asynctp"
T3_1F1B = "llama3_405b/table3/512gpu_3d_1f1b"
T3_INTER = "llama3_405b/table3/512gpu_3d_interleaved_1f1b"
T1_BASE, T1_F8 = "llama3_8b/table1/8gpu_fsdp", "llama3_8b/table1/8gpu_fsdp_compile_float8"


def _rec(rid, tps, mode="proxy", **extra):
    rec = {"recipe": rid, "mode": mode, "world_size": 4, "steps": 3, "losses": [8.0, 7.5, 7.0],
           "hardware": {"device": "test-cpu (2 cores)"}, "tokens_per_sec_per_device": tps,
           "mfu": 0.02, "peak_memory_gib": 0.4, "toggles_applied": ["tp", "fsdp"],
           "versions": {"torch": "2.13.0+cpu", "torchao": "0.18.0", "git": "abc1234"}}
    rec.update(extra)
    return rec


def _write(root, mode, rec):
    d = root / mode
    d.mkdir(parents=True, exist_ok=True)
    (d / (rec["recipe"].replace("/", "__") + ".json")).write_text(json.dumps(rec))


@pytest.fixture
def made(tmp_path):
    rec = tmp_path / "records"
    skipped = {"async_tp": "SymmetricMemory needs CUDA (this run is on cpu)"}
    _write(rec, "proxy", _rec(T2, 400.0))
    _write(rec, "proxy", _rec(T2_ASYNC, 380.0, toggles_skipped=skipped))
    _write(rec, "proxy", _rec(T3_1F1B, 200.0, pp_bubble_fraction=0.2))
    _write(rec, "proxy", _rec(T3_INTER, 260.0, pp_bubble_fraction=0.111))
    _write(rec, "proxy", _rec(T1_BASE, 1000.0, toggles_applied=["fsdp"]))
    _write(rec, "proxy", _rec(T1_F8, 400.0, toggles_applied=["float8", "compile", "fsdp"]))
    _write(rec, "dry-run", {"recipe": T3_INTER, "mode": "dry-run", "estimated_peak_gib": 71.25})
    # a real record of a row beats its proxy record, and its gain is never mixed with a proxy baseline
    _write(rec, "real", _rec(T1_F8, 9000.0, mode="real", hardware={"device": "NVIDIA H100 80GB HBM3"},
                             toggles_applied=["float8", "compile", "fsdp"]))
    for name in ("1d_fsdp8", "2d_fsdp8_cp8"):  # two loss-convergence curves -> csv + png + check
        rid = f"llama3_8b/loss_convergence/{name}"
        _write(rec, "proxy", _rec(rid, 100.0, config=registry.get(rid).job_config("proxy").to_dict()))
    out = tmp_path / "results"
    out.mkdir()
    (out / "benchmarks.csv").write_text("benchmark,value,unit,notes\n")
    (out / "loss_parity.md").write_text("# parity\n")
    (out / "extra_notes.md").write_text("# x\n")
    written = results.write_results(rec, out)
    return out, written


def test_gains_come_from_our_records_beside_the_papers(made):
    out, _ = made
    t3 = pd.read_csv(out / "table3.csv").set_index("recipe")
    assert t3.loc[T3_INTER, "ours gain %"] == pytest.approx(30.0)  # 260 / 200
    assert t3.loc[T3_INTER, "paper gain %"] == pytest.approx(30.0)  # 130 / 100
    assert t3.loc[T3_INTER, "gain of"] == "Interleaved1F1B (vs 1F1B)"
    assert pd.isna(t3.loc[T3_1F1B, "ours gain %"])  # the baseline row has no gain
    assert t3.loc[T3_INTER, "ours PP bubble %"] == pytest.approx(11.1)
    assert t3.loc[T3_1F1B, "ours PP bubble %"] == pytest.approx(20.0)
    assert t3.loc[T3_INTER, "dry-run est. mem GiB"] == pytest.approx(71.25)

    t2 = pd.read_csv(out / "table2.csv").set_index("recipe")
    assert t2.loc[T2_ASYNC, "ours gain %"] == pytest.approx(-5.0)
    assert t2.loc[T2_ASYNC, "paper gain %"] == pytest.approx(12.59, abs=0.01)
    assert t2.loc[T2_ASYNC, "gain of"] == "AsyncTP"
    # the AsyncTP gain was measured without AsyncTP: the row says so beside the number
    assert "async_tp skipped: SymmetricMemory needs CUDA" in t2.loc[T2_ASYNC, "ours notes"]
    assert "ours PP bubble %" not in t2.columns  # no pipeline in Table 2
    assert t2.loc[T2, "ours versions"] == "torch 2.13.0+cpu, torchao 0.18.0, git abc1234"
    assert t2.loc[T2, "ours hardware"] == "test-cpu (2 cores)"


def test_real_record_wins_and_gains_stay_within_one_mode(made):
    out, _ = made
    t1 = pd.read_csv(out / "table1.csv").set_index("recipe")
    assert t1.loc[T1_F8, "ours mode"] == "real" and t1.loc[T1_F8, "ours TPS/device"] == 9000.0
    assert t1.loc[T1_F8, "gain of"] == "compile + Float8"
    assert pd.isna(t1.loc[T1_F8, "ours gain %"])  # no real record of the FSDP baseline
    assert pd.isna(t1.loc[T1_F8, "ours MFU %"])  # Float8 applied: no MFU, as the paper
    assert t1.loc[T1_BASE, "ours MFU %"] == pytest.approx(2.0)
    assert t1.loc[T1_F8, "paper gain %"] == pytest.approx(50.35, abs=0.01)


def test_index_links_tables_and_other_results(made):
    out, written = made
    readme = (out / "README.md").read_text()
    for name in ("table1.md", "table5.csv", "loss_convergence.md", "loss_convergence_table.csv",
                 "benchmarks.csv", "loss_parity.md", "extra_notes.md"):
        assert f"({name})" in readme, name
    assert "(dry_run.md)" not in readme  # absent files are not linked
    assert "(loss_convergence.png)" in readme and "(loss_convergence.csv)" in readme
    lc = (out / "loss_convergence.md").read_text()
    assert "1D FSDP 2" in lc and "2D FSDP 2 x CP 2" in lc and "0 of 1 N-D layouts within" not in lc
    assert "torchao" in readme and "0.18.0" in readme  # versions of every record used
    md = (out / "table2.md").read_text()
    assert "-5.00%" in md and "+12.60%" in md and "AsyncTP" in md
    assert out / "README.md" in written
