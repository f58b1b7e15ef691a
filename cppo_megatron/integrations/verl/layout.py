"""The data-parallel share of each role's pass, as veRL 0.9.1's engines derive it: one function
(``dp_size``) for the preflight's micro-batch checks (``preflight.py``) and the micro-batch sizing
of ``cppo.allocation=false`` (``runconfig._shrink_micro_batches``).

How veRL splits a pass's rows (``workers/engine_workers.py``): the actor's update and old-policy
log-probs go over the ``actor`` mesh, the reference log-probs over the ``ref`` mesh, each
registered from its own engine's ``get_data_parallel_rank`` (``engine_workers.py:146``); every DP
rank then cuts its share into ``*_micro_batch_size_per_gpu`` pieces (``engine/utils.py:125``). Per
engine:

- FSDP (``strategy: fsdp`` / ``fsdp2``): world / Ulysses SP (``engine/fsdp/transformer_impl.py:651``),
  each engine its own device mesh, so actor and reference may differ. SP is
  ``<role>.fsdp_config.ulysses_sequence_parallel_size``, replaced by the deprecated
  ``<role>.ulysses_sequence_parallel_size`` when that is above 1 (``workers/config/actor.py:328``);
  the reference's top-level key follows the actor's top-level one (``ref/dp_ref.yaml``), its
  ``fsdp_config`` one does not.
- Megatron: megatron-core's DP world, world / (TP x PP x CP) (1 with dynamic context parallel,
  ``engine/megatron/transformer_impl.py:756``). Its parallel state is global to the process and
  initialized once, by the first Megatron engine built there (``transformer_impl.py:244`` returns
  when it is initialized). veRL builds the reference before the actor in its fused worker
  (``engine_workers.py:543``; both live in one process also as separate ``Actor`` + ``RefPolicy``
  roles of the same pool, fused by ``create_colocated_worker_cls``, the actor then first,
  ``trainer_base.py:328-335``), so a Megatron actor and reference share one layout, the first-built
  one's: ``megatron_layout_problem`` says when their keys disagree (the preflight refuses it).
- LoRA (``model.lora.rank`` > 0, ``model.lora_rank`` or ``model.lora_adapter_path``): no reference
  engine; reference log-probs run on the actor (``compute_log_prob`` with the adapter off,
  ``trainer_base.py:1703-1706``), over the actor's mesh and micro-batch size.
- No reference at all without a KL term (``algorithm.use_kl_in_reward`` or ``actor.use_kl_loss``,
  ``trainer/ppo/utils.py:75``).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["ROLES", "describe_dp", "dp_size", "megatron_layout_problem", "ref_in_actor", "ref_log_probs_on",
           "uses_reference"]

ROLES = ("actor", "ref")
FSDP_STRATEGIES = ("fsdp", "fsdp2")
MEGATRON_KEYS = ("tensor_model", "pipeline_model", "context")


def _select(config: Any, key: str, default: Any = None) -> Any:
    from omegaconf import OmegaConf

    value = OmegaConf.select(config, key, default=default)
    return default if value is None else value


def _int(config: Any, key: str, default: int = 1) -> int:
    try:
        return int(_select(config, key, default))
    except (TypeError, ValueError):
        return default


def _world(config: Any) -> int:
    return max(_int(config, "trainer.n_gpus_per_node"), 1) * max(_int(config, "trainer.nnodes"), 1)


def _strategy(config: Any, role: str) -> str:
    return str(_select(config, f"actor_rollout_ref.{role}.strategy", "") or "")


def uses_reference(config: Any) -> bool:
    """Whether veRL builds a reference pass at all (a KL term: ``need_reference_policy``)."""
    return bool(_select(config, "algorithm.use_kl_in_reward", False)) or bool(
        _select(config, "actor_rollout_ref.actor.use_kl_loss", False))


def ref_in_actor(config: Any) -> bool:
    """LoRA: the reference is the actor without its adapter, computed by the actor's engine."""
    model = "actor_rollout_ref.model"
    rank = _int(config, f"{model}.lora.rank", 0)
    if rank <= 0:
        rank = _int(config, f"{model}.lora_rank", 0)
    return rank > 0 or _select(config, f"{model}.lora_adapter_path", None) is not None


def ref_log_probs_on(config: Any) -> str | None:
    """The role whose engine computes the reference log-probs (``ref``, or ``actor`` under LoRA);
    None when the run has no reference pass."""
    if not uses_reference(config):
        return None
    return "actor" if ref_in_actor(config) else "ref"


def _megatron_sizes(config: Any, role: str) -> tuple[int, ...]:
    node = f"actor_rollout_ref.{role}.megatron"
    return tuple(max(_int(config, f"{node}.{k}_parallel_size"), 1) for k in MEGATRON_KEYS)


def _shares_megatron_state(config: Any) -> bool:
    # a Megatron reference engine beside a Megatron actor, in the same worker process
    return ref_log_probs_on(config) == "ref" and _strategy(config, "actor") == "megatron" == _strategy(config, "ref")


def _megatron_first(config: Any) -> str:
    """The role whose Megatron engine initializes the shared parallel state (``_shares_megatron_state``)."""
    hybrid = bool(_select(config, "actor_rollout_ref.hybrid_engine", True))
    separate = str(_select(config, "trainer.v1.trainer_mode", "sync")) == "separate_async"
    return "actor" if separate and not hybrid else "ref"  # Actor + RefPolicy roles: the actor's init first


def megatron_layout_problem(config: Any) -> str | None:
    """One line when a Megatron actor and a Megatron reference engine have different TP x PP x CP:
    veRL would run both on the layout of the one it builds first; None otherwise."""
    if not _shares_megatron_state(config):
        return None
    actor, ref = _megatron_sizes(config, "actor"), _megatron_sizes(config, "ref")
    if actor == ref:
        return None
    first = _megatron_first(config)
    return (f"actor_rollout_ref.ref.megatron TP x PP x CP = {' x '.join(map(str, ref))} differs from "
            f"actor_rollout_ref.actor.megatron {' x '.join(map(str, actor))}: veRL 0.9.1 builds both Megatron "
            f"engines in one worker process, where megatron-core's parallel state is initialized once, by the "
            f"{first} (built first; engine/megatron/transformer_impl.py:244), so both would run on the {first}'s "
            "layout; remove the actor_rollout_ref.ref.megatron parallel sizes (they follow the actor's) or set "
            "them equal")


def _engine_layout(config: Any, role: str) -> tuple[int, str]:
    """(DP size, how it comes about) of ``role``'s own engine."""
    world = _world(config)
    node = f"actor_rollout_ref.{role}"
    strategy = _strategy(config, role)
    if strategy == "megatron":
        if bool(_select(config, f"{node}.megatron.dynamic_context_parallel", False)):
            return 1, "Megatron with dynamic context parallel: each DP x CP group gets the whole batch"
        keys = [f"{node}.megatron.{k}_parallel_size" for k in MEGATRON_KEYS]
        sizes = list(_megatron_sizes(config, role))
        how = f"Megatron, {world} ranks / TP {sizes[0]} x PP {sizes[1]} x CP {sizes[2]}"
    elif strategy in FSDP_STRATEGIES or not strategy:
        legacy = _int(config, f"{node}.ulysses_sequence_parallel_size")
        key = f"{node}.ulysses_sequence_parallel_size" if legacy > 1 else \
            f"{node}.fsdp_config.ulysses_sequence_parallel_size"
        keys, sizes = [key], [max(_int(config, key), 1)]
        how = f"FSDP, {world} ranks / Ulysses SP {sizes[0]}"
    else:  # another engine (veomni, torchtitan): plain data parallel as far as the plugin knows
        return world, f"{strategy}, {world} ranks"
    group = math.prod(sizes)
    if world % group:
        named = " x ".join(f"{k}={v}" for k, v in zip(keys, sizes, strict=True))
        raise ValueError(f"{named} does not divide the {world} GPUs (trainer.n_gpus_per_node x trainer.nnodes) "
                         f"of {node}; pick parallel sizes whose product divides the world")
    return world // group, how


def _engine_of(config: Any, role: str) -> str:
    """The role whose engine layout ``role``'s pass runs on."""
    if role not in ROLES:
        raise ValueError(f"dp_size: role must be one of {ROLES}, got {role!r}")
    if role == "ref" and ref_in_actor(config):
        return "actor"
    if _shares_megatron_state(config):
        return _megatron_first(config)  # one megatron-core parallel state per process
    return role


def describe_dp(config: Any, role: str) -> str:
    """How ``dp_size(config, role)`` comes about, for a message (``FSDP, 4 ranks / Ulysses SP 2``)."""
    engine = _engine_of(config, role)
    how = _engine_layout(config, engine)[1]
    return how if engine == role else f"{how}, the {engine}'s engine"


def dp_size(config: Any, role: str = "actor") -> int:
    """Data-parallel ranks veRL splits a pass of ``role`` over (``actor``: update, old-policy and
    rollout log-probs; ``ref``: reference log-probs), from ``trainer.n_gpus_per_node`` x
    ``trainer.nnodes`` and the role's engine as the module doc says: FSDP world / Ulysses SP per
    engine; Megatron world / (TP x PP x CP) of the engine built first in the shared process; the
    reference under LoRA on the actor's engine. Errors name the sizes that do not divide the world."""
    return _engine_layout(config, _engine_of(config, role))[0]
