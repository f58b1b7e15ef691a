"""The CPU mode's pieces without Ray: the platform and seams in fresh interpreters (on with
VERL_PLATFORM=cpu, absent without), the hf rollout server (batching, sampling, log-probs,
weights), rewards and data. The whole loop runs in test_cpu_e2e.py."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from .conftest import ROOT

PROBE = r"""
import json, os, sys
import verl
from verl.utils.device import get_device_name, get_nccl_backend, get_device_id, get_torch_device
import verl.utils.distributed as dist_mod
import verl.workers.engine_workers as ew
import verl.workers.engine.fsdp.transformer_impl as fsdp
import verl.utils.fsdp_utils as fsdp_utils
from verl.checkpoint_engine.base import CheckpointEngineRegistry
from verl.workers.engine.base import EngineRegistry
from verl.workers.rollout.replica import RolloutReplicaRegistry
from verl.workers.rollout.base import _ROLLOUT_REGISTRY
from cppo_megatron.integrations.wrap import is_wrapped
SEAMS = "cppo_megatron.integrations.verl.cpu.seams"  # its wrap tag
out = {"device": get_device_name(), "hf_replica": "hf" in RolloutReplicaRegistry._registry,
       "hf_adapter": _ROLLOUT_REGISTRY.get(("hf", "async")),
       "cpu_engine": "cpu" in EngineRegistry._engines["language_model"]["fsdp2"],
       "pg_wrapped": is_wrapped(ew.initialize_global_process_group_ray, SEAMS),
       "offload_wrapped": is_wrapped(fsdp.CPUOffloadPolicy, SEAMS),
       "save_wrapped": is_wrapped(fsdp_utils.fsdp2_sharded_save_to_cpu, SEAMS),
       "cpu_sync_engine": "cpu" in CheckpointEngineRegistry._registry,
       "cpu_modules": sorted(m for m in sys.modules if m.startswith("cppo_megatron.integrations.verl.cpu"))}
if out["device"] == "cpu":
    import torch.distributed as td
    out["backend"] = get_nccl_backend()
    out["device_id"] = str(get_device_id())
    get_torch_device().empty_cache(); get_torch_device().synchronize()
    out["engine"] = EngineRegistry.get_engine_cls("language_model", "fsdp2").__name__
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
    ew.initialize_global_process_group_ray(timeout_second=None)
    out["pg_backend"] = str(td.get_backend())
    out["offload_pin"] = fsdp.CPUOffloadPolicy(pin_memory=True).pin_memory
    # separate_async's old-policy copy (fsdp_utils.py:1180): a copy, not the live shard
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    m = torch.nn.Linear(4, 4)
    fully_shard(m, mesh=init_device_mesh("cpu", (1,)))
    saved, _ = fsdp_utils.fsdp2_sharded_save_to_cpu(m)
    with torch.no_grad():
        m.weight._local_tensor.add_(1.0)
    out["old_policy_kept"] = not torch.equal(saved["weight"][0], m.weight._local_tensor)
print(json.dumps(out))
"""


def probe(platform: str | None) -> dict:
    from cppo_megatron.distributed.launch import free_port

    env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    if platform:
        env["VERL_PLATFORM"] = platform
    out = subprocess.run([sys.executable, "-c", PROBE, str(free_port())], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_cpu_platform_and_seams_only_when_asked():
    on = probe("cpu")
    assert {f"cppo_megatron.integrations.verl.cpu.{m}" for m in ("platform", "seams", "megatron_engine", "rollout")} <= set(
        on.pop("cpu_modules"))
    assert on == {"device": "cpu", "hf_replica": True, "hf_adapter": "cppo_megatron.integrations.verl.cpu.rollout.HFServerAdapter",
                  "cpu_engine": True, "pg_wrapped": True, "offload_wrapped": True, "save_wrapped": True,
                  "cpu_sync_engine": True, "backend": "gloo", "device_id": "cpu", "engine": "FSDPEngineWithLMHead",
                  "pg_backend": "gloo", "offload_pin": False, "old_policy_kept": True}
    # without VERL_PLATFORM nothing of the CPU mode is installed (a GPU machine keeps veRL as it is),
    # not even the `hf` rollout's registration, and no module of the CPU mode but its switch is imported
    off = probe(None)
    assert off["device"] != "cpu"
    assert (off["cpu_engine"], off["pg_wrapped"], off["offload_wrapped"], off["save_wrapped"], off["cpu_sync_engine"]) == (
        False, False, False, False, False)
    assert (off["hf_replica"], off["hf_adapter"]) == (False, None)
    assert off["cpu_modules"] == ["cppo_megatron.integrations.verl.cpu"]


def test_sampling_params_from_verl():
    from cppo_megatron.integrations.verl.cpu.rollout import to_sampling_params

    p = to_sampling_params({"temperature": 0.7, "top_p": 0.9, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True},
                           max_new_tokens=6, logprobs_mode="processed_logprobs")
    assert (p.n, p.temperature, p.top_p, p.top_k, p.max_new_tokens, p.logprobs, p.logprobs_mode) == (
        1, 0.7, 0.9, -1, 6, True, "processed")
    assert to_sampling_params({"max_tokens": 3}, max_new_tokens=6, logprobs_mode="raw_logprobs").max_new_tokens == 3
    with pytest.raises(ValueError, match="'beam_width'"):
        to_sampling_params({"beam_width": 2}, max_new_tokens=6, logprobs_mode=None)
    with pytest.raises(ValueError, match="raw_logits"):
        to_sampling_params({}, max_new_tokens=6, logprobs_mode="raw_logits")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    from cppo_megatron.tasks import build_task
    from cppo_megatron.trainer.config import load_recipe
    from cppo_megatron.trainer.export import export_hf
    from cppo_megatron.trainer.models import build_model

    r = load_recipe(ROOT / "recipes" / "tiny_cpu.yaml", ["model.hidden_size=32", "model.num_layers=1"])
    model, tok = build_model(r.model, build_task(r.task).alphabet, seed=0)
    out = tmp_path_factory.mktemp("hf")
    export_hf(model, tok, out)
    return out


def make_server(hf_dir, **cfg):
    from cppo_megatron.integrations.verl.cpu.rollout import HFRolloutServer

    config = SimpleNamespace(seed=0, max_num_seqs=1024, response_length=6, prompt_length=8,
                             logprobs_mode="processed_logprobs", **cfg)
    return HFRolloutServer(config, {"path": str(hf_dir)}, replica_rank=0, batch_wait_s=0.02)


def test_server_batches_concurrent_requests_and_answers_like_generate(hf_dir):
    from cppo_megatron.rollout import SamplingParams

    server = make_server(hf_dir)
    prompts = [[1, 7, 10, 13, 11, 8, 16], [1, 4, 5, 14, 9, 9, 16], [1, 3, 16]]
    greedy = {"temperature": 0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}

    async def many():
        return await asyncio.gather(*[server.generate(f"r{i}", p, dict(greedy)) for i, p in enumerate(prompts * 2)])

    outs = asyncio.run(many())
    assert server.stats["batches"] == 1 and server.stats["requests"] == 6  # one generate call, not six
    for p, out in zip(prompts * 2, outs):
        alone = server.engine.generate([p], SamplingParams(n=1, temperature=0, max_new_tokens=6, logprobs=True))
        assert out.token_ids == alone.tokens[0] and out.stop_reason == "completed"
        assert len(out.log_probs) == len(out.token_ids)
        assert out.log_probs == pytest.approx(alone.logprobs[0].tolist(), abs=1e-5)
    # the response budget: min(response_length, prompt_length + response_length - len(prompt))
    assert server._max_new_tokens(7) == 6 and server._max_new_tokens(12) == 2


def test_processed_logprobs_are_those_of_the_tempered_distribution(hf_dir):
    server = make_server(hf_dir)
    prompt = [1, 7, 10, 13, 11, 8, 16]
    params = {"temperature": 0.5, "top_p": 1.0, "top_k": -1, "logprobs": True}
    out = asyncio.run(server.generate("a", prompt, params))
    model = server.engine.model
    seq = torch.tensor([prompt + out.token_ids])
    with torch.no_grad():
        logits = model(seq).logits[0, len(prompt) - 1 : -1].float()
    tokens = torch.tensor(out.token_ids)
    processed = torch.log_softmax(logits / 0.5, -1)[torch.arange(len(tokens)), tokens]
    raw = torch.log_softmax(logits, -1)[torch.arange(len(tokens)), tokens]
    assert out.log_probs == pytest.approx(processed.tolist(), abs=1e-4)
    assert not torch.allclose(processed, raw, atol=1e-3)
    server.config.logprobs_mode = "raw_logprobs"
    out2 = asyncio.run(server.generate("b", prompt, params))
    seq2 = torch.tensor([prompt + out2.token_ids])
    with torch.no_grad():
        logits2 = model(seq2).logits[0, len(prompt) - 1 : -1].float()
    t2 = torch.tensor(out2.token_ids)
    raw2 = torch.log_softmax(logits2, -1)[torch.arange(len(t2)), t2]
    assert out2.log_probs == pytest.approx(raw2.tolist(), abs=1e-4)


def test_server_weight_update_and_bad_requests(hf_dir):
    server = make_server(hf_dir)
    state = {k: v + 0.01 for k, v in server.state_dict().items()}
    assert server.update_weights(state, global_steps=3) == 1
    got = server.state_dict()
    assert all(torch.equal(got[k], state[k]) for k in state)
    assert server.get_stats()["global_steps"] == 3
    out = asyncio.run(server.generate("x", [1, 3, 16], {"temperature": 1.0}))
    assert out.extra_fields["global_steps"] == 3
    with pytest.raises(ValueError, match="ignore_eos"):
        asyncio.run(server.generate("y", [1, 3], {"ignore_eos": True}))
    with pytest.raises(ValueError, match="empty prompt"):
        asyncio.run(server.generate("z", [], {}))


def test_reward_and_data_rows():
    from cppo_megatron.integrations.verl.data import task_rows
    from cppo_megatron.integrations.verl.reward import compute_score
    from cppo_megatron.tasks import Problem

    assert compute_score("cppo_arithmetic", "132", "132") == {"score": 1.1, "acc": 1.0, "formatted": 1.0}
    assert compute_score("cppo_arithmetic", "131", "132") == {"score": pytest.approx(0.1), "acc": 0.0, "formatted": 1.0}
    assert compute_score("cppo_arithmetic", "1+", "132")["score"] == 0.0
    with pytest.raises(ValueError, match="'gsm8k'"):
        compute_score("gsm8k", "1", "1")
    rows = task_rows([Problem("47+85=", "132"), Problem("10-99=", "-89")], "train")
    assert rows[1] == {"data_source": "cppo_arithmetic", "prompt": [{"role": "user", "content": "10-99="}],
                       "ability": "math", "reward_model": {"style": "rule", "ground_truth": "-89"},
                       "extra_info": {"split": "train", "index": 1}}


def test_worked_reward_and_data_rows(tmp_path):
    """The worked task in veRL: its rows carry the question, the reward grades the steps against it."""
    import pyarrow.parquet as pq

    from cppo_megatron.integrations.verl.data import task_rows, write_task_parquet
    from cppo_megatron.integrations.verl.reward import compute_score, data_source_for
    from cppo_megatron.tasks import Problem, make_worked_task

    p = Problem("47+8-25+63=", "93")
    rows = task_rows([p], "test", data_source=data_source_for("worked_arithmetic"))
    assert rows[0]["extra_info"] == {"split": "test", "index": 0, "question": "47+8-25+63="}
    assert rows[0]["data_source"] == "cppo_worked_arithmetic"
    info = rows[0]["extra_info"]
    good = "47+8=55\n55-25=30\n30+63=93\n<answer>93</answer>"
    assert compute_score("cppo_worked_arithmetic", good, "93", info) == {
        "score": 1.1, "acc": 1.0, "formatted": 1.0, "steps": 1.0}
    slip = "47+8=55\n55-25=31\n31+63=94\n<answer>94</answer>"
    out = compute_score("cppo_worked_arithmetic", slip, "93", info, w_step=0.3)
    assert out == {"score": pytest.approx(0.2), "acc": 0.0, "formatted": 1.0, "steps": pytest.approx(1 / 3)}
    with pytest.raises(ValueError, match="needs extra_info.question"):
        compute_score("cppo_worked_arithmetic", good, "93", {"split": "test", "index": 0})
    with pytest.raises(ValueError, match="task 'gsm8k' has no veRL scorer yet"):
        data_source_for("gsm8k")
    task = make_worked_task(train_size=30, test_size=10, seed=0)
    d = write_task_parquet(task, tmp_path, test_rows=4)
    assert (d.train_rows, d.test_rows) == (30, 4)
    back = pq.read_table(d.test).to_pylist()
    assert [r["extra_info"]["question"] for r in back] == [q.question for q in task.test[:4]]
    assert {r["data_source"] for r in back} == {"cppo_worked_arithmetic"}
    with pytest.raises(ValueError, match="write_task_parquet: task 'gsm8k' has no veRL scorer"):
        write_task_parquet(type(task)("gsm8k", task.train, task.test, task.scorer, task.sft_target), tmp_path)
