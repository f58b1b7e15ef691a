"""One CPPO step inside a Megatron-core pipeline: prune over all data-parallel ranks, move
the survivors, then the log-prob passes and the update (docs/integrations/megatron.md).

Every rank runs this script (torchrun); on a CPU machine gloo and a tiny random Qwen2:

    torchrun --standalone --nproc-per-node 2 examples/megatron_step.py --tp 1   # DP 2 (~1 min on 2 cores)
    torchrun --standalone --nproc-per-node 4 examples/megatron_step.py          # TP 2 x DP 2

(`python -m torch.distributed.run` where torchrun is not on the PATH.)
"""

import argparse

import torch
import torch.distributed as dist
import transformers
from megatron.core import parallel_state as ps

import cppo_megatron.megatron as cm
from cppo_megatron import CPPOConfig
from cppo_megatron.distributed import prune_and_exchange

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2); dp = processes / tp")
args = parser.parse_args()
dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
torch.manual_seed(0)  # the same HF model on every rank
hf_model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=128)).eval()
rollout_model = hf_model  # stands in for your generation engine


def rollouts(dp_rank, prompts=4, group_size=8):
    """This DP rank's share of a step: prompts x G sequences with rewards (your rollout + reward)."""
    g = torch.Generator().manual_seed(100 + dp_rank)
    lengths = torch.randint(8, 40, (prompts * group_size,), generator=g)            # [n] int64
    token_lists = [torch.randint(0, 128, (int(n),), generator=g) for n in lengths]  # n x [L]
    loss_masks = [torch.arange(int(n) - 1) >= 4 for n in lengths]                   # n x [L-1]: response tokens
    rewards = torch.randint(0, 2, (prompts * group_size,), generator=g).float()     # [n] float32
    group_ids = torch.arange(prompts).repeat_interleave(group_size) + dp_rank * prompts  # [n], global per prompt
    return token_lists, loss_masks, rewards, group_ids, lengths


# --- the step as docs/integrations/megatron.md shows it ---
# once, after torch.distributed.init_process_group(...)
cm.init_parallel(tp=args.tp, pp=1, seed=0)
model = cm.build_gpt_model(hf_model.config)            # this rank's TP/PP shard
cm.load_hf_weights(model, hf_model.state_dict(), hf_model.config)
ref_model = cm.build_gpt_model(hf_model.config)        # frozen reference for the KL term
cm.load_hf_weights(ref_model, hf_model.state_dict(), hf_model.config)
ddp, opt = cm.build_ddp_and_optimizer(model, lr=1e-6)
cppo = CPPOConfig(pruning_rate=0.875)
loss_cfg = cm.PolicyLossConfig(clip_low=0.2, kl_coef=0.04, kl_kind="k3", loss_agg_mode="token-mean")
step = 0
token_lists, loss_masks, rewards, group_ids, lengths = rollouts(ps.get_data_parallel_rank())

# every step, on every rank, after rewards are known
res = prune_and_exchange(
    {"tokens": token_lists, "mask": loss_masks},   # this DP rank's rollouts (any fields)
    rewards, group_ids, lengths,                    # [n] each; group ids global per prompt
    cppo, step=step, group=ps.get_data_parallel_group(),
)
toks, mask = res.fields["tokens"], res.fields["mask"]  # survivors this rank now owns
old = cm.compute_logprobs(ddp, toks, max_tokens_per_micro_batch=8192)
ref = cm.compute_logprobs(ref_model, toks, max_tokens_per_micro_batch=8192)
metrics = cm.policy_update(ddp, opt, cm.UpdateBatch(toks, mask, res.advantages, old, ref), loss_cfg,
                           max_tokens_per_micro_batch=8192, clip_grad=1.0)
metrics.update(res.metrics)                          # cppo/* pruning and exchange metrics
old_on_owner = res.handle.return_to_owners(old)      # n entries, None for pruned rows
weights = cm.export_hf_weights(ddp, hf_model.config) # full HF state dict: sync the rollout engine
# --- end of the step ---

kept_here = sum(lp is not None for lp in old_on_owner)
print(f"rank {dist.get_rank()}: {len(token_lists)} rollouts, {kept_here} of them kept, {len(toks)} survivors "
      f"received; kept {metrics['cppo/num_kept']:.0f} of {metrics['cppo/num_completions']:.0f}; "
      f"loss {metrics['loss']:.4f}; {len(weights)} HF tensors exported", flush=True)
assert metrics["cppo/num_kept"] == metrics["cppo/num_completions"] * (1 - 0.875)

# --- the same step, composed (docs/integrations/megatron.md) ---
actor = cm.MegatronActor(hf_model.config, hf_model.state_dict(),
                         cm.ActorConfig(tp=args.tp, pp=1, lr=1e-6, mu=2, loss=loss_cfg))
result = actor.step(token_lists, loss_masks, rewards, group_ids, cppo, step=step)  # metrics of the step
rollout_model.load_state_dict(actor.hf_state_dict(), strict=False)  # weight sync (tied head omitted)
# --- end ---
print(f"rank {dist.get_rank()}: MegatronActor.step done, rollout model synced", flush=True)
cm.destroy_parallel()
dist.destroy_process_group()
