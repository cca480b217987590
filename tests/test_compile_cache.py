"""The shared compile cache is opt-in (`compile.shared_cache`): on where it was proven (CPU ranks),
torch's own caching elsewhere, and a bad value is refused before anything runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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
