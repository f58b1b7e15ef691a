"""Seams moved onto integrations/wrap.py whose own tests need a whole host run (the CPU e2e
runs): each installs once over stand-ins of the host classes, reads the original through the
helper, and the block-scoped ones put the host back. In-process, a few seconds (most of it
importing the veRL adapter)."""

from __future__ import annotations

import sys
import time
import types

import pytest
import torch

from cppo_megatron.integrations import wrap


def test_timed_ray_init_times_the_call_and_puts_ray_init_back(monkeypatch):
    from cppo_megatron.integrations.verl.cpu.phases import Phases, timed_ray_init

    calls = []

    def init(*args, **kwargs):
        calls.append((args, kwargs))
        return "ctx"

    ray = types.ModuleType("ray")
    ray.init = init  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ray", ray)
    lines: list[str] = []
    phases = Phases(t0=time.time(), printer=lines.append)
    with timed_ray_init(phases):
        assert ray.init is not init and wrap.original(ray.init) is init
        assert ray.init(num_cpus=1) == "ctx"
    assert ray.init is init and calls == [((), {"num_cpus": 1})]
    assert lines[0] == "cpu mode: starting Ray (a local cluster for this run) ..." and "ray" in phases.durations


def test_openrlhf_replay_buffer_sees_index_zero_only_inside_its_init(monkeypatch):
    from cppo_megatron.integrations.openrlhf.cpu import seams

    seen = []

    class NaiveReplayBuffer:
        def __init__(self, sample_batch_size):
            seen.append(torch.cuda.current_device())  # replay_buffer.py:40 formats cuda:{index}
            self.target_device = torch.device(f"cuda:{torch.cuda.current_device()}")

    seam = lambda: "cpu"  # noqa: E731 - what the CPU mode's torch.cuda seam returns
    monkeypatch.setattr(torch.cuda, "current_device", seam)
    module = types.SimpleNamespace(NaiveReplayBuffer=NaiveReplayBuffer)
    seams._patch_replay_buffer(module)
    top = NaiveReplayBuffer.__dict__["__init__"]
    seams._patch_replay_buffer(module)  # a second install changes nothing
    assert NaiveReplayBuffer.__dict__["__init__"] is top and wrap.is_wrapped(top, seams.WRAP_TAG)
    buf = NaiveReplayBuffer(4)
    assert seen == [0] and buf.target_device == torch.device("cpu")
    assert torch.cuda.current_device is seam  # the CPU mode's seam is back after the call


def test_openrlhf_process_group_in_a_module_that_bound_it_early():
    from cppo_megatron.integrations.openrlhf.cpu import seams

    def stateless_init_process_group(master_address, master_port, rank, world_size, device=None):
        raise AssertionError("NCCL")

    dist_util = types.SimpleNamespace(stateless_init_process_group=stateless_init_process_group)
    user = types.SimpleNamespace(stateless_init_process_group=stateless_init_process_group)  # bound by name
    seams.patch_dist_util(dist_util)
    seams.patch_dist_util(user)
    for m in (dist_util, user):
        assert wrap.is_wrapped(m.stateless_init_process_group, seams.WRAP_TAG)
        assert wrap.original(m.stateless_init_process_group) is stateless_init_process_group
    top = user.stateless_init_process_group
    seams.patch_dist_util(user)  # a second install changes nothing
    assert user.stateless_init_process_group is top and getattr(top, wrap.ORIGINAL) is stateless_init_process_group


def test_openrlhf_recorders_install_once_over_the_host_methods(monkeypatch, tmp_path):
    from cppo_megatron.integrations.openrlhf import metrics
    from cppo_megatron.integrations.openrlhf.diagnostics import audit

    class TensorboardLogger:
        def log_train(self, global_step, logs_dict):
            return "train"

        def log_eval(self, global_step, logs_dict):
            return "eval"

    class DeepspeedStrategy:
        def save_ckpt(self, model, directory, tag=None):
            return None

        def load_ckpt(self, model, directory):
            return ("global_step1", {})

    originals = {n: TensorboardLogger.__dict__[n] for n in ("log_train", "log_eval")}
    for _ in range(2):
        metrics._patch_logger(types.SimpleNamespace(TensorboardLogger=TensorboardLogger))
        audit._patch_strategy(types.SimpleNamespace(DeepspeedStrategy=DeepspeedStrategy))
    for name, fn in originals.items():
        top = TensorboardLogger.__dict__[name]
        assert wrap.original(top) is fn and getattr(top, wrap.ORIGINAL) is fn  # one layer, not two
    for name in ("save_ckpt", "load_ckpt"):
        assert wrap.layer(DeepspeedStrategy.__dict__[name], audit.WRAP_TAG) is DeepspeedStrategy.__dict__[name]
        assert not wrap.is_wrapped(getattr(DeepspeedStrategy.__dict__[name], wrap.ORIGINAL))
    monkeypatch.setenv(metrics.ENV, str(tmp_path / "m.jsonl"))
    assert TensorboardLogger().log_train(3, {"loss": 0.5}) == "train"
    assert metrics.read(tmp_path / "m.jsonl") == [{"step": 3, "loss": 0.5}]


def test_verl_placement_recorder_stacks_on_the_cpu_mode_once_per_class():
    from cppo_megatron.integrations.verl.diagnostics import audit
    from cppo_megatron.integrations.verl.cpu import megatron_engine

    class MegatronEngine:
        def initialize(self):
            return "init"

    class MegatronEngineWithLMHead(MegatronEngine):
        pass

    class MegatronEngineWithValueHead(MegatronEngine):
        def initialize(self):
            return "value init"

    host = MegatronEngine.__dict__["initialize"]
    module = types.SimpleNamespace(MegatronEngine=MegatronEngine, MegatronEngineWithLMHead=MegatronEngineWithLMHead,
                                   MegatronEngineWithValueHead=MegatronEngineWithValueHead)
    for cls in (MegatronEngine, MegatronEngineWithLMHead, MegatronEngineWithValueHead):
        megatron_engine._wrap_engine_methods(cls)  # the CPU mode's layer first, as in a CPU run
    audit._record_placement(module)
    audit._record_placement(module)
    top = MegatronEngine.__dict__["initialize"]
    assert wrap.layer(top, audit.WRAP_TAG) is top and wrap.is_wrapped(top, megatron_engine.WRAP_TAG)
    assert wrap.original(top) is host and "initialize" not in MegatronEngineWithLMHead.__dict__  # inherits both
    value = MegatronEngineWithValueHead.__dict__["initialize"]
    assert wrap.is_wrapped(value, audit.WRAP_TAG) and wrap.original(value).__qualname__.endswith("ValueHead.initialize")
    assert not wrap.is_wrapped(getattr(top, wrap.ORIGINAL), audit.WRAP_TAG)  # one audit layer, not two


def test_openrlhf_vllm_worker_update_weight_is_replaced_once():
    from cppo_megatron.integrations.openrlhf.cpu import vllm_sync

    class WorkerWrap:
        def update_weight(self, name, dtype, shape, empty_cache=False):
            raise AssertionError("the CUDA path")

    host = WorkerWrap.__dict__["update_weight"]
    module = types.SimpleNamespace(WorkerWrap=WorkerWrap)
    vllm_sync._patch_worker_wrap(module)
    top = WorkerWrap.__dict__["update_weight"]
    vllm_sync._patch_worker_wrap(module)
    assert WorkerWrap.__dict__["update_weight"] is top and wrap.original(top) is host
    worker = WorkerWrap()
    worker.model_config = types.SimpleNamespace(dtype=torch.bfloat16)  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="actor sends torch.float32, the vLLM engine runs torch.bfloat16"):
        worker.update_weight("w", torch.float32, (2,))  # the CPU receive path: checks the dtype first
