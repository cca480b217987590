"""The software a prediction speaks for (core/dryrun/software.py): the rules that derive what a
software stack does differently from its versions and dates, --software, and the dry-run's line."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from core.dryrun import software as S
from core.dryrun.stack import THIS_TRAINER


def test_this_trainer_is_the_pinned_stack():
    assert S.PINNED.stack() == THIS_TRAINER
    assert "torch 2.13.0" in S.PINNED.text() and S.PINNED.trainer == S.THIS_TRAINER_NAME


@pytest.mark.parametrize(
    ("sw", "field", "expected"),
    [
        # torchtitan's nn.RMSNorm (2025-03-19) on a torch with the fused kernel (2.9, nightlies from 2025-08-03)
        (S.Software("2025-08-29", torch="nightly of Aug 2025"), "fused_rms_norm", True),
        (S.Software("2025-08", torch="2.9.0.dev20250815+cu128"), "fused_rms_norm", True),
        (S.Software("2025-07-01"), "fused_rms_norm", False),  # 2.7.0, its date's release
        (S.Software("2025-02-01", torch="2.9.0"), "fused_rms_norm", False),  # torchtitan's own norm then
        # cuDNN attention: torch 2.5.0 / nightlies of Jul-Oct 2024, and torchtitan from 2025-10-09
        (S.Software("2024-10-20", torch="2.5.0"), "cudnn_attention", True),
        (S.Software("2024-11-01", torch="2.5.1"), "cudnn_attention", False),
        (S.Software("2024-09", torch="2.6.0.dev20240901"), "cudnn_attention", True),
        (S.Software("2024-09"), "cudnn_attention", False),  # 2.4.0, its date's release
        (S.Software("2025-08-11", torch="2.9.0.dev20250811"), "cudnn_attention", False),  # flash forced on H100
        (S.Software("2025-10-26"), "cudnn_attention", True),
        (S.Software("2025-10-26"), "sac_recomputes_attention", True),
        (S.Software("2025-12-02"), "sac_recomputes_attention", False),
        # SDPA's own choice again where its cuDNN passes 9.15.0: the torch 2.11 wheels (this
        # trainer asks SDPA for no backend; torchtitan forced flash on H100 from 2025-05-14)
        (S.Software("2026-11-27", trainer="titan-recipes", torch="2.11.0+cu130"), "cudnn_attention", True),
        (S.Software("2026-02", trainer="titan-recipes", torch="2.10.0"), "cudnn_attention", False),
        (S.Software("2026-02", trainer="titan-recipes", torch="2.10.0", cudnn="9.15.1"), "cudnn_attention", True),
        (S.Software("2026-05", trainer="titan-recipes", torch="2.11.0", cudnn="9.10.2"), "cudnn_attention", False),
        (S.Software("2026-04", trainer="titan-recipes"), "cudnn_attention", True),  # 2.11.0, its date's release
        (S.Software("2025-08-11", torch="2.11.0"), "cudnn_attention", False),
        (S.Software("2026-11-27", trainer="titan-recipes", torch="2.11.0+cu130"), "sac_recomputes_attention", False),
        # FSDP2 kept the root gathered before torch 2.8 (pytorch PR 154704, June 2025)
        (S.Software("2025-03", torch="2.7.0a0+gitb98af95"), "root_kept_gathered", True),
        (S.Software("2025-06", torch="2.8.0a0+5228986c39"), "root_kept_gathered", False),
        (S.Software("2025-09", torch="2.7.1"), "root_kept_gathered", True),
        (S.Software("2025-02-23"), "adamw_foreach", True),
        (S.Software("2025-02-24"), "adamw_foreach", False),
    ],
)
def test_each_mechanism_is_decided_by_the_versions(sw, field, expected):
    assert getattr(sw.stack(), field) is expected


def test_software_text_names_what_was_not_stated():
    assert "torch 2.4.0 (not stated: its date's release)" in S.Software("2024-09").text()
    assert S.Software("2025-08-11", torch="2.9.0.dev20250811+rocm6.4", rocm="6.4").short().endswith("ROCm 6.4")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("torch=2.7.0", "date=YYYY-MM is required"),
        ("date=2025-03,cublas=12", "not KEY=VALUE with KEY one of"),
        ("date=March", "is not YYYY-MM"),
        ("date=2025-03,torch", "not KEY=VALUE"),
    ],
)
def test_bad_software_is_refused_naming_the_key(text, error):
    with pytest.raises(ValueError, match=error):
        S.parse(text)


def test_dry_run_names_the_software_and_takes_another(tmp_path):
    """The dry-run's last line names the software its prediction stands for; --software asks for
    another stack's (here torchtitan of Oct 2025: cuDNN attention and the fused RMSNorm make the
    same eager row faster), and a bad one is refused before anything runs."""
    from recipes.cli import main

    def dry(*extra: str) -> tuple[str, dict]:
        out = tmp_path / str(len(list(tmp_path.iterdir())))
        args = ["run", "llama3_8b/table1/8gpu_fsdp", "--mode", "dry-run", "--out", str(out), *extra]
        res = CliRunner().invoke(main, [*args, "--set", "training.local_batch_size=1"], catch_exceptions=False)
        assert res.exit_code == 0, res.output
        return res.output, json.loads((out / "result.json").read_text())

    text, ours = dry()
    last = [line.strip() for line in text.splitlines() if line.strip().startswith("software:")]
    assert last and "titan-recipes" in last[0] and "torch 2.13.0" in last[0]
    text, theirs = dry("--software", "date=2025-10-26")
    assert "torchtitan of 2025-10-26" in text
    assert theirs["software"]["stack"]["cudnn_attention"] and theirs["software"]["stack"]["fused_rms_norm"]
    assert theirs["predicted"]["tokens_per_sec_per_gpu"] > ours["predicted"]["tokens_per_sec_per_gpu"] * 1.05
    bad = CliRunner().invoke(
        main, ["run", "llama3_8b/table1/8gpu_fsdp", "--mode", "proxy", "--software", "date=2025-01"]
    )
    assert bad.exit_code != 0 and "--software are for --mode dry-run" in bad.output


def test_torchtitans_chunked_loss_holds_one_chunk_of_logits():
    """torchtitan's Llama 3 configs chunk the loss from PR 3779 (2026-06-26): the head holds one
    chunk's logits and an fp32 [T, D] gradient buffer instead of every logit."""
    from core.dryrun.activations import chunked, head_memory, shapes
    from tests.test_estimate import small_cfg

    assert S.Software("2026-06-25").stack().loss_chunks == 0 and S.Software("2026-08-05").stack().loss_chunks == 8
    cfg = small_cfg("parallelism.dp_shard=2", world=2)
    s = shapes(cfg)
    whole, parts = head_memory(cfg, s), chunked(head_memory(cfg, s), 8, s)
    assert parts["logits"] == whole["logits"] / 8
    assert parts["loss_bwd_work"] == whole["loss_bwd_work"] / 8 + 4 * s.tokens * s.d
    assert parts["saved"] < whole["saved"] and chunked(whole, 0, s) == whole


def test_plan_sizes_and_predicts_for_the_software_asked():
    """`plan` names the software its estimates and predictions speak for (text and JSON), and
    --software sizes for another: torchtitan of Oct 2024 keeps FSDP's root gathered (torch before
    2.8), so the same layout needs more memory; a bad one is refused before any estimate."""
    from recipes.cli import main

    args = ["plan", "--model", "8B", "--gpus", "8", "--local-batch", "1", "--no-compile", "--gpu-mem", "95"]

    def fsdp8(*extra: str) -> dict:
        res = CliRunner().invoke(main, [*args, "--json", *extra], catch_exceptions=False)
        assert res.exit_code == 0, res.output
        return next(c for c in json.loads(res.output) if c["layout"] == "FSDP 8" and c["ac"] == "none")

    ours, theirs = fsdp8(), fsdp8("--software", "date=2024-10-01")
    assert ours["software"] == S.PINNED.text() and theirs["software"].startswith("torchtitan of 2024-10-01")
    assert theirs["estimate_gib"] > ours["estimate_gib"] + 1.0  # the gathered root: embedding and output
    assert theirs["tokens_per_sec_per_gpu"] != ours["tokens_per_sec_per_gpu"]
    text = CliRunner().invoke(main, [*args, "--top", "1", "--software", "date=2024-10-01"]).output
    assert "Software: the predictions speak for torchtitan of 2024-10-01" in text
    bad = CliRunner().invoke(main, [*args, "--software", "date=2024-10,gpu=h100"])
    assert bad.exit_code == 2 and "--software" in bad.output and "gpu=h100" in bad.output


def test_a_dry_run_for_older_software_runs_its_config_defaults_unless_set():
    """--software's config defaults come before --set's: torchtitan before PR 881 (2025-02-24) ran
    foreach AdamW, as the validation models its figures; a `--set` of the kernel still wins. The
    layouts `plan --software` sizes have the same default."""
    from recipes import registry
    from recipes.modes import DryRunMode, RunOptions

    row = registry.get("llama3_8b/table1/8gpu_fsdp")

    def kernel(software: str | None, *sets: str) -> str:
        return DryRunMode(RunOptions(software=software)).resolve(row, sets).optimizer.implementation

    assert kernel(None) == kernel("date=2025-03") == "fused"
    assert kernel("date=2024-09") == "foreach"
    assert kernel("date=2024-09", 'optimizer.implementation="for-loop"') == "for-loop"
    from recipes.plan import layouts  # plan --software sizes each layout with the same defaults

    def planned(stack) -> str:
        degrees = {"dp_shard": 8, "tp": 1, "pp": 1, "cp": 1}
        cfg = layouts._layout_config("8B", 8192, 1, degrees, 8, ("selective", "op"), False, False, stack)
        return cfg.optimizer.implementation

    assert planned(S.parse("date=2024-09").stack()) == "foreach" and planned(S.PINNED.stack()) == "fused"


def test_the_tables_records_name_the_software_their_predictions_speak_for(tmp_path, monkeypatch):
    """`dry-run-table --all --software S` makes each row's record as `run --mode dry-run --software
    S` would (S's config defaults, S's stack), `--predict` keeps the record's own software, and a
    table's notes name it; a bad S is refused before any dry-run."""
    import pandas as pd

    from recipes import paths, registry
    from recipes.cli import main
    from recipes.report import results

    row = registry.get("llama3_8b/table1/8gpu_fsdp")
    monkeypatch.setattr(registry, "all_recipes", lambda: [row])
    monkeypatch.setattr(paths, "default_runs_dir", lambda: tmp_path / "runs")
    records, out = tmp_path / "records", tmp_path / "out"
    args = ["dry-run-table", "--records", str(records), "--out", str(out), "--no-fake"]
    bad = CliRunner().invoke(main, [*args, "--all", "--software", "date=2024-09,gpu=h100"])
    assert bad.exit_code == 2 and "gpu=h100" in bad.output and not records.exists()
    res = CliRunner().invoke(main, [*args, "--all", "--software", "date=2024-09"], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    path = records / "dry-run" / f"{row.fname}.json"
    rec = json.loads(path.read_text())
    assert rec["software"]["text"].startswith("torchtitan of 2024-09")
    assert rec["config"]["optimizer"]["implementation"] == "foreach" and not rec["software"]["stack"]["cudnn_attention"]
    from recipes.report import compliance  # the row as that software runs it: no deviation

    assert rec["config"]["job"]["deviations"] == []
    assert not [r for r in compliance.check_file(path).reasons if r.startswith("config")]
    rec_fused = {**rec, "software": {**rec["software"], "stack": {}}}  # the same config, claimed as ours
    assert any("optimizer.implementation" in r for r in compliance.check(rec_fused, path).reasons)
    before = rec["predicted"]["tokens_per_sec_per_gpu"]
    rec["predicted"] = {}
    path.write_text(json.dumps(rec))
    assert CliRunner().invoke(main, [*args, "--predict"], catch_exceptions=False).exit_code == 0
    rec = json.loads(path.read_text())
    assert rec["predicted"]["tokens_per_sec_per_gpu"] == before  # for its own software
    df = pd.DataFrame({"recipe": [row.id]})
    assert results._software(df, {(row.id, "dry-run"): rec}) == rec["software"]["text"]
    rec.pop("software")
    assert "software not named" in results._software(df, {(row.id, "dry-run"): rec})
