"""Output places and the records `results` reads, checked before any work: a missing or empty
--records-dir, a record of another schema, a read-only --out. Each case asserts the one line, the
exit code, and that nothing already written changed (digests before and after)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from tests import fault_utils
from tests.dist_utils import ROOT
from tests.fault_utils import ROW, digest, invoke

pytestmark = pytest.mark.faults
no_spawn = fault_utils.no_spawn  # the fixture, registered in this module by name

PROXY_RECORD = "proxy/llama3_8b__table1__8gpu_fsdp.json"


@pytest.fixture(scope="module")
def results_made(tmp_path_factory) -> Path:
    """The shipped records and the tables made from them, once for the module."""
    made = tmp_path_factory.mktemp("made")
    shutil.copytree(ROOT / "results" / "records", made / "records")
    res = invoke("results", "--records-dir", str(made / "records"), "--out", str(made / "results"))
    assert res.exit_code == 0, res.output
    return made


@pytest.fixture
def results_copy(results_made, tmp_path) -> tuple[Path, Path]:
    """(records, results): this test's copy of both."""
    shutil.copytree(results_made, tmp_path, dirs_exist_ok=True)
    return tmp_path / "records", tmp_path / "results"


@pytest.fixture
def read_only_fs(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(d)], check=False, capture_output=True)
    if r.returncode:
        pytest.skip("mounting a read-only tmpfs needs root")
    yield d
    subprocess.run(["umount", "--lazy", str(d)], check=False)


# --------------------------------------------------------------------------- results: records
@pytest.mark.parametrize("how", ["does-not-exist", "empty", "only bad records"])
def test_results_refuses_a_records_dir_with_no_record_and_changes_nothing(results_copy, tmp_path, how):
    records, out = results_copy
    before = digest(out)
    given = tmp_path / how
    skip = []
    if how == "empty":
        given.mkdir()
    elif how == "only bad records":
        (given / "proxy").mkdir(parents=True)
        (given / "proxy" / "x.json").write_text("{")
        skip = ["--skip-bad-records"]
    res = invoke("results", "--records-dir", str(given), "--out", str(out), *skip)
    assert res.exit_code == 2, res.output
    assert str(given) in res.output and "no table was written" in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
    assert digest(out) == before


@pytest.mark.parametrize(
    ("record", "drop", "named"),
    [
        (PROXY_RECORD, ["tokens_per_sec_per_device", "mfu"], "'tokens_per_sec_per_device', 'mfu'"),
        (
            "dry-run/llama3_8b__table1__8gpu_fsdp.json",
            ["estimated_peak_gib", "estimated_peak_memory_gib"],
            "estimated_peak_gib or estimated_peak_memory_gib or peak_memory_gib",
        ),
    ],
)
def test_a_record_of_another_schema_is_refused_naming_the_fields(results_copy, record, drop, named):
    records, out = results_copy
    before = digest(out)
    path = records / record
    rec = json.loads(path.read_text())
    for key in drop:
        del rec[key]
    path.write_text(json.dumps(rec))
    res = invoke("results", "--records-dir", str(records), "--out", str(out))
    assert res.exit_code == 2, res.output
    assert str(path) in res.output and "another schema version" in res.output and named in res.output
    assert digest(out) == before
    # skipped, it is not counted as a row with a record
    res = invoke("results", "--records-dir", str(records), "--out", str(out), "--skip-bad-records")
    assert res.exit_code == 0, res.output
    if record == PROXY_RECORD:
        assert "5 of 6 rows have a record" in (out / "table1.md").read_text()


def test_a_record_filed_under_another_mode_is_refused(results_copy):
    """A proxy run labelled dry-run (issue 36 item 6's record) must not stand in for the dry-run's."""
    records, out = results_copy
    before = digest(out)
    path = records / PROXY_RECORD
    path.write_text(json.dumps({**json.loads(path.read_text()), "mode": "dry-run"}))
    res = invoke("results", "--records-dir", str(records), "--out", str(out))
    assert res.exit_code == 2, res.output
    assert str(path) in res.output and "mode 'dry-run' filed under proxy/" in res.output
    assert digest(out) == before


# ---------------------------------------------------------------------- read-only output places
def test_results_into_a_read_only_out(results_copy, read_only_fs):
    records, _ = results_copy
    res = invoke("results", "--records-dir", str(records), "--out", str(read_only_fs / "results"))
    assert res.exit_code == 2, res.output
    assert "--out" in res.output and "Read-only file system" in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output


def test_results_out_under_a_file(results_copy, tmp_path):
    records, _ = results_copy
    (tmp_path / "a_file").write_text("in the way\n")
    res = invoke("results", "--records-dir", str(records), "--out", str(tmp_path / "a_file" / "results"))
    assert res.exit_code == 2, res.output
    assert "a_file" in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert (tmp_path / "a_file").read_text() == "in the way\n"


@pytest.fixture(params=["read-only", "a file in the way"])
def unwritable(request, tmp_path):
    """A folder that cannot be made or written: on a read-only file system (root only), or under a file."""
    if request.param == "read-only":
        return request.getfixturevalue("read_only_fs") / "out", "Read-only file system"
    (tmp_path / "a_file").write_text("in the way\n")
    return tmp_path / "a_file" / "out", "a file is in the way"


def _one_line(res, code: int = 2) -> str:
    assert res.exit_code == code, res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
    return res.output


def test_run_refuses_an_unwritable_records_dir_before_the_run(tmp_path, unwritable, no_spawn):
    where, why = unwritable
    res = invoke("run", ROW, "--out", str(tmp_path / "run"), "--records-dir", str(where))
    assert "--records-dir" in _one_line(res) and why in res.output
    assert not (tmp_path / "run").exists()


def test_preflight_refuses_an_unwritable_out_before_any_run(unwritable, no_spawn):
    where, why = unwritable
    for form in ([], ["--gpus", "1", "--quick"]):
        res = invoke("preflight", "--out", str(where), *form)
        assert "--out" in _one_line(res) and why in res.output


@pytest.fixture
def no_measuring(monkeypatch):
    from recipes.gpu_spec import command

    def boom(*a, **k):
        raise AssertionError("measured before the options were checked")

    monkeypatch.setattr(command, "measure_spec", boom)


def test_gpu_spec_checks_out_before_measuring(unwritable, no_measuring):
    where, why = unwritable
    res = invoke("gpu-spec", "--measure", "--quick", "--device", "cpu", "--out", str(where / "spec.toml"))
    assert "--out" in _one_line(res) and why in res.output


def test_gpu_spec_checks_base_before_measuring(no_measuring):
    res = invoke("gpu-spec", "--measure", "--quick", "--device", "cpu", "--base", "no_such_spec")
    assert "--base" in _one_line(res) and "unknown GPU spec 'no_such_spec'" in res.output


@pytest.mark.parametrize("name", ["../../x", "a/b", "/abs", "..", ""])
def test_gpu_spec_name_is_a_plain_file_name(no_measuring, name):
    res = invoke("gpu-spec", "--measure", "--quick", "--device", "cpu", "--name", name)
    assert "--name" in _one_line(res) and "plain file name" in res.output


def test_dry_run_table_refuses_an_unknown_gpu(tmp_path, no_spawn):
    res = invoke("dry-run-table", "--predict", "--gpu", "h100_nope", "--out", str(tmp_path / "out"))
    assert "--gpu" in _one_line(res) and "unknown GPU spec 'h100_nope'" in res.output
    assert not (tmp_path / "out").exists()
