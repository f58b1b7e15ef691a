"""Early stopping in veRL: what the trainer side and the agent loops share (``cppo.early_stop``).

- the predictor store: the trainer's seam publishes the predictor fitted after step s for step
  s + 1 on (``publish``); the agent loops fetch the one serving their step (``fetch_state``). A
  named Ray actor (``STORE``) carries it between the driver and the agent-loop workers; without
  Ray (in-process tests) a module dict does;
- ``VALIDATING``: set while veRL runs a validation agent loop (never stopped).
"""

from __future__ import annotations

import contextvars
import sys
from typing import Any

__all__ = ["STORE", "VALIDATING", "fetch_state", "publish"]

STORE = "cppo_early_stop_store"  # the named Ray actor holding the predictor of each step
VALIDATING: contextvars.ContextVar[bool] = contextvars.ContextVar("cppo_early_stop_validating", default=False)
_LOCAL: dict[int, dict] = {}  # the store when Ray is not running (in-process tests)
# the publishing process keeps its handle: a named, non-detached Ray actor dies with its last handle
_STORE_HANDLE: list[Any] = []


class _Store:
    """The predictors of a run by the step they serve from (a Ray actor; ``_LOCAL`` without Ray)."""

    def __init__(self) -> None:
        self.states: dict[int, dict] = {}

    def put(self, step: int, state: dict) -> None:
        self.states[int(step)] = state
        for old in sorted(self.states)[:-3]:
            del self.states[old]

    def get(self, step: int) -> dict | None:
        keys = [k for k in self.states if k <= int(step)]
        return self.states[max(keys)] if keys else None


def _ray_running() -> bool:
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def publish(step: int, state: dict) -> None:
    """Make ``state`` (a ``PrefixPredictor.state_dict``) the predictor of step ``step`` on."""
    if not _ray_running():
        _LOCAL[int(step)] = state
        return
    import ray

    if not _STORE_HANDLE:
        _STORE_HANDLE.append(ray.remote(_Store).options(name=STORE, get_if_exists=True, num_cpus=0).remote())
    ray.get(_STORE_HANDLE[0].put.remote(int(step), state))


async def fetch_state(step: int) -> dict | None:
    """The predictor state serving ``step`` (None: none fitted yet), from an agent-loop worker."""
    if not _ray_running():
        keys = [k for k in _LOCAL if k <= step]
        return _LOCAL[max(keys)] if keys else None
    import ray

    try:
        store = ray.get_actor(STORE)
    except ValueError:  # nothing published yet: the first steps decide nothing
        return None
    return await store.get.remote(int(step))
