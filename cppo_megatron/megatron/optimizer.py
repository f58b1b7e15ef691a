"""Megatron DDP and optimizer for the policy, set up for the loss normalisation of
``passes.policy_loss`` (global kept-set denominators: no division by the number of
micro-batches, DDP sums over DP ranks)."""

from __future__ import annotations

from .convert import unwrap_model
from .cpu_mode import check_cpu_supported, cpu_mode

__all__ = ["build_ddp_and_optimizer"]


def build_ddp_and_optimizer(
    model,
    *,
    lr: float = 1e-6,
    weight_decay: float = 0.0,
    adam_betas: tuple = (0.9, 0.999),
    adam_eps: float = 1e-8,
    use_distributed_optimizer: bool = False,
):
    """Wrap ``model`` in Megatron DDP and build Megatron's optimizer for it (float32).

    Sets the model config so the schedules neither divide the loss by the number of
    micro-batches nor DDP average over DP ranks: ``policy_loss`` already divides by the
    global kept-set denominators. Returns (ddp_model, optimizer).
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    check_cpu_supported(use_distributed_optimizer=use_distributed_optimizer)
    config = unwrap_model(model).config
    config.calculate_per_token_loss = True  # no division by #micro-batches, DDP sums over DP

    def finalize(models, num_tokens=None, **kw):  # the loss is already globally normalised
        return finalize_model_grads(models, None, **kw)

    config.finalize_model_grads_func = finalize
    with cpu_mode():
        ddp = DistributedDataParallel(
            config=config,
            ddp_config=DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                use_distributed_optimizer=use_distributed_optimizer,
            ),
            module=model,
        )
        opt = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=lr,
                weight_decay=weight_decay,
                adam_beta1=adam_betas[0],
                adam_beta2=adam_betas[1],
                adam_eps=adam_eps,
                params_dtype=config.params_dtype,
                bf16=config.bf16,
                fp16=config.fp16,
                use_distributed_optimizer=use_distributed_optimizer,
                clip_grad=0.0,  # clipping is done by policy_update (CUDA-only in megatron 0.16)
            ),
            [ddp],
        )
    config.no_sync_func = ddp.no_sync
    return ddp, opt
