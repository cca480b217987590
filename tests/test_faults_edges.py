"""Faults at the edges around the training core: `--set` values, the corpus, the results writer,
unwritable places, `plan`'s bounds, a checkpoint of another model, the launcher's log, signals and
a failed rank's last line. Each case asserts the message, the exit code, and that nothing already
written changed (digests before and after); what can be refused before spawning spawns nothing.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from core import debug, run_folder
from recipes import launcher, output
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


# -------------------------------------------------------------- signals and the log (slow)
def _run_recipe(out: Path, *sets: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "recipes", "run", ROW, "--out", str(out), "--set", "metrics.log_freq=1"]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=launcher.base_env()
    )


def _wait_for_step(out: Path, step: int, timeout: float = 240.0, poll_s: float = 0.5) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        metrics = out / "metrics.jsonl"
        if metrics.is_file() and any(json.loads(x)["step"] >= step for x in metrics.read_text().splitlines() if x):
            return
        time.sleep(poll_s)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def _session_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_stops_the_run_says_how_to_resume_and_keeps_the_log(tmp_path, sig):
    out = tmp_path / "run"
    ckpt = ("training.steps=200", "checkpoint.enabled=true", "checkpoint.interval=2")
    proc = _run_recipe(out, *ckpt)
    _wait_for_step(out, 3)
    proc.send_signal(sig)
    said, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, said
    last = said.strip().splitlines()[-1]
    assert last.startswith(f"stopped by {sig.name}: {ROW} in {out}") and "last complete checkpoint step 2" in last
    assert f"resume with: run-recipe run {ROW} --mode proxy --out {out}" in last
    assert not (out / run_folder.LOCK).exists()
    children = subprocess.run(["pgrep", "-f", f"--config {out}/job.json"], capture_output=True, text=True)
    assert not children.stdout.strip(), "a rank outlived the launcher"
    log = (out / "train.log").read_bytes()
    assert b"loss" in log or b"step" in log  # what the ranks wrote before the stop
    if sig != signal.SIGTERM:
        return  # the resume after a stop does not depend on the signal: SIGTERM's case checks it
    # the resume continues from step 2 and appends to the log after a separator
    steps = sorted(int(p.name.split("-")[1]) for p in (out / "checkpoint").glob("step-*") if p.name[5:].isdigit())
    before = {s: digest(out / "checkpoint" / f"step-{s}") for s in steps}
    proc = _run_recipe(out, "training.steps=5", "checkpoint.enabled=true", "checkpoint.interval=2")
    said, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, said
    new_log = (out / "train.log").read_bytes()
    assert new_log.startswith(log) and output.SEPARATOR.encode() in new_log[len(log) :]
    assert json.loads((out / "result.json").read_text())["start_step"] == steps[-1]
    for s, d in before.items():
        if (out / "checkpoint" / f"step-{s}").is_dir():
            assert digest(out / "checkpoint" / f"step-{s}") == d


KILL_RUN = (  # small and short: start-up is most of it; a checkpoint every step
    "model.flavor=tiny",
    "training.seq_len=64",
    "training.steps=20",
    "checkpoint.enabled=true",
    "checkpoint.interval=1",
    "metrics.progress=false",
)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The record of the killed runs' configuration run without interruption."""
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    said, _ = _run_recipe(out, *KILL_RUN).communicate(timeout=300)
    assert (out / "result.json").is_file(), said
    return json.loads((out / "result.json").read_text())


@pytest.mark.slow
def test_a_killed_rank_is_named_not_the_survivor(tmp_path):
    """A rank killed outright (SIGKILL: the OOM killer) leaves no error of its own, and the
    survivor's gloo error is a lost connection: the last line names the killed rank."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "recipes", "run", ROW, "--out", str(out), "--set", "training.steps=6"]
    env = {**launcher.base_env(), debug.PAUSE_ENV: "2:120:1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    pid_file = out / "debug" / "pid_rank_1"
    t0 = time.monotonic()
    while not pid_file.is_file() and time.monotonic() - t0 < 240:
        time.sleep(0.1)
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    said, _ = proc.communicate(timeout=240)
    assert proc.returncode == 1, said
    last = said.strip().splitlines()[-1]
    assert f"{ROW}: rank 1 was killed by SIGKILL" in last, said
    assert "Connection" not in said and "Traceback" not in said, said


def _ranks_of(out: Path) -> str:
    return subprocess.run(["pgrep", "-f", f"--config {out}/job.json"], capture_output=True, text=True).stdout.strip()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGHUP])
def test_a_launcher_killed_or_hung_up_takes_its_ranks_and_the_rerun_resumes_bit_for_bit(tmp_path, uninterrupted, sig):
    """SIGKILL (the OOM killer) runs no cleanup; SIGHUP is a closed terminal. Either way no rank
    outlives the launcher by 10 s, the rerun resumes from the last complete checkpoint with the
    uninterrupted run's losses, and metrics.jsonl holds every step once."""
    out = tmp_path / "run"
    proc = _run_recipe(out, *KILL_RUN)
    _wait_for_step(out, 3, poll_s=0.05)
    proc.send_signal(sig)
    said, _ = proc.communicate(timeout=60)
    deadline = time.monotonic() + 10
    while _ranks_of(out) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _ranks_of(out), "a rank outlived its launcher by 10 s"
    if sig == signal.SIGHUP:  # heard: stopped as by SIGTERM, with the line that resumes
        assert proc.returncode == 128 + sig and "stopped by SIGHUP" in said and "resume with:" in said, said
    said, _ = _run_recipe(out, *KILL_RUN).communicate(timeout=300)
    rec = json.loads((out / "result.json").read_text())
    assert 2 <= rec["start_step"] < 20, said  # the kill came at step 3 or later
    resumed = uninterrupted["losses"][rec["start_step"] :]
    assert rec["losses"][-len(resumed) :] == resumed  # bit for bit
    steps = [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines() if x]
    assert steps == list(range(1, 21))


_SIGINT_IGNORED = """
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a non-interactive shell starts a background job
from recipes import output
try:
    with output.stop_on_signals():
        os.kill(os.getpid(), signal.SIGINT)
        signal.pause()
except output.Stopped as e:
    sys.exit(e.exit_code)
"""


def test_sigint_is_heard_even_when_inherited_ignored():
    """A launcher started in the background of a script inherits SIGINT ignored: it must still
    stop on one (the flaky 'Ctrl-C not heard' of a quiet test run)."""
    proc = subprocess.run([sys.executable, "-c", _SIGINT_IGNORED], cwd=ROOT, timeout=60)
    assert proc.returncode == 128 + signal.SIGINT


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig,moment", [(signal.SIGINT, "start-up"), (signal.SIGTERM, "first step"), (signal.SIGINT, "a save")]
)
def test_every_signal_stops_the_run_at_any_moment(tmp_path, sig, moment):
    """Before the ranks exist (imports), while the first step compiles, in the middle of saves."""
    out = tmp_path / "run"
    proc = _run_recipe(out, *KILL_RUN, "compile.enabled=true", "training.steps=400")
    if moment == "start-up":
        time.sleep(1.0)
    elif moment == "first step":  # the ranks are up and compiling
        t0 = time.monotonic()
        while not _ranks_of(out) and time.monotonic() - t0 < 120:
            time.sleep(0.1)
        time.sleep(3.0)
    else:
        _wait_for_step(out, 5, poll_s=0.05)
    proc.send_signal(sig)
    said, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, said
    assert f"stopped by {sig.name}" in said.strip().splitlines()[-1]
    assert not _ranks_of(out)


@pytest.mark.slow
@pytest.mark.parametrize("bad_rank", [None, 1])
def test_a_failed_rank_is_the_last_line(tmp_path, bad_rank):
    """A malformed document every rank reads (one shard, global sharding): said once. One only
    rank 1 reads (per-rank sharding, its own shard): rank 1 says it, located in its own shard,
    and that is the last line; the terminal shows no traceback, the log keeps them."""
    en = tmp_path / "corpus" / "en"
    en.mkdir(parents=True)
    shards = 1 if bad_rank is None else 2
    for i in range(shards):
        lines = _shard_lines(300 * (i + 1))[300 * i :]
        if i == (bad_rank or 0):
            lines[2:2] = [b'{"text": "unterminated\n']
        with gzip.open(en / f"c4-train.{i:05d}-of-{shards:05d}.json.gz", "wb") as f:
            f.writelines(lines)
    out = tmp_path / "run"
    sharding = "global" if bad_rank is None else "per_rank"
    proc = _run_recipe(out, f"data.path='{tmp_path / 'corpus'}'", "training.steps=3", f"data.sharding='{sharding}'")
    said, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, said
    last = said.strip().splitlines()[-1]
    bad_file = f"c4-train.{bad_rank or 0:05d}-of-{shards:05d}.json.gz:3"
    assert f"{ROW}: rank {bad_rank or 0}: error: " in last and "malformed document" in last and bad_file in last
    assert f"[log: {out / 'train.log'}]" in last
    assert "Traceback" not in said and "ChildFailedError" not in said, said
    assert "ChildFailedError" in (out / "train.log").read_text()  # torchrun's report stays in the log
    assert not (out / run_folder.LOCK).exists()
