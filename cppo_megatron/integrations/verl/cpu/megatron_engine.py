"""veRL 0.9.1's Megatron engine (``actor.strategy=megatron``) on CPU: the seams it needs.

veRL's ``MegatronEngineWithLMHead`` / ``WithValueHead`` build the model through mbridge 0.15.1
(``vanilla_mbridge: true``) on megatron-core 0.16.1. Each seam below answers one place where
they assume CUDA or Transformer Engine; each is installed when its module is imported
(``importhook``), only with ``VERL_PLATFORM=cpu`` (``cpu.enable``), and acts only when the
platform is ``cpu`` and CUDA is absent — on a GPU nothing changes.

1. ``register_engines``: veRL registers the Megatron engines for devices cuda/npu only
   (``verl/workers/engine/megatron/transformer_impl.py:1171,1504``); the same classes are
   registered for ``cpu``.
2. ``cpu_rng_tracker``: ``set_random_seed`` (``verl/workers/engine/megatron/utils.py:38``)
   seeds megatron-core's CUDA RNG tracker (``megatron/core/tensor_parallel/random.py:235``
   ``torch.cuda.get_rng_state``); on CPU the tracker keeps torch CPU generator states instead,
   seeded exactly as ``model_parallel_cuda_manual_seed`` seeds its CUDA ones.
3. ``te_free_layer_spec``: mbridge's ``LLMBridge._get_transformer_layer_spec``
   (``mbridge/core/llm_bridge.py:149-151``) hard-codes Transformer Engine; on CPU it returns
   ``layer_spec.te_free_block_spec`` (TE's parameter names, sequence-parallel norms).
4. ``cuda_device_calls``: ``torch.cuda.current_device()`` used as a ``device=`` argument
   (``mbridge/core/util.py:151``, ``megatron/core/distributed/param_and_grad_buffer.py:783``,
   rotary embedding, the sequence-parallel gathers in ``tensor_parallel/mappings.py:91``) returns
   ``"cpu"``, and ``torch.cuda.synchronize`` (``pipeline_parallel/p2p_communication.py:242``) is a
   no-op, for the process, once the engine module is imported and only when CUDA is absent.
5. ``engine_cpu_mode``: literal ``device='cuda'`` (``megatron/core/optimizer/optimizer.py:473``,
   ``grad_scaler.py:15``, ``clip_grads.py:90``), ``Tensor.cuda()`` / ``.to(int)`` and
   ``param.type()`` compared with ``'torch.cuda.*Tensor'`` (``optimizer.py:671``,
   ``clip_grads.py:167``) are answered by a ``TorchFunctionMode`` entered around every method of
   the Megatron engine classes (and every ``next`` of a generator they return). A torch function
   mode is per thread: Ray runs async worker methods on an event-loop thread, not the main one,
   so the mode is entered on the thread where each call runs, never once at start-up.
6. ``cpu_attention_masks``: megatron-core's non-TE ``DotProductAttention.forward``
   (``megatron/core/transformer/dot_product_attention.py:153``) refuses packed sequences and
   cannot take veRL's 2-D ``[b, s]`` padding mask (``verl/models/mcore/model_forward.py:455``;
   ``megatron/core/transformer/utils.py:50`` fills by a broadcastable mask). On CPU the wrapper
   builds the full mask — causal | key padding for ``[b, s]`` masks, block-diagonal causal from
   ``cu_seqlens`` for packed (``thd``) inputs — and uses megatron-core's torch softmax (its fused
   kernel is CUDA-only: ``fusions/fused_softmax.py:254``).
7. ``optimizer_state_before_first_step``: without Transformer Engine or Apex, megatron-core's
   ``DistributedOptimizer.state_dict`` reads the Adam ``step`` from the per-parameter states and
   asserts there is exactly one (``megatron/core/optimizer/distrib_optimizer.py:641-642``). Loading a
   checkpoint (veRL's resume: ``megatron_checkpoint_manager.py:945`` -> ``sharded_state_dict`` ->
   ``distrib_optimizer.py:1246``) calls it on a fresh optimizer, which has no states yet, so every
   resume failed with a bare ``AssertionError``. On CPU an optimizer without states reports step 0,
   as torch's Adam does before its first step. And ``load_state_dict`` on that path gives every
   parameter's state ONE shared ``step`` tensor (``distrib_optimizer.py:817-823``), which torch's Adam
   then increments in place once per parameter (15-16 per update on each rank of the TP 2 x DP 2
   test model: bias corrections of step 16 instead of 2), and the parameter-state load copies into
   it (``:936-940``): a resumed run trained with other updates than a run never stopped. On CPU,
   after the load every parameter state gets its own ``step``: the checkpoint's (its param groups').
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import random
import threading
from collections.abc import Iterator
from typing import Any

import torch

from ...importhook import after_import
from ...wrap import replace, wrap

__all__ = [
    "ATTENTION_MODULE",
    "DISTRIB_OPTIMIZER_MODULE",
    "ENGINE_MODULE",
    "LLM_BRIDGE_MODULE",
    "MEGATRON_ENGINES",
    "CPURNGStatesTracker",
    "EngineCudaToCpu",
    "attention_mask_from_cu_seqlens",
    "attention_mask_from_padding",
    "engine_cpu_mode",
    "install",
    "needed",
    "seed_cpu_rng_tracker",
]

WRAP_TAG = __name__  # marks our layers on veRL's, megatron-core's and torch's attributes (integrations/wrap.py)
ENGINE_MODULE = "verl.workers.engine.megatron.transformer_impl"
LLM_BRIDGE_MODULE = "mbridge.core.llm_bridge"
ATTENTION_MODULE = "megatron.core.transformer.dot_product_attention"
DISTRIB_OPTIMIZER_MODULE = "megatron.core.optimizer.distrib_optimizer"
# veRL 0.9.1's Megatron engine classes, by registry model type
MEGATRON_ENGINES = {"language_model": "MegatronEngineWithLMHead", "value_model": "MegatronEngineWithValueHead"}


def needed() -> bool:
    """True when the seams must act: veRL's platform is ``cpu`` and CUDA is absent."""
    if torch.cuda.is_available():
        return False
    from .seams import on_cpu

    return on_cpu()


# ------------------------------------------------------------------------ 1. engine registry
def register_engines(module) -> None:
    """Register veRL's Megatron engine classes for device ``cpu`` (backend ``megatron``)."""
    from verl.workers.engine.base import EngineRegistry

    for model_type, clsname in MEGATRON_ENGINES.items():
        cls = getattr(module, clsname, None)
        if cls is None:
            raise RuntimeError(f"cppo cpu mode: {ENGINE_MODULE}.{clsname} is gone; veRL changed (pinned 0.9.1)")
        if "cpu" not in EngineRegistry._engines.get(model_type, {}).get("megatron", {}):
            EngineRegistry.register(model_type=model_type, backend=["megatron"], device=["cpu"])(cls)


# ------------------------------------------------------------------------ 2. RNG tracker
class CPURNGStatesTracker:
    """megatron-core's RNG-states tracker interface (``add``, ``fork``, ``get_states``,
    ``set_states``, ``reset``, ``is_initialized``) over torch's CPU generator.

    The semantics of megatron-core 0.16's ``CudaRNGStatesTracker`` (``tensor_parallel/random.py:
    161-278``) with the CPU generator in place of the CUDA one: ``add(name, seed)`` stores the state
    of a generator seeded with ``seed``; ``fork(name)`` runs the block on the named stream and keeps
    its advanced state for the next fork, then restores the caller's stream. A fork inside another
    fork first stores the outer stream's progress (so a nested fork of the same name continues it
    rather than replaying it), as megatron's ``_current_state_name`` bookkeeping does.
    ``tests/integrations/verl/test_cpu_megatron_engine.py`` runs megatron-core's own tracker on CPU
    generator states side by side and compares the draws.
    """

    DEFAULT = "default-rng"  # megatron's name for the caller's stream (never stored)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()
        self._current_state_name = self.DEFAULT

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"cpu rng tracker: seed {seed} already exists")
        if name in self.states_:
            raise ValueError(f"cpu rng tracker: state {name!r} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(int(seed)).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise KeyError(f"cpu rng tracker: state {name!r} is not added")
        outer, outer_name = torch.get_rng_state(), self._current_state_name
        if outer_name != self.DEFAULT:
            self.states_[outer_name] = outer  # the enclosing fork's progress so far
        torch.set_rng_state(self.states_[name])
        self._current_state_name = name
        try:
            yield
        finally:
            if self._current_state_name != name:
                raise RuntimeError(f"cpu rng tracker: stream {self._current_state_name!r} is current at the end "
                                   f"of fork({name!r})")
            self.states_[name] = torch.get_rng_state()  # the named stream advanced
            if outer_name != self.DEFAULT:
                outer = self.states_[outer_name]
            torch.set_rng_state(outer)
            self._current_state_name = outer_name


def seed_cpu_rng_tracker(seed: int) -> CPURNGStatesTracker:
    """Install a ``CPURNGStatesTracker`` as megatron-core's tracker, seeded like
    ``model_parallel_cuda_manual_seed(seed)`` (data-parallel, tensor-parallel, expert states)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel import random as mrandom

    tracker = CPURNGStatesTracker()
    offset = int(seed) + 2718
    tracker.add(mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, int(seed))
    tracker.add(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME, offset + mpu.get_tensor_model_parallel_rank())
    tracker.add(mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME,
                int(seed) + 1024 + 100 * mpu.get_expert_model_parallel_rank()
                + mpu.get_expert_tensor_parallel_rank())
    mrandom._CUDA_RNG_STATE_TRACKER = tracker
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    return tracker


def _cpu_set_random_seed(original):
    @functools.wraps(original)
    def set_random_seed(seed):
        if not needed():
            return original(seed)
        import numpy as np

        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        seed_cpu_rng_tracker(seed)

    return set_random_seed


# ------------------------------------------------------------------------ 3. layer spec
def _te_free_layer_spec(original):
    @functools.wraps(original)
    def _get_transformer_layer_spec(self, vp_stage=None):
        if not needed():
            return original(self, vp_stage)
        from .layer_spec import te_free_block_spec

        self.has_vp_stage = True  # read by LLMBridge._model_provider (megatron-core 0.16 takes vp_stage)
        return te_free_block_spec(self.config, vp_stage=vp_stage)

    return _get_transformer_layer_spec


def _patch_llm_bridge(module) -> None:
    cls = getattr(module, "LLMBridge", None)
    current = getattr(cls, "_get_transformer_layer_spec", None) if cls is not None else None
    if cls is None or current is None:
        raise RuntimeError("cppo cpu mode: mbridge LLMBridge._get_transformer_layer_spec is gone "
                           "(pinned mbridge 0.15.1)")
    wrap(cls, "_get_transformer_layer_spec", _te_free_layer_spec, tag=WRAP_TAG)


# ------------------------------------------------------------------------ 4. torch.cuda calls
def _cpu_current_device() -> str:
    return "cpu"


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def install_cuda_device_calls() -> bool:
    """Make ``torch.cuda.current_device()`` return ``"cpu"`` and ``torch.cuda.synchronize`` a
    no-op for this process when CUDA is absent; returns whether it did (idempotent)."""
    if torch.cuda.is_available():
        return False
    # CUDA streams (Megatron-Bridge's DDP wrap: megatron/training/models/dist_utils.py:246 makes a
    # side stream, waits on the current one and enters it): a stream that orders nothing on CPU
    for name, replacement in (("current_device", _cpu_current_device), ("synchronize", _noop),
                              ("Stream", _CpuStream), ("current_stream", _cpu_current_stream),
                              ("stream", _cpu_stream_context)):
        replace(torch.cuda, name, replacement, tag=WRAP_TAG)
    return True


class _CpuStream:
    """``torch.cuda.Stream`` on CPU: work runs in program order, so there is nothing to order."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True


_CPU_STREAM = _CpuStream()


def _cpu_current_stream(device: Any = None) -> _CpuStream:
    return _CPU_STREAM


@contextlib.contextmanager
def _cpu_stream_context(stream: Any = None) -> Iterator[None]:
    yield


# ------------------------------------------------------------------------ 5. engine cpu mode
def _cuda_to_cpu_base():
    from ....megatron.cpu_mode import CudaToCpu

    return CudaToCpu


def _is_int_device(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class EngineCudaToCpu(_cuda_to_cpu_base()):  # type: ignore[misc]
    """Our Megatron actor's ``CudaToCpu`` mode (cuda devices -> cpu, ``.cuda()`` a no-op,
    ``Tensor.type()`` reporting ``torch.cuda.*`` names for megatron-core's optimizers) plus what
    veRL's engine needs: an int device (``.to(0)``, ``device=0``) is the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_int_device(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_int_device(args[1]):
            args = (args[0], "cpu", *args[2:])
        return super().__torch_function__(func, types, args, kwargs)


_local = threading.local()


@contextlib.contextmanager
def engine_cpu_mode() -> Iterator[bool]:
    """Enter ``EngineCudaToCpu`` on this thread (re-entrant; a no-op when not ``needed()``).
    Yields whether the mode is active."""
    if getattr(_local, "depth", 0) > 0:
        yield True
        return
    if not needed():
        yield False
        return
    _local.depth = 1
    try:
        with EngineCudaToCpu():
            yield True
    finally:
        _local.depth = 0


def _in_mode_generator(gen):
    """A generator that runs each step of ``gen`` inside ``engine_cpu_mode`` on the thread that
    asks for it (the per-tensor weight export is drained by the rollout adapter, later)."""
    while True:
        with engine_cpu_mode():
            try:
                item = next(gen)
            except StopIteration:
                return
        yield item


def _wrap_result(result):
    if inspect.isgenerator(result):
        return _in_mode_generator(result)
    if isinstance(result, tuple) and any(inspect.isgenerator(x) for x in result):
        return tuple(_in_mode_generator(x) if inspect.isgenerator(x) else x for x in result)
    return result


def _in_mode(fn):
    @functools.wraps(fn)
    def method(*args, **kwargs):
        with engine_cpu_mode():
            return _wrap_result(fn(*args, **kwargs))

    return method


def _wrap_engine_methods(cls) -> list[str]:
    """Wrap every plain method ``cls`` has (own or inherited) in ``engine_cpu_mode``."""
    done = []
    for name in dir(cls):
        if name.startswith("__") and name != "__init__":
            continue
        # an inherited method the base class's pass wrapped already is seen through
        if inspect.isfunction(inspect.getattr_static(cls, name)) and wrap(cls, name, _in_mode, tag=WRAP_TAG):
            done.append(name)
    return done


def _patch_engine_module(module) -> None:
    register_engines(module)
    install_cuda_device_calls()
    if getattr(module, "set_random_seed", None) is None:
        raise RuntimeError(f"cppo cpu mode: {ENGINE_MODULE}.set_random_seed is gone; veRL changed (pinned 0.9.1)")
    wrap(module, "set_random_seed", _cpu_set_random_seed, tag=WRAP_TAG)
    for clsname in ("MegatronEngine", *MEGATRON_ENGINES.values()):
        _wrap_engine_methods(getattr(module, clsname))


# ------------------------------------------------------------------------ 6. attention masks
def attention_mask_from_padding(valid: torch.Tensor) -> torch.Tensor:
    """Megatron's boolean attention mask (True = masked) for a padded batch.

    Args:
        valid: [b, s] bool, True at real tokens (veRL's ``attention_mask_bshd``).
    Returns: [b, 1, s, s] bool: key j is masked for query i when j > i or key j is padding.
    """
    if valid.dim() != 2:
        raise ValueError(f"attention_mask_from_padding: need a [b, s] mask, got shape {tuple(valid.shape)}")
    s = valid.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=valid.device).triu(1)
    return causal[None, None] | ~valid.bool()[:, None, None, :]


def attention_mask_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Block-diagonal causal mask (True = masked) for ``total`` packed tokens.

    Args:
        cu_seqlens: [n + 1] int, cumulative sequence starts (0, l1, l1 + l2, ...).
        total: T, the packed length (tokens past ``cu_seqlens[-1]`` form one more block).
    Returns: [1, 1, T, T] bool.
    """
    cu = cu_seqlens.to(torch.int64).cpu()
    if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or bool((cu[1:] < cu[:-1]).any()) or int(cu[-1]) > total:
        raise ValueError(f"attention_mask_from_cu_seqlens: bad cu_seqlens {cu.tolist()} for {total} tokens")
    seq = torch.bucketize(torch.arange(total), cu[1:], right=True)  # sequence index of each token
    same = seq[:, None] == seq[None, :]
    causal = torch.ones(total, total, dtype=torch.bool).triu(1)
    return (causal | ~same)[None, None]


def _cpu_attention(original):
    @functools.wraps(original)
    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if not needed():
            return original(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                            attention_bias=attention_bias, packed_seq_params=packed_seq_params, **kwargs)
        self.scale_mask_softmax.scaled_masked_softmax_fusion = False  # the fused kernel is CUDA-only
        packed = packed_seq_params is not None
        if packed:
            if getattr(packed_seq_params, "qkv_format", "thd") != "thd":
                raise ValueError(f"cppo cpu mode: packed qkv_format={packed_seq_params.qkv_format!r}; only 'thd'")
            cu = packed_seq_params.cu_seqlens_q_padded
            cu = packed_seq_params.cu_seqlens_q if cu is None else cu
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)  # [t, 1, np, hn]
            attention_mask = attention_mask_from_cu_seqlens(cu, query.shape[0]).to(query.device)
        elif attention_mask is not None and attention_mask.dim() == 2:
            attention_mask = attention_mask_from_padding(attention_mask)
        return original(self, query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                        attention_bias=attention_bias, packed_seq_params=None, **kwargs)

    return forward


def _patch_attention(module) -> None:
    cls = getattr(module, "DotProductAttention", None)
    current = cls.__dict__.get("forward") if cls is not None else None
    if cls is None or current is None:
        raise RuntimeError("cppo cpu mode: megatron-core DotProductAttention.forward is gone (pinned 0.16.1)")
    wrap(cls, "forward", _cpu_attention, tag=WRAP_TAG)


# ------------------------------------------------------------------------ 7. optimizer state at load
def _state_dict_before_first_step(original, module):
    @functools.wraps(original)
    def state_dict(self):
        if not needed() or module.HAVE_APEX_OR_TE or len(self.optimizer.state) > 0:
            return original(self)
        # distrib_optimizer.py:641-642 takes 'step' from the per-parameter states; a fresh
        # optimizer (a checkpoint about to be loaded into it) has none: step 0, as torch's Adam
        inner = self.optimizer.state_dict()
        out: dict[str, Any] = {"optimizer": {k: v for k, v in inner.items() if k != "state"}}
        for group in out["optimizer"]["param_groups"]:
            del group["params"]
            group["step"] = 0
        if self.grad_scaler:
            out["grad_scaler"] = self.grad_scaler.state_dict()
        return out

    return state_dict


def _own_step_per_parameter(original, module):
    @functools.wraps(original)
    def load_state_dict(self, state_dict):
        out = original(self, state_dict)
        if not needed() or module.HAVE_APEX_OR_TE or "optimizer" not in state_dict:
            return out
        steps = {g["step"] for g in state_dict["optimizer"].get("param_groups", []) if "step" in g}
        if len(steps) == 1:  # distrib_optimizer.py:817-823 shares one tensor among all states
            step = float(steps.pop())
            for st in self.optimizer.state.values():
                if "step" in st:
                    st["step"] = torch.tensor(step, dtype=torch.float32)
        return out

    return load_state_dict


def _patch_distrib_optimizer(module) -> None:
    cls = getattr(module, "DistributedOptimizer", None)
    names = ("state_dict", "load_state_dict")
    if cls is None or any(n not in cls.__dict__ for n in names) or not hasattr(module, "HAVE_APEX_OR_TE"):
        raise RuntimeError("cppo cpu mode: megatron-core DistributedOptimizer.state_dict / load_state_dict are gone "
                           "(pinned 0.16.1)")
    for name, make in zip(names, (_state_dict_before_first_step, _own_step_per_parameter), strict=True):
        wrap(cls, name, functools.partial(make, module=module), tag=WRAP_TAG)


def install() -> None:
    """Install the seven seams as their modules are imported (idempotent); each acts only when
    ``needed()``. Called by ``cpu.enable`` with ``VERL_PLATFORM=cpu`` (with
    ``megatron_bridge.install``, the seams of the Megatron-Bridge route)."""
    after_import(ENGINE_MODULE, _patch_engine_module)
    after_import(LLM_BRIDGE_MODULE, _patch_llm_bridge)
    after_import(ATTENTION_MODULE, _patch_attention)
    after_import(DISTRIB_OPTIMIZER_MODULE, _patch_distrib_optimizer)
