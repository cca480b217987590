"""`run-recipe results`: gains, bubble, versions and skipped-toggle notes computed from records
only; the results index links what exists. No processes: records are written by hand here."""

from __future__ import annotations

import json
import re
import struct
import subprocess
from pathlib import Path

import pandas as pd
import pytest

from core.dryrun.gpuspec import DEFAULT_GPU, known_gpus, load_spec
from recipes import registry
from recipes.report import figures, loss_curves, results, table_data
from tests.records import conforming

pytestmark = pytest.mark.dryrun

T2 = "llama3_70b/table2/256gpu_fsdp_tp_compile_float8"
T2_ASYNC = T2 + "_asynctp"
T3_1F1B = "llama3_405b/table3/512gpu_3d_1f1b"
T3_INTER = "llama3_405b/table3/512gpu_3d_interleaved_1f1b"
T1_BASE, T1_F8 = "llama3_8b/table1/8gpu_fsdp", "llama3_8b/table1/8gpu_fsdp_compile_float8"
T1_COMP, T1_128 = "llama3_8b/table1/8gpu_fsdp_compile", "llama3_8b/table1/128gpu_fsdp"
T4_CP1, T4_CP2 = "long_context/table4/8b_fsdp8_cp1_32k", "long_context/table4/8b_fsdp4_cp2_64k"
LC_1D, LC_2D = "llama3_8b/loss_convergence/1d_fsdp8", "llama3_8b/loss_convergence/2d_fsdp8_cp8"
CAL_NOTE = (
    "two constants fitted (core/dryrun/calibrate.py), every other one cited: compute.clock_fraction on "
    f"{T1_COMP}, efficiency.flash_attention_bwd on {T4_CP1}"
)
# today's columns of each table CSV (before the performance model): other checks read them
TODAY = {
    "table1": [
        "row",
        "GPUs",
        "paper TPS/GPU",
        "paper mem GiB",
        "bench-2412 TPS/GPU",
        "bench-2412 mem GiB",
        "gain of",
        "paper gain %",
        "ours mode",
        "ours hardware",
        "ours versions",
        "ours world",
        "ours TPS/device",
        "ours MFU %",
        "ours peak mem GiB",
        "ours final loss",
        "ours gain %",
        "ours notes",
        "dry-run est. mem GiB",
        "recipe",
    ],
    "table4": [
        "row",
        "GPUs",
        "paper TPS/GPU",
        "paper mem GiB",
        "ours mode",
        "ours hardware",
        "ours versions",
        "ours world",
        "ours TPS/device",
        "ours MFU %",
        "ours peak mem GiB",
        "ours final loss",
        "ours notes",
        "dry-run est. mem GiB",
        "recipe",
    ],
}
TODAY["table2"] = TODAY["table1"]
TODAY["table3"] = TODAY["table1"][:17] + ["ours PP bubble %"] + TODAY["table1"][17:]
TODAY["table5"] = TODAY["table4"][:12] + ["ours PP bubble %"] + TODAY["table4"][12:]
COMPACT_HEADERS = [
    "row",
    "paper TPS/GPU",
    "predicted TPS/GPU",
    "TPS error %",
    "paper gain %",
    "predicted gain %",
    "paper mem GiB",
    "dry-run mem GiB",
    "mem error %",
    "ours TPS/device",
    "ours gain %",
]


def _rec(rid, tps, mode="proxy", **extra):
    rec = {
        "recipe": rid,
        "mode": mode,
        "world_size": 4,
        "steps": 3,
        "losses": [8.0, 7.5, 7.0],
        "hardware": {"device": "test-cpu (2 cores)"},
        "tokens_per_sec_per_device": tps,
        "mfu": 0.02,
        "peak_memory_gib": 0.4,
        "toggles_applied": ["tp", "fsdp"],
        "versions": {"torch": "2.13.0+cpu", "torchao": "0.18.0", "git": "abc1234"},
    }
    rec.update(extra)
    return rec


def _dry(rid, tps, mem=70.0, **breakdown):
    """A dry-run record with the performance model's `predicted`, as core.dryrun.record writes it."""
    parts = {
        "compute": 1.5,
        "memory_bound": 0.4,
        "recompute": 0.3,
        "bubble": 0.0,
        "optimizer": 0.02,
        "exposed_comm": {"dp_shard": 0.1, "grad_norm": 0.0001},
    }
    parts.update(breakdown)
    return {
        "recipe": rid,
        "mode": "dry-run",
        "estimated_peak_gib": mem,
        "predicted": {
            "gpu": "h100_96gb_hbm2e_500w",
            "step_time_s": 16384 / tps,
            "tokens_per_sec_per_gpu": tps,
            "mfu": 0.4,
            "breakdown": parts,
            "fits": mem <= 95,
            "capacity_gib": 95.0,
            "calibration": CAL_NOTE,
        },
    }


def _write(root, mode, rec):
    """A hand-made record filed as a conforming run of its row (tests/records.py)."""
    d = root / mode
    d.mkdir(parents=True, exist_ok=True)
    (d / (rec["recipe"].replace("/", "__") + ".json")).write_text(json.dumps(conforming(rec)))


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
    _write(rec, "dry-run", {"recipe": T3_INTER, "mode": "dry-run", "estimated_peak_gib": 71.25})  # no prediction
    _write(rec, "dry-run", _dry(T1_BASE, 5000.0, mem=75.8))
    _write(rec, "dry-run", _dry(T1_COMP, 6000.0, mem=75.8, memory_bound=0.2))
    _write(rec, "dry-run", _dry(T1_F8, 9000.0, mem=75.6, compute=1.0))
    _write(rec, "dry-run", _dry(T4_CP1, 4000.0))
    _write(rec, "dry-run", _dry(T4_CP2, 2600.0, mem=120.0))  # does not fit: still predicted, marked
    _write(rec, "dry-run", _dry(T3_1F1B, 110.0, bubble=3.0))
    # a real record of a row beats its proxy record, and its gain is never mixed with a proxy baseline
    _write(
        rec,
        "real",
        _rec(
            T1_F8,
            9000.0,
            mode="real",
            hardware={"device": "NVIDIA H100 80GB HBM3"},
            toggles_applied=["float8", "compile", "fsdp"],
        ),
    )
    for rid in (LC_1D, LC_2D):  # two loss-convergence curves -> csv + png + check
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
    for name in (
        "table1.md",
        "table5.csv",
        "loss_convergence.md",
        "loss_convergence_table.csv",
        "benchmarks.csv",
        "loss_parity.md",
        "extra_notes.md",
    ):
        assert f"({name})" in readme, name
    assert "(dry_run.md)" not in readme  # absent files are not linked
    assert "(loss_convergence.png)" in readme and "(loss_convergence.csv)" in readme
    lc = (out / "loss_convergence.md").read_text()
    assert "1D FSDP 2" in lc and "2D FSDP 2 x CP 2" in lc and "0 of 1 N-D layouts within" not in lc
    assert "torchao" in readme and "0.18.0" in readme  # versions of every record used
    md = (out / "table2.md").read_text()
    assert "-5.00%" in md and "+12.60%" in md and "AsyncTP" in md
    assert out / "README.md" in written


def _md_table(md: str) -> tuple[list[str], dict[str, list[str]]]:
    r"""The first Markdown table of a file: its headers and {row label: cells} (`\|` is a `|` in a
    cell, as GitHub reads it; a bare `|` ends the cell)."""
    lines = [ln for ln in md.splitlines() if ln.startswith("|")]
    cells = [[c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", ln[1:-1])] for ln in lines]
    end = next((i for i, c in enumerate(cells[2:], 2) if len(c) != len(cells[0])), len(cells))
    return cells[0], {c[0]: c for c in cells[2:end]}


def test_compact_table_reads_at_a_glance(made):
    out, _ = made
    for table in ("table1", "table2", "table3", "table4", "table5"):
        headers, body = _md_table((out / f"{table}.md").read_text())
        assert len(headers) <= 12, (table, headers)
        assert headers == COMPACT_HEADERS, table
        assert len(body) == len(registry.by_table(table))
    md = (out / "table1.md").read_text()
    headers, body = _md_table(md)
    col = {h: i for i, h in enumerate(headers)}
    base, comp = body["8 GPUs, FSDP"], body["8 GPUs, FSDP + compile"]
    assert base[col["predicted TPS/GPU"]] == "5,000" and base[col["TPS error %"]] == "-20.1%"  # 5000 / 6258
    assert base[col["paper mem GiB"]] == "~81.9" and base[col["mem error %"]] == "-7.4%"  # 75.8 / 81.9
    assert comp[col["predicted TPS/GPU"]] == "6,000 †"  # the calibration row, marked
    assert comp[col["predicted gain %"]] == "+20.00%" and comp[col["paper gain %"]] == "+6.65%"
    missing = body["128 GPUs, FSDP"]  # no dry-run record: empty cells, never a number
    assert all(missing[col[h]] == "" for h in ("predicted TPS/GPU", "TPS error %", "dry-run mem GiB", "mem error %"))
    # the provenance list under the table: GPU spec, calibration row, mode/hardware/versions, notes, ids
    assert "`h100_96gb_hbm2e_500w`" in md and "3 of 6 rows" in md
    assert "Calibration row here (†): 8 GPUs, FSDP + compile (compute.clock_fraction)" in md
    assert "proxy, test-cpu (2 cores), torch 2.13.0+cpu, torchao 0.18.0, git abc1234" in md
    assert "real, NVIDIA H100 80GB HBM3" in md and f"`{T1_128}`" in md
    t2 = (out / "table2.md").read_text()  # a note names its rows only
    assert f"- **notes** ({registry.get(T2_ASYNC).row}): async_tp skipped: SymmetricMemory needs CUDA" in t2
    t5 = (out / "table5.md").read_text()
    assert "no dry-run record with a prediction" in t5 and "table5.png" not in t5
    t4 = (out / "table4.md").read_text()
    assert "No row of this table was used" not in t4 and "(efficiency.flash_attention_bwd)" in t4
    assert "- **does not fit its GPU** (predicted anyway): FSDP 4, CP 2, seq 65,536" in t4
    assert "No row of this table was used: every figure here is a prediction" in (out / "table3.md").read_text()
    assert "no dry-run record with a prediction" in (out / "table2.md").read_text()


def test_loss_convergence_table_reads_at_a_glance(made):
    """The table of loss_convergence.md: what each row ran, its steps, final loss and its check
    against the 1D control; every other column stays in loss_convergence_table.csv, the check's
    columns appended after the table's own."""
    out, _ = made
    md = (out / "loss_convergence.md").read_text()
    for block in re.findall(r"(?:^\|.*\n)+", md, flags=re.MULTILINE):  # GitHub: a header cell per column
        assert len({len(re.findall(r"(?<!\\)\|", line)) for line in block.splitlines()}) == 1, block
    headers, body = _md_table(md)
    assert headers == list(loss_curves.COMPACT.values()) and len(headers) <= 8
    assert len(body) == len(loss_curves.rows())
    col = {h: i for i, h in enumerate(headers)}
    check = loss_curves.COMPACT[loss_curves.VERDICT]
    control, cp = body[loss_curves.control().row], body[registry.get(LC_2D).row]
    assert control[col["layout run"]] == "1D FSDP 2" and control[col[check]] == "control"
    assert cp[col["layout run"]] == "2D FSDP 2 x CP 2" and cp[col[check]] == "pass"
    steps = str(registry.get(LC_2D).job_config("proxy").training.steps)  # a conforming record ran them all
    assert (cp[col["mode"]], cp[col["steps"]], cp[col["final loss"]]) == ("proxy", steps, "7.0000")
    figure = loss_curves.COMPACT[loss_curves.CHECK_FIGURE]
    assert float(cp[col[figure]]) == 0.0 and control[col[figure]] == ""
    no_record = body[registry.get("llama3_8b/loss_convergence/3d_fsdp8_tp2_pp2").row]
    assert all(cell == "" for cell in no_record[1:])
    csv = pd.read_csv(out / "loss_convergence_table.csv")
    assert list(csv.columns)[-3:] == [loss_curves.LAYOUT, loss_curves.CHECK_FIGURE, loss_curves.VERDICT]
    assert {"ours hardware", "ours versions", "predicted TPS/GPU", "recipe"} <= set(csv.columns)
    assert list(csv.set_index("recipe").loc[[LC_1D, LC_2D], loss_curves.VERDICT]) == ["control", "pass"]


def test_predicted_columns_and_errors_in_the_csv(made):
    out, _ = made
    t1 = pd.read_csv(out / "table1.csv")
    assert list(t1["recipe"]) == [r.id for r in registry.by_table("table1")]  # same row order
    t1 = t1.set_index("recipe")
    assert t1.loc[T1_BASE, "predicted TPS/GPU"] == 5000.0
    assert t1.loc[T1_BASE, "predicted TPS error %"] == pytest.approx(100 * (5000 / 6258 - 1), abs=0.05)
    assert t1.loc[T1_BASE, "dry-run mem error %"] == pytest.approx(100 * (75.8 / 81.9 - 1), abs=0.05)
    assert t1.loc[T1_F8, "predicted gain %"] == pytest.approx(80.0)  # 9000 / 5000, over the baseline
    assert t1.loc[T1_F8, "predicted TPS error %"] == pytest.approx(100 * (9000 / 9409 - 1), abs=0.05)
    assert pd.isna(t1.loc[T1_BASE, "predicted gain %"])  # the baseline has none
    assert t1.loc[T1_COMP, "calibrated on"] == "compute.clock_fraction" and pd.isna(t1.loc[T1_BASE, "calibrated on"])
    assert t1.loc[T1_BASE, "predicted GPU"] == "h100_96gb_hbm2e_500w" and t1.loc[T1_BASE, "predicted MFU %"] == 40.0
    assert t1.loc[T1_BASE, "ours mode"] == "proxy" and t1.loc[T1_BASE, "ours versions"].startswith("torch 2.13.0")
    assert t1.loc[[T1_128], ["predicted TPS/GPU", "predicted TPS error %", "dry-run mem error %"]].isna().all().all()
    t3 = pd.read_csv(out / "table3.csv").set_index("recipe")  # a dry-run record without `predicted`
    assert pd.isna(t3.loc[T3_INTER, "predicted TPS/GPU"]) and pd.isna(t3.loc[T3_INTER, "predicted gain %"])
    assert t3.loc[T3_INTER, "dry-run mem error %"] == pytest.approx(100 * (71.25 / 80.3 - 1), abs=0.05)
    # long-context tables: each row's gain over the previous row (the CP doubling)
    t4 = pd.read_csv(out / "table4.csv").set_index("recipe")
    assert t4.loc[T4_CP2, "paper gain %"] == pytest.approx(100 * (2540 / 3890 - 1), abs=0.01)
    assert t4.loc[T4_CP2, "predicted gain %"] == pytest.approx(-35.0)
    assert t4.loc[T4_CP2, "gain of"] == "CP 2, FSDP 4 (vs CP 1, FSDP 8)"
    assert pd.isna(t4.loc[T4_CP1, "paper gain %"])


def test_every_csv_keeps_todays_columns_in_order(made):
    out, _ = made
    for table, today in TODAY.items():
        cols = list(pd.read_csv(out / f"{table}.csv").columns)
        assert set(today) <= set(cols), (table, set(today) - set(cols))
        assert [c for c in cols if c in today] == today, table
        for new in ("predicted TPS/GPU", "predicted TPS error %", "predicted gain %", "dry-run mem error %"):
            assert new in cols, (table, new)


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    return struct.unpack(">II", data[16:24])


def test_figure_per_table_with_predictions(made):
    out, written = made
    for table in ("table1", "table4"):
        png = out / f"{table}.png"
        assert png in written and png.stat().st_size > 20_000
        w, h = _png_size(png)
        assert w > 800 and h > 300
        assert f"]({table}.png)" in (out / f"{table}.md").read_text()
    assert not (out / "table5.png").exists()  # no prediction there: no figure of paper bars alone
    readme = (out / "README.md").read_text()
    assert "[table1.png](table1.png)" in readme and "(table5.png)" not in readme


def test_stale_figure_goes_when_its_predictions_go(made, tmp_path):
    out, _ = made
    assert (out / "table1.png").exists()
    no_predictions = tmp_path / "no_predictions"  # one proxy record, no dry-run record
    _write(no_predictions, "proxy", _rec(T1_BASE, 1000.0))
    results.write_results(no_predictions, out)
    assert not (out / "table1.png").exists()
    assert "table1.png" not in (out / "table1.md").read_text()


def test_breakdown_parts_stack_in_order_and_keep_unknown_keys():
    parts = figures.breakdown_parts(
        {
            "optimizer": 0.1,
            "bubble": 2.0,
            "compute": 5.0,
            "memory_bound": 1.0,
            "recompute": 0.5,
            "new_thing": 0.25,
            "exposed_comm": {"tp": 0.3, "dp_shard_cp": 0.2, "zz": 0.01},
        }
    )
    assert list(parts) == [
        "compute",
        "memory-bound",
        "recompute",
        "exposed comm: TP",
        "exposed comm: FSDP (shard x CP)",
        "exposed comm: zz",
        "new thing",
        "PP bubble",
        "optimizer",
    ]
    assert sum(parts.values()) == pytest.approx(9.36)


def test_docs_name_the_calibration_the_spec_states():
    """The dry-run page's account of predicted throughput stays true: every spec, and each fitted
    constant with the row or public figure it was fitted on, as the specs' calibration notes say
    (four in all)."""
    from core.dryrun import calibrate

    text = (Path(__file__).resolve().parents[1] / "docs" / "dry-run.md").read_text()
    notes = {gpu: load_spec(gpu).calibration for gpu in known_gpus()}
    pairs = {pair for note in notes.values() for pair in re.findall(r"([\w.]+) on ([\w./-]+)", note)}
    assert len(pairs) == len(calibrate.FITS) == 4
    rows = {r.id for r in registry.all_recipes()}
    for const, target in pairs:
        assert target in rows or target in calibrate.fitted_figures(), target
        assert any(f"`{const}`" in line and f"`{target}`" in line for line in text.splitlines()), (const, target)
        if target in rows:
            assert table_data.calibrated_constants(notes[DEFAULT_GPU], target) == [const]
    for gpu in known_gpus():
        assert f"[{gpu}]" in text or f"`{gpu}`" in text, gpu


def test_record_names_a_modified_tree(tmp_path):
    """A record made from uncommitted code or rows says so beside the commit; generated results
    and notes outside the code do not count."""
    from core.provenance import git_state

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    for d in ("core", "llama3_8b", "results"):
        (tmp_path / d).mkdir()
    (tmp_path / "core" / "a.py").write_text("x = 1\n")
    (tmp_path / "llama3_8b" / "row.toml").write_text("x = 1\n")
    (tmp_path / "results" / "t.md").write_text("old\n")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
    head = git_state(tmp_path)
    assert head["git"] and head["git_dirty"] is False
    (tmp_path / "notes.md").write_text("results\n")
    (tmp_path / "results" / "t.md").write_text("new\n")  # what the main job rewrites
    assert git_state(tmp_path) == head
    (tmp_path / "core" / "b.py").write_text("y = 1\n")  # new code, not yet added
    assert git_state(tmp_path) == {**head, "git_dirty": True}
    (tmp_path / "core" / "b.py").unlink()
    (tmp_path / "llama3_8b" / "row.toml").write_text("x = 2\n")  # a row changed
    assert git_state(tmp_path) == {**head, "git_dirty": True}
    assert git_state(tmp_path / "nowhere") == {"git": "", "git_dirty": None}


def test_toggles_page_renders_its_template_from_the_measurements():
    """results/toggles.md is the page of recipes/studies/toggles_bench.toml filled from toggles.json
    (its "Generated by" line aside: it names the command and torch of the run that wrote it)."""
    from recipes.studies.toggles_bench import markdown

    root = Path(__file__).resolve().parents[1] / "results"
    page = markdown(json.loads((root / "toggles.json").read_text()))
    written = (root / "toggles.md").read_text()
    generated = [i for i, line in enumerate(page.splitlines()) if line.startswith("Generated by ")]
    assert generated == [2] and "{" not in page
    assert [x for i, x in enumerate(page.splitlines()) if i != 2] == [
        x for i, x in enumerate(written.splitlines()) if i != 2
    ]
    assert sum(line.startswith("|---") for line in page.splitlines()) == 3  # the three tables
