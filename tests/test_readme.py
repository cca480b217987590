"""The README and docs/ stay true: the README's recipe table is the registry's, the real-mode
launch commands in docs/multinode.md are the ones run-recipe prints and writes, the README stays
short and self-contained, every relative link of the README and the docs resolves, and the README
links the newest benchmark report."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from recipes import launcher, modes, multinode, paths, registry
from recipes.cli import main
from recipes.report import benchmarks as benchmark_report
from recipes.report import readme

pytestmark = pytest.mark.dryrun

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "README.md").read_text()
REAL_RUNS = ROOT / "docs" / "multinode.md"  # the real-mode launch commands, shown as run-recipe writes them
MULTI = "llama3_70b/table2/256gpu_fsdp_tp_compile_float8"
MAX_README_LINES = 200
BENCHMARKS = ROOT / "results" / "benchmarks"
# what a user reads: the README, the docs, the generated benchmark reports
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(BENCHMARKS.glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target)


def test_readme_table_is_the_registry():
    table = readme.current_table(TEXT)
    assert table is not None, "README.md lost its recipe-table markers"
    res = CliRunner().invoke(main, ["list", "--markdown"], catch_exceptions=False)
    assert res.exit_code == 0
    assert table == res.output.strip("\n"), "README's recipe table is stale: run `python -m recipes.report.readme`"
    body = table.splitlines()[2:]
    assert len(body) == len(registry.all_recipes()) == 22
    for r, line in zip(registry.all_recipes(), body, strict=True):
        assert f"`run-recipe run {r.id}`" in line and f"results/{r.table}.md" in line
        assert f"proxy: {r.world('proxy')} CPU ranks" in line
        assert ("--slurm" in line) == (r.nnodes() > 1)


def test_update_readme_rewrites_only_between_markers(tmp_path):
    p = tmp_path / "README.md"
    p.write_text(f"head\n{readme.BEGIN}\nstale\n{readme.END}\ntail\n")
    assert readme.update_readme(p) is True
    text = p.read_text()
    assert text.startswith("head\n") and text.endswith(f"{readme.END}\ntail\n")
    assert readme.current_table(text) == readme.recipe_table()
    assert readme.update_readme(p) is False


def _blocks() -> list[str]:
    return re.findall(r"```bash\n(.*?)```", REAL_RUNS.read_text(), flags=re.DOTALL)


def test_docs_multinode_command_is_what_run_recipe_prints(tmp_path):
    r = registry.get(MULTI)
    printed = multinode.multinode_command(r.nnodes(), r.gpus_per_node, Path("<run dir>/job.json"), r.fname)
    printed = printed.replace("'<run dir>/job.json'", "<run dir>/job.json")
    printed = printed.replace(shlex.quote(str(paths.project_root())), "<checkout>")  # PYTHONPATH: the checkout
    joined = [b.replace("\\\n    ", "").strip() for b in _blocks()]
    assert printed in joined, f"{REAL_RUNS.name}'s multi-node command differs from:\n{printed}"
    local = " ".join(modes.RealMode().command(8, [Path("runs/<id__>/<timestamp>/job.json")]))
    local = local.replace(launcher.sys.executable, ".venv/bin/python")
    assert local in joined


def test_docs_sbatch_script_is_what_slurm_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: (_ for _ in ()).throw(AssertionError("spawned")))
    out = tmp_path / "run"
    res = CliRunner().invoke(
        main,
        ["run", MULTI, "--mode", "real", "--slurm", "--sbatch", "partition=h100", "--out", str(out)],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    script = (out / "sbatch.sh").read_text()
    root = str(paths.project_root())
    generic = (
        script.replace(str(out.resolve()), "<run dir>")
        .replace(launcher.torchrun_exe(), "<checkout>/.venv/bin/torchrun")
        .replace(sys.executable, "<checkout>/.venv/bin/python")
        .replace(sys.prefix, "<checkout>/.venv")
        .replace(root, "<checkout>")
    )  # the job's Python environment, wherever it is
    # the records dir defaults to none with --out; the page shows the default (results/records)
    shown = next(b for b in _blocks() if b.startswith("#!/bin/bash"))
    assert shown.startswith(generic), f"{REAL_RUNS.name}'s sbatch script differs from:\n{generic}"
    assert (
        shown[len(generic) :].splitlines()[-1].startswith("cp <run dir>/result.json <checkout>/results/records/real/")
    )


def test_every_command_the_readme_names_exists():
    named = set(re.findall(r"(?:^|[\s`/])run-recipe ([a-z][a-z-]*)", TEXT, flags=re.MULTILINE))
    assert {"list", "show", "run", "results", "parity", "bench", "plan", "convergence"} <= named
    commands = set(main.list_commands(None))
    assert named <= commands, f"README names commands run-recipe lacks: {named - commands}"
    for name in named:  # each imports and has its help
        res = CliRunner().invoke(main, [name, "--help"], catch_exceptions=False)
        assert res.exit_code == 0 and "Usage: " in res.output, name


def test_readme_is_short_and_cites_the_paper():
    assert len(TEXT.splitlines()) <= MAX_README_LINES, f"README.md has {len(TEXT.splitlines())} lines"
    for needed in ("arxiv.org/abs/2410.06511", "Wanchao Liang", "ICLR", "TorchTitan: One-stop PyTorch native"):
        assert needed in TEXT, needed
    assert "peer-bench" not in TEXT  # named in the docs only, until the command exists


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_never_points_at_the_shared_folder(page):
    text = page.read_text()
    assert "../shared" not in text and "shared/" not in text, f"{page.name} refers to the shared folder"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    targets = LINK.findall(page.read_text())
    assert page != ROOT / "README.md" or len(targets) > 20  # the pattern finds the README's links
    broken = []
    for target in targets:
        path = target.split("#", 1)[0]
        if not path or re.match(r"^[a-z]+:", path):  # an anchor on the page, or a URL
            continue
        resolved = (page.parent / path).resolve()
        if not resolved.exists() or not resolved.is_relative_to(ROOT):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links that resolve to no file of the repository: {broken}"


def test_readme_links_the_newest_benchmark_report():
    newest = benchmark_report.reports(BENCHMARKS)[0]
    assert f"](results/benchmarks/{newest.name})" in TEXT
    assert "](results/benchmarks/README.md)" in TEXT
    index = (BENCHMARKS / benchmark_report.INDEX).read_text()
    assert index == benchmark_report.index_text(BENCHMARKS), "stale index: run `run-recipe benchmark-report`"


def test_license_is_bsd_3_clause():
    text = (ROOT / "LICENSE").read_text()
    assert text.startswith("BSD 3-Clause License") and "Copyright (c) 2026, the Titan Recipes authors" in text
    assert "Neither the name of the copyright holder nor the names of its" in text


def test_ci_runs_the_readme_commands_in_order():
    """CI does what the README tells a new user: its set-up and main job, then its test command,
    each line verbatim and in that order (a test reading what the main job rewrote fails there)."""
    text = (ROOT / "README.md").read_text()
    block = text.split("## Set up and run (two commands)", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line for line in block.splitlines() if line.strip()]
    assert len(commands) == 2
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    at = [ci.index(command) for command in commands]
    assert at == sorted(at) and "set -euo pipefail" in ci
