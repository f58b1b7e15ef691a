"""CPPO in veRL 0.9.1's asynchronous V1 trainer modes (``trainer.v1.trainer_mode``).

- ``colocate_async`` (``verl/trainer/ppo/v1/trainer_colocate_async.py``): rollout and training
  share the workers, generation of the next batch starts before the update (partial rollout,
  ``num_warmup_batches`` batches ahead). Each step's batch still passes ``_balance_batch`` whole,
  so the hook prunes it as in ``sync``; nothing here is needed.
- ``separate_async`` (``trainer_separate_async.py``): standalone rollout replicas generate while
  the trainer runs ``parameter_sync_step`` local updates per global step, each on
  ``data.train_batch_size / parameter_sync_step`` prompts sampled from the replay buffer; weights
  go to the rollout once per global step. Each local update's batch passes ``_balance_batch``, so
  CPPO prunes every local update's groups whole (the replay buffer evicts stale groups whole,
  ``replay_buffer.py:345``, before the seam).

One wall: ``PPOTrainerSeparateAsync.__init__`` asserts ``data.train_batch_size ==
parameter_sync_step x actor.ppo_mini_batch_size`` (``trainer_separate_async.py:59``), i.e. each
local update samples exactly one mini-batch of prompts. Under CPPO a mini-batch is counted in kept
completions: allocation draws G/k times the prompts for the same kept rows (``allocation=false``
shrinks the mini-batch by k/G instead), so that equality cannot hold in prompts. Its CPPO form is
the one ``separate_async_rule`` checks: the completions kept from one local update's prompts,
``train_batch_size / parameter_sync_step x k``, fill exactly one actor mini-batch,
``ppo_mini_batch_size x G`` rows — which is veRL's rule on the recipe's sizes before allocation.
``install`` wraps that ``__init__`` so its assert sees the mini-batch in prompts
(``train_batch_size / parameter_sync_step``) while it runs; nothing else in that ``__init__``
or in ``PPOTrainer.__init__`` reads the mini-batch size (``test_async_modes`` checks the
sources), and the real value is back before any worker or update reads it.

And one veRL bug, on any platform: with ``actor_rollout_ref.hybrid_engine=false`` (rollout only on
the standalone pool, no colocated replicas) ``PPOTrainerSeparateAsync._setup`` logs with
``logger.info(..., flush=True)`` (``trainer_separate_async.py:181-185``), which Python's logging
rejects ("Logger._log() got an unexpected keyword argument 'flush'") whenever INFO is enabled —
veRL's default level (``VERL_LOGGING_LEVEL``). ``install`` gives that module a logger that drops the
``flush`` keyword and logs the line.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from ..importhook import after_import
from ..wrap import replace, wrap_methods
from .runconfig import cppo_config_from, is_cppo

__all__ = ["SEPARATE_ASYNC", "FlushTolerantLogger", "install", "separate_async_rule"]

SEPARATE_ASYNC = ("verl.trainer.ppo.v1.trainer_separate_async", "PPOTrainerSeparateAsync")
WRAP_TAG = __name__


def _sizes(config: Any) -> tuple[int, int, int, int, int]:
    cfg = cppo_config_from(config)
    group = int(config.actor_rollout_ref.rollout.n)
    psync = int(config.trainer.v1.separate_async.parameter_sync_step)
    return (int(config.data.train_batch_size), psync, int(config.actor_rollout_ref.actor.ppo_mini_batch_size),
            group, cfg.keep_for_group(group))


def separate_async_rule(config: Any) -> str:
    """Why a prepared CPPO config (allocation applied) cannot run ``separate_async``; "" when it can:
    each local update's prompts must keep exactly one actor mini-batch of completions."""
    b, psync, mini, group, keep = _sizes(config)
    if psync < 1:
        return f"trainer.v1.separate_async.parameter_sync_step={psync} must be at least 1"
    if b % psync:
        return (f"data.train_batch_size={b} (after CPPO allocation) is not a multiple of "
                f"trainer.v1.separate_async.parameter_sync_step={psync}")
    if (b // psync) * keep != mini * group:
        return (f"each of the {psync} local updates samples {b // psync} prompts and keeps "
                f"{b // psync * keep} of their completions (k={keep} of G={group}), "
                f"but actor.ppo_mini_batch_size={mini} trains {mini * group}; "
                f"set the recipe's data.train_batch_size = parameter_sync_step x ppo_mini_batch_size "
                f"({psync} x {mini} = {psync * mini} before allocation), veRL's own rule")
    return ""


def _sized_init(original):
    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        if not is_cppo(config):
            return original(self, config, *args, **kwargs)
        from omegaconf import OmegaConf, open_dict

        why = separate_async_rule(config)
        if why:
            raise ValueError(f"cppo with trainer.v1.trainer_mode=separate_async: {why}")
        key = "actor_rollout_ref.actor.ppo_mini_batch_size"
        kept_mini = OmegaConf.select(config, key)
        prompts = int(config.data.train_batch_size) // int(config.trainer.v1.separate_async.parameter_sync_step)
        with open_dict(config):
            OmegaConf.update(config, key, prompts, merge=False)  # veRL's assert counts prompts (module doc)
            try:
                return original(self, config, *args, **kwargs)
            finally:
                OmegaConf.update(config, key, kept_mini, merge=False)

    return __init__


class FlushTolerantLogger(logging.LoggerAdapter):
    """``logger`` that accepts (and drops) ``print``'s ``flush`` keyword, for veRL's
    ``logger.info(..., flush=True)`` (module doc)."""

    def log(self, level, msg, *args, **kwargs):
        kwargs.pop("flush", None)
        super().log(level, msg, *args, **kwargs)


def _patch(module) -> None:
    logger = getattr(module, "logger", None)
    if isinstance(logger, logging.Logger):
        replace(module, "logger", FlushTolerantLogger(logger, {}), tag=WRAP_TAG)
    wrap_methods(module, SEPARATE_ASYNC, {"__init__": _sized_init}, tag=WRAP_TAG, changed="veRL changed (pinned 0.9.1)")


def install() -> None:
    """Wrap ``PPOTrainerSeparateAsync.__init__`` when its module is imported (idempotent)."""
    after_import(SEPARATE_ASYNC[0], _patch)
