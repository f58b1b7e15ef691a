"""Check 3, ``megatron``: megatron-core on the device (NCCL on CUDA, gloo on CPU; world size 1
in this process, TP 2 and PP 2 through torchrun when ``parallel`` >= 2): per-token
log-probs of a random-init Qwen2 against the HF model in float32 and bfloat16, one float32
update step, its loss and grad norm against a plain-torch HF reference (``TOLERANCES``).
``megatron_worker`` is one torchrun rank (``python -m cppo_megatron.bench.gpu_check
--megatron-worker SPEC``)."""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from .common import finite, quiet_megatron, rss_mib, sync_device

if TYPE_CHECKING:
    from .settings import GpuCheckSettings

__all__ = ["TOLERANCES", "check_megatron", "judge_megatron", "megatron_sizes"]

# Pass criteria of the megatron check (max/mean over every compared token).
TOLERANCES = {
    "fp32_logprob_max_abs": 1e-3,   # megatron fp32 vs HF fp32 (TF32 off on CUDA)
    "bf16_logprob_max_abs": 0.1,    # megatron bf16 vs HF bf16: two bf16 kernel paths
    "bf16_logprob_mean_abs": 0.01,
    "loss_abs": 1e-4,               # fp32 update: pre-step loss, |diff| <= abs + rel * |loss|
    "loss_rel": 1e-3,
    "grad_norm_rel": 1e-3,          # fp32 update: grad norm before clipping
    "post_loss_rel": 1e-2,          # fp32 update: loss after the AdamW step (abs floor loss_abs)
}


def megatron_sizes(quick: bool) -> dict:
    """The random-init Qwen2 and the sequences of the megatron check."""
    model: dict[str, Any]
    if quick:
        model = dict(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                     max_position_embeddings=256)
        lengths = [9, 23, 40, 5, 17, 31]
    else:  # Qwen2.5-0.5B's shape (494M parameters), random weights
        model = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                     num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
                     max_position_embeddings=4096, rope_theta=1000000.0, rms_norm_eps=1e-6)
        lengths = [256, 31, 128, 200, 77, 160, 64, 250]
    return {"model": model, "lengths": lengths, "max_tokens": 4 * max(lengths), "lr": 1e-3 if quick else 1e-5}


def _hf_model(model_kw: dict, seed: int):
    """A random-init Qwen2 (float32, CPU) with non-zero biases and norms, so that the QKV
    bias and norm layouts are really compared."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**model_kw)).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def _hf_logprobs(model, seqs, device) -> list[torch.Tensor]:
    """[L-1] float32 log p(token t+1 | tokens <= t) per sequence from the HF model."""
    out = []
    with torch.no_grad():
        for s in seqs:
            logits = model(s[None].to(device)).logits[0, :-1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, s[1:, None].to(device)).squeeze(-1).cpu())
    return out


def _diff(a: list, b: list) -> tuple[float, float]:
    d = torch.cat([(x.float() - y.float()).abs() for x, y in zip(a, b, strict=True)])
    return float(d.max()), float(d.mean())


def _hf_update_reference(model, seqs, masks, adv, old, lr: float, device) -> tuple[float, float, float]:
    """(loss, grad norm, loss after one AdamW step) of the core's clipped surrogate with
    token-mean over the whole batch, computed on the HF model in plain torch."""
    from ...core import aggregate_loss, clipped_surrogate

    n_tok = float(sum(m.sum() for m in masks))
    n_seq = float(sum(1 for m in masks if m.any()))

    def loss_fn():
        total: torch.Tensor | float = 0.0
        for s, m, a, o in zip(seqs, masks, adv, old, strict=True):
            logits = model(s[None].to(device)).logits[0, :-1].float()
            lp = torch.log_softmax(logits, -1).gather(-1, s[1:, None].to(device)).squeeze(-1)[None]
            pg, _ = clipped_surrogate(lp, o[None].to(device), a.reshape(1).to(device))
            total = total + aggregate_loss(pg, m[None].float().to(device), "token-mean",
                                           global_num_tokens=n_tok, global_num_seqs=n_seq)
        return total

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    loss = loss_fn()
    loss.backward()
    norm = math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None))
    opt.step()
    opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        post = float(loss_fn())
    model.eval()
    return float(loss.detach()), norm, post


def _megatron_rank(spec: dict, tp: int, pp: int) -> dict:
    """Everything the megatron check measures on one rank (torch.distributed is up)."""
    import cppo_megatron.megatron as cm

    quiet_megatron()
    device = torch.device("cuda", torch.cuda.current_device()) if spec["device"] == "cuda" else torch.device("cpu")
    sizes = megatron_sizes(spec["quick"])
    seed = spec["seed"]
    out: dict[str, Any] = {"tp": tp, "pp": pp}
    timings: dict[str, float] = {}

    def tick(name, t0):
        sync_device(spec["device"])
        timings[name] = round(timings.get(name, 0.0) + time.perf_counter() - t0, 3)

    t0 = time.perf_counter()
    hf = _hf_model(sizes["model"], seed)
    out["params"] = sum(p.numel() for p in hf.parameters())
    cpu_state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    g = torch.Generator().manual_seed(seed + 2)
    vocab = sizes["model"]["vocab_size"]
    seqs = [torch.randint(0, vocab, (L,), generator=g) for L in sizes["lengths"]]
    hf.to(device)
    tick("hf_build_s", t0)

    lay = cm.init_parallel(tp, pp, seed=seed)
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        t0 = time.perf_counter()
        ref_model = hf if dtype == torch.float32 else hf.to(torch.bfloat16)
        ref = _hf_logprobs(ref_model, seqs, device)
        tick(f"hf_logprobs_{name}_s", t0)
        t0 = time.perf_counter()
        cfg = cm.transformer_config_from_hf(hf.config, tp=lay.tp, pp=lay.pp, params_dtype=dtype)
        model = cm.build_gpt_model(hf.config, config=cfg)
        state = cpu_state if dtype == torch.float32 else {k: v.to(dtype) for k, v in cpu_state.items()}
        cm.load_hf_weights(model, state, hf.config)
        tick(f"megatron_build_{name}_s", t0)
        t0 = time.perf_counter()
        lp = cm.compute_logprobs(model, seqs, max_tokens_per_micro_batch=sizes["max_tokens"])
        tick(f"megatron_logprobs_{name}_s", t0)
        out[f"logprob_max_abs_diff_{name}"], out[f"logprob_mean_abs_diff_{name}"] = _diff(lp, ref)
        if name == "bf16":
            out["logprob_max_abs_diff_bf16_vs_hf_fp32"] = _diff(lp, out.pop("_ref_fp32"))[0]
        else:
            out["_ref_fp32"] = ref
        del model
        if dtype == torch.bfloat16:
            hf.to(torch.float32)  # back to the exact float32 weights (bf16 -> fp32 is lossy: reload)
            hf.load_state_dict(cpu_state)
    out["tokens_compared"] = sum(L - 1 for L in sizes["lengths"])

    # one float32 update step, against the same step in plain torch on the HF model
    t0 = time.perf_counter()
    masks = [torch.arange(L - 1) >= min(3, L - 2) for L in sizes["lengths"]]  # the first targets are "prompt"
    adv = torch.randn(len(seqs), generator=g)
    old = _hf_logprobs(hf, seqs, device)
    model = cm.build_gpt_model(hf.config, config=cm.transformer_config_from_hf(hf.config, tp=lay.tp, pp=lay.pp))
    cm.load_hf_weights(model, cpu_state, hf.config)
    ddp, opt = cm.build_ddp_and_optimizer(model, lr=sizes["lr"])
    loss_cfg = cm.PolicyLossConfig(kl_coef=0.0)
    batch = cm.UpdateBatch(seqs, masks, adv, old)
    met = cm.policy_update(ddp, opt, batch, loss_cfg, max_tokens_per_micro_batch=sizes["max_tokens"], clip_grad=0.0)
    post = cm.policy_loss(ddp, batch, loss_cfg, max_tokens_per_micro_batch=sizes["max_tokens"], forward_only=True)
    tick("megatron_update_s", t0)
    del ddp, opt, model
    cm.destroy_parallel()
    gc.collect()  # megatron's modules hold reference cycles: free them before the HF reference step
    if spec["device"] == "cuda":
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    ref_loss, ref_norm, ref_post = _hf_update_reference(hf, seqs, masks, adv, old, sizes["lr"], device)
    tick("hf_update_s", t0)
    out.update(loss=met["loss"], grad_norm=met["grad_norm"], post_step_loss=post["loss"],
               hf_loss=ref_loss, hf_grad_norm=ref_norm, hf_post_step_loss=ref_post, timings=timings)
    del hf
    if spec["device"] == "cuda":
        out["peak_memory_mib"] = torch.cuda.max_memory_allocated() / 2**20
    else:
        out["peak_memory_mib"] = rss_mib()
    return out


def judge_megatron(r: dict, label: str = "") -> list[str]:
    """The missed criteria of one ``_megatron_rank`` result (``TOLERANCES``)."""
    t = TOLERANCES
    f = []
    pre = f"{label}: " if label else ""
    for key, tol in (("logprob_max_abs_diff_fp32", t["fp32_logprob_max_abs"]),
                     ("logprob_max_abs_diff_bf16", t["bf16_logprob_max_abs"]),
                     ("logprob_mean_abs_diff_bf16", t["bf16_logprob_mean_abs"])):
        v = r.get(key)
        if not finite(v) or v > tol:
            f.append(f"{pre}{key} = {v} exceeds the tolerance {tol}")
    loss, ref = r.get("loss"), r.get("hf_loss")
    if not (finite(loss) and finite(ref)) or abs(loss - ref) > t["loss_abs"] + t["loss_rel"] * abs(ref):
        f.append(f"{pre}update loss {loss} vs HF {ref}: beyond {t['loss_abs']} + {t['loss_rel']} x |loss|")
    gn, ref_gn = r.get("grad_norm"), r.get("hf_grad_norm")
    if not (finite(gn) and finite(ref_gn)) or ref_gn <= 0 or abs(gn - ref_gn) > t["grad_norm_rel"] * ref_gn:
        f.append(f"{pre}grad norm {gn} vs HF {ref_gn}: relative difference above {t['grad_norm_rel']}")
    post, ref_post = r.get("post_step_loss"), r.get("hf_post_step_loss")
    if not (finite(post) and finite(ref_post)) or (
            abs(post - ref_post) > max(t["loss_abs"], t["post_loss_rel"] * abs(ref_post))):
        f.append(f"{pre}post-step loss {post} vs HF {ref_post}: relative difference above {t['post_loss_rel']}")
    elif not post < r["loss"]:
        f.append(f"{pre}the update step did not lower the loss on its own batch ({r['loss']} -> {post})")
    return f


def _init_single_process(backend: str) -> None:
    import torch.distributed as dist

    from ...distributed.launch import free_port

    if dist.is_initialized():
        return
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def check_megatron(s: GpuCheckSettings, ctx: dict) -> tuple[dict, list[str]]:
    import torch.distributed as dist

    from ..._optional import require

    quiet_megatron()
    require("megatron.core", "the megatron check")
    require("transformers", "the megatron check")
    spec = {"device": s.device, "quick": s.quick, "seed": s.seed}
    backend = "nccl" if s.device == "cuda" else "gloo"
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # fp32 means fp32
    started_here = not dist.is_initialized()
    try:
        if s.device == "cuda":
            torch.cuda.set_device(0)
        _init_single_process(backend)
        one = _megatron_rank(spec, 1, 1)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved
        if started_here and dist.is_initialized():
            dist.destroy_process_group()
    one.pop("peak_memory_mib", None)  # the check's own peak covers this process
    sizes = megatron_sizes(s.quick)
    nums: dict[str, Any] = {"backend": backend, "model": sizes["model"], "world_size_1": one,
                            "tolerances": dict(TOLERANCES)}
    failures = judge_megatron(one, "world size 1")
    if s.parallel >= 2:
        if s.device == "cuda":
            gc.collect()
            torch.cuda.empty_cache()  # GPU 0 is shared with the two ranks
        runs, err = _megatron_torchrun(s, ctx)
        nums["parallel"] = runs
        if err:
            failures.append(err)
        for name, r in runs.items():
            failures += judge_megatron(r, name)
        mems = [r["peak_memory_mib"] for r in runs.values() if finite(r.get("peak_memory_mib"))]
        nums["parallel_peak_memory_mib"] = max(mems) if mems else None
    else:
        nums["parallel"] = "not run (needs 2 GPUs, or --parallel 2)"
    return nums, failures


def _megatron_torchrun(s: GpuCheckSettings, ctx: dict) -> tuple[dict, str | None]:
    """TP 2 and PP 2 on two local processes (torchrun); rank 0's results per layout."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        spec = {"device": s.device, "quick": s.quick, "seed": s.seed, "out": tmp, "layouts": [[2, 1], [1, 2]]}
        spec_path = Path(tmp) / "spec.json"
        spec_path.write_text(json.dumps(spec))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
               "-m", "cppo_megatron.bench.gpu_check", "--megatron-worker", str(spec_path)]
        env = os.environ.copy()
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // 2)))
        timeout = max(30.0, ctx["deadline"] - time.perf_counter())
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        except subprocess.TimeoutExpired:
            return {}, f"torchrun TP/PP run timed out after {timeout:.0f} s"
        runs = {}
        for rank in range(2):
            path = Path(tmp) / f"rank{rank}.json"
            if path.exists():
                for name, r in json.loads(path.read_text()).items():
                    runs[f"{name} rank {rank}"] = r
        if proc.returncode != 0 or len(runs) != 4:
            return runs, f"torchrun TP/PP run exited {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-600:]}"
        return runs, None


def megatron_worker(spec_path: str) -> int:
    """One torchrun rank of the TP/PP part: every layout in the spec, results to rank{R}.json."""
    import torch.distributed as dist

    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ["RANK"])
    if spec["device"] == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    dist.init_process_group("nccl" if spec["device"] == "cuda" else "gloo")
    try:
        res = {f"tp{tp}_pp{pp}": _megatron_rank(spec, tp, pp) for tp, pp in spec["layouts"]}
    finally:
        dist.destroy_process_group()
    for r in res.values():
        r.pop("_ref_fp32", None)
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(res))
    return 0
