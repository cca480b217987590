"""Loading a checkpoint never runs what it reads (core/checkpoint/trusted.py).

A `.metadata` or a non-tensor item whose pickle calls a function (here `touch`, a harmless
stand-in for any code: it creates a marker file) is refused with one line naming the file and
the type, through `checkpoint.resume_from`, a run folder handed over, a resharded load and
`python -m core.checkpoint export-hf`, with the manifest updated to match or deleted; the marker
never appears. The project's own checkpoints load bit for bit as torch's plain reader loads them.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from core.checkpoint import trusted
from core.checkpoint.files import main as ckpt_main
from core.checkpoint.folder import INFO, MANIFEST, METADATA, CheckpointError
from core.checkpoint.manifest import checksum_files
from core.config import load_config
from core.train import run
from core.validate import validate
from tests.dist_utils import ROOT, TINY_JOB, dist_env, torchrun_command

pytestmark = pytest.mark.checkpoint

CKPT = ["--checkpoint.enabled=true"]
SHARD = "__0_0.distcp"  # a world-1 save writes one shard


def touch(path: str) -> None:
    Path(path).touch()


TOUCH = f"{touch.__module__}.touch"  # the global a payload's pickle names


class Payload:
    """Unpickled by a plain unpickler, it calls touch(marker)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return touch, (self.marker,)


def train(out: Path, *overrides: str) -> dict:
    return run(validate(load_config(None, [*TINY_JOB, f"--job.output_dir={out}", *overrides]), 1, check_files=False))


@pytest.fixture(scope="module")
def saved(pg, tmp_path_factory) -> Path:
    """A full checkpoint of this project (model, optimizer, scheduler, loader, RNG, train state)."""
    out = tmp_path_factory.mktemp("saved")
    train(out, *CKPT, "--training.steps=1")
    return out / "checkpoint" / "step-1"


def _reseal(step: Path, manifest: str) -> None:
    """What a forger does after editing: the manifest's sizes and CRC32s updated to match, or the
    manifest deleted and titan.json no longer saying there was one (as before manifests)."""
    if manifest == "updated":
        m = json.loads((step / MANIFEST).read_text())
        m["files"] = checksum_files(step, sorted(m["files"]))["files"]
        (step / MANIFEST).write_text(json.dumps(m))
    else:
        (step / MANIFEST).unlink()
        info = json.loads((step / INFO).read_text())
        info.pop("manifest")
        (step / INFO).write_text(json.dumps(info))


def craft(src: Path, dst: Path, kind: str, marker: Path, manifest: str = "updated") -> Path:
    """A copy of checkpoint `src` at `dst` carrying a payload that creates `marker`: in `.metadata`
    (kind "metadata"), or as the pickle of the non-tensor item train_state.step ("item") or of the
    tensor model.output.weight ("tensor"), appended to the shard. Returns the file to be named."""
    shutil.copytree(src, dst)
    md = trusted.read_metadata(dst)
    if kind == "metadata":
        md.planner_data["payload"] = Payload(marker)  # a plain unpickler runs it, then loads on
        named = dst / METADATA
    else:
        key = {"item": "train_state.step", "tensor": "model.output.weight"}[kind]
        buf = io.BytesIO()
        torch.save(Payload(marker), buf)
        named = dst / SHARD
        offset = named.stat().st_size
        with open(named, "ab") as f:
            f.write(buf.getvalue())
        for index in [i for i in md.storage_data if i.fqn == key]:
            md.storage_data[index] = _StorageInfo(SHARD, offset, len(buf.getvalue()))
    with open(dst / METADATA, "wb") as f:
        pickle.dump(md, f)
    _reseal(dst, manifest)
    return named


def assert_refused(message: str, named: Path, marker: Path) -> None:
    assert "\n" not in message, message
    assert message.endswith(f"{named.name}: refused to load '{TOUCH}' ({trusted.WHY})"), message
    assert named.parent.name in message, message
    assert not marker.exists(), "the payload ran"


# --------------------------------------------------------------------------- the allowlists
def test_the_payload_is_live(tmp_path):
    """What the tests below refuse would run: a plain unpickler calls touch."""
    marker = tmp_path / "ran"
    pickle.loads(pickle.dumps(Payload(marker)))
    assert marker.exists()


def test_metadata_allowlist_covers_what_the_project_writes(saved):
    """Every global a `.metadata` of this project names is admitted (how METADATA_TYPES was found)."""
    seen: set[tuple[str, str]] = set()

    class Recording(trusted.MetadataUnpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    with open(saved / METADATA, "rb") as f:
        Recording(f, saved / METADATA).load()
    assert ("torch.distributed.checkpoint.metadata", "Metadata") in seen
    assert seen <= set(trusted.METADATA_TYPES)


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_metadata_unpickler_refuses_a_call_in_any_protocol(tmp_path, protocol):
    marker = tmp_path / "ran"
    for payload, name in ((Payload(marker), TOUCH), (os.system, f"{os.system.__module__}.system")):
        data = pickle.dumps({"planner_data": [payload]}, protocol=protocol)
        with pytest.raises(trusted.RefusedCheckpoint) as err:
            trusted.MetadataUnpickler(io.BytesIO(data), tmp_path / METADATA).load()
        assert str(err.value) == f"{tmp_path / METADATA}: refused to load '{name}' ({trusted.WHY})"
    assert not marker.exists()


def test_non_tensor_items_are_plain_values(tmp_path):
    def saved_bytes(value) -> io.BytesIO:
        buf = io.BytesIO()
        torch.save(value, buf)
        buf.seek(0)
        return buf

    plain = {"step": 3, "json": '{"a": 1}', "betas": (0.9, 0.95), "foreach": None, "fused": True, "x": [1.5]}
    assert trusted.load_plain(saved_bytes(plain), tmp_path / SHARD) == plain
    marker = tmp_path / "ran"
    with pytest.raises(trusted.RefusedCheckpoint) as err:
        trusted.load_plain(saved_bytes(Payload(marker)), tmp_path / SHARD)
    assert_refused(str(err.value), tmp_path / SHARD, marker)
    # loadable without running code, but not what this project saves there
    with pytest.raises(trusted.RefusedCheckpoint, match=r"refused to load 'torch\.Tensor'"):
        trusted.load_plain(saved_bytes(torch.zeros(2)), tmp_path / SHARD)


def test_own_checkpoint_loads_bit_for_bit_as_torch_reads_it(saved):
    """The trusted reader returns what torch's plain reader returns, every tensor and value."""
    md = trusted.read_metadata(saved)
    assert pickle.dumps(md.state_dict_metadata) == pickle.dumps(
        dcp.FileSystemReader(str(saved)).read_metadata().state_dict_metadata
    )

    def template() -> dict:
        return {
            k: torch.empty(tuple(m.size), dtype=m.properties.dtype) if isinstance(m, TensorStorageMetadata) else None
            for k, m in md.state_dict_metadata.items()
        }

    ours, theirs = template(), template()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's "loading in a single process"
        trusted.load(ours, saved, no_dist=True)
        dcp.load(theirs, checkpoint_id=str(saved), no_dist=True)
    assert sum(not isinstance(v, torch.Tensor) for v in ours.values()) > 100  # train state, optimizer groups, ...
    for k, v in theirs.items():
        if isinstance(v, torch.Tensor):
            assert ours[k].dtype == v.dtype and torch.equal(ours[k], v), k
        else:
            assert type(ours[k]) is type(v) and ours[k] == v, k


# ------------------------------------------------------------------- every path that loads
@pytest.mark.parametrize("manifest", ["updated", "deleted"])
@pytest.mark.parametrize("kind", ["metadata", "item"])
def test_refused_through_resume_from(saved, tmp_path, kind, manifest):
    marker = tmp_path / "ran"
    named = craft(saved, tmp_path / "shared" / "step-1", kind, marker, manifest)
    with pytest.raises(CheckpointError) as err:
        train(tmp_path / "run", *CKPT, "--training.steps=2", f"--checkpoint.resume_from={named.parent}")
    assert_refused(str(err.value), named, marker)


@pytest.mark.parametrize("kind", ["metadata", "item"])
def test_refused_in_a_handed_run_folder(saved, tmp_path, kind):
    """A run folder from someone else, resumed as our own (its latest checkpoint)."""
    marker = tmp_path / "ran"
    named = craft(saved, tmp_path / "run" / "checkpoint" / "step-1", kind, marker)
    with pytest.raises(CheckpointError) as err:
        train(tmp_path / "run", *CKPT, "--training.steps=2")
    assert_refused(str(err.value), named, marker)


@pytest.mark.parametrize("kind", ["metadata", "tensor"])
def test_refused_by_export_hf(saved, tmp_path, capsys, kind):
    marker = tmp_path / "ran"
    named = craft(saved, tmp_path / "ckpt" / "step-1", kind, marker)
    assert ckpt_main(["export-hf", str(named.parent.parent), str(tmp_path / "hf")]) == 2  # a folder: its latest
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ")
    assert_refused(err, named, marker)
    assert not (tmp_path / "hf").exists()


def test_export_hf_never_reads_non_tensor_items(saved, tmp_path):
    """The export reads the model's tensors only: a payload in a non-tensor item stays unread."""
    marker = tmp_path / "ran"
    named = craft(saved, tmp_path / "ckpt" / "step-1", "item", marker)
    assert ckpt_main(["export-hf", str(named.parent), str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "config.json").is_file() and not marker.exists()


@pytest.mark.slow
def test_refused_on_every_rank_of_a_resharded_load(saved, tmp_path):
    """The world-1 checkpoint loaded under FSDP 2 (DCP reshards): as saved, it loads; crafted, both
    ranks refuse it, naming the file."""
    root = tmp_path / "group"
    markers = {kind: tmp_path / f"ran_{kind}" for kind in ("metadata", "item")}
    named = {kind: craft(saved, tmp_path / kind / "step-1", kind, m) for kind, m in markers.items()}
    fsdp = [*TINY_JOB, "--parallelism.dp_shard=2", "--training.local_batch_size=4", "--training.steps=2", *CKPT]
    jobs = [{"name": "good", "overrides": [*fsdp, f"--checkpoint.resume_from={saved}"]}]
    jobs += [
        {"name": k, "overrides": [*fsdp, f"--checkpoint.resume_from={p.parent}"], "expect_error": True}
        for k, p in named.items()
    ]
    root.mkdir()
    (root / "plan.json").write_text(json.dumps({"root": str(root), "jobs": jobs}))
    cmd = torchrun_command(2, ["-m", "tests.checkpoint_driver", str(root / "plan.json")], forked=True)
    proc = subprocess.run(cmd, cwd=ROOT, env=dist_env(2), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert json.loads((root / "good" / "result.json").read_text())["start_step"] == 1
    for kind, path in named.items():
        for rank in (0, 1):
            assert_refused((root / kind / f"error_rank_{rank}.txt").read_text(), path, markers[kind])
        assert not (root / kind / "result.json").exists()
