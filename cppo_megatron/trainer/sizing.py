"""Per-rank memory of a recipe before anything starts: will it fit?

``estimate(recipe, nproc)`` sizes every kind of rank of a run from the model's architecture
alone (the recipe's ``model`` fields, an HF directory's ``config.json``, or a ``config.json``
given with ``--model-config`` to size a model not downloaded yet):

- the Megatron actor (``backend: megatron``; ``megatron.memory.training_memory``: weights,
  gradients, optimizer, reference, activations) — per pipeline stage;
- the rollout engine, on the ranks that generate (the first rank of each TP x PP group;
  rank 0 also evaluates): the HF copy of the whole policy in ``model.dtype`` and, during a
  weight sync, the float32 HF tensors gathered for it; with ``rollout.engine: vllm`` the vLLM
  engine instead of the HF copy's generation (its weights / ``rollout.vllm_tp`` and its KV cache,
  or on a GPU the ``rollout.vllm_gpu_memory_utilization`` share of the device), on every rank
  (vLLM's external launcher makes every process of the job a vLLM worker);
- ``backend: hf``: one process holds the whole model, its gradients, AdamW (8 B/param), the
  reference, and generates with the policy itself.

``check_fit`` compares the largest rank with ``megatron.device_memory_gb`` (0: this machine:
the CUDA device's memory, or on CPU the RAM available divided by the processes) and raises
``RecipeError`` with the numbers when it does not fit. ``cppo-megatron train RECIPE --nproc N
--dry-run`` prints the table; the launcher refuses a run that cannot fit.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import Recipe, RecipeError

__all__ = ["HEADROOM", "RankKind", "SizingReport", "check_fit", "estimate", "format_report", "machine_memory_gb",
           "on_gpu", "ram_bytes", "ram_warning", "size_run"]

GB = 1e9
HEADROOM = 0.9  # a rank may plan to use 90 % of its memory: allocator, buffers, fragmentation


@dataclass(frozen=True)
class RankKind:
    """One kind of rank and what it holds (bytes); ``ranks``: how many of the run's ranks."""

    name: str
    ranks: int
    parameters: int
    weights: int
    gradients: int
    optimizer: int
    reference: int
    activations: int
    engine: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer + self.reference + self.activations + self.engine


@dataclass(frozen=True)
class SizingReport:
    """The rank kinds of a run (largest first) and the architecture they were sized from."""

    kinds: tuple[RankKind, ...]
    model_parameters: int
    source: str
    layout: str
    notes: tuple[str, ...]

    @property
    def largest(self) -> RankKind:
        return max(self.kinds, key=lambda k: k.total)


def _hf_config(recipe: Recipe, model_config: str | None) -> tuple[Any, str]:
    """The model's HF config (architecture only: no weights are read) and where it came from."""
    import transformers

    m = recipe.model
    if model_config:
        path = Path(model_config)
        if not path.is_file():
            raise RecipeError(f"--model-config {model_config} does not exist; give an HF config.json")
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except ValueError as exc:
            raise RecipeError(f"--model-config {model_config} is not valid JSON ({exc})") from exc
        return _config_from_dict(transformers, data, str(path)), str(path)
    if m.source == "config":
        from ..tasks import build_task
        from .models import build_tokenizer

        tok = build_tokenizer(m, build_task(recipe.task).alphabet)
        cls = transformers.Qwen2Config if m.arch == "qwen2" else transformers.LlamaConfig
        cfg = cls(vocab_size=tok.vocab_size, hidden_size=m.hidden_size, num_hidden_layers=m.num_layers,
                  num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
                  intermediate_size=m.intermediate_size, max_position_embeddings=m.max_position,
                  tie_word_embeddings=m.tie_embeddings)
        return cfg, "the recipe's model section"
    if m.source == "hf_dir":
        path = Path(m.path or "") / "config.json"
        if not path.is_file():
            raise RecipeError(f"model.path {m.path} has no config.json to size the model from; download the model, "
                              "or pass its config.json with --model-config FILE")
        return _config_from_dict(transformers, json.loads(path.read_text(encoding="utf-8")), str(path)), str(path)
    from .models import resolve_gguf

    assert m.path is not None  # validate_recipe: model.source=gguf needs model.path
    gguf = resolve_gguf(m.path)
    return transformers.AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name), str(gguf)


def _config_from_dict(transformers, data: dict, where: str):
    model_type = data.get("model_type")
    classes = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig}
    if model_type not in classes:
        raise RecipeError(f"{where}: model_type {model_type!r} is not supported by the Megatron backend "
                          f"({', '.join(classes)})")
    return classes[model_type](**{k: v for k, v in data.items() if k != "model_type" and not k.startswith("_")})


def _seq_len(recipe: Recipe, hf_config) -> int:
    limit = getattr(hf_config, "max_position_embeddings", None) or recipe.model.max_position
    return int(min(limit, recipe.train.micro_batch_tokens))


def estimate(recipe: Recipe, nproc: int, *, model_config: str | None = None,
             device_gb: float | None = None) -> SizingReport:
    """The per-rank memory of ``recipe`` run on ``nproc`` processes (module docstring)."""
    from ..megatron.memory import DTYPE_BYTES, hf_parameters, kv_cache_bytes, training_memory

    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise RecipeError(f"--nproc must be an integer >= 1, got {nproc!r}")
    hf_config, source = _hf_config(recipe, model_config)
    total = hf_parameters(hf_config)
    dtype, width = recipe.model.dtype, DTYPE_BYTES[recipe.model.dtype]
    ro, t = recipe.rollout, recipe.train
    gpu = on_gpu(recipe)
    seq = _seq_len(recipe, hf_config)
    sync = total * 4  # the float32 HF tensors of a weight sync (export_hf_weights; host memory)
    notes: list[str] = []
    if ro.engine == "vllm":
        if gpu and device_gb:
            vllm_bytes = int(ro.vllm_gpu_memory_utilization * device_gb * GB)
            what = f"rollout.vllm_gpu_memory_utilization {ro.vllm_gpu_memory_utilization:g} of {device_gb:.0f} GB"
        else:
            vllm_bytes = int(total * width / ro.vllm_tp + ro.vllm_kv_cache_gb * GB)
            what = f"weights / rollout.vllm_tp {ro.vllm_tp} + KV cache {ro.vllm_kv_cache_gb:g} GB"
        hf_gen = 0
        notes.append(f"engine: vLLM ({what}) on every rank (its external launcher makes every process a vLLM "
                     "worker); rank 0 also keeps the HF policy for evaluation and final.pt")
    else:
        vllm_bytes = 0
        hf_gen = kv_cache_bytes(hf_config, ro.max_batch_sequences, seq, dtype)  # HF generate's KV cache
        notes.append("engine: the HF policy copy (model.dtype) and HF generate's KV cache (rollout.max_batch_sequences "
                     "x the longest sequence) on the ranks that generate (the first of each TP x PP group)")
    hf_copy = total * width
    # on a GPU the sync's float32 tensors sit in host RAM; on CPU they share the rank's memory
    notes.append(f"a weight sync gathers the float32 HF tensors ({sync / GB:.2f} GB) on the ranks that receive them"
                 + (" (host RAM, not counted above)" if gpu else " (counted in engine)"))
    sync_here = 0 if gpu else sync
    fused = gpu
    notes.append("activations: " + ("fused attention assumed on GPU (Transformer Engine / flash: no s x s scores)"
                                    if fused else "the local layer spec's unfused attention (s x s scores)")
                 + f", micro-batches of train.micro_batch_tokens {t.micro_batch_tokens}, sequences up to {seq}")
    if recipe.backend == "hf":
        if nproc != 1:
            raise RecipeError(f"--nproc {nproc} needs backend=megatron (backend=hf is one process)")
        acts = training_memory(hf_config, dtype=dtype, micro_batch_tokens=t.micro_batch_tokens, seq_len=seq,
                               fused_attention=fused).activations
        engine = (vllm_bytes + sync_here) if ro.engine == "vllm" else hf_gen  # HF generates with the policy itself
        kind = RankKind("the process", 1, total, hf_copy, total * width, total * 8,
                        hf_copy if t.beta > 0 else 0, acts, engine)
        return SizingReport((kind,), total, source, f"backend hf, one process, {dtype}", tuple(notes))
    tp, pp = recipe.megatron.tp, recipe.megatron.pp
    if nproc % (tp * pp):
        raise RecipeError(f"--nproc {nproc} is not divisible by megatron.tp * megatron.pp = {tp} * {pp}")
    dp = nproc // (tp * pp)
    vtp = ro.vllm_tp if ro.engine == "vllm" else 1
    # (name, ranks, pipeline stage, engine bytes): rank 0 evaluates and writes final.pt; the first
    # rank (first vllm_tp ranks) of each TP x PP group generates; the rest only train
    if ro.engine == "vllm":
        rank0 = vllm_bytes + hf_copy + sync_here
        gen = vllm_bytes + sync_here
        other = vllm_bytes
    else:
        rank0 = gen = hf_copy + hf_gen + sync_here
        other = 0
    groups = [("rank 0", 1, 0, rank0), ("generating rank", dp * vtp - 1, 0, gen),
              ("other rank" if pp == 1 else "other stage-0 rank", dp * (tp - vtp), 0, other)]
    groups += [(f"stage {s} rank", dp * tp, s, other) for s in range(1, pp)]
    kinds = []
    for name, ranks, stage, engine in groups:
        if ranks <= 0:
            continue
        mem = training_memory(hf_config, tp=tp, pp=pp, dp=dp, pp_rank=stage, dtype=dtype,
                              distributed_optimizer=recipe.megatron.distributed_optimizer, reference=t.beta > 0,
                              micro_batch_tokens=t.micro_batch_tokens, seq_len=seq, fused_attention=fused)
        kinds.append(RankKind(name, ranks, mem.parameters, mem.weights, mem.gradients, mem.optimizer, mem.reference,
                              mem.activations, engine))
    kinds.sort(key=lambda k: -k.total)
    layout = (f"backend megatron, tp {tp} x pp {pp} x dp {dp} = {nproc} processes, {dtype}, "
              f"{'distributed' if recipe.megatron.distributed_optimizer else 'plain'} optimizer")
    return SizingReport(tuple(kinds), total, source, layout, tuple(notes))


def on_gpu(recipe: Recipe) -> bool:
    """Sized as a GPU run: device cuda, or auto with CUDA here or a device_memory_gb given for a cluster."""
    import torch

    if recipe.device == "cpu":
        return False
    return recipe.device == "cuda" or torch.cuda.is_available() or recipe.megatron.device_memory_gb > 0


def machine_memory_gb(recipe: Recipe, nproc: int) -> tuple[float, str]:
    """(GB one rank may use, where that number comes from)."""
    if recipe.megatron.device_memory_gb > 0:
        return recipe.megatron.device_memory_gb, "megatron.device_memory_gb"
    import torch

    if recipe.device != "cpu" and torch.cuda.is_available():  # pragma: no cover - CUDA only
        return torch.cuda.get_device_properties(0).total_memory / GB, f"CUDA device {torch.cuda.get_device_name(0)}"
    local = min(nproc, int(os.environ.get("LOCAL_WORLD_SIZE", nproc)))
    return ram_bytes("MemTotal") / GB / local, f"this machine's RAM / {local} processes"


def ram_bytes(field: str = "MemAvailable") -> float:
    """``MemTotal`` or ``MemAvailable`` of /proc/meminfo in bytes (physical memory elsewhere)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def ram_warning(report: SizingReport, recipe: Recipe, nproc: int) -> str | None:
    """On a CPU run: a line when the ranks together need more than the RAM available now."""
    if on_gpu(recipe) or recipe.megatron.device_memory_gb > 0:
        return None
    need = sum(k.total * k.ranks for k in report.kinds)
    free = ram_bytes("MemAvailable")
    if need <= free:
        return None
    return (f"the {nproc} processes need about {need / GB:.1f} GB together, {free / GB:.1f} GB of RAM is available "
            "now: the run may swap or be killed")


def format_report(report: SizingReport, limit_gb: float | None = None, limit_source: str = "") -> str:
    """The dry run's table: one row per kind of rank, GB per term."""
    cols = ("weights", "gradients", "optimizer", "reference", "activations", "engine", "total")
    head = f"{'rank kind':<22}{'ranks':>6}" + "".join(f"{c:>12}" for c in cols)
    lines = [f"memory per rank (GB), {report.layout}; model {report.model_parameters / 1e9:.3g}B parameters "
             f"({report.source})", head]
    for k in report.kinds:
        vals = [getattr(k, c) if c != "total" else k.total for c in cols]
        lines.append(f"{k.name:<22}{k.ranks:>6}" + "".join(f"{v / GB:>12.3f}" for v in vals))
    for note in report.notes:
        lines.append(f"  {note}")
    if limit_gb is not None:
        big = report.largest
        verdict = "fits" if big.total <= HEADROOM * limit_gb * GB else "does NOT fit"
        lines.append(f"largest rank {big.total / GB:.2f} GB of {limit_gb:.1f} GB per rank ({limit_source}; "
                     f"{HEADROOM:.0%} usable): {verdict}")
    return "\n".join(lines)


def check_fit(report: SizingReport, limit_gb: float, limit_source: str) -> None:
    """RecipeError with the numbers when the largest rank needs more than ``HEADROOM`` of its memory."""
    big = report.largest
    if big.total <= HEADROOM * limit_gb * GB:
        return
    terms = ", ".join(f"{c} {getattr(big, c) / GB:.2f}" for c in ("weights", "gradients", "optimizer", "reference",
                                                                   "activations", "engine") if getattr(big, c))
    raise RecipeError(
        f"this run does not fit: a {big.name} needs {big.total / GB:.2f} GB ({terms} GB) but has "
        f"{limit_gb:.1f} GB ({limit_source}; {HEADROOM:.0%} usable). Use more processes (tp / pp / dp), "
        "model.dtype=bfloat16, megatron.distributed_optimizer=true, a smaller train.micro_batch_tokens, or set "
        "megatron.device_memory_gb to the memory your ranks really have; --dry-run prints the table")


def size_run(recipe: Recipe, nproc: int, *, model_config: str | None = None) -> tuple[SizingReport, str, list[str]]:
    """Estimate, check the fit (``RecipeError`` with the numbers when it cannot), and return
    (report, the printed table, warnings)."""
    limit, where = machine_memory_gb(recipe, nproc)
    report = estimate(recipe, nproc, model_config=model_config, device_gb=limit)
    table = format_report(report, limit, where)
    check_fit(report, limit, where)
    warning = ram_warning(report, recipe, nproc)
    return report, table, [warning] if warning else []
