"""Check the Megatron-core path on local processes: HF -> megatron weights, log-probs vs
the HF model, the weight round trip, then one pruned, rebalanced CPPO update.

Runs tp * pp * dp local gloo processes on this machine (CPU mode when there is no GPU).
Without --model it uses a tiny random-init Qwen2 (no download); --model takes a local HF
model directory (Qwen2 or Llama) — keep it small on CPU.

examples:
  cppo-megatron megatron-check --tp 2 --pp 1 --dp 2
  cppo-megatron megatron-check --tp 1 --pp 2 --dp 1 --pruning-rate 0.75
"""

from __future__ import annotations

import argparse
import time

import torch


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (default 2)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    parser.add_argument("--dp", type=int, default=2, help="data-parallel size (default 2)")
    parser.add_argument("--model", default=None, help="local HF model directory (default: tiny random Qwen2)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts in the batch (default 8)")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (default 8)")
    parser.add_argument("--pruning-rate", type=float, default=0.75, help="P (default 0.75)")
    parser.add_argument("--max-tokens", type=int, default=256, help="token budget per micro-batch (default 256)")
    parser.add_argument("--seed", type=int, default=0)


def _load_hf(model_dir, seed):
    import transformers

    torch.manual_seed(seed)
    if model_dir:
        return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = transformers.Qwen2Config(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                   max_position_embeddings=256)
    return transformers.Qwen2ForCausalLM(cfg).eval()


def _batch(args, vocab):
    g = torch.Generator().manual_seed(args.seed + 1)
    n = args.prompts * args.group_size
    # long-tailed lengths, as reasoning traces are
    lengths = torch.exp(3.0 + 0.6 * torch.randn(n, generator=g)).clamp(4, 120).long()
    seqs = [torch.randint(0, vocab, (int(L),), generator=g) for L in lengths]
    rewards = torch.randint(0, 2, (n,), generator=g).double()
    gids = torch.arange(n) // args.group_size
    return seqs, rewards, gids, lengths


def _worker(rank, world, args):
    from megatron.core import parallel_state as ps

    import cppo_megatron.megatron as cm
    from cppo_megatron import CPPOConfig
    from cppo_megatron.distributed import prune_and_exchange

    hf = _load_hf(args.model, args.seed)
    lay = cm.init_parallel(args.tp, args.pp, seed=args.seed)
    model = cm.build_gpt_model(hf.config)
    cm.load_hf_weights(model, hf.state_dict(), hf.config)
    exported = cm.export_hf_weights(model, hf.config)
    sd = {k: v for k, v in hf.state_dict().items() if k in exported}
    round_trip = all(torch.equal(exported[k], sd[k].float()) for k in sd) and len(sd) == len(exported)

    seqs, rewards, gids, lengths = _batch(args, hf.config.vocab_size)
    n = len(seqs)
    bounds = [round(i * n / lay.dp) for i in range(lay.dp + 1)]
    mine = slice(bounds[lay.dp_rank], bounds[lay.dp_rank + 1])
    masks = [torch.arange(int(L) - 1) >= min(3, int(L) - 2) for L in lengths]
    t0 = time.perf_counter()
    res = prune_and_exchange({"tokens": seqs[mine], "mask": masks[mine]}, rewards[mine], gids[mine], lengths[mine],
                             CPPOConfig(pruning_rate=args.pruning_rate, seed=args.seed),
                             group=ps.get_data_parallel_group())
    t_exchange = time.perf_counter() - t0
    ddp, opt = cm.build_ddp_and_optimizer(model, lr=1e-4)
    counter = cm.ForwardCounter()
    old = cm.compute_logprobs(ddp, res.fields["tokens"], max_tokens_per_micro_batch=args.max_tokens, counter=counter)
    back = res.handle.return_to_owners(old)
    met = cm.policy_update(ddp, opt, cm.UpdateBatch(res.fields["tokens"], res.fields["mask"], res.advantages, old),
                           cm.PolicyLossConfig(kl_coef=0.0), max_tokens_per_micro_batch=args.max_tokens)
    cm.destroy_parallel()
    own = list(range(bounds[lay.dp_rank], bounds[lay.dp_rank + 1]))
    return dict(layout=lay, round_trip=round_trip, back={own[i]: lp for i, lp in enumerate(back) if lp is not None},
                seen=counter.sequences, metrics={**res.metrics, **met}, t_exchange=t_exchange)


def run(args) -> int:
    import warnings

    from ..distributed import run_local

    # megatron-core announces every missing CUDA extension; none of them matters here
    warnings.filterwarnings("ignore",
                            message=r".*(Apex|Transformer Engine|cuda_graph_scope|CUDA_DEVICE_MAX_CONNECTIONS).*")
    for name, v in (("--tp", args.tp), ("--pp", args.pp), ("--dp", args.dp)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    world = args.tp * args.pp * args.dp
    print(f"megatron-check: tp={args.tp} pp={args.pp} dp={args.dp} on {world} local processes "
          f"({'CUDA' if torch.cuda.is_available() else 'CPU mode, gloo'})")
    t0 = time.perf_counter()
    results = run_local(_worker, world, args, timeout=900, threads=1)
    hf = _load_hf(args.model, args.seed)
    seqs = _batch(args, hf.config.vocab_size)[0]
    worst = 0.0
    checked = set()
    with torch.no_grad():
        for r in results:
            for i, lp in r["back"].items():
                if i in checked:
                    continue
                checked.add(i)
                s = seqs[i]
                ref = torch.log_softmax(hf(s[None]).logits[0, :-1].float(), -1).gather(-1, s[1:, None]).squeeze(-1)
                worst = max(worst, float((ref - lp).abs().max()))
    m = results[0]["metrics"]
    print(f"  weights round trip HF -> megatron -> HF exact: {all(r['round_trip'] for r in results)}")
    print(f"  kept {int(m['cppo/num_kept'])} of {int(m['cppo/num_completions'])} completions; "
          f"log-probs of {len(checked)} survivors vs HF: max |diff| = {worst:.2e}")
    print(f"  sequences each rank forwarded: {[r['seen'] for r in results]}")
    print(f"  rank workload max/mean: {m['cppo/exchange_imbalance']:.3f} rebalanced vs "
          f"{m['cppo/exchange_imbalance_without']:.3f} if survivors stayed put; "
          f"{int(m['cppo/exchange_moved_sequences'])} sequences moved")
    print(f"  update: loss {m['loss']:.5f}, grad norm {m['grad_norm']:.5f}; exchange took "
          f"{max(r['t_exchange'] for r in results) * 1e3:.1f} ms; total {time.perf_counter() - t0:.1f} s")
    ok = worst < 1e-4 and all(r["round_trip"] for r in results)
    print("megatron-check: OK" if ok else "megatron-check: FAILED")
    return 0 if ok else 1
