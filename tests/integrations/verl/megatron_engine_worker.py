"""One rank of veRL 0.9.1's own ``MegatronEngineWithLMHead`` on CPU (gloo), for
test_cpu_megatron_engine.py: run as ``python -m`` in fresh processes, ``WORLD_SIZE`` ranks.

    python megatron_engine_worker.py MODEL_DIR OUT_JSON TP PACKED:THREAD[,PACKED:THREAD...]

Builds the engine as veRL's worker does (``EngineRegistry`` for device cpu, mbridge with
``vanilla_mbridge``), then on the ranks that hold outputs writes: the engine's log-probs of a
fixed batch (variable lengths) next to HF's (bf16, the same weights), ``get_per_tensor_param``'s
tensors, one ``train_batch`` step's grad norm and the log-probs after it. With THREAD=1 the
export and the step run on a second thread, as Ray runs a worker's async methods. Several
PACKED:THREAD runs build one engine each in the same processes (veRL keeps the parallel state).
"""

from __future__ import annotations

import json
import os
import sys
import threading


# CPPO_TEST_BRIDGE=megatron-bridge: veRL's default route (vanilla_mbridge=false, Python 3.12 env)
def _route() -> str:
    import importlib.util

    installed = "mbridge" if importlib.util.find_spec("mbridge") else "megatron-bridge"
    return os.environ.get("CPPO_TEST_BRIDGE") or installed


VANILLA = _route() != "megatron-bridge"  # True: mbridge (vanilla_mbridge: true)
PP = int(os.environ.get("CPPO_TEST_PP", "1"))


def batch(tokenizer_vocab: int, lengths: list[int], seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, tokenizer_vocab, (n,), generator=g) for n in lengths]


def engine_inputs(seqs, *, packed: bool):
    import torch
    from verl.utils import tensordict_utils as tu

    nested = torch.nested.as_nested_tensor(seqs, layout=torch.jagged)
    loss = torch.nested.as_nested_tensor([torch.ones_like(s) for s in seqs], layout=torch.jagged)
    pos = torch.nested.as_nested_tensor([torch.arange(len(s)) for s in seqs], layout=torch.jagged)
    return tu.get_tensordict(
        {"input_ids": nested, "loss_mask": loss, "position_ids": pos,
         "temperature": torch.ones(len(seqs), dtype=torch.float32)},
        non_tensor_dict={"use_dynamic_bsz": False, "micro_batch_size_per_gpu": len(seqs),
                         "use_remove_padding": packed, "use_fused_kernels": False},
    )


def hf_log_probs(model_dir: str, seqs) -> list[list[float]]:
    """HF's log p(token_t | tokens_<t) for t >= 1, in bf16 (the engine's dtype)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    out = []
    with torch.no_grad():
        for s in seqs:
            logits = model(s[None]).logits[0].float()
            lp = torch.log_softmax(logits[:-1], -1).gather(-1, s[1:, None])[:, 0]
            out.append(lp.tolist())
    return out


def hf_grad_norm(model_dir: str, seqs) -> float:
    """Total gradient norm of the same loss in HF (fp32 compute on the bf16-rounded weights)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).float()
    lps = []
    for s in seqs:
        logits = model(s[None]).logits[0]
        lps.append(torch.log_softmax(logits[:-1], -1).gather(-1, s[1:, None])[:, 0])
    (-torch.cat(lps).mean()).backward()
    return float(torch.sqrt(sum(p.grad.double().pow(2).sum() for p in model.parameters() if p.grad is not None)))


def tp_replica_max_diff(engine, tp: int) -> float:
    """Largest difference between TP ranks' copies of the replicated (not TP-split) parameters
    after the step: 0 when every partial gradient (sequence-parallel norms) was summed over TP."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    diff = 0.0
    for chunk in engine.module:
        for _, p in chunk.named_parameters():
            if getattr(p, "tensor_model_parallel", False):
                continue
            copies = [torch.empty_like(p.data) for _ in range(tp)]
            dist.all_gather(copies, p.data.contiguous(), group=mpu.get_tensor_model_parallel_group())
            diff = max(diff, max(float((c.float() - copies[0].float()).abs().max()) for c in copies))
    return diff


def engine_log_probs(engine, seqs, packed: bool) -> list[list[float]]:
    out = engine.infer_batch(engine_inputs(seqs, packed=packed), loss_function=None)
    if "model_output" not in out:  # a pipeline stage before the last: no outputs here
        return []
    lp = out["model_output"]["log_probs"]
    # the engine's log_probs[t] is log p(token_{t+1} | tokens_<=t) (rolled labels): drop the last
    return [row[:-1].float().tolist() for row in lp.unbind()]


def seams_installed() -> dict:
    """Which of the CPU mode's Megatron seams this process has (test_cpu_megatron_engine.PROBE)."""
    import megatron.core.optimizer.distrib_optimizer as dopt
    import megatron.core.transformer.dot_product_attention as dpa
    import torch
    import verl.workers.engine.megatron.transformer_impl as impl
    from verl.workers.engine.base import EngineRegistry

    from cppo_megatron.integrations.verl.cpu import megatron_bridge, megatron_engine
    from cppo_megatron.integrations.wrap import is_wrapped

    def ours(fn, seam=megatron_engine) -> bool:
        return is_wrapped(fn, seam.WRAP_TAG)

    extra: dict = {}
    if VANILLA:
        from mbridge.core import llm_bridge as llm

        layer_spec = ours(llm.LLMBridge._get_transformer_layer_spec)
    else:
        import sys

        import megatron.bridge.peft.lora_layers as lora_layers
        from megatron.bridge.models import gpt_provider

        layer_spec = ours(gpt_provider.GPTModelProvider.provide, megatron_bridge)
        # the TE placeholder served the two modules that import TE, then left sys.modules
        placeholder = getattr(lora_layers.te, megatron_bridge.PLACEHOLDER, False)
        extra = {"te_placeholder": bool(placeholder) and "transformer_engine" not in sys.modules}
    return {
        "cpu_engine": "cpu" in EngineRegistry._engines["language_model"].get("megatron", {}),
        "cpu_value_engine": "cpu" in EngineRegistry._engines["value_model"].get("megatron", {}),
        "layer_spec": layer_spec,
        "attention": ours(dpa.DotProductAttention.forward),
        "seed": ours(impl.set_random_seed),
        "methods": ours(impl.MegatronEngine.forward_backward_batch),
        "optimizer_state": all(ours(getattr(dopt.DistributedOptimizer, m)) for m in ("state_dict", "load_state_dict")),
        "current_device": str(torch.cuda.current_device()) if ours(torch.cuda.current_device) else None,
        **extra,
    }


def _catch(fn, errors: list) -> None:
    try:
        fn()
    except BaseException as exc:  # re-raised on the main thread
        errors.append(exc)


def run_one(model_dir: str, tp: int, packed: bool, thread: bool) -> dict:
    """Build the engine (veRL's way), infer, export, step, infer; the result on output ranks."""
    import torch
    import torch.distributed as dist

    engine = build_engine(model_dir, tp, packed)
    seqs = batch(19, [5, 9, 12, 7])
    result: dict = {"rank": dist.get_rank(), "engine": type(engine).__name__, "dp": engine.get_data_parallel_size(),
                    "packed": packed, "thread": thread}
    with engine.eval_mode():
        before = engine_log_probs(engine, seqs, packed)
    sent: dict = {}
    tstep: dict = {}

    def loss_fn(model_output, data, dp_group=None):
        # -mean next-token log-prob (the last position's label is the rolled-in first token: out)
        rows = model_output["log_probs"].unbind()
        loss = -torch.cat([r[:-1] for r in rows]).float().mean()
        return loss, {"loss": float(loss.detach())}

    def sync_then_step():
        # weights as veRL's sync sends them (every rank drains: the export gathers over TP), then
        # one update (megatron-core's optimizer: device='cuda' literals, 'torch.cuda.*Tensor' checks)
        gen, _ = engine.get_per_tensor_param()
        for name, t in gen:
            sent[name] = t.detach().float().clone()
        with engine.train_mode():
            tstep.update(engine.train_batch(engine_inputs(seqs, packed=packed), loss_function=loss_fn))

    if thread:  # as Ray runs a worker's async methods: on a thread other than the main one
        errors: list = []
        th = threading.Thread(target=lambda: _catch(sync_then_step, errors))
        th.start()
        th.join()
        if errors:
            raise errors[0]
    else:
        sync_then_step()
    with engine.eval_mode():
        after = engine_log_probs(engine, seqs, packed)
    result["tp_replica_max_diff"] = tp_replica_max_diff(engine, tp)
    if engine.is_mp_src_rank_with_outputs():
        from safetensors.torch import load_file

        weights = load_file(os.path.join(model_dir, "model.safetensors"))
        safe = {k: v.to(torch.bfloat16).float() for k, v in weights.items()}
        result.update(
            log_probs=before, hf=hf_log_probs(model_dir, seqs), after=after,
            grad_norm=float(tstep["metrics"]["grad_norm"]) if "metrics" in tstep else None,
            hf_grad_norm=hf_grad_norm(model_dir, seqs),
            sent={k: [list(v.shape), float(v.double().abs().sum())] for k, v in sent.items()},
            sent_equal={k: bool(torch.equal(v, safe[k])) for k, v in sent.items() if k in safe},
            safetensors=sorted(safe),
        )
    return result


def build_engine(model_dir: str, tp: int, packed: bool):
    """veRL's Megatron engine as its worker builds it (the LR schedule restored with a checkpoint)."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import HFModelConfig, McoreEngineConfig, McoreOptimizerConfig
    from verl.workers.engine.base import EngineRegistry

    cls = EngineRegistry.get_engine_cls("language_model", "megatron")
    engine = cls(
        model_config=HFModelConfig(path=model_dir),
        engine_config=McoreEngineConfig(tensor_model_parallel_size=tp, vanilla_mbridge=VANILLA, use_mbridge=True,
                                        pipeline_model_parallel_size=PP,
                                        use_remove_padding=packed, use_distributed_optimizer=True, seed=1,
                                        override_transformer_config={"attention_backend": "local"}),
        optimizer_config=McoreOptimizerConfig(lr=1e-2, clip_grad=1.0, lr_warmup_steps=0, total_training_steps=10,
                                              use_checkpoint_opt_param_scheduler=True),
        checkpoint_config=CheckpointConfig(),
    )
    engine.initialize()
    return engine


def run_resume(model_dir: str, tp: int, ckpt_dir: str) -> dict:
    """Exact resume of the engine: A steps, saves, steps again; B (a new engine) loads A's
    checkpoint and takes the same second step. Per rank: the optimizer's fingerprint after A's
    save and after B's load, and the log-probs after each one's second step."""
    import torch
    import torch.distributed as dist

    from cppo_megatron.integrations.records import optimizer_fingerprint

    seqs = batch(19, [5, 9, 12, 7])
    second = batch(19, [8, 6, 11, 4], seed=1)

    def loss_fn(model_output, data, dp_group=None):
        rows = model_output["log_probs"].unbind()
        loss = -torch.cat([r[:-1] for r in rows]).float().mean()
        return loss, {"loss": float(loss.detach())}

    def step(engine, data):  # one update as veRL's worker runs it: the batch, then the LR schedule
        with engine.train_mode():
            engine.train_batch(engine_inputs(data, packed=False), loss_function=loss_fn)
        engine.lr_scheduler_step()

    out: dict = {"rank": dist.get_rank(), "dp": None}
    a = build_engine(model_dir, tp, packed=False)
    out["dp"] = a.get_data_parallel_size()
    step(a, seqs)
    a.save_checkpoint(ckpt_dir, global_step=1)
    out["saved"] = optimizer_fingerprint(a.optimizer)
    step(a, second)
    out["a_after"] = optimizer_fingerprint(a.optimizer)
    with a.eval_mode():
        out["a_log_probs"] = engine_log_probs(a, seqs, False)
    dist.barrier()
    b = build_engine(model_dir, tp, packed=False)
    b.load_checkpoint(ckpt_dir, del_local_after_load=False)
    out["loaded"] = optimizer_fingerprint(b.optimizer)
    out["b_scheduler_steps"] = int(b.lr_scheduler.num_steps) if b.lr_scheduler is not None else None
    step(b, second)
    out["b_after"] = optimizer_fingerprint(b.optimizer)
    with b.eval_mode():
        out["b_log_probs"] = engine_log_probs(b, seqs, False)
    return out


def main() -> None:
    # RUNS: comma-separated PACKED:THREAD pairs, one engine each, in this process (e.g. "1:1,0:0");
    # "resume:DIR" runs run_resume with its checkpoint in DIR
    model_dir, out_path, tp, runs = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    os.environ["VERL_PLATFORM"] = "cpu"
    import torch.distributed as dist

    import verl  # noqa: F401 - loads the plugin and the CPU mode

    dist.init_process_group("gloo")
    out = {"seams": seams_installed(), "runs": []}
    for spec in runs.split(","):
        if spec.startswith("resume:"):
            result = run_resume(model_dir, tp, spec.split(":", 1)[1])
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, result)  # every rank's optimizer shard, on every rank
            out["runs"].append({"resume": gathered, "log_probs": True})  # every output rank writes the same
            dist.barrier()
            continue
        packed, thread = (x == "1" for x in spec.split(":"))
        out["runs"].append(run_one(model_dir, tp, packed, thread))
        dist.barrier()
    if all("log_probs" in r for r in out["runs"]):
        with open(out_path, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
