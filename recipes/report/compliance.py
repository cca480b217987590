"""Whether a record is a conforming run of its row: the one check `run-recipe check`, the tables
(`run-recipe results`) and the filing of a new record in results/records/ all use. MLPerf
Training's compliance checker is the model: a result counts when its record shows the row's
configuration, the row's data, the full run, by known code on the pinned versions, with figures
the hardware could reach. Each failed test is one line of reasons; none means it conforms.

The record's own claims (its `provenance.deviations`) are not trusted: the configuration it
names is compared again with the row's, the asset digests with the pinned ones, and the
fingerprint with the configuration."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from core import run_folder
from core.config import flatten_keys
from core.data.verify import HUB_C4, project_asset
from core.data.verify import PINNED as PINNED_ASSETS
from core.dryrun.gpuspec import DEFAULT_GPU
from core.dryrun.stack import config_settings
from core.errors import ConfigError
from core.provenance import config_fingerprint
from core.versions import PINNED as PINNED_VERSIONS
from core.versions import base_version
from recipes import paths, registry
from recipes.report.table_data import RecordError, check_record
from recipes.schema import MODES, Recipe, RecipeError

RAN = ("proxy", "real")  # modes whose records trained: steps, data and figures to check


@dataclass
class Verdict:
    """One record's check: `reasons` (one line each) is empty when it conforms."""

    path: Path
    record: dict | None = None
    reasons: list[str] = field(default_factory=list)
    deviations: list[str] = field(default_factory=list)  # the config keys among the reasons

    @property
    def conforms(self) -> bool:
        return not self.reasons


def check_file(path: str | Path) -> Verdict:
    """The verdict on the record at `path`: filed as <mode>/<id__>.json, or a run folder's
    result.json."""
    path = Path(path)
    filed = path.parent.name in MODES
    try:
        rec = check_record(path, filed)  # JSON, types, the mode's fields
    except RecordError as e:
        return Verdict(path, None, [f"schema: {str(e).removeprefix(f'{path}: ')}"])
    return check(rec, path, filed)


def check(rec: dict, path: Path, filed: bool = True) -> Verdict:
    """Every test of a parsed record, each failure a reason."""
    v = Verdict(path, rec)
    try:
        recipe = registry.get(rec["recipe"])
    except RecipeError as e:
        v.reasons.append(f"row: {e}")
        return v
    if filed and path.stem != recipe.fname:
        v.reasons.append(f"row: filed as {path.name}, the row's record is {recipe.fname}.json")
    prov, config = rec.get("provenance"), rec.get("config")
    if not isinstance(prov, dict) or not isinstance(config, dict):
        v.reasons.append(
            "schema: no 'provenance' or 'config' (a record made before records named what they were made "
            "from): run the row again"
        )
        return v
    # a dry-run for another software: the row as that software configures it by default
    defaults = config_settings(((rec.get("software") or {}).get("stack")) or {})
    _check_config(v, recipe, rec["mode"], config, prov, defaults)
    _check_code(v, rec.get("versions") or {})
    if rec["mode"] in RAN:
        _check_run(v, config, rec)
        _check_assets(v, recipe, rec["mode"], prov.get("assets") or {})
        _check_figures(v, rec)
    elif (rec.get("predicted") or {}).get("gpu") not in (None, DEFAULT_GPU):
        v.reasons.append(f"dry-run: predicted on {rec['predicted']['gpu']}, the tables' GPU is {DEFAULT_GPU}")
    return v


def _check_config(v: Verdict, recipe: Recipe, mode: str, config: dict, prov: dict, defaults: list[str]) -> None:
    if prov.get("config_fingerprint") != config_fingerprint(config):
        v.reasons.append("config: the configuration does not match the record's fingerprint (edited after the run)")
    try:
        keys = registry.deviations(recipe, mode, config, prov.get("assets"), defaults)
        canonical = flatten_keys(registry.resolve_config(recipe, mode, defaults=defaults).to_dict())
    except ConfigError as e:
        v.reasons.append(f"config: the row's {mode} configuration cannot be resolved: {e}")
        return
    ours = flatten_keys(config)
    for key in keys:
        theirs = "another file" if key.endswith(".path") else json.dumps(ours.get(key))
        v.reasons.append(f"config: {key} = {theirs}, the row's is {json.dumps(canonical.get(key))}")
    v.deviations = keys


def _check_code(v: Verdict, versions: dict) -> None:
    if not versions.get("git"):
        v.reasons.append("code: the record names no commit")
    elif versions.get("git_dirty") is not False:
        what = "had uncommitted changes" if versions.get("git_dirty") else "is not known to have been clean"
        v.reasons.append(f"code: the tree at {versions['git']} {what}")
    for name, pinned in PINNED_VERSIONS.items():
        have = versions.get(name)
        if have is None and name == "torch":
            v.reasons.append("versions: the record names no torch version")
        elif have is not None and base_version(str(have)) != pinned:
            v.reasons.append(f"versions: {name} {have}, the suite pins {pinned}")


def _check_run(v: Verdict, config: dict, rec: dict) -> None:
    want = (config.get("training") or {}).get("steps")
    done = rec.get("start_step", 0) + rec["steps"]
    if done != want or len(rec["losses"]) != rec["steps"]:
        v.reasons.append(f"run: {done} of the configuration's {want} steps recorded")


def _check_assets(v: Verdict, recipe: Recipe, mode: str, assets: dict) -> None:
    """The tokenizer and data read, by digest, against the row's pinned assets."""
    canonical = registry.resolve_config(recipe, mode)
    data, tok = assets.get("data") or {}, assets.get("tokenizer") or {}
    if canonical.data.dataset == "c4_offline":
        row_corpus = project_asset(canonical.data.path, "corpus")
        if row_corpus and data.get("digest") != PINNED_ASSETS[row_corpus]:
            v.reasons.append(
                f"data: the corpus read (digest {str(data.get('digest'))[:12]}) is not the row's {row_corpus}"
            )
    elif canonical.data.dataset == "c4" and data.get("name") != HUB_C4:
        v.reasons.append(f"data: {data.get('name')!r} read, the row streams {HUB_C4}")
    row_tok = project_asset(canonical.tokenizer.path, "tokenizer")
    if canonical.data.dataset != "synthetic" and row_tok and tok.get("sha256") != PINNED_ASSETS[row_tok]:
        v.reasons.append(f"data: the tokenizer read (sha256 {str(tok.get('sha256'))[:12]}) is not the row's {row_tok}")


def _check_figures(v: Verdict, rec: dict) -> None:
    """MFU against the peak of the kernels that ran, and within what that peak allows."""
    hw = rec.get("hardware") or {}
    peak, per_token, tps = hw.get("peak_flops"), rec.get("flops_per_token"), rec.get("tokens_per_sec_per_device")
    if "peak_gemm_route" not in hw:
        v.reasons.append("figures: the record does not name the GEMM route of its MFU's peak: run the row again")
    elif hw["peak_gemm_route"] is not None and hw["peak_gemm_route"] != hw.get("bf16_gemm"):
        v.reasons.append(
            f"figures: MFU against a peak measured on the {hw['peak_gemm_route']} GEMM route, "
            f"the steps ran the {hw.get('bf16_gemm')} route"
        )
    if isinstance(rec.get("mfu"), (int, float)) and rec["mfu"] > 1:
        v.reasons.append(f"figures: MFU {rec['mfu']:.1%} is above 100%")
    if all(isinstance(x, (int, float)) and x > 0 for x in (peak, per_token, tps)) and tps * per_token > peak:
        v.reasons.append(
            f"figures: {tps:,.0f} tokens/s/device needs {tps * per_token / 1e9:,.1f} GFLOP/s, "
            f"above the {peak / 1e9:,.1f} GFLOP/s peak"
        )


def check_folder(records_dir: str | Path) -> list[Verdict]:
    """The verdict on every record filed in <records_dir>/<mode>/*.json."""
    return [check_file(p) for p in sorted(Path(records_dir).glob("*/*.json"))]


def conforming(path: str | Path) -> bool:
    return Path(path).is_file() and check_file(path).conforms


def file_record(
    result: Path, records_dir: Path | None, mode: str, name: str, deviating_ok: bool = False
) -> tuple[Path | None, str | None]:
    """A run's record copied to <records_dir>/<mode>/<name>.json, unless it does not conform
    and would replace a conforming one in the project's own records (results/records/): a smoke
    run never rewrites a published row. Returns (where it was filed or None, a note why not).
    Another --records-dir, or `deviating_ok` (run's --record-deviating), files it regardless."""
    if records_dir is None:
        return None, None
    dest = Path(records_dir) / mode / f"{name}.json"
    if not deviating_ok and Path(records_dir).resolve() == paths.default_records_dir().resolve():
        verdict = check_file(result)
        if not verdict.conforms and conforming(dest):
            why = "; ".join(verdict.reasons[:4]) + ("; ..." if len(verdict.reasons) > 4 else "")
            return None, (
                f"not filed over the conforming {paths.relative(dest)}: this run is not the row as published "
                f"({why}); its record stays in {result} (--records-dir DIR files it elsewhere, "
                "--record-deviating here)"
            )
    return run_folder.copy_record(result, records_dir, mode, name), None


def counted(records: dict, include_deviating: bool = False) -> tuple[dict, list[str]]:
    """What the tables may show of `records` ({(id, mode): record}, as table_data.load_records
    reads them): the conforming records; with `include_deviating` the others too, each marked
    with its reasons (`_not_conforming`). Returns (those records, a line for each one left out)."""
    kept, left_out = {}, []
    for key, rec in records.items():
        verdict = check(rec, Path(rec["_path"]))
        if verdict.conforms:
            kept[key] = rec
        elif include_deviating:
            kept[key] = {**rec, "_not_conforming": verdict.reasons}
        else:
            left_out.append(f"{paths.relative(verdict.path)}: " + "; ".join(verdict.reasons))
    return kept, left_out
