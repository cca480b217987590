"""Process groups made with a timeout of their own: the checkpoint's (core/checkpoint/collectives.py
`checkpoint_group`, its async-save poll group included) and the profiler's gather
(core/step_hooks.py). After the first step the trainer applies `comm.train_timeout_seconds` to
every other group (core/debug.py `set_pg_timeouts`); these keep the one they were made with,
sized for what they wait on (file-system I/O, 512 ranks writing traces), not for a step.

The maker registers the group where it makes it, so a new group of this kind is kept without the
trainer knowing of it. Held weakly: a destroyed group leaves the registry with its last reference
(torch reuses group names after a new process group, so names would not do).
"""

from __future__ import annotations

import weakref
from typing import TypeVar

G = TypeVar("G")

_OWN_TIMEOUT: weakref.WeakSet = weakref.WeakSet()


def keep_own_timeout(group: G) -> G:
    """Register `group` (None is let through) as keeping its own timeout; returns it."""
    if group is not None:
        _OWN_TIMEOUT.add(group)
    return group


def own_timeout_groups() -> list:
    """The live groups that keep their own timeout (what `set_pg_timeouts` must exclude)."""
    return list(_OWN_TIMEOUT)
