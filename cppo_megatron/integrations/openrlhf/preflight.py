"""Preflight of an OpenRLHF 0.11.2 run (``cppo-megatron openrlhf``): what OpenRLHF, DeepSpeed or
vLLM would refuse minutes later, after Ray, the placement groups and the model actors started —
checked on the parsed flags (after CPPO's allocation) and the model's local ``config.json``
(never downloaded), one line naming the flag and the fix (the CLI prints it and exits 2).

- ``--train.colocate_all`` (sync): actor nodes x GPUs must equal vLLM engines x vLLM TP
  (``openrlhf/cli/train_ppo_ray.py:57``, asserted after Ray and the placement group are up);
- DeepSpeed's batch: ``--train.batch_size`` must be a multiple of ``--train.micro_batch_size`` x the
  actor's data-parallel ranks (nodes x GPUs / ring-attention / DeepSpeed TP); DeepSpeed asserts
  ``train_batch = micro x grad_accum x world`` when each actor builds its engine;
- the model: ``--vllm.tensor_parallel_size`` must divide the attention heads (vLLM, at engine
  start) and ``--data.max_len`` must fit ``max_position_embeddings`` (vLLM's ``max_model_len``);
- the CPU mode: the logical GPUs Ray declares must cover the actor's nodes x GPUs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["PreflightError", "check", "problems"]


class PreflightError(ValueError):
    """An OpenRLHF setting that would fail later in a Ray actor: one line naming the flag and the fix."""


def _model_config(path: str) -> tuple[dict | None, str]:
    p = Path(os.path.expanduser(str(path or "")))
    cfg = p / "config.json"
    if not path or not cfg.is_file():
        return None, ""
    data = json.loads(cfg.read_text())
    return (data["text_config"] if isinstance(data.get("text_config"), dict) else data), str(cfg)


def problems(args: Any, *, cpu_num_gpus: int | None = None) -> list[str]:
    """Problems of parsed OpenRLHF arguments, one line each ([] when none)."""
    out: list[str] = []
    nodes, per_node = int(args.actor.num_nodes), int(args.actor.num_gpus_per_node)
    actors = nodes * per_node
    engines = int(args.vllm.num_engines or 0)
    vtp = max(int(args.vllm.tensor_parallel_size or 1), 1)
    if args.train.colocate_all and not args.train.async_enable and engines and actors != engines * vtp:
        out.append(f"--train.colocate_all needs --actor.num_nodes x --actor.num_gpus_per_node ({nodes} x {per_node} = "
                   f"{actors}) == --vllm.num_engines x --vllm.tensor_parallel_size "
                   f"({engines} x {vtp} = {engines * vtp}) "
                   f"(train_ppo_ray.py:57, after Ray starts): set --vllm.num_engines {max(actors // vtp, 1)}")
    dp = max(actors // max(int(args.ds.ring_attn_size or 1), 1) // max(int(args.ds.tensor_parallel_size or 1), 1), 1)
    micro = int(args.train.micro_batch_size)
    batch = int(args.train.batch_size)
    if not getattr(args.train, "dynamic_batch_enable", False) and micro > 0 and batch % (micro * dp):
        out.append(f"--train.batch_size {batch} is not a multiple of --train.micro_batch_size {micro} x {dp} "
                   f"data-parallel actor ranks: DeepSpeed asserts batch = micro x grad-accumulation x ranks when each "
                   f"actor builds its engine; set --train.batch_size {max(batch // (micro * dp), 1) * micro * dp}")
    if cpu_num_gpus is not None and cpu_num_gpus < actors:
        out.append(f"the CPU mode declares {cpu_num_gpus} logical GPUs (cpu.num_gpus) but --actor.num_nodes x "
                   f"--actor.num_gpus_per_node = {actors}: the actors' placement would wait forever; set cpu.num_gpus "
                   f"{actors}")
    hf, where = _model_config(args.actor.model_name_or_path)
    if hf is not None:
        heads = int(hf.get("num_attention_heads") or 0)
        if engines and heads and heads % vtp:
            out.append(f"--vllm.tensor_parallel_size {vtp} does not divide the model's {heads} attention heads "
                       f"({where}); vLLM refuses it when the engine starts: use a divisor of {heads}")
        positions = hf.get("max_position_embeddings")
        if positions and int(args.data.max_len) > int(positions):
            out.append(f"--data.max_len {args.data.max_len} exceeds the model's max_position_embeddings={positions} "
                       f"({where}); vLLM's max_model_len refuses it when the engine starts: set --data.max_len "
                       f"{positions} or less")
    return out


def check(args: Any, *, cpu_num_gpus: int | None = None) -> None:
    """Raise ``PreflightError`` with the first problem."""
    found = problems(args, cpu_num_gpus=cpu_num_gpus)
    if found:
        more = f" (and {len(found) - 1} more preflight problem(s))" if len(found) > 1 else ""
        raise PreflightError(f"preflight: {found[0]}{more}")
