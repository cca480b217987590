"""The peer trainer's environment: a venv with torchtitan 0.3.0 on the torch installed here, our CPU
patches applied to it, and its assets built locally (no model hub). Every step is skipped when
its result is already there, so `setup()` is cheap on a second call and needs no network then.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from core.fileio import atomic_copy, atomic_path
from recipes import paths
from recipes.peer_bench.patches import TORCHTITAN_VERSION, PatchError, apply_all

TRITON_VERSION = "3.9.0"  # torchtitan imports triton at start-up (it never runs it on CPU)
DEFAULT_INDEX = "https://pypi.org/simple"
TOKENIZER_SCRIPT = Path(__file__).with_name("tokenizer_build.py")


class SetupError(RuntimeError):
    """A setup step failed; the message is one line saying which and why."""


class IndexUnreachable(SetupError):
    """The package index cannot be reached (the machine cannot set up here)."""


def peer_root() -> Path:
    return paths.project_root() / ".cache" / "peer_torchtitan"


def default_venv() -> Path:
    return peer_root() / "venv"


def work_dir() -> Path:
    """Assets, logs and torchtitan's outputs (its dump folder)."""
    return peer_root() / "work"


def corpus_file() -> Path:
    return work_dir() / "c4_test" / "data.json"


def tokenizer_dir() -> Path:
    return work_dir() / "tokenizer"


def venv_python(venv: Path) -> Path:
    return Path(venv) / "bin" / "python"


def torch_pin() -> str:
    """The torch release of this interpreter, without its local build tag (2.13.0+cpu -> 2.13.0)."""
    import torch

    return torch.__version__.split("+")[0]


def installed_versions(python: Path, names: tuple[str, ...]) -> dict[str, str | None]:
    """{distribution: version or None} as the interpreter `python` sees them."""
    code = (
        "import json, sys\nfrom importlib import metadata\nout = {}\nfor n in sys.argv[1:]:\n"
        "    try:\n        out[n] = metadata.version(n)\n    except metadata.PackageNotFoundError:\n"
        "        out[n] = None\nprint(json.dumps(out))"
    )
    res = subprocess.run([str(python), "-c", code, *names], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SetupError(f"{python} cannot report its packages: {res.stderr.strip().splitlines()[-1:]}")
    return json.loads(res.stdout)


def check_index(url: str | None = None, timeout: float = 15.0) -> None:
    """IndexUnreachable (one line) unless the package index answers for torchtitan."""
    url = url or os.environ.get("PIP_INDEX_URL") or DEFAULT_INDEX
    probe = url.rstrip("/") + "/torchtitan/"
    try:
        with urllib.request.urlopen(probe, timeout=timeout):
            pass
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise IndexUnreachable(
            f"cannot reach the package index ({probe}: {reason}); setup installs torchtitan from it"
        ) from None


def _run(cmd: list[str], what: str) -> None:
    """Run with its output shown (pip's progress); SetupError naming the step when it fails."""
    rc = subprocess.run(cmd, check=False).returncode
    if rc != 0:
        raise SetupError(f"{what} failed (exit {rc}): {' '.join(cmd)}")


def packages_ready(versions: dict[str, str | None], pin: str) -> bool:
    torch_ok = (versions.get("torch") or "").split("+")[0] == pin
    return torch_ok and versions.get("torchtitan") == TORCHTITAN_VERSION and versions.get("triton") == TRITON_VERSION


def install_packages(venv: Path, say: Callable[[str], None]) -> None:
    """torch (the release installed here) first, then torchtitan and triton under a constraints
    file that holds torch at the build pip chose, so torchtitan's requirements cannot move it."""
    py = venv_python(venv)
    pin = torch_pin()
    names = ("torch", "torchtitan", "triton")
    versions = installed_versions(py, names)
    if packages_ready(versions, pin):
        say(f"packages present: torch {versions['torch']}, torchtitan {TORCHTITAN_VERSION}, triton {TRITON_VERSION}")
        return
    check_index()
    pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check"]
    if (versions.get("torch") or "").split("+")[0] != pin:
        say(f"installing torch=={pin} (the release this interpreter runs)")
        _run([*pip, f"torch=={pin}"], "pip install torch")
    build = installed_versions(py, ("torch",))["torch"]
    constraints = venv / "torch-constraints.txt"
    constraints.write_text(f"torch=={build}\n")
    say(f"installing torchtitan=={TORCHTITAN_VERSION} triton=={TRITON_VERSION} with torch held at {build}")
    _run([*pip, "-c", str(constraints), f"torchtitan=={TORCHTITAN_VERSION}", f"triton=={TRITON_VERSION}"], "pip")
    versions = installed_versions(py, names)
    if not packages_ready(versions, pin):
        wanted = f"torch {pin}, torchtitan {TORCHTITAN_VERSION}, triton {TRITON_VERSION}"
        raise SetupError(f"after installing, {venv} has {versions}; wanted {wanted}")


def torchtitan_dir(venv: Path) -> Path:
    """The installed torchtitan package folder (found without importing it)."""
    code = "import importlib.util; print(list(importlib.util.find_spec('torchtitan').submodule_search_locations)[0])"
    res = subprocess.run([str(venv_python(venv)), "-c", code], capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SetupError(f"torchtitan is not importable from {venv}")
    return Path(res.stdout.strip())


def patch_torchtitan(venv: Path, say: Callable[[str], None]) -> None:
    version = installed_versions(venv_python(venv), ("torchtitan",))["torchtitan"]
    if version != TORCHTITAN_VERSION:
        raise SetupError(f"the CPU patches are for torchtitan {TORCHTITAN_VERSION}; {venv} has {version}")
    try:
        for name, state in apply_all(torchtitan_dir(venv)):
            say(f"  patch {name}: {state}")
    except PatchError as e:
        raise SetupError(str(e)) from None


def build_corpus(say: Callable[[str], None]) -> Path:
    """c4_test/data.json (JSON lines, C4's record layout) from the train split of this project's
    offline corpus (built first when missing: `python -m core.data.assets --corpus`)."""
    from core.data.corpus import build_offline_corpus, corpus_shard_names

    out = corpus_file()
    if out.is_file():
        say(f"corpus present: {paths.relative(out)}")
        return out
    en = build_offline_corpus() / "en"
    with atomic_path(out) as tmp, open(tmp, "wb") as f:
        for name in corpus_shard_names("train"):
            with gzip.open(en / name, "rb") as shard:
                f.write(shard.read())
    say(f"corpus built: {paths.relative(out)} from {paths.relative(en)} (train split)")
    return out


def build_tokenizer(venv: Path, say: Callable[[str], None]) -> Path:
    out = tokenizer_dir()
    if (out / "tokenizer.json").is_file() and (out / "tokenizer_config.json").is_file():
        say(f"tokenizer present: {paths.relative(out)}")
        return out
    say(f"training the tokenizer: {paths.relative(out)}")
    with tempfile.TemporaryDirectory() as staging:  # the peer's interpreter writes there; we publish
        _run([str(venv_python(venv)), str(TOKENIZER_SCRIPT), str(corpus_file()), staging], "tokenizer build")
        for name in ("tokenizer_config.json", "tokenizer.json"):  # tokenizer.json last: it marks "present"
            atomic_copy(Path(staging) / name, out / name)
    return out


def setup(venv: Path, say: Callable[[str], None]) -> None:
    """venv -> packages -> CPU patches -> assets; each step skipped when done."""
    venv = Path(venv).resolve()
    if venv_python(venv).is_file():
        say(f"[1/4] venv present: {venv}")
    else:
        say(f"[1/4] creating the venv {venv} with {sys.executable}")
        _run([sys.executable, "-m", "venv", str(venv)], "python -m venv")
    say("[2/4] packages")
    install_packages(venv, say)
    say("[3/4] CPU patches of torchtitan")
    patch_torchtitan(venv, say)
    say("[4/4] assets (local: no model hub)")
    build_corpus(say)
    build_tokenizer(venv, say)
