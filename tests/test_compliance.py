"""A record counts only when the compliance check says it is its row's run, on the row's data, by
known code (recipes/report/compliance.py), and the assets a run reads are verified against
assets/MANIFEST.json before anything spawns (core/data/verify.py)."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from click.testing import CliRunner

from core.data.store import read_manifest, update_manifest
from core.provenance import config_fingerprint, provenance
from recipes import paths, registry
from recipes.cli import main
from recipes.report import compliance
from tests.committed import ROOT, committed_bytes, copy_committed_tree

pytestmark = pytest.mark.core

ROW = "llama3_8b/table1/8gpu_fsdp"
SMOKE = ["--set", "model.flavor=tiny", "--set", "training.seq_len=64", "--set", "training.steps=2"]


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def committed_records(dest: Path) -> Path:
    """results/records as committed (the main job rewrites the working tree's), copied to dest."""
    return copy_committed_tree("results/records", dest)


def test_every_committed_record_conforms(tmp_path):
    """What the tables are built from passes the check: each row run as published, in full, on the
    pinned assets, from a clean tree on the pinned versions."""
    records = committed_records(tmp_path / "records")
    verdicts = compliance.check_folder(records)
    assert len(verdicts) == len(registry.all_recipes()) * 2  # a proxy and a dry-run record per row
    assert {str(v.path.name): v.reasons for v in verdicts if not v.conforms} == {}


def _conforming_proxy(tmp_path) -> tuple[dict, Path]:
    rel = "results/records/proxy/" + registry.get(ROW).fname + ".json"
    rec = json.loads(committed_bytes(rel))
    path = tmp_path / "proxy" / Path(rel).name
    path.parent.mkdir(parents=True, exist_ok=True)
    return rec, path


def _verdict(rec: dict, path: Path) -> compliance.Verdict:
    path.write_text(json.dumps(rec))
    return compliance.check_file(path)


def test_each_departure_from_the_row_is_one_reason(tmp_path):
    rec, path = _conforming_proxy(tmp_path)
    assert _verdict(rec, path).conforms
    bad = copy.deepcopy(rec)
    bad["config"]["model"]["flavor"] = "tiny"
    bad["config"]["training"]["steps"] = 2
    bad["provenance"]["config_fingerprint"] = config_fingerprint(bad["config"])
    bad["provenance"]["deviations"] = []  # the record's own claim is not believed
    bad["steps"], bad["losses"] = 2, bad["losses"][:2]
    bad["versions"].update(git_dirty=True, torch="2.12.0+cpu")
    bad["provenance"]["assets"]["data"]["digest"] = "0" * 64
    bad["provenance"]["assets"]["tokenizer"]["sha256"] = "1" * 64
    bad["mfu"] = 1.768
    bad["hardware"]["peak_gemm_route"] = "native"
    reasons = _verdict(bad, path).reasons
    heads = [r.split(":")[0] + ":" + r.split(":")[1].split("=")[0].strip() for r in reasons]
    assert "config:model.flavor" in heads and "config:training.steps" in heads
    joined = "\n".join(reasons)
    for words in (
        "tree at",
        "torch 2.12.0+cpu, the suite pins 2.13.0",
        "corpus read",
        "tokenizer read",
        "MFU 176.8% is above 100%",
        "peak measured on the native GEMM route, the steps ran the fp32 route",
    ):
        assert words in joined, (words, joined)
    assert "run:" not in joined  # 2 steps of a configuration of 2: complete, if not the row's
    bad["steps"] = 1  # now short of its own configuration's steps too
    assert "run: 1 of the configuration's 2 steps recorded" in _verdict(bad, path).reasons


def test_a_record_edited_after_the_run_is_caught_by_its_fingerprint(tmp_path):
    rec, path = _conforming_proxy(tmp_path)
    rec["config"]["optimizer"]["lr"] = 1.0
    reasons = _verdict(rec, path).reasons
    assert any("does not match the record's fingerprint" in r for r in reasons)
    assert any(r.startswith("config: optimizer.lr = 1.0") for r in reasons)


def test_an_old_record_and_another_rows_name_do_not_conform(tmp_path):
    rec, path = _conforming_proxy(tmp_path)
    old = {k: v for k, v in rec.items() if k != "provenance"}
    assert any("run the row again" in r for r in _verdict(old, path).reasons)
    other = path.with_name(registry.get("llama3_8b/table1/128gpu_fsdp").fname + ".json")
    assert any(r.startswith("row: filed as") for r in _verdict(rec, other).reasons)


def test_throughput_above_the_peak_is_refused(tmp_path):
    rec, path = _conforming_proxy(tmp_path)
    rec["tokens_per_sec_per_device"] = 2 * rec["hardware"]["peak_flops"] / rec["flops_per_token"]
    assert any("above the" in r and "GFLOP/s peak" in r for r in _verdict(rec, path).reasons)


def test_a_deviating_record_never_replaces_a_conforming_one(tmp_path, monkeypatch):
    rec, path = _conforming_proxy(tmp_path)
    records = tmp_path / "results" / "records"
    monkeypatch.setattr(paths, "results_root", lambda: tmp_path / "results")
    filed = records / "proxy" / path.name
    filed.parent.mkdir(parents=True)
    filed.write_text(json.dumps(rec))
    smoke = copy.deepcopy(rec)
    smoke["config"]["model"]["flavor"] = "tiny"
    smoke["provenance"]["config_fingerprint"] = config_fingerprint(smoke["config"])
    run_result = tmp_path / "run" / "result.json"
    run_result.parent.mkdir()
    run_result.write_text(json.dumps(smoke))
    before = filed.read_bytes()
    dest, note = compliance.file_record(run_result, records, "proxy", path.stem)
    assert dest is None and "model.flavor" in note and filed.read_bytes() == before
    dest, note = compliance.file_record(run_result, records, "proxy", path.stem, deviating_ok=True)
    assert dest == filed and note is None and json.loads(filed.read_text())["config"]["model"]["flavor"] == "tiny"
    other = tmp_path / "mine"  # another records folder takes it
    assert compliance.file_record(run_result, other, "proxy", path.stem)[0] == other / "proxy" / path.name


# ------------------------------------------------------------------------------------ assets
@pytest.fixture
def private_assets(tmp_path, monkeypatch):
    """A copy of the assets the rows read, where TITAN_ASSETS points."""
    src = ROOT / "assets"
    root = tmp_path / "assets"
    for rel in ("MANIFEST.json", "tokenizer/llama3/tokenizer.model", "tokenizer/proxy_bpe_4k/tokenizer.model"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src / rel, root / rel)
    shutil.copytree(src / "c4_offline", root / "c4_offline")
    monkeypatch.setenv("TITAN_ASSETS", str(root))
    return root


ASSET_FILES = [
    "c4_offline/en/c4-train.00000-of-00004.json.gz",
    "c4_offline/en/c4-train.00002-of-00004.json.gz",
    "c4_offline/en/c4-validation.00000-of-00001.json.gz",
    "tokenizer/proxy_bpe_4k/tokenizer.model",
    "tokenizer/llama3/tokenizer.model",
    "MANIFEST.json",
]
MODES = {"proxy": (), "real": ("--mode", "real"), "slurm": ("--mode", "real", "--slurm")}


def _refused(out: Path, mode: str, *extra: str):
    res = invoke("run", ROW, *MODES[mode], "--out", str(out), *extra)
    assert not out.exists(), "nothing is written before the assets are verified"
    return res


@pytest.mark.parametrize("rel", ASSET_FILES)
def test_a_missing_asset_stops_every_mode_that_reads_it_before_anything_spawns(private_assets, tmp_path, rel):
    (private_assets / rel).unlink()
    reads = {"proxy": "llama3" not in rel, "real": "c4_offline" not in rel and "proxy" not in rel}
    reads["slurm"] = reads["real"]
    for mode in (m for m, read in reads.items() if read):
        res = _refused(tmp_path / f"run-{mode}", mode)
        assert res.exit_code == 2, (mode, res.output)
        assert Path(rel).name in res.output and "python -m core.data.assets" in res.output, (mode, res.output)


def _cut(path: Path, lines: int) -> None:
    path.write_text("".join(path.read_text().splitlines(keepends=True)[:lines]))


def test_a_cut_tokenizer_is_refused_even_with_a_manifest_to_match(private_assets, tmp_path):
    proxy_tok = private_assets / "tokenizer/proxy_bpe_4k/tokenizer.model"
    llama3_tok = private_assets / "tokenizer/llama3/tokenizer.model"
    _cut(proxy_tok, 2000)
    _cut(llama3_tok, 100_000)
    assert "changed since set-up" in _refused(tmp_path / "p", "proxy").output
    for mode in ("real", "slurm"):
        res = _refused(tmp_path / mode, mode)
        assert res.exit_code == 2 and "tokenizer/llama3/tokenizer.model has changed" in res.output, res.output
    # a manifest rewritten to the cut files: the shape (and Meta's sha256) still say no
    from core.data.store import file_sha256

    manifest = read_manifest(private_assets)["assets"]
    for key, path in (("proxy_tokenizer", proxy_tok), ("llama3_tokenizer", llama3_tok)):
        files = {str(path.relative_to(private_assets)): file_sha256(path)}
        update_manifest(private_assets, key, {**manifest[key], "files": files})
    res = _refused(tmp_path / "p2", "proxy")
    assert res.exit_code == 2 and "has 2256 ids with BOS 2000" in res.output, res.output
    res = _refused(tmp_path / "s2", "slurm")
    assert res.exit_code == 2 and "is not Meta's Llama 3 tokenizer" in res.output, res.output


def test_an_extra_corpus_shard_is_refused(private_assets, tmp_path):
    en = private_assets / "c4_offline" / "en"
    shutil.copyfile(en / "c4-train.00000-of-00004.json.gz", en / "c4-train.00004-of-00005.json.gz")
    res = _refused(tmp_path / "p", "proxy")
    assert res.exit_code == 2 and "c4-train.00004-of-00005.json.gz is not one of c4_offline's files" in res.output


def test_a_users_own_corpus_and_tokenizer_are_recorded_by_digest_not_refused(tmp_path):
    mine = tmp_path / "corpus" / "en"
    shutil.copytree(ROOT / "assets" / "c4_offline" / "en", mine)
    (mine / "c4-train.00000-of-00004.json.gz").unlink()
    tok = tmp_path / "my_tokenizer.model"
    shutil.copyfile(ROOT / "assets/tokenizer/proxy_bpe_4k/tokenizer.model", tok)
    sets = ["data.path=" + str(mine.parent), "tokenizer.path=" + str(tok)]
    cfg = registry.resolve_config(registry.get(ROW), "proxy", sets, check_files=True)  # not refused
    assert cfg.job.deviations == ["tokenizer.path", "data.path"]
    prov = provenance(cfg)
    data, token = prov["assets"]["data"], prov["assets"]["tokenizer"]
    assert data["asset"] is None and len(data["files"]) == 4 and len(data["digest"]) == 64
    assert token["asset"] is None and token["sha256"] == compliance.PINNED_ASSETS["proxy_tokenizer"]


# --------------------------------------------------------------------------------- the CLI
@pytest.mark.slow
def test_a_smoke_run_leaves_the_tables_as_they_were_and_fails_the_check(tmp_path, monkeypatch):
    """The README's smoke pattern: its record stays in its run folder, `results` writes the same
    bytes, and `check` names each key it changed; the published row's record passes."""
    from recipes.report import results

    results_dir = tmp_path / "results"
    committed_records(results_dir / "records")
    monkeypatch.setattr(paths, "results_root", lambda: results_dir)
    results.write_results(results_dir / "records", results_dir)
    before = {p.name: p.read_bytes() for p in results_dir.glob("table1.*")}
    res = invoke("run", ROW, *SMOKE, "--out", str(tmp_path / "smoke"), "--records-dir", str(results_dir / "records"))
    assert res.exit_code == 0, res.output
    assert "not filed over the conforming" in res.output
    results.write_results(results_dir / "records", results_dir)
    assert {p.name: p.read_bytes() for p in results_dir.glob("table1.*")} == before
    res = invoke("check", str(tmp_path / "smoke" / "result.json"))
    assert res.exit_code == 1
    for key in ("model.flavor", "training.seq_len", "training.steps"):
        assert f"config: {key} = " in res.output
    published = results_dir / "records" / "proxy" / (registry.get(ROW).fname + ".json")
    res = invoke("check", str(published))
    assert res.exit_code == 0 and res.output.startswith("ok"), res.output


def test_check_exits_zero_only_when_all_conform(tmp_path):
    records = committed_records(tmp_path / "records")
    res = invoke("check", "--records-dir", str(records))
    assert res.exit_code == 0, res.output[-2000:]
    assert f"{2 * len(registry.all_recipes())} of {2 * len(registry.all_recipes())} records conform" in res.output
    victim = next((records / "proxy").glob("*.json"))
    rec = json.loads(victim.read_text())
    rec["versions"]["git_dirty"] = True
    victim.write_text(json.dumps(rec))
    res = invoke("check", "--records-dir", str(records))
    assert res.exit_code == 1 and f"FAIL  {victim}" in res.output and "had uncommitted changes" in res.output
    assert invoke("check", str(tmp_path / "nope.json")).exit_code == 2


def test_git_state_of_this_checkout_is_named():
    """The records of this checkout name its commit (the tree's state is what it is)."""
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    from core.provenance import git_state

    if out.returncode == 0:
        assert git_state()["git"] == out.stdout.strip()


def test_tables_leave_out_what_does_not_conform_and_say_so(tmp_path):
    """`results` fills its cells from conforming records; a deviating one is listed with its
    reasons, or (--include-deviating) shown with its row marked and the reasons in its notes."""
    import pandas as pd

    from recipes.report import results
    from tests.records import conforming

    good = conforming({"recipe": ROW, "mode": "proxy", "tokens_per_sec_per_device": 500.0, "losses": [7.0]})
    bad = conforming({"recipe": "llama3_8b/table1/8gpu_fsdp_compile", "mode": "proxy", "losses": [7.0]})
    bad["tokens_per_sec_per_device"] = 3083.0
    bad["config"]["model"]["flavor"] = "tiny"
    bad["provenance"]["config_fingerprint"] = config_fingerprint(bad["config"])
    records = tmp_path / "records"
    for rec in (good, bad):
        path = records / "proxy" / (registry.get(rec["recipe"]).fname + ".json")
        path.parent.mkdir(parents=True, exist_ok=True)
        rec.setdefault("hardware", {}).setdefault("device", "test-cpu")
        for key in ("world_size", "mfu", "peak_memory_gib", "toggles_applied"):
            rec.setdefault(key, [] if key == "toggles_applied" else 1)
        path.write_text(json.dumps(rec))
    out = tmp_path / "out"
    results.write_results(records, out)
    t1 = pd.read_csv(out / "table1.csv").set_index("recipe")
    assert t1.loc[ROW, "ours TPS/device"] == 500.0
    assert pd.isna(t1.loc[bad["recipe"], "ours TPS/device"])  # left out, not shown
    readme, md = (out / "README.md").read_text(), (out / "table1.md").read_text()
    for text in (readme, md):
        assert "Records not counted" in text or "not a conforming run" in text
        assert 'config: model.flavor = "tiny", the row\'s is "debug"' in text
    results.write_results(records, out, include_deviating=True)
    t1 = pd.read_csv(out / "table1.csv").set_index("recipe")
    assert t1.loc[bad["recipe"], "ours TPS/device"] == 3083.0
    assert t1.loc[bad["recipe"], "row"].endswith("≠") and not t1.loc[ROW, "row"].endswith("≠")
    assert "model.flavor" in t1.loc[bad["recipe"], "ours notes"]
    assert "shown by `--include-deviating`" in (out / "table1.md").read_text()


def test_a_corpus_too_large_to_hash_is_known_by_its_shards_sizes(tmp_path, monkeypatch):
    """A local copy of C4 (~300 GB) is not hashed at every run's end: names and sizes stand in."""
    from core.data import verify

    monkeypatch.setattr(verify, "HASH_LIMIT_BYTES", 0)
    files, kind = verify.corpus_files(ROOT / "assets" / "c4_offline")
    assert kind == "size" and all(v.isdigit() for v in files.values()) and len(files) == 5
