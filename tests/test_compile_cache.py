"""The shared compile cache is opt-in (`compile.shared_cache`): on where it was proven (CPU ranks),
torch's own caching elsewhere, and a bad value is refused before anything runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from core.config import ConfigError, load_config
from core.toggles import compile_cache
from core.validate import validate
from tests.dist_utils import ROOT

pytestmark = [pytest.mark.toggles]


def test_auto_is_on_for_cpu_proxies_and_off_for_real_cuda_runs():
    proxy = load_config(None, ["job.mode=proxy", "compile.enabled=true"])
    real = load_config(None, ["job.mode=real", "compile.enabled=true"])
    assert proxy.compile.shared_cache == real.compile.shared_cache == "auto"  # the default
    assert compile_cache.wanted(proxy.compile.shared_cache, "cpu")
    assert not compile_cache.wanted(real.compile.shared_cache, "cuda")
    for device in ("cpu", "cuda"):  # an explicit choice wins on either device
        assert compile_cache.wanted("on", device) and not compile_cache.wanted("off", device)


def test_a_bad_shared_cache_value_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"^compile\.shared_cache: 'sometimes' is not one of: auto, on, off$"):
        validate(load_config(None, ['compile.shared_cache="sometimes"']), 1, check_files=False)


# In a fresh process: what apply_compile leaves in torch's classes per choice (compile_cache.targets).
PATCHED_BY_CHOICE = """
import json
from core.config import Compile
from core.models.llama3 import create_model
from core.parallel.parallelize import Toggles
from core.toggles import compile_cache
from core.toggles.compile import apply_compile

def torch_attrs():
    return {key: vars(owner)[name] for key, (owner, name) in compile_cache.targets().items()}

original = torch_attrs()
out = {}
for choice in ("off", "auto", "on", "off"):
    apply_compile(create_model("tiny", vocab_size=512, max_seq_len=64, device="cpu"),
                  Compile(enabled=True, shared_cache=choice), Toggles(), "cpu")
    now = torch_attrs()
    out[len(out)] = [choice, compile_cache.active(), sorted(k for k in now if now[k] is not original[k])]
print(json.dumps(out))
"""


@pytest.mark.slow
def test_off_leaves_inductor_unpatched_and_on_patches_it():
    proc = subprocess.run(
        [sys.executable, "-c", PATCHED_BY_CHOICE], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    steps = json.loads(proc.stdout.splitlines()[-1])
    everything = sorted(compile_cache.PATCHES)
    assert steps["0"] == ["off", False, []]  # nothing patched in a fresh process
    assert steps["1"] == ["auto", True, everything]  # auto on CPU
    assert steps["2"] == ["on", True, everything]
    assert steps["3"] == ["off", False, []]  # a later job with it off: torch's functions back


# In a fresh process: one forward and backward of a compiled Float8 block, then this process's
# AOTAutograd cache lookups (torchao's Float8 casts are autograd.Functions marked allow_in_graph).
FLOAT8_BLOCK = """
import json
import torch
from core.config import Compile, load_config
from core.models.llama3 import create_model
from core.parallel.parallelize import Toggles
from core.toggles import compile_cache
from core.toggles.compile import apply_compile
from core.toggles.float8 import apply_float8

torch.manual_seed(0)
model = create_model("tiny", vocab_size=512, max_seq_len=64, device="cpu")
model.layers = torch.nn.ModuleDict({"0": model.layers["0"]})
apply_float8(model, load_config(None, ["float8.enabled=true", "float8.emulate=true"]), Toggles())
apply_compile(model, Compile(enabled=True, shared_cache="on"), Toggles(), "cpu")
x = torch.randn(2, 64, model.layers["0"].attention.wq.in_features, requires_grad=True)
freqs = model.freqs_cis[:64]
model.layers["0"](x, freqs).sum().backward()
print(json.dumps({"aot": compile_cache.counts("aot_autograd"), "grad": x.grad.double().sum().item()}))
"""


@pytest.mark.slow
def test_a_float8_block_is_served_by_the_aot_autograd_cache_in_the_next_process(tmp_path):
    """torch 2.13 bypasses AOTAutograd's cache for such a graph (the closure Dynamo makes for an
    allow_in_graph autograd.Function has no importable name): a warm process re-traced the joint
    graph of every Float8 block. With the shared cache on, the key names the Function instead:
    the next process hits, with the same gradients."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}

    def run() -> dict:
        proc = subprocess.run(
            [sys.executable, "-c", FLOAT8_BLOCK], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.splitlines()[-1])

    cold, warm = run(), run()
    assert cold["aot"] == {"hit": 0, "miss": 1, "bypass": 0}, cold
    assert warm["aot"] == {"hit": 1, "miss": 0, "bypass": 0}, warm
    assert warm["grad"] == cold["grad"]


def test_an_autograd_function_is_named_in_a_key_by_class_version_and_source():
    """Two of Dynamo's trampolines to one Function give one key line; another Function, another."""
    from torch._dynamo.variables.misc import produce_trampoline_autograd_apply
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
    from torchao.float8.float8_training_tensor import _ToFloat8ConstrFunc

    compile_cache.install()
    try:
        fmt = compile_cache.targets()["format_global"][0]._format_global_for_cache_key
        one, two = (produce_trampoline_autograd_apply(matmul_with_hp_or_float8_args) for _ in range(2))
        other = produce_trampoline_autograd_apply(_ToFloat8ConstrFunc)
        assert one is not two and fmt("fn", one) == fmt("fn", two) != fmt("fn", other)
        line = fmt("fn", one)
        assert "torchao.float8.float8_linear.matmul_with_hp_or_float8_args" in line
        import torchao

        assert torchao.__version__ in line
        assert fmt("torch", __import__("torch")) == "import torch"  # everything else as torch writes it
    finally:
        compile_cache.uninstall()


def test_a_mesh_saved_by_role_loads_as_this_jobs_mesh_of_those_dims():
    """What an AOTAutograd entry saved by role gets back on load: this job's mesh of the same dims,
    refused (a cache miss) where its shape or device differs or no job mesh is registered."""
    from types import SimpleNamespace

    from core.toggles import group_roles

    def mesh(shape):
        return SimpleNamespace(device_type="cpu", mesh=torch.zeros(shape))

    views = {("tp",): mesh((2,)), ("dp_shard", "cp"): mesh((2, 2))}
    try:
        group_roles.name_groups({"tp": "27", "cp": "41"}, views.__getitem__)
        assert group_roles.roles_of(("41", "27")) == ("cp", "tp")
        assert group_roles.roles_of(("27", "99")) is None  # a group without a role: nothing shared
        assert group_roles.job_mesh("cpu", ("tp",), (2,)) is views[("tp",)]
        assert group_roles.job_mesh("cpu", ["dp_shard", "cp"], [2, 2]) is views[("dp_shard", "cp")]
        with pytest.raises(RuntimeError, match=r"\(4,\)"):
            group_roles.job_mesh("cpu", ("tp",), (4,))
        with pytest.raises(RuntimeError, match="cuda"):
            group_roles.job_mesh("cuda", ("tp",), (2,))
        group_roles.name_groups({"tp": "27"})  # roles without a job mesh: keys keep the raw names
        assert group_roles.roles_of(("27",)) is None
        with pytest.raises(RuntimeError, match="no job mesh"):
            group_roles.job_mesh("cpu", ("tp",), (2,))
    finally:
        group_roles.name_groups({})
