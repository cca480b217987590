"""Discovers the recipe rows: every `<package>/<table>/<name>.toml` of the four recipe packages.

Merge order of one row (later wins; tables merge key by key, lists and values replace):

    recipes/defaults.toml              suite-wide (data set, tokenizer, mixed precision, proxy basics)
    <package>/defaults.toml            the model's shared setup
    <package>/<table>/defaults.toml    the table's shared setup
    <package>/<table>/<name>.toml      the row

Every layer may hold `[paper]`, `[paper.config.*]`, `[proxy.config.*]`, `[requires]`,
`[reference]`; `id`, `title`, `row`, `order`, `effect` belong to the row file only. Files are
read through importlib.resources, so an installed wheel works like the source tree.
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import os
from importlib import resources
from pathlib import Path

import tomllib

from core.config import JobConfig, Mode, apply_dict, flatten_keys
from core.data.store import default_assets_root
from core.data.verify import project_asset
from core.errors import ConfigError
from core.overrides import parse_override
from core.provenance import RUN_LOCAL_KEYS
from core.validate import validate
from recipes.paths import project_root
from recipes.schema import REFERENCE_KEYS, TABLES, TOP_KEYS, Recipe, RecipeError, deep_merge

PACKAGES = ("llama3_8b", "llama3_70b", "llama3_405b", "long_context")
DEFAULTS = "defaults.toml"
ROW_ONLY = ("id", "title", "row", "order", "effect")
_ABSENT = object()


def _read(trav, where: str) -> dict:
    try:
        return tomllib.loads(trav.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise RecipeError(f"{where}: cannot parse: {e}") from None


def _defaults(trav, where: str) -> dict:
    if not trav.is_file():
        return {}
    data = _read(trav, where)
    bad = [k for k in ROW_ONLY if k in data]
    if bad:
        raise RecipeError(f"{where}: {', '.join(bad)} belong in row files, not in defaults")
    return data


def _build(data: dict, where: str) -> Recipe:
    unknown = set(data) - TOP_KEYS
    if unknown:
        raise RecipeError(f"{where}: unknown keys {sorted(unknown)} (valid: {sorted(TOP_KEYS)})")
    for key in ("id", "title", "table", "row", "techniques"):
        if key not in data:
            raise RecipeError(f"{where}: missing {key!r}")
    if data["table"] not in TABLES:
        raise RecipeError(f"{where}: table {data['table']!r} is not one of: {', '.join(TABLES)}")
    paper, proxy = data.get("paper", {}), data.get("proxy", {})
    if set(paper) - {"gpus", "gpus_per_node", "config"}:
        raise RecipeError(f"{where}: [paper] takes gpus, gpus_per_node, config")
    if set(proxy) - {"config"}:
        raise RecipeError(f"{where}: [proxy] takes config only")
    for key in ("gpus", "gpus_per_node"):
        if not isinstance(paper.get(key), int) or paper[key] < 1:
            raise RecipeError(f"{where}: paper.{key} must be a positive integer")
    reference = data.get("reference", {})
    if set(reference) - set(REFERENCE_KEYS):
        raise RecipeError(f"{where}: unknown reference keys {sorted(set(reference) - set(REFERENCE_KEYS))}")
    requires = {k: tuple(v) for k, v in data.get("requires", {}).items()}
    recipe = Recipe(
        id=data["id"],
        title=data["title"],
        table=data["table"],
        row=data["row"],
        techniques=tuple(data["techniques"]),
        gpus=paper["gpus"],
        gpus_per_node=paper["gpus_per_node"],
        paper_config=paper.get("config", {}),
        proxy_config=proxy.get("config", {}),
        reference=reference,
        requires=requires,
        baseline=data.get("baseline"),
        effect=data.get("effect", ""),
        notes=data.get("notes", ""),
        order=data.get("order", 0),
        source=where,
    )
    if recipe.world("real") != recipe.gpus:
        raise RecipeError(
            f"{where}: paper degrees {recipe.degrees('real')} multiply to "
            f"{recipe.world('real')}, not paper.gpus = {recipe.gpus}"
        )
    return recipe


@functools.cache
def _load() -> dict[str, Recipe]:
    suite = _defaults(resources.files("recipes") / DEFAULTS, "recipes/defaults.toml")
    found: dict[str, Recipe] = {}
    for pkg in PACKAGES:
        root = resources.files(pkg)
        pkg_defaults = deep_merge(suite, _defaults(root / DEFAULTS, f"{pkg}/{DEFAULTS}"))
        for table_dir in sorted((d for d in root.iterdir() if d.is_dir()), key=lambda d: d.name):
            if table_dir.name.startswith(("_", ".")):
                continue
            table_defaults = deep_merge(
                pkg_defaults, _defaults(table_dir / DEFAULTS, f"{pkg}/{table_dir.name}/{DEFAULTS}")
            )
            for f in sorted(table_dir.iterdir(), key=lambda f: f.name):
                if not f.is_file() or not f.name.endswith(".toml") or f.name == DEFAULTS:
                    continue
                where = f"{pkg}/{table_dir.name}/{f.name}"
                row = _read(f, where)
                expected = where[: -len(".toml")]
                if row.get("id") != expected:
                    raise RecipeError(f"{where}: id {row.get('id')!r} must be its path {expected!r}")
                recipe = _build(deep_merge(table_defaults, row), where)
                if recipe.table != table_dir.name:
                    raise RecipeError(f"{where}: table {recipe.table!r} must be its folder {table_dir.name!r}")
                if recipe.id in found:
                    raise RecipeError(f"{where}: duplicate id {recipe.id}")
                found[recipe.id] = recipe
    for r in found.values():
        if r.baseline and r.baseline not in found:
            raise RecipeError(f"{r.source}: baseline {r.baseline!r} is not a recipe id")
    return found


def all_recipes() -> list[Recipe]:
    """Every row in paper order: by table, then by the row's `order` in it."""
    return sorted(_load().values(), key=lambda r: (TABLES.index(r.table), r.order, r.id))


def by_table(table: str) -> list[Recipe]:
    if table not in TABLES:
        raise RecipeError(f"unknown table {table!r}; tables: {', '.join(TABLES)}")
    return [r for r in all_recipes() if r.table == table]


def get(recipe_id: str) -> Recipe:
    recipes = _load()
    key = recipe_id.strip().removesuffix(".toml").strip("/")
    if key in recipes:
        return recipes[key]
    ids = list(recipes)
    close = difflib.get_close_matches(key, ids, n=5, cutoff=0.6)
    close += [i for i in ids if key and key in i and i not in close][: 5 - len(close)]
    hint = ("; did you mean: " + ", ".join(close)) if close else "; see `run-recipe list --ids`"
    raise RecipeError(f"unknown recipe {recipe_id!r}{hint}")


def select(patterns: list[str] | tuple[str, ...] = (), table: str | None = None) -> list[Recipe]:
    """Ids (exact, or shell patterns such as `llama3_8b/table1/*`) plus every row of `table`."""
    chosen: list[Recipe] = []
    for pat in patterns:
        if any(c in pat for c in "*?["):
            hits = [r for r in all_recipes() if fnmatch.fnmatchcase(r.id, pat)]
            if not hits:
                raise RecipeError(f"no recipe matches {pat!r}; see `run-recipe list --ids`")
            chosen += hits
        else:
            chosen.append(get(pat))
    if table:
        chosen += by_table(table)
    unique: dict[str, Recipe] = {}
    for r in chosen:
        unique.setdefault(r.id, r)  # each id once, where it first came
    return list(unique.values())


def table_info() -> dict[str, dict]:
    """Titles and captions of the paper tables (recipes/tables.toml)."""
    return _read(resources.files("recipes") / "tables.toml", "recipes/tables.toml")


# ------------------------------------------------------------------ a row's config for a mode
def _resolve_paths(cfg: JobConfig) -> None:
    """Relative paths: `assets/...` where set-up built the assets ($TITAN_ASSETS, else the
    checkout's assets/); others as given if they exist from the working directory, else under
    the project root."""
    for obj, key in ((cfg.tokenizer, "path"), (cfg.data, "path"), (cfg.checkpoint, "resume_from")):
        value = getattr(obj, key)
        if value and not os.path.isabs(value):
            p = Path(value)
            if p.parts[0] == "assets":
                setattr(obj, key, str(default_assets_root().resolve().joinpath(*p.parts[1:])))
            else:
                setattr(obj, key, str(p.resolve() if p.exists() else project_root() / p))


# Keys the command line sets for a row, with what sets them: a `--set` of one would run one
# thing and file a record saying another (a proxy labelled dry-run, another row's id).
CLI_OWNED_KEYS = {
    "job.mode": "--mode",
    "job.recipe": "the recipe id",
    "job.output_dir": "--out",
    "job.deviations": "the --set keys that change the row",
}


def resolve_config(
    recipe: Recipe,
    mode: Mode,
    overrides: list[str] | tuple[str, ...] = (),
    check_files: bool = False,
    defaults: list[str] | tuple[str, ...] = (),
) -> JobConfig:
    """Recipe overlay for the mode <- `defaults` <- `--set` overrides, validated (ConfigError names
    the key); `job.deviations` lists the keys where the overrides change the row. `defaults`: where
    another software's defaults differ (a dry-run's --software, core/dryrun/stack.py
    config_settings): the row as that software runs it, not a deviation."""
    cfg = recipe.job_config(mode)
    for text in [*defaults, *overrides]:
        section, key, value = parse_override(text)
        owner = CLI_OWNED_KEYS.get(f"{section}.{key}")
        if owner:
            raise ConfigError(f"{section}.{key} is not a --set key: the command line sets it (use {owner})")
        apply_dict(cfg, {section: {key: value}}, "--set")
    _resolve_paths(cfg)
    cfg = validate(cfg, check_files=check_files)
    if overrides:  # the keys where this run is not the row as published (into its record)
        cfg.job.deviations = deviations(recipe, mode, cfg.to_dict(), defaults=defaults)
    return cfg


def deviations(
    recipe: Recipe, mode: Mode, config: dict, assets: dict | None = None, defaults: list[str] | tuple[str, ...] = ()
) -> list[str]:
    """The keys where `config` (a resolved config as a dict, e.g. a record's) differs from the
    row's configuration for `mode`, in the config's key order. Where a run lives (its folder, the
    assets' paths) is not compared: an asset path counts when it names another file than the
    row's, told by which project asset it is (`assets`: a record's own names for them, read where
    the paths are another machine's; else looked up here). `defaults`: as resolve_config's."""
    canonical = flatten_keys(resolve_config(recipe, mode, defaults=defaults).to_dict())
    # a key the record lacks came after it: it ran as the key's default does (keys are added so)
    ours = {**flatten_keys(JobConfig().to_dict()), **flatten_keys(config)}
    keys = list(canonical) + [k for k in ours if k not in canonical]
    out = [k for k in keys if k not in RUN_LOCAL_KEYS and ours.get(k, _ABSENT) != canonical.get(k, _ABSENT)]
    dataset, reads_files = ours.get("data.dataset"), mode != "dry-run"  # a dry-run reads no asset
    for key, kind, section, read in (
        ("tokenizer.path", "tokenizer", "tokenizer", reads_files and dataset != "synthetic"),
        ("data.path", "corpus", "data", reads_files and dataset == "c4_offline"),
    ):
        mine = (assets.get(section) or {}).get("asset") if assets is not None else project_asset(ours.get(key), kind)
        if read and mine != project_asset(canonical.get(key), kind):
            out.append(key)
    return out
