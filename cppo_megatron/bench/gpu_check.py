"""gpu-check: prove the GPU path in minutes — environment, core, megatron-core, trainer.

Four checks run one after another, each with a time budget; a check that raises, misses
a tolerance or overruns its budget fails, and the next one still runs:

1. ``environment``: GPU name and memory, torch / CUDA / NCCL versions, bf16 support, and
   what every optional backend imports (``cppo-megatron doctor`` in a subprocess, so
   importing veRL or vLLM cannot change this process).
2. ``core``: ``prune`` + allocation + balancing for 10^6 completions (10^5 with
   ``quick``) with device tensors in and out; the result must be identical to the same
   step on CPU tensors.
3. ``megatron``: megatron-core on the device (NCCL on CUDA, gloo on CPU; world size 1 in
   this process, TP 2 and PP 2 through torchrun when ``parallel`` >= 2): per-token
   log-probs of a random-init Qwen2 against the HF model in float32 and bfloat16, one
   float32 update step, its loss and grad norm against a plain-torch HF reference.
4. ``trainer``: the embedded trainer on the device: GRPO vs CPPO P = 0.875 with and
   without allocation, side by side in one process (``bench speedup``'s ``measure``):
   time per prompt, speedup, the bound from the GRPO phase split, the fraction of it, and
   how the rollout time per prompt changes with allocation's larger batch.

Every check records the peak memory it used (CUDA: ``max_memory_allocated`` reset per
check; CPU: the process's peak RSS so far). ``run_gpu_check`` writes gpu_check.json and
gpu_check.md; docs/gpu.md explains every number and tolerance.
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import resource
import subprocess
import sys
import time
import traceback
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

__all__ = [
    "CHECKS",
    "CheckResult",
    "GpuCheckSettings",
    "TOLERANCES",
    "budgets",
    "run_gpu_check",
    "write_outputs",
]

CHECKS = ("environment", "core", "megatron", "trainer")
TITLES = {
    "environment": "environment: device, versions, backends",
    "core": "core: prune + allocation + balancing, device vs CPU",
    "megatron": "megatron-core: log-probs and one update vs HF",
    "trainer": "trainer: GRPO vs CPPO P=0.875, side by side",
}

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

# Time budgets in seconds, per check: (full, quick).
# Full sizes sum to 435 s: the whole run fits the 8 minutes an offline GPU machine gives it.
# The quick budgets are loose: they must hold on a shared 2-core CI machine.
_BUDGETS = {"environment": (45, 60), "core": (60, 60), "megatron": (150, 120), "trainer": (180, 120)}
_PARALLEL_BUDGET = (120, 120)  # the torchrun part of the megatron check, on top of its budget


def budgets(quick: bool, scale: float = 1.0, parallel: int = 0) -> dict[str, float]:
    """Seconds each check may take (``scale`` stretches all of them, for slow machines)."""
    if not (isinstance(scale, (int, float)) and scale > 0):
        raise ValueError(f"budget scale must be > 0, got {scale!r}")
    out = {k: scale * v[1 if quick else 0] for k, v in _BUDGETS.items()}
    if parallel >= 2:
        out["megatron"] += scale * _PARALLEL_BUDGET[1 if quick else 0]
    return out


@dataclass(frozen=True)
class GpuCheckSettings:
    """What to run and where.

    Attributes: device (``cuda`` or ``cpu``), quick (scaled-down sizes: 10^5 completions,
    a tiny Qwen2, a tiny policy), out (directory for gpu_check.json / .md and the trainer's
    run files), seed (every random choice), budget_scale (multiplies every time budget),
    parallel (megatron TP 2 / PP 2 across this many local processes via torchrun; 0 = off),
    only (the checks to run, in ``CHECKS`` order).
    """

    device: str = "cuda"
    quick: bool = False
    out: str = "runs/gpu_check"
    seed: int = 0
    budget_scale: float = 1.0
    parallel: int = 0
    only: tuple = CHECKS

    def validate(self) -> "GpuCheckSettings":
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device cuda but torch {torch.__version__} sees no CUDA device: use --device cpu")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")
        if self.parallel not in (0, 2):
            raise ValueError(f"parallel must be 0 (off) or 2 (TP 2 and PP 2 on 2 processes), got {self.parallel!r}")
        if self.parallel and self.device == "cuda" and torch.cuda.device_count() < 2:
            raise ValueError(f"parallel=2 on cuda needs 2 GPUs, torch sees {torch.cuda.device_count()}")
        bad = [c for c in self.only if c not in CHECKS]
        if bad or not self.only:
            raise ValueError(f"checks must be among {list(CHECKS)}, got {list(self.only)}")
        budgets(self.quick, self.budget_scale)
        return self


@dataclass(frozen=True)
class CheckResult:
    """One check's outcome. ``failures`` lists each missed criterion (empty when passed);
    ``numbers`` holds everything measured; ``peak_memory_mib`` is described by
    ``memory_kind``."""

    name: str
    title: str
    passed: bool
    seconds: float
    budget_s: float
    peak_memory_mib: Optional[float]
    memory_kind: str
    numbers: dict
    failures: tuple = ()
    error: Optional[str] = None
    traceback: Optional[str] = None


# ----------------------------------------------------------------------------- helpers
def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _rss_mib() -> float:
    # ru_maxrss is KiB on Linux: the process's high-water mark, which never decreases
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@contextlib.contextmanager
def _peak_memory(device: str, box: dict):
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    try:
        yield
    finally:
        if device == "cuda":
            torch.cuda.synchronize()
            box["peak_memory_mib"] = torch.cuda.max_memory_allocated() / 2**20
            box["memory_kind"] = "CUDA max_memory_allocated during this check (this process)"
        else:
            box["peak_memory_mib"] = _rss_mib()
            box["memory_kind"] = "process peak RSS so far (CPU; never decreases)"


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _quiet_megatron() -> None:
    # megatron-core announces every missing CUDA extension; none of them matters here
    warnings.filterwarnings(
        "ignore", message=r".*(Apex|Transformer Engine|TransformerEngine|cuda_graph_scope|CUDA_DEVICE_MAX_CONNECTIONS).*"
    )
    # bf16 activations meet megatron's float32 RMSNorm weight: torch falls back to the unfused norm
    warnings.filterwarnings("ignore", message=r"Mismatch dtype between input and weight")


# ----------------------------------------------------------------------------- 1. environment
def check_environment(s: GpuCheckSettings, ctx: dict) -> tuple[dict, list[str]]:
    """Versions, devices, bf16, and ``doctor``'s table of backends (run in a subprocess)."""
    import torch.distributed as dist

    nums: dict[str, Any] = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(),
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "nccl_available": dist.is_nccl_available(),
        "gloo_available": dist.is_gloo_available(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    failures = []
    if torch.cuda.is_available():
        nums["gpus"] = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            nums["gpus"].append({"name": p.name, "memory_gib": round(p.total_memory / 2**30, 2),
                                 "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count})
        nums["cudnn"] = torch.backends.cudnn.version()
        try:
            v = torch.cuda.nccl.version()
            nums["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            nums["nccl"] = f"unavailable ({type(exc).__name__})"
        nums["bf16_supported"] = bool(torch.cuda.is_bf16_supported())
    else:
        # CPU: bf16 support means bf16 matmuls run and round as expected
        a = torch.full((4, 4), 1.0, dtype=torch.bfloat16)
        nums["bf16_supported"] = bool((a @ a).float().eq(4.0).all())
    if s.device == "cuda":
        if not nums["cuda_available"]:
            failures.append("--device cuda but no CUDA device is visible")
        if not nums["bf16_supported"]:
            failures.append("the GPU does not support bf16 (the bf16 log-prob check needs it)")
        if not nums["nccl_available"]:
            failures.append("torch.distributed has no NCCL backend")
    elif not nums["gloo_available"]:
        failures.append("torch.distributed has no gloo backend")

    # doctor's backend table, in a child process (imports are real and some have side effects)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "cppo_megatron.cli", "doctor", "--json"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(10.0, ctx["budget"] - 5.0))
        rows = json.loads(proc.stdout)["backends"] if proc.returncode == 0 else None
        if rows is None:
            failures.append(f"`cppo-megatron doctor --json` exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    except (subprocess.TimeoutExpired, json.JSONDecodeError, KeyError) as exc:
        rows = None
        failures.append(f"`cppo-megatron doctor --json` failed: {type(exc).__name__}: {str(exc)[:200]}")
    nums["doctor_seconds"] = round(time.perf_counter() - t0, 2)
    if rows is not None:
        nums["backends"] = {r["backend"]: (r["version"] if r["importable"] else f"no: {r['note'] or 'not installed'}")
                            for r in rows}
        need = {"torch", "numpy", "omegaconf", "transformers", "megatron-core"}
        for r in rows:
            if r["backend"] in need and not r["importable"]:
                failures.append(f"{r['backend']} does not import ({r['note'] or 'not installed'}): "
                                "the later checks need it (scripts/gpu_check.sh installs it offline)")
    return nums, failures


# ----------------------------------------------------------------------------- 2. core
def _core_step(rewards, gids, lengths, cfg, group_size: int, ranks: int) -> dict:
    """One CPPO decision on whatever device the inputs are: full-group advantages and
    survivors (``prune``), the allocation plan and its accounting, survivors balanced
    onto ``ranks`` ranks."""
    from ..core import AllocationPlanner, balance_partitions, prune, sequence_workload

    n = int(rewards.numel())
    res = prune(rewards, gids, cfg, step=0)
    # capacity = this step's survivors: the planner must then plan exactly every group's prompt
    planner = AllocationPlanner.from_config(cfg, capacity=res.selection.num_kept, group_size=group_size)
    planned = planner.begin_step()
    planner.record_round(n // group_size, n)
    alloc = planner.end_step(res.selection)
    kept = res.selection.kept
    w = sequence_workload(lengths[kept.to(lengths.device)], linear=cfg.workload_linear,
                          quadratic=cfg.workload_quadratic)
    part = balance_partitions(w, ranks)
    return {"advantages": res.advantages, "kept": kept, "pruned": res.selection.pruned, "planned": planned,
            "alloc": alloc, "parts": [list(map(int, p)) for p in part.parts], "imbalance": part.imbalance}


def check_core(s: GpuCheckSettings, ctx: dict) -> tuple[dict, list[str]]:
    from ..config import CPPOConfig
    from .overhead import _synthetic_step

    n = 10**5 if s.quick else 10**6
    G, P, ranks = 16, 0.875, 8
    cfg = CPPOConfig(pruning_rate=P, seed=s.seed)
    rewards, gids, lengths = _synthetic_step(n, G, s.seed)
    dev = torch.device(s.device)
    _core_step(rewards[: 64 * G], gids[: 64 * G], lengths[: 64 * G], cfg, G, ranks)  # warm-up (imports)

    t0 = time.perf_counter()
    ref = _core_step(rewards, gids, lengths, cfg, G, ranks)
    t_cpu = time.perf_counter() - t0
    r_d, g_d, l_d = rewards.to(dev), gids.to(dev), lengths.to(dev)
    _sync(s.device)
    t0 = time.perf_counter()
    got = _core_step(r_d, g_d, l_d, cfg, G, ranks)
    _sync(s.device)
    t_dev = time.perf_counter() - t0

    adv_dev = got["advantages"]
    checks = {
        "advantages_identical": bool(torch.equal(adv_dev.cpu(), ref["advantages"])),
        "advantages_on_device": adv_dev.device.type == dev.type,
        "kept_identical": bool(torch.equal(got["kept"].cpu(), ref["kept"])),
        "pruned_identical": bool(torch.equal(got["pruned"].cpu(), ref["pruned"])),
        "allocation_identical": got["planned"] == ref["planned"] and got["alloc"] == ref["alloc"],
        "balance_identical": got["parts"] == ref["parts"],
    }
    kept = int(ref["kept"].numel())
    expect_kept = (n // G) * max(1, math.floor(G * (1 - P) + 1e-9))
    nums = {
        "completions": n, "group_size": G, "pruning_rate": P, "ranks": ranks, "kept": kept,
        "prompts_planned": got["planned"], "balance_imbalance": ref["imbalance"],
        "cpu_seconds": t_cpu, "device_seconds": t_dev, "device": s.device,
        "advantages_max_abs_diff": float((adv_dev.cpu().double() - ref["advantages"].double()).abs().max()),
        **checks,
    }
    failures = [f"{k} is False (device result differs from the CPU result)" for k, v in checks.items() if not v]
    if kept != expect_kept:
        failures.append(f"kept {kept} completions, expected {expect_kept} (= {n // G} groups x k)")
    if got["planned"] != n // G:
        failures.append(f"allocation planned {got['planned']} prompts, expected {n // G} (capacity / (G (1-P)))")
    if sorted(i for p in got["parts"] for i in p) != list(range(kept)):
        failures.append("balancing lost or duplicated survivors")
    return nums, failures


# ----------------------------------------------------------------------------- 3. megatron
def megatron_sizes(quick: bool) -> dict:
    """The random-init Qwen2 and the sequences of the megatron check."""
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
    from ..core import aggregate_loss, clipped_surrogate

    n_tok = float(sum(m.sum() for m in masks))
    n_seq = float(sum(1 for m in masks if m.any()))

    def loss_fn():
        total = 0.0
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

    _quiet_megatron()
    device = torch.device("cuda", torch.cuda.current_device()) if spec["device"] == "cuda" else torch.device("cpu")
    sizes = megatron_sizes(spec["quick"])
    seed = spec["seed"]
    out: dict[str, Any] = {"tp": tp, "pp": pp}
    timings: dict[str, float] = {}

    def tick(name, t0):
        _sync(spec["device"])
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
        out["peak_memory_mib"] = _rss_mib()
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
        if not _finite(v) or v > tol:
            f.append(f"{pre}{key} = {v} exceeds the tolerance {tol}")
    loss, ref = r.get("loss"), r.get("hf_loss")
    if not (_finite(loss) and _finite(ref)) or abs(loss - ref) > t["loss_abs"] + t["loss_rel"] * abs(ref):
        f.append(f"{pre}update loss {loss} vs HF {ref}: beyond {t['loss_abs']} + {t['loss_rel']} x |loss|")
    gn, ref_gn = r.get("grad_norm"), r.get("hf_grad_norm")
    if not (_finite(gn) and _finite(ref_gn)) or ref_gn <= 0 or abs(gn - ref_gn) > t["grad_norm_rel"] * ref_gn:
        f.append(f"{pre}grad norm {gn} vs HF {ref_gn}: relative difference above {t['grad_norm_rel']}")
    post, ref_post = r.get("post_step_loss"), r.get("hf_post_step_loss")
    if not (_finite(post) and _finite(ref_post)) or abs(post - ref_post) > max(t["loss_abs"], t["post_loss_rel"] * abs(ref_post)):
        f.append(f"{pre}post-step loss {post} vs HF {ref_post}: relative difference above {t['post_loss_rel']}")
    elif not post < r["loss"]:
        f.append(f"{pre}the update step did not lower the loss on its own batch ({r['loss']} -> {post})")
    return f


def _init_single_process(backend: str) -> None:
    import torch.distributed as dist

    from ..distributed.launch import free_port

    if dist.is_initialized():
        return
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)


def check_megatron(s: GpuCheckSettings, ctx: dict) -> tuple[dict, list[str]]:
    import torch.distributed as dist

    from .._optional import require

    _quiet_megatron()
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
        mems = [r["peak_memory_mib"] for r in runs.values() if _finite(r.get("peak_memory_mib"))]
        nums["parallel_peak_memory_mib"] = max(mems) if mems else None
    else:
        nums["parallel"] = "not run (needs 2 GPUs, or --parallel 2)"
    return nums, failures


def _megatron_torchrun(s: GpuCheckSettings, ctx: dict) -> tuple[dict, Optional[str]]:
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


def _megatron_worker(spec_path: str) -> int:
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


# ----------------------------------------------------------------------------- 4. trainer
def trainer_overrides(device: str, quick: bool, seed: int) -> list[str]:
    """Recipe overrides of the trainer check (on top of the recipe defaults: arithmetic
    task, its 16-symbol character vocabulary, HF rollout)."""
    common = [f"seed={seed}", f"device={device}", "task.train_size=4000", "task.test_size=50",
              "eval.every=0", "eval.num_problems=20", "log.progress=false", "log.tensorboard=false",
              "log.plots=false", "log.checkpoint_every=0", "warmup.eval_every=1000", "warmup.eval_problems=10",
              "warmup.target_accuracy=1.0", "rollout.max_new_tokens=6", "model.max_position=32"]
    if quick:
        return common + ["threads=0", "model.hidden_size=32", "model.num_layers=2", "model.num_heads=2",
                         "model.num_kv_heads=2", "model.intermediate_size=64", "rollout.group_size=8",
                         "train.capacity=32", "warmup.max_steps=3", "warmup.batch_size=16"]
    # ~200M parameters: 12 layers of hidden 1024, MLP 4096 (the GPU is busy, the vocabulary small)
    dtype = "bfloat16" if device == "cuda" else "float32"
    return common + [f"model.dtype={dtype}", "model.hidden_size=1024", "model.num_layers=12", "model.num_heads=16",
                     "model.num_kv_heads=16", "model.intermediate_size=4096", "rollout.group_size=16",
                     "train.capacity=512", "train.lr=1e-5",
                     "warmup.max_steps=30", "warmup.batch_size=64", "warmup.lr=3e-4"]


def check_trainer(s: GpuCheckSettings, ctx: dict) -> tuple[dict, list[str]]:
    import shutil

    from .._optional import require
    from ..trainer.config import load_recipe
    from .speedup import analyse, measure, warm_start

    require("transformers", "the trainer check")
    P = 0.875
    steps, repeats, warm_steps = (1, 2, 1) if s.quick else (3, 2, 1)
    out = Path(s.out) / "trainer"
    recipe = load_recipe(None, [*trainer_overrides(s.device, s.quick, s.seed), f"out_dir={out}"])
    shutil.rmtree(out / "warmup", ignore_errors=True)  # never start from a stale run's weights
    t0 = time.perf_counter()
    warm = warm_start(recipe, out, None)
    t_warm = time.perf_counter() - t0
    rates, allocations = [0.0, P], [True, False]
    params = _count_params(warm)
    try:
        records = measure(recipe, rates, allocations, steps, repeats, warm, out, progress=False,
                          warmup_steps=warm_steps)
    finally:
        shutil.rmtree(warm.parent, ignore_errors=True)  # the start weights (up to ~0.4 GB) are not a result
    rows, split = analyse(records, rates, allocations)
    by = {(r["P"], r["allocation"]): r for r in rows}
    grpo, alloc, noalloc = by[(0.0, True)], by[(P, True)], by[(P, False)]
    m = recipe.model
    keep = ["P", "allocation", "prompts/step", "trained/step", "ms/prompt", "speedup", "bound", "of bound",
            "ms/prompt rollout", "ms/prompt update", "steps measured"]
    nums = {
        "model": {"hidden": m.hidden_size, "layers": m.num_layers, "heads": m.num_heads, "mlp": m.intermediate_size,
                  "dtype": m.dtype, "params": params},
        "group_size": recipe.rollout.group_size, "capacity": recipe.train.capacity,
        "steps_per_run_per_round": steps, "rounds": repeats, "unmeasured_warmup_steps_per_run": warm_steps, "warmup_seconds": t_warm,
        "rows": [{k: r[k] for k in keep} for r in rows],
        "t_gen_ms_per_prompt": 1e3 * split["t_gen_per_prompt_s"],
        "t_rest_ms_per_prompt": 1e3 * split["t_rest_per_prompt_s"],
        "speedup_alloc": alloc["speedup"], "speedup_noalloc": noalloc["speedup"], "bound": alloc["bound"],
        "of_bound_alloc": alloc["of bound"], "of_bound_noalloc": noalloc["of bound"],
        "rollout_ms_per_prompt": {"grpo": grpo["ms/prompt rollout"], "cppo_alloc": alloc["ms/prompt rollout"],
                                  "cppo_noalloc": noalloc["ms/prompt rollout"]},
        # < 1: the larger allocation batch makes generation cheaper per prompt (the paper's super-bound effect)
        "rollout_per_prompt_alloc_over_grpo": alloc["ms/prompt rollout"] / grpo["ms/prompt rollout"],
    }
    failures = []
    for r in rows:
        for k in ("ms/prompt", "speedup", "bound", "of bound", "ms/prompt rollout"):
            if not (_finite(r[k]) and r[k] > 0):
                failures.append(f"P={r['P']} allocation={r['allocation']}: {k} = {r[k]} is not a positive number")
        if r["steps measured"] != steps * repeats:
            failures.append(f"P={r['P']} allocation={r['allocation']}: {r['steps measured']} steps measured, "
                            f"expected {steps * repeats}")
    want_prompts = grpo["prompts/step"] / (1 - P)
    if alloc["prompts/step"] != want_prompts:
        failures.append(f"allocation drew {alloc['prompts/step']} prompts per step, expected {want_prompts:g} "
                        f"(GRPO's {grpo['prompts/step']:g} / (1 - P))")
    if noalloc["prompts/step"] != grpo["prompts/step"] or noalloc["trained/step"] != grpo["trained/step"] * (1 - P):
        failures.append(f"without allocation: {noalloc['prompts/step']} prompts and {noalloc['trained/step']} trained "
                        f"per step, expected {grpo['prompts/step']:g} and {grpo['trained/step'] * (1 - P):g}")
    if alloc["trained/step"] != grpo["trained/step"]:
        failures.append(f"with allocation {alloc['trained/step']} completions trained per step, expected GRPO's "
                        f"{grpo['trained/step']:g} (the capacity)")
    if _finite(alloc["bound"]) and abs(alloc["bound"] - _bound(P, split)) > 1e-9 * alloc["bound"]:
        failures.append("the reported bound does not follow from the GRPO phase split")
    return nums, failures


def _bound(P: float, split: dict) -> float:
    from .bound import speedup_bound

    return speedup_bound(P, split["t_gen_per_prompt_s"], split["t_rest_per_prompt_s"])


def _count_params(path: Path) -> int:
    """Parameters in a saved state dict (tied tensors counted once), read memory-mapped."""
    state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    seen, total = set(), 0
    for t in state.values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            total += t.numel()
    return total


# ----------------------------------------------------------------------------- driver
CHECK_FUNCS: dict[str, Callable[[GpuCheckSettings, dict], tuple[dict, list[str]]]] = {
    "environment": check_environment,
    "core": check_core,
    "megatron": check_megatron,
    "trainer": check_trainer,
}


def run_one(name: str, fn, s: GpuCheckSettings, budget: float) -> CheckResult:
    """Run one check, catching everything: an exception or an overrun budget is a failure."""
    box: dict = {}
    t0 = time.perf_counter()
    ctx = {"budget": budget, "deadline": t0 + budget}
    nums: dict = {}
    failures: list[str] = []
    err = tb = None
    with _peak_memory(s.device, box):
        try:
            nums, failures = fn(s, ctx)
        except Exception as exc:  # noqa: BLE001 - a failing check must not stop the others
            err = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
            tb = traceback.format_exc()
    seconds = time.perf_counter() - t0
    failures = list(failures)
    if seconds > budget:
        failures.append(f"took {seconds:.0f} s, over its budget of {budget:.0f} s")
    return CheckResult(
        name=name, title=TITLES[name], passed=err is None and not failures, seconds=seconds, budget_s=budget,
        peak_memory_mib=box.get("peak_memory_mib"), memory_kind=box.get("memory_kind", ""), numbers=nums,
        failures=tuple(failures), error=err, traceback=tb,
    )


def run_gpu_check(s: GpuCheckSettings, *, log: Callable[[str], None] = print,
                  funcs: Optional[dict] = None) -> tuple[list[CheckResult], float]:
    """Run the selected checks in order; return their results and the total seconds."""
    s.validate()
    funcs = funcs or CHECK_FUNCS
    b = budgets(s.quick, s.budget_scale, s.parallel)
    todo = [c for c in CHECKS if c in s.only]
    results = []
    t0 = time.perf_counter()
    for i, name in enumerate(todo, 1):
        log(f"gpu-check [{i}/{len(todo)}] {TITLES[name]} (budget {b[name]:.0f} s) ...")
        r = run_one(name, funcs[name], s, b[name])
        mem = f", peak {r.peak_memory_mib:.0f} MiB" if r.peak_memory_mib is not None else ""
        log(f"gpu-check [{i}/{len(todo)}] {name}: {'PASS' if r.passed else 'FAIL'} in {r.seconds:.1f} s{mem}"
            f"{'' if r.passed else ': ' + '; '.join(([r.error] if r.error else []) + list(r.failures))}")
        results.append(r)
    return results, time.perf_counter() - t0


def _jsonable(o):
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {str(k): _jsonable(v) for k, v in o.items() if not str(k).startswith("_")}
    if isinstance(o, (list, tuple)):
        return [_jsonable(v) for v in o]
    if isinstance(o, torch.Tensor):
        return _jsonable(o.tolist())
    if isinstance(o, (torch.dtype, torch.device, Path)):
        return str(o)
    return o


def write_outputs(results: list[CheckResult], s: GpuCheckSettings, total_s: float) -> dict[str, str]:
    """gpu_check.json (every number) and gpu_check.md (summary + per-check numbers) in ``s.out``."""
    from .. import __version__
    from .report import machine_info, markdown_table

    out = Path(s.out)
    out.mkdir(parents=True, exist_ok=True)
    data = {
        "tool": "cppo-megatron gpu-check",
        "version": __version__,
        "settings": asdict(s),
        "passed": all(r.passed for r in results),
        "total_seconds": total_s,
        "machine": machine_info(),
        "peak_memory_mib": {r.name: r.peak_memory_mib for r in results},
        "checks": [asdict(r) for r in results],
    }
    env = next((r for r in results if r.name == "environment"), None)
    if env is not None and env.numbers.get("gpus"):
        data["machine"]["gpus"] = env.numbers["gpus"]
    (out / "gpu_check.json").write_text(json.dumps(_jsonable(data), indent=2, allow_nan=False) + "\n")

    head = "GPU" if s.device == "cuda" else "CPU"
    gpus = env.numbers.get("gpus") if env else None
    where = (", ".join(f"{g['name']} ({g['memory_gib']} GiB)" for g in gpus) if gpus
             else f"{os.cpu_count()} CPU cores")
    lines = [
        f"# cppo-megatron gpu-check ({head}{', quick' if s.quick else ''}): "
        f"{'PASSED' if data['passed'] else 'FAILED'}",
        "",
        f"- machine: {where}; python {sys.version.split()[0]}, torch {torch.__version__}"
        f"{', CUDA ' + str(torch.version.cuda) if torch.version.cuda else ''}",
        f"- total {total_s:.1f} s; written {data['machine']['time_utc']}",
        "",
        markdown_table(
            ["check", "result", "seconds", "budget", "peak memory (MiB)"],
            [{"check": r.name, "result": "pass" if r.passed else "FAIL", "seconds": r.seconds,
              "budget": r.budget_s, "peak memory (MiB)": r.peak_memory_mib} for r in results],
            {"seconds": ".1f", "budget": ".0f", "peak memory (MiB)": ".0f"},
        ),
    ]
    for r in results:
        lines += ["", f"## {r.title}", ""]
        if not r.passed:
            lines += [f"- **FAILED**: {x}" for x in ([r.error] if r.error else []) + list(r.failures)] + [""]
        lines.append(f"- peak memory: {r.peak_memory_mib:.0f} MiB ({r.memory_kind})" if r.peak_memory_mib is not None
                     else "- peak memory: -")
        if r.name == "trainer" and r.numbers.get("rows"):
            rows = r.numbers["rows"]
            lines += ["", markdown_table(list(rows[0]), rows), ""]
            lines += [f"- {k}: {_short(v)}" for k, v in r.numbers.items() if k != "rows"]
        else:
            lines += [f"- {k}: {_short(v)}" for k, v in _flat(r.numbers)]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")
    return {"json": str(out / "gpu_check.json"), "md": str(out / "gpu_check.md")}


def _flat(d: dict, prefix: str = ""):
    for k, v in d.items():
        if str(k).startswith("_"):
            continue
        if isinstance(v, dict) and k not in ("model", "backends", "tolerances", "timings"):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _short(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_short(x)}" for k, x in v.items())
    return str(v)


if __name__ == "__main__":  # a torchrun rank of the megatron check's TP/PP part
    if len(sys.argv) == 3 and sys.argv[1] == "--megatron-worker":
        sys.exit(_megatron_worker(sys.argv[2]))
    sys.exit("usage: python -m cppo_megatron.bench.gpu_check --megatron-worker SPEC.json (used by gpu-check)")
