"""The README stays true: its recipe table is the registry's, and its real-mode launch commands
are the ones run-recipe prints and writes."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from recipes import launcher, modes, multinode, readme, registry
from recipes.cli import main

pytestmark = pytest.mark.dryrun

ROOT = Path(__file__).resolve().parents[1]
TEXT = (ROOT / "README.md").read_text()
MULTI = "llama3_70b/table2/256gpu_fsdp_tp_compile_float8"


def test_readme_table_is_the_registry():
    table = readme.current_table(TEXT)
    assert table is not None, "README.md lost its recipe-table markers"
    res = CliRunner().invoke(main, ["list", "--markdown"], catch_exceptions=False)
    assert res.exit_code == 0
    assert table == res.output.strip("\n"), "README's recipe table is stale: run `python -m recipes.readme`"
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
    return re.findall(r"```bash\n(.*?)```", TEXT, flags=re.DOTALL)


def test_readme_multinode_command_is_what_run_recipe_prints(tmp_path):
    r = registry.get(MULTI)
    printed = multinode.multinode_command(r.nnodes(), r.gpus_per_node, Path("<run dir>/job.json"), r.fname)
    printed = printed.replace("'<run dir>/job.json'", "<run dir>/job.json")
    joined = [b.replace("\\\n    ", "").strip() for b in _blocks()]
    assert printed in joined, f"README's multi-node command differs from:\n{printed}"
    local = " ".join(modes.RealMode().command(8, [Path("runs/<id__>/<timestamp>/job.json")]))
    local = local.replace(launcher.sys.executable, ".venv/bin/python")
    assert local in joined


def test_readme_sbatch_script_is_what_slurm_writes(tmp_path, monkeypatch):
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: (_ for _ in ()).throw(AssertionError("spawned")))
    out = tmp_path / "run"
    res = CliRunner().invoke(
        main,
        ["run", MULTI, "--mode", "real", "--slurm", "--sbatch", "partition=h100", "--out", str(out)],
        catch_exceptions=False,
    )
    assert res.exit_code == 0, res.output
    script = (out / "sbatch.sh").read_text()
    root = str(launcher.project_root())
    generic = (
        script.replace(str(out.resolve()), "<run dir>")
        .replace(root, "<checkout>")
        .replace(launcher.torchrun_exe(), "<checkout>/.venv/bin/torchrun")
    )  # a venv outside the checkout
    # the records dir defaults to none with --out; the README shows the default (results/records)
    shown = next(b for b in _blocks() if b.startswith("#!/bin/bash"))
    assert shown.startswith(generic), f"README's sbatch script differs from:\n{generic}"
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
