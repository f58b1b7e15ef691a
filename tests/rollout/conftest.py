import pytest
import torch

from cppo_megatron.tasks import build_task
from cppo_megatron.trainer.config import load_recipe
from cppo_megatron.trainer.models import build_model
from tests.trainer.conftest import MICRO, micro_recipe  # noqa: F401 - the fixture, for tests here


# vLLM's CPU attention needs head size >= 32: the micro model with 2 heads of 32
VLLM_MICRO = ["model.hidden_size=64", "model.intermediate_size=128"]


def tiny_recipe(*overrides):
    return load_recipe(None, MICRO + VLLM_MICRO + list(overrides))


def tiny_policy(seed: int = 0):
    """The micro recipe's Qwen2 (random init, perturbed so that outputs vary; fp32, no
    download), its tokenizer and task."""
    recipe = tiny_recipe(f"seed={seed}")
    task = build_task(recipe.task)
    model, tok = build_model(recipe.model, task.alphabet, seed)
    return perturb_(model, seed + 1000).eval(), tok, task


def sample_prompts(tok, task, n: int) -> list[list[int]]:
    """n test prompts; some cut short so that lengths differ (batches need padding)."""
    prompts = [tok.prompt_ids(p.question) for p in task.test[:n]]
    return [p[: len(p) - (i % 3)] for i, p in enumerate(prompts)]


@torch.no_grad()
def perturb_(model, seed: int, scale: float = 0.2):
    """Add N(0, scale^2) noise to every parameter, in place (tied weights once). At 0.2 the
    random-init model stops echoing its last input token: greedy outputs vary and some stop."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


@pytest.fixture(scope="module")
def tiny():
    return tiny_policy()


@torch.no_grad()
def reference_greedy(model, prompts, max_new_tokens: int, eos_id: int) -> list[list[int]]:
    """Greedy decoding one prompt at a time with plain forward passes (no padding, no cache)."""
    out = []
    for p in prompts:
        ids = list(p)
        gen: list[int] = []
        for _ in range(max_new_tokens):
            nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            gen.append(nxt)
            ids.append(nxt)
            if nxt == eos_id:
                break
        out.append(gen)
    return out
