"""Smallest reproduction of "ZeRO-3 with more than one rank gives wrong numbers on CPU" (issue 29).

No OpenRLHF, no CPPO, no Ray: a random-init Qwen2 (2 layers, hidden 64, fixed seed, saved as an HF
directory and loaded with ``from_pretrained`` under ``HfDeepSpeedConfig`` -> ``deepspeed.zero.Init``,
as OpenRLHF's Actor does), one DeepSpeed engine per run, DeepSpeed's CPU accelerator on gloo. Each
run does, on the same 6 rows split evenly over N ranks:

1. one forward/backward/step of the mean per-token NLL (every rank holds 6/N equal-length rows, so
   DeepSpeed's gradient average over ranks is the global mean for any N);
2. a no-grad forward after the step;
3. optionally (``--eval``) a second engine built from OpenRLHF's *eval* config (the reference
   model's) and its no-grad forward.

It prints the loss, DeepSpeed's global gradient norm, and max |log-prob difference| against the
1-rank run of the same variant, for the train forward, the post-step forward and the eval engine,
and every parameter whose gathered value differs from the saved weight (after ``from_pretrained``,
after ``deepspeed.initialize``, in the eval engine). A run with right numbers gives the same loss
and grad norm for every N and equal log-probs before the step. On DeepSpeed 0.19.6's CPU
accelerator the multi-rank ZeRO-3 runs are wrong *intermittently* (garbage in gathered weights;
docs/records/openrlhf_cpu_mode.md, "ZeRO-3 with more than one rank"): repeat a rank count to see it,
e.g. ``--ranks 1 3 3 3``. DeepSpeed compiles its CPU ops (fused Adam, shm comm) on first use into
``TORCH_EXTENSIONS_DIR``.

    DS_ACCELERATOR=cpu .venv-vllm/bin/python scripts/zero3_cpu_repro.py --ranks 1 2 3 \\
        --variant openrlhf --variant openrlhf-fp32

``--variant`` names one of VARIANTS below (``--list`` prints them); ``--set KEY=JSON`` changes one
key of every variant's train and eval configs (dotted path, e.g. ``--set zero_optimization.reduce_scatter=false``;
``--unset KEY`` removes one). The ``openrlhf`` variant is exactly what OpenRLHF 0.11.2's
``get_train_ds_config`` / ``get_eval_ds_config`` build for the 7B recipe (``ds.zero_stage 3``,
``ds.param_dtype bf16``, defaults elsewhere), with the optimizer section its ``prepare`` adds.
Each N runs in its own process group (``torch.multiprocessing`` spawn, gloo, localhost).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import sys
import tempfile

import torch
import torch.multiprocessing as mp

ROWS, SEQ, VOCAB = 6, 16, 256  # 6 rows split evenly over 1, 2 or 3 ranks

ADAMW = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}}


def openrlhf_train_config(bf16: bool = True) -> dict:
    """OpenRLHF 0.11.2 ``get_train_ds_config(offload=False, adam_offload=False, stage=3,
    param_dtype='bf16', max_norm=1.0, zpg=1)`` plus the optimizer section and batch sizes."""
    return {
        "steps_per_print": 100,
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "none"},
            "offload_optimizer": {"device": "none", "pin_memory": True},
            "sub_group_size": "auto",
            "stage3_max_live_parameters": "auto",
            "stage3_max_reuse_distance": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "reduce_bucket_size": "auto",
            "zero_hpz_partition_size": 1,
            "zero_quantized_weights": False,
            "zero_quantized_gradients": False,
            "reduce_scatter": True,
        },
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": False},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "data_types": {"grad_accum_dtype": None},
        "checkpoint": {"load_universal": False},
        "compile": {"deepcompile": False},
        "tensor_parallel": {"autotp_size": 1},
        "optimizer": copy.deepcopy(ADAMW),
    }


def openrlhf_eval_config(bf16: bool = True) -> dict:
    """OpenRLHF 0.11.2 ``get_eval_ds_config(offload=False, stage=3, param_dtype='bf16')``."""
    return {
        "steps_per_print": 100,
        "zero_optimization": {
            "stage": 3,
            "stage3_max_live_parameters": "auto",
            "stage3_max_reuse_distance": "auto",
            "stage3_param_persistence_threshold": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "offload_param": {"device": "none", "pin_memory": True},
        },
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": False},
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
        "compile": {"deepcompile": False},
        "tensor_parallel": {"autotp_size": 1},
    }


def minimal_config(bf16: bool = False) -> dict:
    return {"zero_optimization": {"stage": 3}, "bf16": {"enabled": bf16}, "optimizer": copy.deepcopy(ADAMW)}


# name -> (train config, eval config, model dtype)
VARIANTS = {
    "openrlhf": lambda: (openrlhf_train_config(True), openrlhf_eval_config(True), "bf16"),
    "openrlhf-fp32": lambda: (openrlhf_train_config(False), openrlhf_eval_config(False), "fp32"),
    "minimal-fp32": lambda: (minimal_config(False), minimal_config(False), "fp32"),
    "minimal-bf16": lambda: (minimal_config(True), minimal_config(True), "bf16"),
    "zero2-bf16": lambda: (
        {**openrlhf_train_config(True), "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}},
        {**openrlhf_eval_config(True), "zero_optimization": {"stage": 0}}, "bf16"),
}


def set_key(config: dict, dotted: str, value) -> None:
    *path, last = dotted.split(".")
    node = config
    for key in path:
        node = node.setdefault(key, {})
    if value is _UNSET:
        node.pop(last, None)
    else:
        node[last] = value


_UNSET = object()


def make_model_dir(root: str, seed: int, tied: bool) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied)
    model = Qwen2ForCausalLM(config)
    path = os.path.join(root, "model")
    model.save_pretrained(path)
    return path


def weight_errors(module, model_dir: str) -> dict:
    """Max |gathered parameter - saved weight| per wrong parameter, right after ``deepspeed.initialize``:
    tells a wrong load/partition from a wrong forward."""
    import deepspeed
    from safetensors.torch import load_file

    saved = load_file(os.path.join(model_dir, "model.safetensors"))
    errors = {}
    named = dict(getattr(module, "module", module).named_parameters())
    with deepspeed.zero.GatheredParameters(list(named.values())):
        for name, param in named.items():
            key = name if name in saved else "model.embed_tokens.weight"  # a tied lm_head is not saved
            err = (param.detach().float() - saved[key].to(param.dtype).float()).abs().max().item()
            if not err == 0.0:
                errors[name] = err
    return errors


def token_logprobs(engine, ids: torch.Tensor) -> torch.Tensor:
    logits = engine(input_ids=ids).logits[:, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # [rows, SEQ-1] fp32


def gather_rows(local: torch.Tensor, world: int) -> torch.Tensor:
    import torch.distributed as dist

    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous())
    return torch.cat(parts)  # rank r holds rows [r*k, (r+1)*k): concatenation is row order


def worker(rank: int, world: int, port: int, model_dir: str, train_cfg: dict, eval_cfg: dict | None,
           dtype: str, grad_ckpt: bool, zero_init: bool, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.integrations.deepspeed import HfDeepSpeedConfig

    deepspeed.init_distributed(dist_backend="gloo")
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    k = ROWS // world
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(1234))
    local = ids[rank * k:(rank + 1) * k]

    def load(cfg):
        cfg = {**cfg, "train_micro_batch_size_per_gpu": k, "train_batch_size": k * world}
        zero3 = cfg["zero_optimization"]["stage"] == 3 and zero_init
        dschf = HfDeepSpeedConfig(cfg) if zero3 else None  # noqa: F841 (zero.Init while alive)
        model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch_dtype, attn_implementation="sdpa")
        return model, cfg

    model, cfg = load(train_cfg)
    load_errors = weight_errors(model, model_dir)  # before deepspeed.initialize
    if grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()], config=cfg)
    engine.train()
    werr = weight_errors(engine, model_dir)
    lp = token_logprobs(engine, local)
    loss = -lp.mean()
    engine.backward(loss)
    engine.step()
    grad_norm = engine.get_global_grad_norm()
    grad_norm = float(grad_norm) if grad_norm is not None else float("nan")
    global_loss = loss.detach().float().clone()
    dist.all_reduce(global_loss)
    engine.eval()
    with torch.no_grad():
        lp_after = token_logprobs(engine, local)
    result = {"loss": global_loss.item() / world, "grad_norm": grad_norm,
              "logprobs": gather_rows(lp.detach(), world).tolist(),
              "weight_errors": werr, "load_weight_errors": load_errors,
              "logprobs_after_step": gather_rows(lp_after, world).tolist()}
    if eval_cfg is not None:
        ref_model, ecfg = load(eval_cfg)
        ref, *_ = deepspeed.initialize(model=ref_model, config=ecfg)
        ref.eval()
        result["eval_weight_errors"] = weight_errors(ref, model_dir)
        with torch.no_grad():
            result["logprobs_eval_engine"] = gather_rows(token_logprobs(ref, local), world).tolist()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, model_dir: str, train_cfg: dict, eval_cfg: dict | None, dtype: str, grad_ckpt: bool,
        zero_init: bool, tmp: str) -> dict:
    out = os.path.join(tmp, f"result-{world}.json")
    mp.start_processes(worker,
                       args=(world, free_port(), model_dir, train_cfg, eval_cfg, dtype, grad_ckpt, zero_init, out),
                       nprocs=world, start_method="spawn")
    with open(out) as f:
        return json.load(f)


def max_diff(a, b) -> float:
    return (torch.tensor(a) - torch.tensor(b)).abs().max().item()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 3], help="rank counts; 1 must come first")
    parser.add_argument("--variant", action="append", choices=sorted(VARIANTS), help="config variant (repeatable)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                        help="set a (dotted) key of the train and eval configs, e.g. bf16.enabled=false")
    parser.add_argument("--unset", action="append", default=[], metavar="KEY",
                        help="remove a key of the train and eval configs")
    parser.add_argument("--eval", action="store_true", help="also build the eval (reference) engine and compare it")
    parser.add_argument("--grad-ckpt", action="store_true", help="gradient checkpointing, as the recipes enable")
    parser.add_argument("--tied", action="store_true",
                        help="tie input and output embeddings (as the CPU toy model of the OpenRLHF recipes does)")
    parser.add_argument("--no-zero-init", action="store_true",
                        help="load the full model without HfDeepSpeedConfig (no deepspeed.zero.Init); "
                             "deepspeed.initialize partitions it")
    parser.add_argument("--seed", type=int, default=0, help="model init seed")
    parser.add_argument("--json", help="write all results here")
    parser.add_argument("--list", action="store_true", help="print the variants' train configs and exit")
    args = parser.parse_args(argv)
    if args.ranks[0] != 1:
        parser.error(f"--ranks {args.ranks}: the first must be 1 (the reference the others are compared with)")
    for n in args.ranks:
        if ROWS % n:
            parser.error(f"--ranks {n}: must divide the {ROWS} rows")
    variants = args.variant or ["openrlhf"]
    if args.list:
        for name in sorted(VARIANTS):
            print(name, json.dumps(VARIANTS[name]()[0], indent=1))
        return 0
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(tmp, args.seed, args.tied)
        print(f"{'variant':<40} {'N':>2} {'loss':>10} {'grad norm':>12} {'max|dlp| train':>15} "
              f"{'after step':>11} {'eval engine':>12}")
        for name in variants:
            train_cfg, eval_cfg, dtype = VARIANTS[name]()
            label = name
            for item in args.set:
                key, _, value = item.partition("=")
                for cfg in (train_cfg, eval_cfg):
                    set_key(cfg, key, json.loads(value))
                label += f" {key}={value}"
            for key in args.unset:
                for cfg in (train_cfg, eval_cfg):
                    set_key(cfg, key, _UNSET)
                label += f" -{key}"
            base = None
            for n in args.ranks:
                r = run(n, model_dir, train_cfg, eval_cfg if args.eval else None, dtype, args.grad_ckpt,
                      not args.no_zero_init, tmp)
                base = base or r
                row = {"variant": label, "ranks": n, "loss": r["loss"], "grad_norm": r["grad_norm"],
                       "dlp_train": max_diff(r["logprobs"], base["logprobs"]),
                       "dlp_after_step": max_diff(r["logprobs_after_step"], base["logprobs_after_step"]),
                       "dlp_eval": (max_diff(r["logprobs_eval_engine"], base["logprobs_eval_engine"])
                                    if args.eval else float("nan"))}
                rows.append(row)
                print(f"{label:<40} {n:>2} {row['loss']:>10.5f} {row['grad_norm']:>12.5g} {row['dlp_train']:>15.3g} "
                      f"{row['dlp_after_step']:>11.3g} {row['dlp_eval']:>12.3g}", flush=True)
                for key in ("load_weight_errors", "weight_errors", "eval_weight_errors"):
                    if r.get(key):
                        print(f"    rank 0 {key}: {r[key]}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
