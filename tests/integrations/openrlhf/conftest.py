"""Fixtures for tests on the real pinned OpenRLHF source (installed with --no-deps on CPU).

OpenRLHF's trainer modules import three GPU-only packages at module level: deepspeed
(``openrlhf.models.utils``, ``openrlhf.utils.deepspeed``), flash-attn
(``openrlhf.models.ring_attn_utils``) and vLLM (``openrlhf.trainer.ray.vllm_engine``,
``samples_generator``). None of the code under test calls them. For exactly those three
names, and only when they are not installed, ``gpu_only_stubs`` serves a placeholder
module whose attributes raise if anything calls them; every other import is real.
The placeholders are removed again when this test package ends.
"""

from __future__ import annotations

import copy
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

import pytest
import torch

GPU_ONLY = ("deepspeed", "flash_attn", "vllm")

if importlib.util.find_spec("openrlhf") is None:
    pytest.skip(
        "OpenRLHF 0.11.2 is not installed (bash scripts/setup.sh installs it with --no-deps)",
        allow_module_level=True,
    )


class _GPUOnly:
    """Stands in for an attribute of a GPU-only package; any call fails loudly."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _GPUOnly(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name} is GPU-only and stubbed in these CPU tests; the code under test called it")

    def __mro_entries__(self, bases):
        return (object,)


class _GPUOnlyFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names):
        self.names = set(names)

    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in self.names:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name, f"CPU-test placeholder for the GPU-only {spec.name}")
        module.__path__ = []
        module.__getattr__ = lambda attr, _n=spec.name: _GPUOnly(f"{_n}.{attr}")
        return module

    def exec_module(self, module):
        pass


@pytest.fixture(scope="package", autouse=True)
def gpu_only_stubs():
    missing = [name for name in GPU_ONLY if name not in sys.modules and importlib.util.find_spec(name) is None]
    finder = _GPUOnlyFinder(missing)
    sys.meta_path.insert(0, finder)
    yield missing
    sys.meta_path.remove(finder)
    for name in list(sys.modules):
        if name.split(".")[0] in finder.names:
            del sys.modules[name]


@pytest.fixture(scope="package")
def orl(gpu_only_stubs):
    """OpenRLHF's real modules used by the tests."""
    from openrlhf.trainer.ppo_utils import experience as experience_mod
    from openrlhf.trainer.ppo_utils import experience_maker
    from openrlhf.trainer.ppo_utils.kl_controller import FixedKLController
    from openrlhf.trainer.ppo_utils.samples_generator import SamplesGenerator
    from openrlhf.utils.config import hierarchize

    return types.SimpleNamespace(
        em=experience_maker,
        Maker=experience_maker.RemoteExperienceMaker,
        experience=experience_mod,
        FixedKLController=FixedKLController,
        SamplesGenerator=SamplesGenerator,
        hierarchize=hierarchize,
    )


@pytest.fixture(scope="package")
def parser():
    from cppo_megatron.integrations.openrlhf.pinned import pinned_parser

    return pinned_parser()


BASE_FLAGS = [
    "--actor.model_name_or_path", "tiny",
    "--reward.remote_url", "http://localhost:1/reward",
    "--algo.advantage.estimator", "group_norm",
    "--actor.num_nodes", "1", "--actor.num_gpus_per_node", "1",
    "--ref.num_nodes", "1", "--ref.num_gpus_per_node", "1",
    "--rollout.micro_batch_size", "2",
    "--train.batch_size", "2",
]  # fmt: skip


@pytest.fixture
def make_args(orl, parser):
    """OpenRLHF's own hierarchical args from train_ppo_ray flags."""

    def build(*flags: str):
        return orl.hierarchize(parser.parse_args(BASE_FLAGS + list(flags)))

    return build


@pytest.fixture
def make_maker(orl):
    """A real RemoteExperienceMaker whose Ray model groups are replaced by ``record_forward``."""

    def build(args, kl_coef: float = 0.01, maker_class=None):
        maker = (maker_class or orl.Maker)(
            actor_model_group=None,
            critic_model_group=None,
            reward_model_group=None,
            initial_model_group=None,
            kl_controller=orl.FixedKLController(kl_coef),
            strategy=types.SimpleNamespace(args=args),
            tokenizer=types.SimpleNamespace(pad_token_id=0),
        )
        maker.forwarded_uids = []

        def record_forward(samples_list):
            # Stands in for the actor/ref forwards through Ray (DeepSpeed on GPUs): records
            # which samples reach them and attaches a per-sample KL that identifies the row.
            for s in samples_list:
                uid = s.info["uid"].to(torch.float32)
                maker.forwarded_uids.extend(int(u) for u in uid.tolist())
                mask = s.action_mask.float()
                s.action_log_probs = torch.zeros_like(mask)
                s.values = None
                s.kl = 1e-3 * uid[:, None] * mask
                s.info["kl"] = (s.kl * mask).sum(-1) / mask.sum(-1).clamp_min(1)
            return samples_list

        maker.make_experience = record_forward
        return maker

    return build


@pytest.fixture
def make_rollout(orl):
    """Single-sample rollout Experiences built by OpenRLHF's own response processing.

    groups: list of (prompt, rewards); each reward makes one sample, with a response
    length that varies by sample, and a unique ``uid`` in ``info``.
    """

    def build(groups, max_len: int = 64, lengths=None):
        gen = orl.SamplesGenerator.__new__(orl.SamplesGenerator)
        samples, uid = [], 0
        for g, (prompt, rewards) in enumerate(groups):
            for j, reward in enumerate(rewards):
                prompt_len = 3 + g % 3
                resp_len = lengths[uid] if lengths is not None else 2 + (5 * uid + 3 * j) % 11
                tokens = list(range(10 + g, 10 + g + prompt_len)) + [100 + uid] * resp_len
                response = {
                    "observation_tokens": tokens,
                    "action_ranges": [(prompt_len, prompt_len + resp_len)],
                    "reward": float(reward),
                    "scores": float(reward),
                    "rollout_log_probs": None,
                    "prompt": prompt,
                    "label": f"label-{prompt}",
                    "extra_logs": {"uid": uid},
                    "truncated": resp_len >= 12,
                }
                samples.append(gen._process_response_into_experience(response, max_len=max_len))
                uid += 1
        return samples

    return build


@pytest.fixture
def fresh(orl):
    """Deep copies of a rollout (the hook and OpenRLHF both change samples in place)."""
    return copy.deepcopy


@pytest.fixture
def host_audit():
    """This host's observers and audit, for ``audit_on`` (tests/integrations/conftest.py)."""
    from cppo_megatron.integrations.openrlhf import observers
    from cppo_megatron.integrations.openrlhf.diagnostics import audit

    return observers, audit
