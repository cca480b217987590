"""What the Checkpointer saves of this rank besides the other stateful objects: the model parts
under one key space (the whole model's FQNs on every layout) and the train state."""

from __future__ import annotations

from typing import Any

import torch.nn as nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
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

    get_state_dict needs a module holding every parameter of the optimizer: a ModuleList of the
    parts, whose index prefix is stripped so that keys are the whole model's FQNs on every
    layout (pipeline splitting keeps FQNs)."""

    OPTS = StateDictOptions(flatten_optimizer_state_dict=True)

    def __init__(self, model_parts: list[nn.Module], optimizer):
        self.wrap = nn.ModuleList(model_parts)
        self.optimizer = optimizer

    def model_state(self) -> tuple[dict, dict]:
        sd = get_model_state_dict(self.wrap)
        names = {_strip_model(k): k for k in sd}
        return {n: sd[k] for n, k in names.items()}, names

    def full_state(self) -> tuple[dict, dict, dict, dict]:
        msd, osd = get_state_dict(self.wrap, self.optimizer, options=self.OPTS)
        mnames = {_strip_model(k): k for k in msd}
        onames = {_strip_optim(k): k for k in osd}
        if len(mnames) != len(msd) or len(onames) != len(osd):
            raise RuntimeError("two model parts share a parameter name")
        return ({n: msd[k] for n, k in mnames.items()}, mnames, {n: osd[k] for n, k in onames.items()}, onames)

    def set_model(self, model: dict, names: dict) -> None:
        set_model_state_dict(self.wrap, {names[n]: v for n, v in model.items()})

    def set_full(self, model: dict, mnames: dict, optim: dict, onames: dict) -> None:
        set_state_dict(
            self.wrap,
            self.optimizer,
            model_state_dict={mnames[n]: v for n, v in model.items()},
            optim_state_dict={onames[n]: v for n, v in optim.items()},
            options=self.OPTS,
        )


class TrainState(Stateful):
    """What the training loop carries across a restart besides the objects it checkpoints."""

    def __init__(self, step: int = 0):
        self.step = step

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = int(state_dict["step"])
