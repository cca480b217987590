"""Options and `--set` keys refused before anything is spawned, in one line naming what to use
instead (exit 2): keys the command line owns, plan's bounds, forms of an option that would be
silently ignored, path components that escape their folder."""

from __future__ import annotations

import json

import pytest

from core import run_folder
from core.overrides import parse_override
from tests import fault_utils
from tests.fault_utils import ROW, digest, invoke

pytestmark = pytest.mark.faults
no_spawn = fault_utils.no_spawn  # the fixture, registered in this module by name


# --------------------------------------------------------------------- keys the CLI owns
@pytest.mark.parametrize(
    ("text", "use"), [("job.mode=dry-run", "--mode"), ("job.recipe=x", "recipe id"), ("job.output_dir=/tmp/x", "--out")]
)
def test_set_of_a_key_the_cli_owns_is_refused(tmp_path, no_spawn, text, use):
    res = invoke("run", ROW, "--mode", "proxy", "--set", text, "--out", str(tmp_path / "out"))
    assert res.exit_code == 2, res.output
    assert text.split("=")[0] in res.output and use in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
    assert not (tmp_path / "out").exists()
    assert text.split("=")[0] not in invoke("keys", "job.").output  # not listed as a --set key


# ------------------------------------------------------------------------ whitespace in --set
@pytest.mark.parametrize("text", [" training.steps=7", "training.steps =7", " training . steps = 7 "])
def test_set_key_with_whitespace_around_it_is_read_as_toml_reads_it(text):
    assert parse_override(text) == ("training", "steps", 7)
    res = invoke("show", ROW, "--json", "--set", text, "--set", "model.flavor = tiny")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["proxy"]["config"]["training"]["steps"] == 7


# --------------------------------------------------------------------- a corrupt titan.json
@pytest.mark.parametrize("text", ["garbage{", "[1, 2]", "null", "", '{"step": 4, "model_shape": 5}'])
def test_a_corrupt_checkpoint_info_is_one_line_naming_it(tmp_path, no_spawn, text):
    step = tmp_path / "run" / "checkpoint" / "step-4"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"not read before spawn")
    (step / "titan.json").write_text(text)
    before = digest(tmp_path / "run")
    res = invoke("run", ROW, "--set", "checkpoint.enabled=true", "--out", str(tmp_path / "run"))
    assert res.exit_code == 2, res.output
    assert str(step / "titan.json") in res.output and "corrupted checkpoint info" in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
    assert digest(tmp_path / "run") == before and not (tmp_path / "run" / run_folder.LOCK).exists()


# -------------------------------------------------------------- preflight's one-device options
@pytest.mark.parametrize(
    "args", [["--quick"], ["--device", "cpu"], ["--rounds", "1"], ["--layers", "2", "--steps", "2"]]
)
def test_preflight_one_device_options_without_gpus_1_are_refused(tmp_path, no_spawn, args):
    res = invoke("preflight", "--out", str(tmp_path / "pf"), *args)
    assert res.exit_code == 2, res.output
    assert args[0] in res.output and "only with --gpus 1" in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
    assert not (tmp_path / "pf").exists()
