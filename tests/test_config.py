"""Config loading, overrides and the validation that happens before anything is spawned."""

import copy
import dataclasses
import gzip
import json
import re
import typing

import pytest

from core.config import ConfigError, JobConfig, field_docs, load_config
from core.models.args import FLAVORS, model_args
from core.overrides import parse_override
from core.parallel.stages import PP_SCHEDULES
from core.validate import check_choices, key_choices, resolve_world_size, validate

pytestmark = pytest.mark.core


def _cfg(overrides, world=None):
    cfg = load_config(None, overrides)
    return validate(cfg, world, check_files=False)


def test_defaults_validate():
    cfg = _cfg([])
    assert cfg.parallelism.dp_shard == 1 and cfg.parallelism.world_size == 1


def test_override_types_are_toml_literals():
    assert parse_override("--training.steps=20") == ("training", "steps", 20)
    assert parse_override("optimizer.lr=1e-3") == ("optimizer", "lr", 1e-3)
    assert parse_override("compile.enabled=true") == ("compile", "enabled", True)
    assert parse_override("model.flavor=tiny") == ("model", "flavor", "tiny")  # bare string
    assert parse_override('float8.filter_fqns=["output","w2"]') == ("float8", "filter_fqns", ["output", "w2"])
    # no eval: a Python expression stays a string and is then rejected by the type check
    with pytest.raises(ConfigError, match="training.steps"):
        _cfg(["training.steps=__import__('os').getpid()"])


def test_dp_shard_fills_the_world():
    cfg = _cfg(["parallelism.tp=2"], world=8)
    assert cfg.parallelism.dp_shard == 4


def test_file_then_overrides(tmp_path):
    p = tmp_path / "job.toml"
    p.write_text('[training]\nsteps = 7\nseq_len = 128\n[model]\nflavor = "tiny"\n')
    cfg = load_config(str(p), ["--training.steps=9"])
    assert (cfg.training.steps, cfg.training.seq_len, cfg.model.flavor) == (9, 128, "tiny")
    j = tmp_path / "job.json"
    j.write_text(json.dumps(cfg.to_dict()))
    assert load_config(str(j)).to_dict() == cfg.to_dict()


# Each malformed config must fail with a one-line error that names the offending key.
BAD = [
    (["nosuch.key=1"], "nosuch"),
    (["training.nosuch=1"], "training.nosuch"),
    (["training.steps=ten"], "training.steps"),
    (["training.steps=1.5"], "training.steps"),
    (["compile.enabled=1"], "compile.enabled"),
    (["optimizer.lr=fast"], "optimizer.lr"),
    (["training.steps=0"], "training.steps"),
    (["optimizer.lr=0"], "optimizer.lr"),
    (["model.flavor=9B"], "model.flavor"),
    (["data.dataset=wikipedia"], "data.dataset"),
    (["training.mixed_precision_param=float16"], "training.mixed_precision_param"),
    (["parallelism.pp_schedule=Zigzag", "parallelism.pp=2", "model.flavor=tiny4"], "parallelism.pp_schedule"),
    (["parallelism.cp_rotate_method=ring"], "parallelism.cp_rotate_method"),
    (["activation_checkpoint.mode=some"], "activation_checkpoint.mode"),
    (
        ["activation_checkpoint.mode=selective", "activation_checkpoint.selective_ac_option=0"],
        "activation_checkpoint.selective_ac_option",
    ),
    (["float8.recipe=e5m2"], "float8.recipe"),
    (
        ["parallelism.tp=3", "model.flavor=debug", "parallelism.dp_shard=1", "parallelism.world_size=3"],
        "parallelism.tp",
    ),
    (["parallelism.tp=16", "model.flavor=debug", "parallelism.dp_shard=1"], "parallelism.tp"),  # 8 kv heads
    (["parallelism.pp=4", "model.flavor=tiny", "parallelism.dp_shard=1"], "parallelism.pp"),  # 2 layers
    (
        ["parallelism.pp=2", "parallelism.pp_microbatches=1", "model.flavor=tiny4", "parallelism.dp_shard=1"],
        "parallelism.pp_microbatches",
    ),
    (
        [
            "parallelism.pp=2",
            "parallelism.pp_microbatches=3",
            "model.flavor=tiny4",
            "parallelism.dp_shard=1",
            "training.local_batch_size=8",
        ],
        "parallelism.pp_microbatches",
    ),
    (["parallelism.cp=2", "training.seq_len=250", "parallelism.dp_shard=1"], "training.seq_len"),
    (["parallelism.tp=0"], "parallelism.tp"),
    (["parallelism.dp_shard=0"], "parallelism.dp_shard"),
    (["parallelism.dp_shard=2", "parallelism.world_size=8"], "parallelism"),
    (["checkpoint.async_mode=later"], "checkpoint.async_mode"),
    (["lr_scheduler.decay_type=step"], "lr_scheduler.decay_type"),
    (["metrics.log_freq=0"], "metrics.log_freq"),
    (["model.dim=250"], "model.n_heads"),  # debug: 16 heads
    (["model.dim=80"], "model.n_heads"),  # debug: head dim 80 / 16 = 5, odd
    (["model.n_heads=4"], "model.n_kv_heads"),  # debug: 8 kv heads do not divide 4 heads
    (["model.n_heads=16", "model.n_kv_heads=6"], "model.n_kv_heads"),
    (["model.n_layers=-1"], "model.n_layers"),
    (["model.ffn_dim_multiplier=-1.3"], "model.ffn_dim_multiplier"),
    (
        ["model.n_kv_heads=2", "model.flavor=tiny", "parallelism.tp=4", "parallelism.dp_shard=1"],
        "parallelism.tp",
    ),  # tp divides the 8 heads, not the 2 kv heads
    (["model.vocab_size=1001", "parallelism.tp=2", "parallelism.dp_shard=1"], "parallelism.tp"),
    (["model.n_layers=3", "parallelism.pp=4", "parallelism.dp_shard=1"], "parallelism.pp"),
]


@pytest.mark.parametrize("overrides,key", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_malformed_config_names_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        _cfg(overrides)
    msg = str(e.value)
    assert key in msg and "\n" not in msg


def test_world_size_mismatch_from_launcher():
    with pytest.raises(ConfigError, match="world size 6"):
        _cfg(["parallelism.tp=4"], world=6)


def test_missing_files_are_named(tmp_path):
    cfg = load_config(None, [f"data.path={tmp_path}/nope", "data.dataset=c4_offline"])
    with pytest.raises(ConfigError, match="data.path"):
        validate(cfg)
    (tmp_path / "en").mkdir()  # a corpus that passes its own check: one gzip shard
    (tmp_path / "en" / "c4-train.00000-of-00001.json.gz").write_bytes(gzip.compress(b'{"text": "a"}\n'))
    cfg = load_config(None, [f"data.path={tmp_path}", f"tokenizer.path={tmp_path}/tok.model"])
    with pytest.raises(ConfigError, match="tokenizer.path"):
        validate(cfg)
    cfg = load_config(None, ["data.dataset=synthetic", f"checkpoint.resume_from={tmp_path}/ckpt"])
    with pytest.raises(ConfigError, match="checkpoint.resume_from"):
        validate(cfg)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(str(tmp_path / "nope.toml"))
    bad = tmp_path / "bad.toml"
    bad.write_text("[training\nsteps=")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(str(bad))


def _choice_fields():
    """("section.key", valid values) of every Literal-typed field of the config."""
    out = []
    for section in dataclasses.fields(JobConfig):
        for key, typ in typing.get_type_hints(type(getattr(JobConfig(), section.name))).items():
            if typing.get_origin(typ) is typing.Literal:
                out.append((f"{section.name}.{key}", typing.get_args(typ)))
    return out


def test_enum_fields_are_checked_from_their_type():
    fields = {"model.flavor": tuple(FLAVORS), **dict(_choice_fields())}
    assert key_choices() == fields  # what `run-recipe keys` lists is what validate() accepts
    assert len(fields) >= 15
    assert fields["parallelism.pp_schedule"] == PP_SCHEDULES
    assert fields["job.mode"] == ("real", "proxy", "dry-run")
    for key, valid in fields.items():
        with pytest.raises(ConfigError) as e:
            _cfg([f'{key}="no_such_value"'])
        msg = str(e.value)
        assert msg.startswith(f"{key}: 'no_such_value' is not one of: ") and "\n" not in msg
        assert all(v in msg for v in valid)
        for v in valid:  # each listed value passes the check
            cfg = load_config(None, [f'{key}="{v}"'])
            check_choices(cfg)


def test_validate_returns_a_new_config_and_leaves_its_input_alone():
    cfg = load_config(None, ["parallelism.tp=2"])
    before = copy.deepcopy(cfg.to_dict())
    out = validate(cfg, 8, check_files=False)
    assert cfg.to_dict() == before and cfg.parallelism.dp_shard == -1
    assert out is not cfg and out.parallelism is not cfg.parallelism and out.training is not cfg.training
    assert (out.parallelism.dp_shard, out.parallelism.world_size) == (4, 8)
    assert validate(out, 8, check_files=False).to_dict() == out.to_dict()  # idempotent
    assert resolve_world_size(cfg, 8) == 8 and cfg.parallelism.dp_shard == -1


def test_every_field_has_a_doc():
    docs = field_docs()
    keys = {f"{s}.{k}" for s in JobConfig().to_dict() for k in JobConfig().to_dict()[s]}
    assert set(docs) == keys
    empty = [k for k, d in docs.items() if not d.strip() or "\n" in d]
    assert not empty, f"fields without a one-line doc: {empty}"
    assert "-1 fills" in docs["parallelism.dp_shard"]


def test_a_doc_that_explains_its_values_explains_every_one():
    """A key's doc that names one of its allowed values names them all: a doc cut short (as
    data.sharding's "auto: per_rank if real" once was) leaves the others unexplained."""
    docs, cut = field_docs(), {}
    for key, valid in key_choices().items():
        named = {v for v in valid if re.search(rf"(?<![\w-]){re.escape(v)}(?![\w-])", docs[key])}
        if named and named != set(valid):
            cut[key] = sorted(set(valid) - named)
    assert not cut, f"docs that explain some of their key's values but not these: {cut}"


def test_model_shape_overrides_validate():
    """model.dim, ... override the flavor; the checked shape is the one the trainer builds."""
    shape = [
        "model.dim=256",
        "model.n_layers=6",
        "model.n_heads=16",
        "model.n_kv_heads=16",
        "model.vocab_size=2048",
        "data.dataset=synthetic",
    ]
    cfg = _cfg([*shape, "parallelism.tp=2", "parallelism.dp_shard=1", "parallelism.pp=2"])
    a = model_args(cfg, 4352)
    assert (a.dim, a.n_layers, a.n_heads, a.n_kv_heads, a.vocab_size) == (256, 6, 16, 16, 2048)
    a = model_args(_cfg(["model.ffn_dim_multiplier=1.5", "model.multiple_of=64"]), None)
    assert a.ffn_hidden_dim == 1024 and (a.dim, a.n_layers) == (256, 6)  # 682 * 1.5 -> 1023 -> 1024
