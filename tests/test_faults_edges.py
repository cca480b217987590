"""Faults at the edges around the training core: `--set` values, the corpus, the results writer,
unwritable places, `plan`'s bounds, a checkpoint of another model, the launcher's log, signals and
a failed rank's last line. Each case asserts the message, the exit code, and that nothing already
written changed (digests before and after); what can be refused before spawning spawns nothing.
"""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from core import run_folder
from recipes import output
from recipes.plan.layouts import plan
from tests import fault_utils
from tests.dist_utils import ROOT
from tests.fault_utils import ROW, digest, invoke

pytestmark = pytest.mark.faults
no_spawn = fault_utils.no_spawn  # the fixture, registered in this module by name

CORPUS = ROOT / "assets" / "c4_offline" / "en"

# ------------------------------------------------------------------ --set: one line of visible text
BAD_TEXT_SETS = [  # (--set text, the key the message names)
    ('model.flavor="tiny"\n[training]\nsteps=100000', "model.flavor"),
    ('job.name="a\tb"', "job.name"),
    ('job.name="a\u200bb"', "job.name"),
    ('job.name="a\u2028b"', "job.name"),
    ('job.name="a\x00b"', "job.name"),
    ('model.fl\u200bavor="tiny"', "U+200B"),
    ("training.steps=" + "9" * 10_000, "training.steps"),
    ("training.steps=99999999999999999999", "training.steps"),
    ("data.path='" + "x" * 5000 + "'", "data.path"),
]


@pytest.mark.parametrize(("text", "key"), BAD_TEXT_SETS, ids=range(len(BAD_TEXT_SETS)))
def test_set_refuses_what_is_not_one_visible_line(tmp_path, no_spawn, text, key):
    res = invoke("run", ROW, "--set", text, "--out", str(tmp_path / "out"))
    assert res.exit_code == 2, res.output
    assert key in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert len(res.output) < 400, "the value is cut short in the message"
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ the corpus
def _shard_lines(n: int) -> list[bytes]:
    src = min(CORPUS.glob("c4-train.*.json.gz"))
    with gzip.open(src, "rb") as f:
        return [next(f) for _ in range(n)]


def _bad_corpus(tmp_path: Path, how: str) -> Path:
    en = tmp_path / "corpus" / "en"
    en.mkdir(parents=True)
    if how == "no shards":
        (en / "README.txt").write_text("not a shard\n")
    elif how == "empty shard":
        (en / "c4-train.00000-of-00001.json.gz").write_bytes(b"")
    elif how == "not gzip":
        (en / "c4-train.00000-of-00001.json.gz").write_text('{"text": "plain json, not gzip"}\n')
    return tmp_path / "corpus"


@pytest.mark.parametrize("how", ["empty folder", "no shards", "empty shard", "not gzip"])
def test_unusable_corpus_refused_before_spawn(tmp_path, no_spawn, how):
    corpus = _bad_corpus(tmp_path, how)
    before = digest(corpus)
    res = invoke("run", ROW, "--set", f"data.path='{corpus}'", "--out", str(tmp_path / "out"))
    assert res.exit_code == 2, res.output
    assert "data.path" in res.output and len(res.output.strip().splitlines()) == 1, res.output
    assert "dataset_path" not in res.output  # a key that does not exist
    assert digest(corpus) == before and not (tmp_path / "out").exists()


def _truncated_first_shard(tmp_path: Path) -> tuple[Path, Path]:
    en = tmp_path / "corpus" / "en"
    en.mkdir(parents=True)
    first, second = en / "c4-train.00000-of-00002.json.gz", en / "c4-train.00001-of-00002.json.gz"
    whole = gzip.compress(b"".join(_shard_lines(200)))
    first.write_bytes(whole[:600])  # a download or copy cut off after its first document or so
    second.write_bytes(gzip.compress(b"".join(_shard_lines(200))))
    return tmp_path / "corpus", first


def test_truncated_shard_named_then_skipped(pg, tmp_path):
    from core.data.documents import BadDocumentError
    from tests.test_faults import DATA, train

    corpus, first = _truncated_first_shard(tmp_path)
    before = digest(corpus)
    with pytest.raises(BadDocumentError, match=rf"{first}:\d+: the gzip stream ends early.*skip_bad_documents"):
        train(tmp_path / "a", *DATA, f"--data.path={corpus}")
    rec = train(tmp_path / "b", *DATA, f"--data.path={corpus}", "--data.skip_bad_documents=true")
    (skipped,) = rec["skipped_bad_documents"]
    assert skipped.startswith(f"{first}:") and rec["steps"] == 2
    assert digest(corpus) == before


# ----------------------------------------------------------------------------- results writer
def _records_copy(tmp_path: Path) -> Path:
    records = tmp_path / "records"
    shutil.copytree(ROOT / "results" / "records", records)
    return records


BAD_RECORDS = {  # what is written over the Table 1 FSDP proxy record -> what the message names
    "not json": ('{"recipe": "llama3_8b/table1/8gpu_fsdp", "mode": ', "not valid JSON"),
    "not an object": ("[1, 2, 3]", "JSON object"),
    "a field of the wrong type": (None, "'tokens_per_sec_per_device'"),
    "a loss that is not a number": (None, "'losses'"),
}


@pytest.mark.parametrize("how", list(BAD_RECORDS))
def test_bad_record_refused_and_tables_kept_unless_skipped(tmp_path, how):
    records, out = _records_copy(tmp_path), tmp_path / "results"
    assert CliRunner().invoke(_cli(), ["results", "--records-dir", str(records), "--out", str(out)]).exit_code == 0
    good = digest(out)
    bad = records / "proxy" / "llama3_8b__table1__8gpu_fsdp.json"
    text, named = BAD_RECORDS[how]
    if text is None:
        rec = json.loads(bad.read_text())
        if how == "a field of the wrong type":
            rec["tokens_per_sec_per_device"] = "fast"
        else:
            rec["losses"][1] = "nan?"
        text = json.dumps(rec)
    bad.write_text(text)
    res = CliRunner().invoke(_cli(), ["results", "--records-dir", str(records), "--out", str(out)])
    assert res.exit_code == 2, res.output
    assert str(bad) in res.output and named in res.output and "no table was written" in res.output
    assert digest(out) == good  # the good tables stay
    res = CliRunner().invoke(
        _cli(), ["results", "--records-dir", str(records), "--out", str(out), "--skip-bad-records"]
    )
    assert res.exit_code == 0, res.output
    table1 = (out / "table1.md").read_text()
    assert "Records skipped" in (out / "README.md").read_text() and str(bad) in table1 and named in table1
    assert "5 of 6 rows have a record" in table1


def _cli():
    from recipes.cli import main

    return main


# --------------------------------------------------------------------------- unwritable places
@pytest.fixture
def read_only_fs(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(d)], check=False, capture_output=True)
    if r.returncode:
        pytest.skip("mounting a read-only tmpfs needs root; the file-in-the-way case covers the refusal")
    yield d
    subprocess.run(["umount", "--lazy", str(d)], check=False)


def test_out_on_a_read_only_file_system(read_only_fs, no_spawn):
    res = invoke("run", ROW, "--out", str(read_only_fs / "run"))
    assert res.exit_code == 2, res.output
    assert f"{read_only_fs / 'run'}" in res.output and "Read-only file system" in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_out_under_a_file(tmp_path, no_spawn):
    (tmp_path / "a_file").write_text("in the way\n")
    res = invoke("run", ROW, "--out", str(tmp_path / "a_file" / "run"))
    assert res.exit_code == 2, res.output
    assert "a_file" in res.output and "cannot write the run folder" in res.output
    assert (tmp_path / "a_file").read_text() == "in the way\n"


def test_a_full_disk_stops_the_log_not_the_launch(tmp_path, monkeypatch):
    logs = output.JobLogs(tmp_path / "train.log")
    logs.write("first line\n")
    real = logs.file

    class Full:
        def write(self, data):
            raise OSError(28, "No space left on device")

        def close(self):
            real.close()

    logs.file = Full()
    assert logs.write("second line\n") == "second line\n"  # still echoed
    assert logs.error and "No space left on device" in logs.error and "train.log" in logs.error
    logs.close()
    assert (tmp_path / "train.log").read_text() == "first line\n"


# ------------------------------------------------------------------------------------ plan
@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--seq", "1"], "at least 2 tokens"),
        (["--seq", "10000000"], "beyond Llama 3.1 8B's context length of 131,072"),
        (["--gpus", "0"], "at least 1 GPU"),
        (["--gpu-mem", "0"], "must be above 0"),
        (["--local-batch", "0"], "at least 1 sequence"),
    ],
)
def test_plan_names_the_real_bound(args, says):
    res = CliRunner().invoke(plan, ["--model", "8B", "--gpus", "8", *args])
    assert res.exit_code == 2, res.output
    assert says in res.output and "must be positive" not in res.output


# ------------------------------------------------------------- a checkpoint of another model
def test_checkpoint_of_another_model_shape_refused_before_spawn(tmp_path, no_spawn):
    step = tmp_path / "run" / "checkpoint" / "step-4"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"not read before spawn")
    shape = {"dim": 4096, "n_layers": 32, "n_heads": 32, "n_kv_heads": 8, "vocab_size": 128256, "ffn_hidden_dim": 14336}
    (step / "titan.json").write_text(json.dumps({"step": 4, "kind": "full", "model_shape": shape}))
    before = digest(tmp_path / "run")
    res = invoke("run", ROW, "--set", "checkpoint.enabled=true", "--out", str(tmp_path / "run"))
    assert res.exit_code == 2, res.output
    assert (
        "titan.json" in res.output and "another model shape" in res.output and "n_layers 32 (checkpoint)" in res.output
    )
    assert digest(tmp_path / "run") == before and not (tmp_path / "run" / run_folder.LOCK).exists()


# ------------------------------------------------------------------- resume: what it says
def test_resume_says_what_changed_and_what_it_removed(pg, tmp_path, capsys):
    from tests.test_faults import CKPT, train

    out = tmp_path / "run"
    train(out, *CKPT, "--training.steps=2", "--training.local_batch_size=4")
    (out / "checkpoint" / "step-3.tmp").mkdir()  # a save a killed run never finished
    capsys.readouterr()
    rec = train(out, *CKPT, "--training.steps=3", "--training.local_batch_size=8")
    said = capsys.readouterr()
    assert rec["start_step"] == 2
    assert "step-3.tmp: a save that never completed" in said.out
    assert "resharded on load: global batch 4 -> 8 sequences per step" in said.err


def test_failure_cause_is_the_ranks_own_line(tmp_path):
    log = tmp_path / "train.log"
    log.write_text(
        "step 1 ...\nerror: /c/en/shard.json.gz:3: malformed document (bad); fix or remove it\n"
        "Traceback (most recent call last):\n  File x\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        "core.train FAILED\n"
    )
    assert output.failure_cause(log) == "error: /c/en/shard.json.gz:3: malformed document (bad); fix or remove it"
    log.write_text(
        "old launch\nerror: an old failure\n"
        f"\n{output.SEPARATOR}, now =====\n"
        "Traceback (most recent call last):\n  File y\nRuntimeError: shapes do not match\n"
        "[rank1]: Traceback\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
    )
    assert output.failure_cause(log) == "RuntimeError: shapes do not match"


def test_failure_cause_is_the_rank_that_said_its_error_not_the_survivor_torchrun_saw_first(tmp_path):
    """torchrun may observe a survivor first (its lost connection failed it before the failed
    rank's exit was seen; seen in a CI run under load): the rank that said its own error is named."""
    log = tmp_path / "train.log"
    log.write_text(
        "[rank1]: error: /c/en/c4-train.00001-of-00002.json.gz:3: malformed document (bad); fix or remove it\n"
        "E1127 api.py:836] RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
        "Root Cause (first observed failure):\n[0]:\n  rank      : 0 (local_rank: 0)\n  exitcode  : 1 (pid: 7)\n"
        "  RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer\n"
    )
    assert output.failure_cause(log) == (
        "rank 1: error: /c/en/c4-train.00001-of-00002.json.gz:3: malformed document (bad); fix or remove it"
    )
