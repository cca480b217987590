"""What a checkpoint holds, as the `Stateful` objects torch.distributed.checkpoint saves and loads
in place: DCP calls `state_dict()` to save (and for the template it loads into), then
`load_state_dict()` with what it read. One class per kind of state; the Checkpointer picks which
of them a save or a load includes (`checkpoint_items`).

Keys on disk (DCP flattens one level per dict):

    model.<fqn>                       parameters under the whole model's FQNs on every layout
    optimizer.state.<fqn>.<name>      flattened optimizer state (one key space for every PP split)
    optimizer.param_groups.<fqn>.<k>
    lr_scheduler.json                 the scheduler's state_dict as JSON
    train_state.step                  the optimizer steps taken
    train_state.history               every step's loss and grad norm since the run began (JSON)
    dataloader.dp_rank_<r>            JSON of dp rank r's loader state
    rng.rank_<R>                      torch RNG state of global rank R
"""

from __future__ import annotations

import json
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful


# ------------------------------------------------------------- model parts <-> one key space
def _strip_model(key: str) -> str:
    return key.split(".", 1)[1]  # "<part>.<fqn>" -> "<fqn>"


def _strip_optim(key: str) -> str:
    kind, _, rest = key.split(".", 2)  # "state.<part>.<fqn>.<name>" -> "state.<fqn>.<name>"
    return f"{kind}.{rest}"


class ModelParts:
    """The model parts of this rank (one, or several pipeline stages) under one optimizer.

    torch's state-dict API needs a module holding every parameter of the optimizer: a ModuleList
    of the parts, whose index prefix is stripped so that keys are the whole model's FQNs on every
    layout (pipeline splitting keeps FQNs)."""

    OPTS = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, model_parts: list[nn.Module], optimizer):
        self.wrap = nn.ModuleList(model_parts)
        self.optimizer = optimizer

    @staticmethod
    def _renamed(sd: dict, strip) -> tuple[dict, dict]:
        names = {strip(k): k for k in sd}
        if len(names) != len(sd):
            raise RuntimeError("two model parts share a parameter name")
        return {n: sd[k] for n, k in names.items()}, names

    def model_state_dict(self) -> dict[str, Any]:
        return self._renamed(get_model_state_dict(self.wrap), _strip_model)[0]

    def load_model_state_dict(self, model: dict[str, Any]) -> None:
        _, names = self._renamed(get_model_state_dict(self.wrap), _strip_model)
        set_model_state_dict(self.wrap, {names[n]: v for n, v in model.items()})

    def optimizer_state_dict(self) -> dict[str, Any]:
        sd = get_optimizer_state_dict(self.wrap, self.optimizer, options=self.OPTS)
        return self._renamed(sd, _strip_optim)[0]

    def load_optimizer_state_dict(self, optim: dict[str, Any]) -> None:
        sd = get_optimizer_state_dict(self.wrap, self.optimizer, options=self.OPTS)
        _, names = self._renamed(sd, _strip_optim)
        set_optimizer_state_dict(self.wrap, self.optimizer, {names[n]: v for n, v in optim.items()}, options=self.OPTS)

    def state_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.wrap.parameters())


# ----------------------------------------------------------------------------- the Statefuls
class ModelState(Stateful):
    """The weights; `dtype` casts them for a weights-only export."""

    def __init__(self, parts: ModelParts, dtype: torch.dtype | None = None):
        self.parts, self.dtype = parts, dtype

    def state_dict(self) -> dict[str, Any]:
        model = self.parts.model_state_dict()
        return model if self.dtype is None else {k: v.to(self.dtype) for k, v in model.items()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.parts.load_model_state_dict(state_dict)


class OptimizerState(Stateful):
    def __init__(self, parts: ModelParts):
        self.parts = parts

    def state_dict(self) -> dict[str, Any]:
        return self.parts.optimizer_state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.parts.load_optimizer_state_dict(state_dict)


class JsonState(Stateful):
    """An object whose state is plain Python values of a shape that changes as it runs (the data
    loader's position, the LR scheduler): one JSON string under `key`, so a load needs no
    template of that shape, and the string is copied at save time (an async save runs on while
    the object moves on)."""

    def __init__(self, obj, key: str = "json"):
        self.obj, self.key = obj, key

    def state_dict(self) -> dict[str, Any]:
        return {self.key: json.dumps(self.obj.state_dict())}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.obj.load_state_dict(json.loads(state_dict[self.key]))


class RngState(Stateful):
    """This rank's torch RNG (restored only on the layout that saved it)."""

    def __init__(self, rank: int):
        self.key = f"rank_{rank}"

    def state_dict(self) -> dict[str, Any]:
        return {self.key: torch.get_rng_state()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        torch.set_rng_state(state_dict[self.key])


class TrainState(Stateful):
    """What the training loop carries across a restart besides the objects it checkpoints: the
    optimizer steps taken, and every step's loss and grad norm since the run began (`history`,
    from step `history_from`), so a resumed run's record holds the steps before the resume too.
    A checkpoint written before the history existed loads without it (`with_history` False)."""

    def __init__(self, step: int = 0):
        self.step = step
        self.history_from = 1
        self.history: dict[str, list[float]] = {"losses": [], "grad_norms": []}
        self.with_history = True

    def record(self, loss: float, grad_norm: float) -> None:
        self.history["losses"].append(loss)
        self.history["grad_norms"].append(grad_norm)

    def state_dict(self) -> dict[str, Any]:
        if not self.with_history:
            return {"step": self.step}
        return {"step": self.step, "history": json.dumps({"from_step": self.history_from, **self.history})}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
        if "history" in state_dict:
            history = json.loads(state_dict["history"])
            self.history_from = int(history.pop("from_step", 1))
            self.history = {k: list(v)[: self.step - self.history_from + 1] for k, v in history.items()}
        else:  # an older checkpoint: the history starts after it
            self.history_from, self.history = self.step + 1, {"losses": [], "grad_norms": []}
        self.with_history = True


def dataloader_key(dp_rank: int) -> str:
    return f"dp_rank_{dp_rank}"
