"""Where OpenRLHF 0.11.2 assumes a CUDA device, fixed from outside (no OpenRLHF file edited).

Installed only by ``cpu.install()`` — that is, only in a process of a run that asked for the
CPU mode and has no CUDA device. Each seam names the OpenRLHF lines it answers (paths inside
the ``openrlhf`` package of the pinned 0.11.2 release); why each is needed:
tests/integrations/openrlhf/test_cpu_mode.py checks that every cited line still makes that call
and that the call raises on a CPU build of torch (the OpenRLHF probe in the project's platform
notes also removed each one and watched the loop fail).

torch.cuda, process-wide (OpenRLHF calls these through the ``torch.cuda`` attribute):

- ``set_device`` -> no-op: ``utils/deepspeed/deepspeed.py:97`` (``setup_distributed``).
- ``current_device`` -> ``"cpu"``: used as a ``device=`` / ``.to()`` target at
  ``trainer/ray/launcher.py:136,190``, ``trainer/ray/ppo_actor.py:148,171,627``,
  ``utils/deepspeed/deepspeed.py:614,633``, ``trainer/ppo_utils/replay_buffer.py:104,129,159``.
- ``synchronize`` -> no-op: ``utils/distributed_util.py:10`` (after every barrier,
  e.g. ``ppo_actor.py:106``), ``launcher.py:65``, ``ppo_actor.py:605``.
- ``current_stream`` -> None: ``ppo_actor.py:436`` passes it to the weight-sync broadcast
  (the gloo broadcaster below takes no stream).

OpenRLHF objects:

- ``NaiveReplayBuffer.__init__`` builds ``torch.device(f"cuda:{current_device()}")``
  (``trainer/ppo_utils/replay_buffer.py:40``): its target device becomes ``cpu``.
- ``models/ring_attn_utils.py:3-4`` imports flash-attn at module level although only sample
  packing and ring attention use it: while that one module executes, ``flash_attn`` is a
  placeholder whose functions raise; it is removed from ``sys.modules`` right after, so no
  other code (transformers' flash-attn detection) ever sees it.
- weight sync: ``stateless_init_process_group`` (``utils/distributed_util.py:13-26``, called at
  ``ppo_actor.py:147`` and ``vllm_worker_wrap.py:20``) opens a NCCL communicator; on CPU it
  opens a stateless gloo group with the same ``broadcast(tensor, src, stream)`` call. The
  rollout side (vLLM worker) is in ``vllm_sync``.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ...importhook import after_import, around_import
from ...wrap import replace, wrap, wrapped

__all__ = ["GlooBroadcaster", "gloo_stateless_process_group", "install", "installed", "patch_dist_util"]

WRAP_TAG = __name__  # marks our layers on torch's and OpenRLHF's attributes (integrations/wrap.py)
_INSTALLED = False

REPLAY_BUFFER_MODULE = "openrlhf.trainer.ppo_utils.replay_buffer"
RING_ATTN_MODULE = "openrlhf.models.ring_attn_utils"
DIST_UTIL_MODULE = "openrlhf.utils.distributed_util"
# modules that bound stateless_init_process_group by name at import
DIST_UTIL_USERS = ("openrlhf.trainer.ray.ppo_actor",)
FLASH_ATTN = ("flash_attn", "flash_attn.bert_padding", "flash_attn.utils", "flash_attn.utils.distributed")


def installed() -> bool:
    return _INSTALLED


# ------------------------------------------------------------------------------ torch.cuda
# one function object per replaced name: torch._dynamo maps torch functions by identity and
# refuses one object under two names
def _set_device(device: Any) -> None:
    return None


def _current_device() -> str:
    return "cpu"


def _index_zero() -> int:
    return 0


def _synchronize(device: Any = None) -> None:
    return None


def _current_stream(device: Any = None) -> None:
    return None


_CUDA_SEAMS: dict[str, Callable] = {
    "set_device": _set_device,
    "current_device": _current_device,
    "synchronize": _synchronize,
    "current_stream": _current_stream,
}


def _patch_torch_cuda() -> None:
    for name, fn in _CUDA_SEAMS.items():
        replace(torch.cuda, name, fn, tag=WRAP_TAG)


# ------------------------------------------------------------------------------ replay buffer
def _cpu_replay_buffer_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        # line 40 formats f"cuda:{current_device()}": give it an index for that one call
        with wrapped(torch.cuda, "current_device", lambda _seam: _index_zero, tag=f"{WRAP_TAG}.replay_buffer"):
            original(self, *args, **kwargs)
        self.target_device = torch.device("cpu")

    return __init__


def _patch_replay_buffer(module) -> None:
    wrap(module.NaiveReplayBuffer, "__init__", _cpu_replay_buffer_init, tag=WRAP_TAG)


# ------------------------------------------------------------------------------ flash-attn placeholder
class _Unavailable:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(
            f"{self._name}: flash-attn is not available in OpenRLHF's CPU mode; sample packing "
            "(--ds.packing_samples) and ring attention need a GPU"
        )


def _unavailable_names(module_name: str) -> Callable[[str], _Unavailable]:
    def __getattr__(attr: str) -> _Unavailable:
        return _Unavailable(f"{module_name}.{attr}")

    return __getattr__


@contextlib.contextmanager
def _flash_attn_placeholder() -> Iterator[None]:
    """flash_attn names in sys.modules only while ring_attn_utils executes."""
    if any(name in sys.modules for name in FLASH_ATTN):  # a real install: leave it alone
        yield
        return
    for name in FLASH_ATTN:
        module = types.ModuleType(name, "CPU-mode placeholder: flash-attn is not installed")
        module.__path__ = []
        vars(module)["__getattr__"] = _unavailable_names(name)  # a module-level __getattr__ (PEP 562)
        sys.modules[name] = module
    try:
        yield
    finally:
        for name in FLASH_ATTN:
            sys.modules.pop(name, None)


# ------------------------------------------------------------------------------ weight sync over gloo
class GlooBroadcaster:
    """A stateless gloo group between the actor's rank 0 and the vLLM workers, with the
    ``broadcast(tensor, src, stream)`` call OpenRLHF makes on vLLM's ``PyNcclCommunicator``."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 1800.0):
        if not 0 <= rank < world_size:
            raise ValueError(f"gloo weight sync: rank {rank} outside world size {world_size}")
        timeout = datetime.timedelta(seconds=timeout_s)
        self.rank, self.world_size = rank, world_size
        store = torch.distributed.TCPStore(host, int(port), world_size, is_master=rank == 0, timeout=timeout)
        self.group = torch.distributed.ProcessGroupGloo(store, rank, world_size, timeout)

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream: Any = None) -> None:
        opts = torch.distributed.BroadcastOptions()
        opts.rootRank = int(src)
        opts.rootTensor = 0
        self.group.broadcast([tensor], opts).wait()  # type: ignore[attr-defined]  # bound, not in torch's stubs


def gloo_stateless_process_group(master_address, master_port, rank, world_size, device=None) -> GlooBroadcaster:
    """Stands in for ``openrlhf.utils.distributed_util.stateless_init_process_group`` on CPU."""
    return GlooBroadcaster(master_address, master_port, rank, world_size)


def _gloo_group(current):
    def stateless_init_process_group(master_address, master_port, rank, world_size, device=None) -> GlooBroadcaster:
        """``gloo_stateless_process_group`` in place of OpenRLHF's NCCL group."""
        return gloo_stateless_process_group(master_address, master_port, rank, world_size, device)

    return stateless_init_process_group


def patch_dist_util(module) -> None:
    """Replace ``stateless_init_process_group`` in ``module`` (OpenRLHF's ``distributed_util``,
    or a module that bound the name from it) by the gloo group (idempotent)."""
    wrap(module, "stateless_init_process_group", _gloo_group, tag=WRAP_TAG)


def _patch_dist_util_user(module) -> None:
    patch_dist_util(__import__(DIST_UTIL_MODULE, fromlist=["x"]))
    # a module that bound the name before distributed_util's was replaced gets its own layer
    if hasattr(module, "stateless_init_process_group"):
        patch_dist_util(module)


def install() -> None:
    """Install every seam in this process (idempotent). Callers check the CPU mode first."""
    global _INSTALLED
    _patch_torch_cuda()
    after_import(REPLAY_BUFFER_MODULE, _patch_replay_buffer)
    around_import(RING_ATTN_MODULE, _flash_attn_placeholder)
    after_import(DIST_UTIL_MODULE, patch_dist_util)
    for name in DIST_UTIL_USERS:
        after_import(name, _patch_dist_util_user)
    _INSTALLED = True
