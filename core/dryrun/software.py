"""The software a prediction speaks for: the versions (torch, torchao, the trainer, CUDA or ROCm,
NCCL) and the date of the code that runs the step, and what the model derives from them.

The performance and memory models price a step as some software runs it. What changed from one
software era to the next, where the model's numbers depend on it, is a mechanism in
core/dryrun/stack.py (`Stack`), and `Software.stack()` decides each from the versions, by the
release or the merge date that changed it (each rule names its source). A public figure names its
software (recipes/report/perf_figures.toml `software`); a prediction of this project's trainer
speaks for the versions pinned here (`PINNED`), and `--software date=2025-03,torch=2.7.0` asks
for another stack's. Torch-free, like the models.
"""

from __future__ import annotations

import dataclasses
import re

from core.dryrun.stack import Stack, config_settings, stack_of
from core.versions import PINNED as PINNED_VERSIONS

FIELDS = ("date", "trainer", "torch", "torchao", "torchtitan", "cuda", "rocm", "cudnn", "nccl")
THIS_TRAINER_NAME = "titan-recipes"
_DATE = re.compile(r"^\d{4}-\d{2}(-\d{2})?$")


@dataclasses.dataclass(frozen=True)
class Software:
    """What ran (or will run) the step. `date`: when its code was taken (YYYY-MM or YYYY-MM-DD),
    what the trainer-side rules key on; `trainer`: torchtitan, or this project's trainer. A
    field a source leaves out is empty ("not stated")."""

    date: str
    trainer: str = "torchtitan"
    torch: str = ""
    torchao: str = ""
    torchtitan: str = ""
    cuda: str = ""
    rocm: str = ""
    cudnn: str = ""
    nccl: str = ""

    def __post_init__(self):
        if not _DATE.match(self.date):
            raise ValueError(f"software.date: {self.date!r} is not YYYY-MM or YYYY-MM-DD")

    def text(self) -> str:
        """'torchtitan of 2025-03 (torch 2.7.0a0+gitb98af95, torchao 0.10.0, CUDA not stated)'; a
        torch not stated is named as the release taken for it."""
        named = ("torch", "torchao", "torchtitan", "cudnn", "nccl")
        parts = [f"{k} {getattr(self, k)}" for k in named if getattr(self, k)]
        if not self.torch:
            parts.insert(0, f"torch {_torch(self)} (not stated: its date's release)")
        gpu_stack = f"ROCm {self.rocm}" if self.rocm else f"CUDA {self.cuda}" if self.cuda else "CUDA not stated"
        if self.trainer == THIS_TRAINER_NAME and not (self.cuda or self.rocm):
            gpu_stack = "CUDA, cuDNN and NCCL as its torch's wheel bundles them"
        return f"{self.trainer} of {self.date} ({', '.join([*parts, gpu_stack])})"

    def short(self) -> str:
        """'torchtitan 2025-03, torch 2.7.0a0+gitb98af95': a table cell (a torch not stated is its
        date's release, marked *)."""
        torch = self.torch or f"{_torch(self)}*"
        gpu = f", ROCm {self.rocm}" if self.rocm else f", CUDA {self.cuda}" if self.cuda else ""
        return f"{self.trainer} {self.date}, torch {torch}{gpu}"

    def record(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v} | {"stack": dataclasses.asdict(self.stack())}

    def settings(self, overrides: list[str] | tuple[str, ...] = ()) -> list[str]:
        """A run's `--set` settings after those its config defaults differ by (stack.config_settings)."""
        return config_settings(dataclasses.asdict(self.stack()), overrides)

    def stack(self) -> Stack:
        """What this software does differently from this project's trainer, rule by rule."""
        cudnn = _cudnn_attention(self)
        if self.trainer == THIS_TRAINER_NAME:  # its SAC saves cuDNN attention's output
            return Stack(cudnn_attention=cudnn)
        return Stack(
            sac_saves_abs=self.date < "2025-02-06",
            root_kept_gathered=not _torch_since(self, (2, 8), "2025-06"),
            loss_compiled=self.date >= "2025-04",
            adamw_foreach=self.date < "2025-02-24",
            fused_rms_norm=self.date >= "2025-03-19" and _torch_since(self, (2, 9), "2025-08-03"),
            cudnn_attention=cudnn,
            sac_recomputes_attention=cudnn and self.date < "2025-12-01",
            loss_chunks=8 if self.date >= "2026-06-26" else 0,
        )


# torch's releases and their dates (github.com/pytorch/pytorch/releases): a source that does not
# state its torch is taken to run the latest release of its date.
RELEASES = (
    ("2.3.0", "2024-04-24"),
    ("2.4.0", "2024-07-24"),
    ("2.5.0", "2024-10-17"),
    ("2.5.1", "2024-10-29"),
    ("2.6.0", "2025-01-29"),
    ("2.7.0", "2025-04-23"),
    ("2.8.0", "2025-08-06"),
    ("2.9.0", "2025-10-15"),
    ("2.10.0", "2026-01-21"),  # its release notes' date (reported by the press the next days)
    ("2.11.0", "2026-03-23"),  # "On March 23, version 2.11 was launched" (PyTorch's release blog)
)


def _torch(sw: Software) -> str:
    """The torch version the software ran: as stated, else the latest release at its date."""
    if sw.torch:
        return sw.torch
    return next((v for v, d in reversed(RELEASES) if d <= sw.date), RELEASES[0][0])


def _build_date(sw: Software) -> str:
    """When the torch build was made: a nightly's own date (2.9.0.dev20250815), else the software's."""
    m = re.search(r"dev(\d{4})(\d{2})(\d{2})", sw.torch)
    return f"{m[1]}-{m[2]}-{m[3]}" if m else sw.date


def _release(sw: Software) -> tuple[int, int] | None:
    """(major, minor) of the torch release it ran; None for a nightly or a source build (a commit)."""
    m = re.match(r"^(\d+)\.(\d+)\.\d+(\+\w+)?$", _torch(sw))
    return (int(m[1]), int(m[2])) if m else None


def _torch_since(sw: Software, release: tuple[int, int], merged: str) -> bool:
    """torch has a change that shipped in `release` and was merged on `merged` (a nightly or a
    build whose version is not stated: by the build's date)."""
    rel = _release(sw)
    return rel >= release if rel else _build_date(sw) >= merged


def _cudnn_attention(sw: Software) -> bool:
    """SDPA ran cuDNN's attention on Hopper (core/dryrun/stack.py `cudnn_attention`): this
    trainer asks SDPA for no backend (core/models/llama3.py), torchtitan chose one for a while."""
    if sw.trainer != THIS_TRAINER_NAME:
        if sw.date >= "2025-10-09":  # torchtitan puts cuDNN first (PR 1776)
            return True
        if sw.date >= "2025-05-14":  # torchtitan forces flash first on H100
            return False
    return _sdpa_prefers_cudnn(sw)


def _sdpa_prefers_cudnn(sw: Software) -> bool:
    """SDPA's own choice on Hopper: cuDNN in torch 2.5.0 and the nightlies of 2024-07-24 to 10-22
    (pytorch PR 128888 until PR 138522), and again where the cuDNN torch loads is newer than 9.15.0
    (sdp_utils.cpp `check_prefer_cudnn_attention`, in torch 2.10: the 2.11 wheels are the first
    whose bundled cuDNN passes it, huggingface/transformers PR 48163's closing comment). A nightly
    or source build is judged by its date: from the 2.11 release, the cuDNN bump's date unknown."""
    rel = _release(sw)
    if sw.cudnn and (rel or (0, 0)) >= (2, 10):
        return tuple(int(x) for x in re.findall(r"\d+", sw.cudnn)[:3]) > (9, 15, 0)
    if rel:
        return _torch(sw).startswith("2.5.0") or rel >= (2, 11)
    build = _build_date(sw)
    return "2024-07-24" <= build < "2024-10-22" or build >= "2026-03-23"


# This project's trainer, at the versions it pins (core/versions.py).
PINNED = Software(
    date="2026-11", trainer=THIS_TRAINER_NAME, torch=PINNED_VERSIONS["torch"], torchao=PINNED_VERSIONS["torchao"]
)


def parse(text: str) -> Software:
    """`date=2025-03,torch=2.7.0,trainer=torchtitan` (the --software option): a torchtitan stack
    unless `trainer` says otherwise; ValueError naming a bad or unknown key."""
    values: dict[str, str] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or key not in FIELDS or not value:
            raise ValueError(f"--software: {item!r} is not KEY=VALUE with KEY one of {', '.join(FIELDS)}")
        values[key] = value
    if "date" not in values:
        raise ValueError("--software: date=YYYY-MM is required (the rules key on it)")
    return Software(**values)


def of_source(table: dict) -> Software:
    """A source's `software` table (recipes/report/perf_figures.toml)."""
    unknown = sorted(set(table) - set(FIELDS))
    if unknown:
        raise ValueError(f"software.{unknown[0]}: not one of {', '.join(FIELDS)}")
    return Software(**table)


def stack_with(sw: Software, override: dict) -> Stack:
    """The software's stack, with a figure's own `stack` entries (a run whose code differs from
    its date's: an option it set) taking precedence."""
    return stack_of({**dataclasses.asdict(sw.stack()), **override})
