"""Preflight of a veRL config: the host assertions that would otherwise fire minutes later in a
Ray worker, checked by ``cppo-megatron verl`` before Ray starts, each as one line that names the
key, the value and the fix (the CLI prints it and exits 2).

What veRL 0.9.1 / megatron-core check late, and where (sizes after CPPO's allocation):

- lr warm-up vs decay steps (Megatron actor): megatron-core's ``OptimizerParamScheduler``
  asserts ``lr_warmup_steps < lr_decay_steps`` (``megatron/core/optimizer_param_scheduler.py:157``)
  when the worker builds its optimizer; veRL takes ``lr_decay_steps`` = the run's total training
  steps unless set (``verl/utils/megatron/optimizer.py:239-249``);
- layout: ``trainer.nnodes x trainer.n_gpus_per_node`` must be a multiple of TP x PP x CP of the
  Megatron actor and reference (``verl/utils/config.py:109``) and of the rollout's TP x DP x PP
  (``verl/workers/engine_workers.py:659``); in the CPU mode of a single-node run, Ray must declare
  that many logical GPUs (``ray_kwargs.ray_init.num_gpus``) or the resource pool waits forever;
- micro-batches: the rows one data-parallel rank gets per mini-batch (update) and per step
  (old-policy / reference log-probs) must divide into ``*_micro_batch_size_per_gpu``
  (``verl/workers/engine/utils.py:125``, ``verl/utils/config.py:124``);
- the model (read from ``actor_rollout_ref.model.path``'s ``config.json`` when it is a local
  directory; nothing is downloaded): TP must divide the attention heads, the KV heads and (Megatron)
  the vocabulary (megatron-core's ``divide``, ``tensor_parallel/utils.py:118``); PP (x virtual PP)
  must divide the layers; ``data.max_prompt_length + data.max_response_length`` must fit the
  model's ``max_position_embeddings``.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from .layout import describe_dp, dp_size, megatron_layout_problem, ref_log_probs_on

__all__ = ["PreflightError", "check", "check_config", "check_model", "model_config"]


class PreflightError(ValueError):
    """A host config that would fail later in a worker: one line naming the key and the fix."""


def _get(config: Any, key: str, default: Any = None) -> Any:
    from omegaconf import OmegaConf

    value = OmegaConf.select(config, key, default=default)
    return default if value is None else value


def _int(config: Any, key: str, default: int = 0) -> int:
    value = _get(config, key, default)
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _megatron_roles(config: Any) -> list[str]:
    roles = []
    for role in ("actor", "ref"):
        if str(_get(config, f"actor_rollout_ref.{role}.strategy", "")) == "megatron":
            roles.append(role)
    return roles


def _model_parallel(config: Any, role: str) -> tuple[int, int, int]:
    base = f"actor_rollout_ref.{role}.megatron"
    return (max(_int(config, f"{base}.tensor_model_parallel_size", 1), 1),
            max(_int(config, f"{base}.pipeline_model_parallel_size", 1), 1),
            max(_int(config, f"{base}.context_parallel_size", 1), 1))


def _world(config: Any) -> int:
    return max(_int(config, "trainer.nnodes", 1), 1) * max(_int(config, "trainer.n_gpus_per_node", 1), 1)


def _total_steps(config: Any) -> int | None:
    """The run's training steps as veRL computes them, when knowable here."""
    steps = _get(config, "trainer.total_training_steps", None)
    if steps is not None:
        return int(steps)
    return None


def _rows_per_step(config: Any) -> int:
    """Completions entering the log-prob passes per step (CPPO: the kept ones)."""
    from .runconfig import cppo_config_from, is_cppo

    n = max(_int(config, "actor_rollout_ref.rollout.n", 1), 1)
    b = _int(config, "data.train_batch_size", 1)
    if is_cppo(config):
        keep = cppo_config_from(config).keep_for_group(n)
        return b * keep  # train_batch_size is already grown by allocation when this runs
    return b * n


def check_config(config: Any) -> list[str]:
    """Problems of the config alone (no model read), one line each; [] when none."""
    problems: list[str] = []
    world = _world(config)
    nodes, per_node = _int(config, "trainer.nnodes", 1), _int(config, "trainer.n_gpus_per_node", 1)
    megatron = _megatron_roles(config)

    # lr warm-up vs decay (megatron-core optimizer_param_scheduler.py:157)
    if "actor" in megatron:
        steps = _total_steps(config)
        optim = "actor_rollout_ref.actor.optim"
        decay = _get(config, f"{optim}.lr_decay_steps", None)
        decay = int(decay) if decay is not None else steps
        warmup = _int(config, f"{optim}.lr_warmup_steps", -1)
        ratio = _get(config, f"{optim}.lr_warmup_steps_ratio", None)
        if warmup <= 0 and ratio is not None and decay is not None:
            warmup = int(float(ratio) * decay)
        if decay is not None and warmup >= 0 and warmup >= decay:
            src = "trainer.total_training_steps" if _get(config, f"{optim}.lr_decay_steps", None) is None \
                else f"{optim}.lr_decay_steps"
            problems.append(
                f"{optim}.lr_warmup_steps={warmup} is not below the lr decay steps ({src}={decay}): megatron-core's "
                f"LR scheduler asserts warm-up < decay (optimizer_param_scheduler.py:157) when the workers build the "
                f"optimizer; set {optim}.lr_warmup_steps={max(decay - 1, 0)} (or fewer) or raise {src}")

    # layout: world vs TP x PP x CP of each Megatron role, and vs the rollout's TP x DP x PP
    for role in megatron:
        tp, pp, cp = _model_parallel(config, role)
        if world % (tp * pp * cp):
            problems.append(
                f"trainer.nnodes x trainer.n_gpus_per_node = {nodes} x {per_node} = {world} ranks is not a multiple of "
                f"actor_rollout_ref.{role}.megatron TP {tp} x PP {pp} x CP {cp} = {tp * pp * cp}: set "
                f"trainer.n_gpus_per_node (or the parallel sizes) so that TP x PP x CP divides the ranks")
    rtp = max(_int(config, "actor_rollout_ref.rollout.tensor_model_parallel_size", 1), 1)
    rdp = max(_int(config, "actor_rollout_ref.rollout.data_parallel_size", 1), 1)
    rpp = max(_int(config, "actor_rollout_ref.rollout.pipeline_model_parallel_size", 1), 1)
    if world % (rtp * rdp * rpp):
        problems.append(
            f"actor_rollout_ref.rollout.tensor_model_parallel_size={rtp} (x data {rdp} x pipeline {rpp}) does not "
            f"divide "
            f"the {world} ranks (trainer.nnodes x trainer.n_gpus_per_node); veRL asserts it in every worker "
            f"(engine_workers.py:659): set it to a divisor of {world}")
    ray_gpus = _get(config, "ray_kwargs.ray_init.num_gpus", None)
    address = _get(config, "ray_kwargs.ray_init.address", None)
    if str(_get(config, "trainer.device", "")) == "cpu" and address in (None, "", "local") and ray_gpus is not None:
        if int(ray_gpus) < world:
            problems.append(
                f"ray_kwargs.ray_init.num_gpus={int(ray_gpus)} logical GPUs on this one Ray node, but the layout needs "
                f"trainer.nnodes x trainer.n_gpus_per_node = {world}: veRL's resource pool would wait forever; set "
                f"ray_kwargs.ray_init.num_gpus={world}, or start a Ray cluster of {nodes} nodes and pass "
                f"ray_kwargs.ray_init.address")

    # a Megatron actor and reference share one parallel state per process (layout.py)
    shared = megatron_layout_problem(config)
    if shared:
        problems.append(shared)
    # micro-batches: rows per DP rank of each pass's role, per mini-batch (update) and per step (log-prob passes)
    if not bool(_get(config, "actor_rollout_ref.actor.use_dynamic_bsz", False)) and not problems:
        problems.extend(_micro_batch_problems(config))
    return problems


def _micro_batch_problems(config: Any) -> list[str]:
    """Each fixed micro-batch size against the rows one DP rank of its pass gets (``layout.dp_size``
    of the role that runs the pass; the reference's key only when a reference engine runs it)."""
    n = max(_int(config, "actor_rollout_ref.rollout.n", 1), 1)
    mini = _int(config, "actor_rollout_ref.actor.ppo_mini_batch_size", 0) * n
    step_rows = _rows_per_step(config)
    step = "step (the rows entering the log-prob passes)"
    checks = [("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "actor", mini,
               "mini-batch (ppo_mini_batch_size x n)"),
              ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", "actor", step_rows, step)]
    if ref_log_probs_on(config) == "ref":  # no KL: no reference pass; LoRA: the actor's engine and key
        checks.append(("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "ref", step_rows, step))
    problems: list[str] = []
    for key, role, rows, what in checks:
        micro = _get(config, key, None)
        if micro is None or int(micro) <= 0 or rows <= 0:
            continue
        micro = int(micro)
        try:
            dp = dp_size(config, role)
        except ValueError as exc:
            return [str(exc)]
        layout = f"the {dp} data-parallel ranks of the {role} ({describe_dp(config, role)})"
        if rows % dp:
            return [f"{rows} rows per {what} do not split over {layout}: make "
                    f"actor_rollout_ref.actor.ppo_mini_batch_size x rollout.n a multiple of {dp}"]
        share = rows // dp
        if share % micro:
            problems.append(
                f"{key}={micro} does not divide the {share} rows each of {layout} gets per {what}; veRL asserts it "
                f"in the worker (engine/utils.py:125): set {key}={math.gcd(share, micro)} (a divisor of {share})")
    return problems


def model_config(config: Any) -> tuple[dict | None, str]:
    """The HF ``config.json`` of ``actor_rollout_ref.model.path`` when it is a local directory
    (never downloads); (None, why) otherwise."""
    path = str(_get(config, "actor_rollout_ref.model.path", "") or "")
    if not path:
        return None, "no actor_rollout_ref.model.path"
    p = Path(os.path.expanduser(path))
    cfg = p / "config.json"
    if not cfg.is_file():
        return None, f"{path} is not a local model directory (a hub name is not fetched here)"
    data = json.loads(cfg.read_text())
    return data.get("text_config", data) if isinstance(data.get("text_config"), dict) else data, str(cfg)


def check_model(config: Any) -> list[str]:
    """Problems of the parallel and length settings against the model's own config; [] when none
    or when the model is not a local directory."""
    hf, where = model_config(config)
    if hf is None:
        return []
    problems: list[str] = []
    heads = int(hf.get("num_attention_heads") or 0)
    kv = int(hf.get("num_key_value_heads") or heads or 0)
    vocab = int(hf.get("vocab_size") or 0)
    layers = int(hf.get("num_hidden_layers") or 0)
    positions = hf.get("max_position_embeddings")
    megatron = _megatron_roles(config)
    sizes = [(f"actor_rollout_ref.{role}.megatron.tensor_model_parallel_size", _model_parallel(config, role)[0], True)
             for role in megatron]
    sizes.append(("actor_rollout_ref.rollout.tensor_model_parallel_size",
                  max(_int(config, "actor_rollout_ref.rollout.tensor_model_parallel_size", 1), 1), False))
    for key, tp, is_megatron in sizes:
        if tp <= 1:
            continue
        if heads and heads % tp:
            problems.append(f"{key}={tp} does not divide the model's {heads} attention heads ({where}): use a TP "
                            f"that divides {heads}")
        elif kv and kv % tp and is_megatron:
            problems.append(f"{key}={tp} does not divide the model's {kv} KV heads (num_key_value_heads, {where}): "
                            f"megatron-core splits query groups over TP; use a TP that divides {kv}")
        elif vocab and vocab % tp and is_megatron:
            problems.append(f"{key}={tp} does not divide the model's vocabulary of {vocab} rows ({where}): "
                            f"megatron-core splits the embedding over TP (tensor_parallel/utils.py:118); pad the "
                            f"vocabulary to a multiple of {tp} (CPU recipes: cppo_cpu.vocab_multiple) or lower TP")
    for role in megatron:
        _, pp, _ = _model_parallel(config, role)
        vpp = _int(config, f"actor_rollout_ref.{role}.megatron.virtual_pipeline_model_parallel_size", 1) or 1
        chunks = pp * max(vpp, 1)
        if layers and chunks > 1 and layers % chunks:
            key = f"actor_rollout_ref.{role}.megatron.pipeline_model_parallel_size"
            problems.append(f"{key}={pp}{f' x virtual {vpp}' if vpp > 1 else ''} does not divide the model's "
                            f"{layers} layers ({where}): use a PP that divides {layers}")
    if positions:
        prompt = _int(config, "data.max_prompt_length", 0)
        response = _int(config, "data.max_response_length", 0)
        if prompt + response > int(positions):
            problems.append(
                f"data.max_prompt_length + data.max_response_length = {prompt} + {response} = {prompt + response} "
                f"tokens exceed the model's max_position_embeddings={positions} ({where}): lower "
                f"data.max_response_length to {max(int(positions) - prompt, 0)} or less")
    return problems


def check(config: Any, *, model: bool = True) -> None:
    """Raise ``PreflightError`` with the first problem (config, then model when ``model``)."""
    problems = check_config(config)
    if not problems and model:
        problems = check_model(config)
    if problems:
        more = f" (and {len(problems) - 1} more preflight problem(s))" if len(problems) > 1 else ""
        raise PreflightError(f"preflight: {problems[0]}{more}")
