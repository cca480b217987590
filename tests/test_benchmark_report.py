"""`run-recipe benchmark-report`: a dated file of what the harness measured, every figure read
from its source file with its CPU, ISA, versions and commit, and an index newest first."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from recipes.cli import main
from recipes.report import benchmarks as br
from tests.committed import committed_names, copy_committed

pytestmark = pytest.mark.core

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
SOURCES = ("peer_torchtitan.csv", "benchmarks.csv", "checkpoint_overhead.csv", "toggles.json", "toggles.md")


@pytest.fixture
def results(tmp_path) -> Path:
    """A copy of the committed measurements (not what the README's main job rewrote on this
    machine), outside git (so no line has a commit)."""
    out = tmp_path / "results"
    for rel in committed_names("results/records/proxy", "llama3_8b__table1__*.json"):
        copy_committed(rel, out / "records" / "proxy" / Path(rel).name)
    for name in SOURCES:
        copy_committed(f"results/{name}", out / name)
    return out


def test_device_names_split_into_cpu_and_isa():
    assert br.split_device("cpu (AMD EPYC, AVX2, no AVX-512, no AMX, 2 cores)") == (
        "AMD EPYC",
        "AVX2, no AVX-512, no AMX",
    )
    assert br.split_device("cpu (x86_64, 2 cores)") == ("x86_64", br.NOT_RECORDED)
    assert br.split_device("NVIDIA H100 80GB HBM3") == ("NVIDIA H100 80GB HBM3", "")
    assert br.slug("AMD EPYC AVX2") == "amd-epyc-avx2"


def test_report_is_named_by_newest_record_and_most_common_cpu():
    def rec(day, device):
        return {"finished_at": f"2026-01-{day}T10:00:00+00:00", "hardware": {"device": device}}

    avx512 = "cpu (Intel Xeon Gold, AVX-512 bf16, no AMX, 8 cores)"
    records = [rec("03", avx512), rec("09", "cpu (AMD EPYC, AVX2, no AVX-512, no AMX, 2 cores)"), rec("05", avx512)]
    assert br.report_name(records) == "2026-01-09-intel-xeon-gold-avx-512-bf16.md"


def test_report_reads_every_figure_with_its_provenance(results, tmp_path):
    out = tmp_path / "benchmarks"
    res = CliRunner().invoke(
        main, ["benchmark-report", "--results-dir", str(results), "--out", str(out)], catch_exceptions=False
    )
    assert res.exit_code == 0, res.output
    records = br.table1_records(results / "records")
    assert len(records) == 6
    name = br.report_name(records)
    text = (out / name).read_text()
    cpu, isa = br.split_device(records[0]["hardware"]["device"])  # the machine that made the records
    machine = br.slug(cpu + " " + isa.split(",")[0])
    assert name == f"{max(r['finished_at'] for r in records)[:10]}-{machine}.md"
    for rec in records:
        line = next(ln for ln in text.splitlines() if Path(rec["_path"]).name in ln)
        v = rec["versions"]
        for cell in (f"{rec['tokens_per_sec_per_device']:,.0f}", f"{rec['wall_s']:,.2f}", v["torch"], v["torchao"]):
            assert f" {cell} " in line, (cell, line)
        assert f" {v['git']} " in line and f" {br.split_device(rec['hardware']['device'])[1]} " in line
    with open(results / "peer_torchtitan.csv", newline="") as f:
        peer = list(csv.DictReader(f))
    ours = [r for r in peer if r["trainer"] == "titan-recipes"]
    for r in ours:  # each pair's ratio, computed from the two figures
        theirs = next(p for p in peer if p is not r and (p["date"], p["nproc"]) == (r["date"], r["nproc"]))
        ratio = float(r["tokens_per_s_per_rank"]) / float(theirs["tokens_per_s_per_rank"])
        line = next(ln for ln in text.splitlines() if ln.startswith(f"| {r['date']} "))
        assert f" {ratio:.2f} " in line and f" {br.NOT_COMMITTED} " in line  # a copy outside git
    toggles = json.loads((results / "toggles.json").read_text())
    assert f"speed-up {toggles['compile']['speedup']:,.2f}x" in text
    with open(results / "checkpoint_overhead.csv", newline="") as f:
        for row in csv.DictReader(f):
            assert f"| {row['mode']} " in text and f" {row['blocking_s']} " in text
    index = (out / br.INDEX).read_text()
    assert f"[{name}]({name})" in index


def test_index_lists_reports_newest_first(tmp_path):
    for name in ("2025-03-01-a.md", "2026-02-01-b.md", "2025-12-31-c.md"):
        (tmp_path / name).write_text(f"# Benchmarks: machine {name[:10]}\n")
    (tmp_path / "notes.md").write_text("# not a report\n")
    rows = [ln for ln in br.index_text(tmp_path).splitlines() if ln.startswith("| 20")]
    assert [r.split("|")[1].strip() for r in rows] == ["2026-02-01", "2025-12-31", "2025-03-01"]


def test_readme_link_points_at_the_newest_report(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("Latest: [x](results/benchmarks/2025-01-01-old-cpu.md).\n")
    newest = tmp_path / "2026-02-01-new-cpu.md"
    assert br.update_readme_link(readme, newest) is True
    assert readme.read_text() == "Latest: [x](results/benchmarks/2026-02-01-new-cpu.md).\n"
    assert br.update_readme_link(readme, newest) is False


def test_csv_lines_carry_the_commit_that_recorded_them():
    path = RESULTS / "checkpoint_overhead.csv"
    commits = br.line_commits(path)
    n_lines = len(path.read_text().splitlines())
    assert sorted(commits) == list(range(1, n_lines + 1)), "the committed CSV is tracked by git line by line"
    assert all(len(c) == 7 and set(c) <= set("0123456789abcdef") for c in commits.values())
    assert br.file_commit(path) in set(commits.values())
