"""An HF-``generate`` rollout for veRL 0.9.1 (``actor_rollout_ref.rollout.name=hf``).

veRL's rollouts are servers (vLLM, SGLang, TensorRT-LLM) that need a GPU. This one has the
same three parts, on ``cppo_megatron.rollout.HFEngine``:

- ``HFRolloutReplica`` (trainer side, ``RolloutReplicaRegistry``): ``launch_servers`` starts
  one ``HFRolloutServer`` Ray actor per replica, named so the workers can find it;
- ``HFRolloutServer`` (a Ray actor): ``generate(request_id, prompt_ids, sampling_params)``
  returns veRL's ``TokenOutput``. Concurrent requests (veRL's agent loop sends one per
  sample) are collected for ``batch_wait_s`` and generated in one batched ``generate`` call
  per distinct sampling setting, not one call per request. Log-probs follow
  ``rollout.logprobs_mode``: ``processed_logprobs`` (veRL's default: after temperature /
  top-k / top-p) or ``raw_logprobs``;
- ``HFServerAdapter`` (worker side, veRL's ``_ROLLOUT_REGISTRY``): receives the trainer's
  weights through veRL's own checkpoint-engine path (``update_weights`` with the per-tensor
  generator; every rank drains it, since FSDP's ``full_tensor`` is a collective) and the
  first rank of each replica sends them to its server. ``resume``/``release`` and the
  server's sleep/wake/abort/clear-cache are no-ops: a CPU process has no device memory to
  hand back.

Sampling randomness: the server seeds torch from ``rollout.seed`` and its replica rank at
start; a batch's draws depend on which requests arrived together (as in vLLM).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, cast

import torch

__all__ = [
    "ADAPTER_PATH",
    "ROLLOUT_NAME",
    "HFRolloutServer",
    "HFServerAdapter",  # noqa: F822 - made on first access by the module __getattr__ (it needs veRL)
    "load_replica_class",
    "server_name",
    "to_sampling_params",
]

logger = logging.getLogger(__name__)

ROLLOUT_NAME = "hf"
ADAPTER_PATH = "cppo_megatron.integrations.verl.cpu.rollout.HFServerAdapter"
LOGPROBS_MODES = {"processed_logprobs": "processed", "raw_logprobs": "raw"}
_SERVER_PREFIX = "cppo_hf_rollout_server_"


def server_name(replica_rank: int) -> str:
    """The Ray actor name of replica ``replica_rank``'s server (workers look it up by name)."""
    return f"{_SERVER_PREFIX}{int(replica_rank)}"


def to_sampling_params(params: dict, *, max_new_tokens: int, logprobs_mode: str | None):
    """veRL's per-request sampling dict -> our ``SamplingParams`` (n = 1: veRL sends one request
    per sample). Temperature 0 is greedy; top_k -1 is off. Unknown keys are refused, naming
    them, rather than silently ignored."""
    from ....rollout import SamplingParams

    p = dict(params)
    known = {"temperature", "top_p", "top_k", "repetition_penalty", "logprobs", "max_tokens", "max_new_tokens",
             "ignore_eos"}
    unknown = sorted(set(p) - known)
    if unknown:
        raise ValueError(f"hf rollout: sampling parameter(s) {unknown} are not supported by HF generate; "
                         f"known: {sorted(known)}")
    if p.get("ignore_eos"):
        raise ValueError("hf rollout: ignore_eos=True is not supported; set actor_rollout_ref.rollout.ignore_eos=false")
    mode = LOGPROBS_MODES.get(logprobs_mode or "processed_logprobs")
    if mode is None:
        raise ValueError(
            f"hf rollout: rollout.logprobs_mode={logprobs_mode!r} is not supported; use one of {sorted(LOGPROBS_MODES)}"
        )
    cap = p.get("max_tokens", p.get("max_new_tokens"))
    return SamplingParams(
        n=1,
        temperature=float(p.get("temperature", 1.0)),
        top_p=float(p.get("top_p", 1.0)),
        top_k=int(p.get("top_k", -1)),
        repetition_penalty=float(p.get("repetition_penalty", 1.0)),
        max_new_tokens=int(min(cap, max_new_tokens) if cap is not None else max_new_tokens),
        logprobs=bool(p.get("logprobs", False)),
        logprobs_mode=mode,
    )


class HFRolloutServer:
    """One replica's generation server (a Ray actor, async: requests queue while a batch runs).

    Args:
        config: veRL ``RolloutConfig`` (prompt_length, response_length, seed, logprobs_mode,
            max_num_seqs).
        model_config: veRL ``HFModelConfig`` (``local_path``: the HF model directory).
        replica_rank: int, this replica's rank (seeds its sampler).
        batch_wait_s: how long to let concurrent requests gather before a batch starts.
    """

    def __init__(self, config, model_config, replica_rank: int, batch_wait_s: float = 0.01) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from ....rollout import HFEngine

        self.config = config
        self.replica_rank = int(replica_rank)
        get = model_config.get if hasattr(model_config, "get") else lambda k, d=None: getattr(model_config, k, d)
        path = get("local_path", None) or get("path", None)
        if not path or not os.path.isdir(path):
            raise FileNotFoundError(f"hf rollout: actor_rollout_ref.model.path={path!r} is not a local HF model "
                                    "directory")
        tok = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        eos = model.generation_config.eos_token_id
        eos = eos[0] if isinstance(eos, (list, tuple)) else eos
        eos = tok.eos_token_id if eos is None else eos
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos
        torch.manual_seed(int(config.seed) * 1_000_003 + self.replica_rank)
        self.engine = HFEngine(model, pad_id=pad, eos_id=eos, device=torch.device("cpu"),
                               max_batch_sequences=int(config.max_num_seqs), shared=False)
        self.batch_wait_s = float(batch_wait_s)
        self.global_steps: int | None = None
        self.weight_version = 0
        self._queue: list[tuple[list[int], dict, asyncio.Future]] = []
        self._drainer: asyncio.Task | None = None
        self.stats = {"requests": 0, "batches": 0, "generate_s": 0.0, "max_batch": 0, "tokens": 0}
        from ..diagnostics.clock import Snapshots

        self.snapshots = Snapshots.from_env()  # wall-clock mode (CPPO_VERL_CLOCK): the policy at each mark

    def _max_new_tokens(self, prompt_len: int) -> int:
        c = self.config
        return max(1, min(int(c.response_length), int(c.prompt_length) + int(c.response_length) - prompt_len))

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data=None, video_data=None, **kwargs):
        """veRL's token-in/token-out call: one prompt, one sample, -> ``TokenOutput``."""
        if image_data is not None or video_data is not None or kwargs.get("audio_data") is not None:
            raise ValueError("hf rollout: multimodal inputs are not supported")
        if not prompt_ids:
            raise ValueError(f"hf rollout: request {request_id!r} has an empty prompt")
        fut = asyncio.get_running_loop().create_future()
        self._queue.append((list(map(int, prompt_ids)), dict(sampling_params), fut))
        if self._drainer is None or self._drainer.done():
            self._drainer = asyncio.create_task(self._drain())
        return await fut

    async def _drain(self) -> None:
        while self._queue:
            seen = -1
            while len(self._queue) != seen:  # wait until no new request joins
                seen = len(self._queue)
                await asyncio.sleep(self.batch_wait_s)
            batch, self._queue = self._queue, []
            groups: dict = {}
            for item in batch:
                try:
                    params = to_sampling_params(item[1], max_new_tokens=self._max_new_tokens(len(item[0])),
                                                logprobs_mode=self.config.logprobs_mode)
                except ValueError as exc:
                    item[2].set_exception(exc)
                    continue
                groups.setdefault(params, []).append(item)
            for params, items in groups.items():
                try:
                    outs = await asyncio.to_thread(self._generate, [it[0] for it in items], params)
                except Exception as exc:  # noqa: BLE001 - every waiting request must hear of it
                    for it in items:
                        if not it[2].done():
                            it[2].set_exception(exc)
                    continue
                for it, out in zip(items, outs, strict=False):
                    if not it[2].done():
                        it[2].set_result(out)

    def _generate(self, prompts: list[list[int]], params) -> list:
        from verl.workers.rollout.replica import TokenOutput

        t0 = time.perf_counter()
        res = self.engine.generate(prompts, params)
        self.stats["generate_s"] += time.perf_counter() - t0
        self.stats["requests"] += len(prompts)
        self.stats["batches"] += 1
        self.stats["tokens"] += sum(len(t) for t in res.tokens)  # generated tokens (the study's cost per step)
        self.stats["max_batch"] = max(self.stats["max_batch"], len(prompts))
        extra = {"global_steps": self.global_steps}
        return [
            TokenOutput(
                token_ids=res.tokens[i],
                log_probs=res.logprobs[i].tolist() if res.logprobs is not None else None,
                stop_reason="completed",
                num_preempted=0,
                extra_fields=dict(extra),
            )
            for i in range(len(prompts))
        ]

    def update_weights(self, state: dict[str, torch.Tensor], global_steps: int | None = None) -> int:
        """Load full HF-named tensors (from the adapter); returns the new weight version."""
        if self.snapshots is not None:
            self.snapshots.before_update(self.engine.model.state_dict, global_steps)
        self.engine.update_weights(state.items())
        self.weight_version += 1
        if global_steps is not None:
            self.global_steps = int(global_steps)
        if self.snapshots is not None:
            self.snapshots.after_update(self.engine.model.state_dict, global_steps,
                                        {"generate_s": round(self.stats["generate_s"], 4),
                                         "requests": self.stats["requests"], "batches": self.stats["batches"],
                                         "tokens": self.stats["tokens"]})
        return self.weight_version

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The server model's weights (tests compare them with the actor's)."""
        return {k: v.detach().clone() for k, v in self.engine.model.state_dict().items()}

    def get_stats(self) -> dict:
        return {**self.stats, "weight_version": self.weight_version, "global_steps": self.global_steps}

    # control methods veRL calls; CPU has no device memory to release or restore
    async def sleep(self, *args, **kwargs) -> None:
        return None

    async def wake_up(self, *args, **kwargs) -> None:
        return None

    async def abort_all_requests(self, reject_request: bool = False) -> None:
        return None

    async def resume_generation(self) -> None:
        return None

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        return None

    async def resume_kv_cache(self) -> None:
        return None

    async def start_profile(self, **kwargs) -> None:
        return None

    async def stop_profile(self) -> None:
        return None


def load_replica_class():
    """``RolloutReplicaRegistry`` loader: the replica class (needs veRL and Ray)."""
    import ray
    from verl.workers.rollout.replica import RolloutReplica

    class HFRolloutReplica(RolloutReplica):
        """Starts one ``HFRolloutServer`` actor; the hybrid workers feed it weights."""

        async def launch_servers(self):
            server_cls = ray.remote(HFRolloutServer)
            server = server_cls.options(
                name=server_name(self.replica_rank),
                max_concurrency=self.max_concurrency,
                num_cpus=0,  # generation shares the training workers' cores (colocated, hybrid)
            ).remote(config=self.config, model_config=self.model_config, replica_rank=self.replica_rank)
            # ray types .options().remote() as "a handle or the class"; it is the handle
            server = cast("ray.actor.ActorHandle", server)
            self.servers = [server]
            self._server_handle = server
            self._server_address = server_name(self.replica_rank)  # a router key; no HTTP server

        def rollout_worker_use_gpu(self) -> bool:
            return False

    return HFRolloutReplica


def _adapter_base():
    from verl.workers.rollout.base import BaseRollout

    return BaseRollout


def __getattr__(name: str):
    # HFServerAdapter subclasses veRL's BaseRollout: built on first use, so importing this
    # module (the driver does, to register the replica) does not import veRL's rollout package
    if name == "HFServerAdapter":
        cls = _make_adapter()
        globals()["HFServerAdapter"] = cls
        return cls
    raise AttributeError(name)


def _make_adapter():
    from ...records import tensor_hash
    from ..diagnostics import audit

    BaseRollout = _adapter_base()

    class HFServerAdapter(BaseRollout):  # type: ignore[valid-type, misc]  # veRL's, imported on first use
        """Worker-side rollout: forwards the trainer's weights to the replica's server.

        Constructed by veRL as ``(config, model_config, device_mesh)`` on every hybrid worker.
        """

        def __init__(self, config, model_config, device_mesh, *args, **kwargs):
            super().__init__(config, model_config, device_mesh, *args, **kwargs)
            import torch.distributed as dist

            c = self.config
            replica_world = int(c.tensor_model_parallel_size) * int(c.data_parallel_size) * int(
                c.pipeline_model_parallel_size)
            rank = dist.get_rank() if dist.is_initialized() else 0
            self.replica_rank = rank // replica_world
            self.is_leader = rank % replica_world == 0
            self._server = None
            self.sleep_level = 1

        def _server_handle(self):
            if self._server is None:
                import ray

                self._server = ray.get_actor(server_name(self.replica_rank))
            return self._server

        async def resume(self, tags: list[str]):
            return None

        async def release(self):
            return None

        async def update_weights(self, weights, wire_format: str = "named_tensors", **kwargs):
            if wire_format != "named_tensors":
                raise ValueError(
                    f"hf rollout: wire_format={wire_format!r} is not supported; use the naive checkpoint engine "
                    "(actor_rollout_ref.rollout.checkpoint_engine.backend=naive)"
                )
            if kwargs.get("peft_config") is not None:
                raise ValueError("hf rollout: LoRA adapters are not supported; merge them (model.lora.merge=true)")
            state = {}
            for name, tensor in weights:  # every rank drains: FSDP's full_tensor is a collective
                if hasattr(tensor, "full_tensor"):
                    tensor = tensor.full_tensor()
                if self.is_leader:
                    state[name] = tensor.detach().to("cpu", copy=True)
            if self.is_leader:
                server = self._server_handle()
                await server.update_weights.remote(state, kwargs.get("global_steps"))
                if audit.enabled():
                    loaded = await server.state_dict.remote()
                    missing = sorted(set(state) - set(loaded))
                    diff = max((float((loaded[k] - v).abs().max()) for k, v in state.items() if k in loaded),
                               default=float("nan"))
                    audit.record("sync", role="rollout-adapter", global_steps=kwargs.get("global_steps"),
                                 max_abs_diff=diff, num_tensors=len(state), missing=missing,
                                 fingerprint=float(sum(float(v.double().abs().sum()) for v in state.values())),
                                 sums={k: float(v.double().abs().sum()) for k, v in state.items()},
                                 hashes={k: tensor_hash(v) for k, v in state.items()})

    return HFServerAdapter
