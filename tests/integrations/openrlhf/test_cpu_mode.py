"""The OpenRLHF CPU mode's pieces on their own (fast; the whole loop runs in
tests/integrations/openrlhf_cpu/test_e2e.py): inert without its switch, the torch.cuda seams
with it, the flash-attn placeholder's lifetime, the gloo weight-sync group, the recipes' dry
runs (tiny CPU recipes and the cluster recipes under the one override file), the reward."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
RECIPES = ROOT / "recipes" / "openrlhf"
CLUSTER = ["qwen2.5-1.5b-gsm8k-cppo.yaml", "qwen2.5-1.5b-gsm8k-grpo.yaml", "qwen2.5-7b-math-cppo.yaml",
           "qwen2.5-7b-math-grpo.yaml"]


def _python(code: str, env_extra: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CPPO_")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=300)


SEAMS_PROBE = """
    import torch
    original = torch.cuda.current_device
    from cppo_megatron.integrations.openrlhf import cpu
    print("installed", cpu.install())
    print("same", torch.cuda.current_device is original)
    if torch.cuda.current_device is not original:
        print("device", torch.cuda.current_device(), torch.cuda.synchronize(), torch.cuda.current_stream())
        torch.cuda.set_device(0)
    import sys
    print("finders", sum(type(f).__name__ == "_Finder" for f in sys.meta_path))
"""


def test_inert_without_the_switch():
    out = _python(SEAMS_PROBE)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "installed False" in out.stdout and "same True" in out.stdout and "finders 0" in out.stdout


def test_torch_cuda_seams_with_the_switch():
    out = _python(SEAMS_PROBE, {"CPPO_OPENRLHF_CPU": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "installed True" in out.stdout and "same False" in out.stdout
    assert "device cpu None None" in out.stdout  # set_device(0) was a no-op, no error


def test_flash_attn_placeholder_exists_only_while_ring_attn_utils_executes():
    out = _python("""
        import importlib.util, sys
        from cppo_megatron.integrations.openrlhf.cpu import seams
        with seams._flash_attn_placeholder():
            from flash_attn.bert_padding import pad_input
            from flash_attn.utils.distributed import all_gather
            try:
                pad_input(1)
            except RuntimeError as e:
                print("raises", "packing" in str(e))
        print("after", "flash_attn" in sys.modules, importlib.util.find_spec("flash_attn"))
    """)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "raises True" in out.stdout and "after False None" in out.stdout


def test_gloo_weight_sync_group_broadcasts_bf16_exactly(tmp_path):
    script = tmp_path / "bcast.py"
    script.write_text(textwrap.dedent("""
        import socket, sys, torch, torch.multiprocessing as mp
        from cppo_megatron.integrations.openrlhf.cpu.seams import gloo_stateless_process_group

        def run(rank, port, q):
            group = gloo_stateless_process_group("127.0.0.1", port, rank, 3)
            t = torch.randn(7, 5, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
            buf = t.clone() if rank == 0 else torch.empty(7, 5, dtype=torch.bfloat16)
            group.broadcast(buf, src=0, stream=None)
            q.put((rank, bool(torch.equal(buf, t))))

        if __name__ == "__main__":
            s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
            q = mp.get_context("spawn").Queue()
            ps = [mp.get_context("spawn").Process(target=run, args=(r, port, q)) for r in range(3)]
            [p.start() for p in ps]; [p.join(120) for p in ps]
            print(sorted(q.get() for _ in range(3)))
    """))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[(0, True), (1, True), (2, True)]" in out.stdout


def test_required_flags_refuse_what_cannot_work_on_cpu():
    from cppo_megatron.integrations.openrlhf.cpu.prepare import CPU_FLAGS, required_flags

    with pytest.raises(ValueError, match="sync_with_ray"):
        required_flags(["--vllm.sync_with_ray"])
    with pytest.raises(ValueError, match="packing_samples"):
        required_flags(["--ds.packing_samples"])
    out = required_flags(["--ds.attn_implementation", "flash_attention_2"])
    assert out[-len(CPU_FLAGS):] == list(CPU_FLAGS)  # after the run's own: the CPU mode's flags win


def test_cpu_section_and_override_file_are_validated(tmp_path):
    from cppo_megatron.integrations.openrlhf.cpu.prepare import settings
    from cppo_megatron.integrations.openrlhf.recipe import load_recipe, merge_cpu_override

    with pytest.raises(ValueError, match="unknown cpu field"):
        settings({"model_dri": "x"})
    bad = tmp_path / "bad.yaml"
    bad.write_text("cppo: {pruning_rate: 0.5}\n")
    recipe = load_recipe(RECIPES / "qwen2.5-1.5b-gsm8k-cppo.yaml")
    with pytest.raises(ValueError, match="unknown section"):
        merge_cpu_override(recipe, bad)
    merged = merge_cpu_override(recipe, RECIPES / "cpu_toy.yaml")
    toy = yaml.safe_load((RECIPES / "cpu_toy.yaml").read_text())
    # only the override's flags change; everything else is the recipe as written
    for key, value in recipe["openrlhf"].items():
        assert merged["openrlhf"][key] == toy["openrlhf"].get(key, value)
    assert merged["cpu"] == toy["cpu"] and merged["cppo"] == recipe["cppo"]


def _dry_run(*args, cwd) -> str:
    out = subprocess.run([sys.executable, "-m", "cppo_megatron.cli", "openrlhf", *args, "--dry-run"],
                         capture_output=True, text=True, timeout=300, cwd=cwd,
                         env={k: v for k, v in os.environ.items() if not k.startswith("CPPO_")})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout


def _flag(command: str, name: str) -> str:
    argv = command.split()
    return argv[len(argv) - 1 - argv[::-1].index(name) + 1]  # the last value given (a later flag wins)


def test_tiny_cpu_recipes_dry_run(tmp_path):
    out = _dry_run(str(RECIPES / "tiny_cpu_cppo.yaml"), cwd=tmp_path)
    command = next(line for line in out.splitlines() if line.startswith("openrlhf: "))
    assert _flag(command, "--rollout.batch_size") == "128"  # 16 x 16/2: allocation
    assert _flag(command, "--data.max_samples") == str(20 * 128)  # cpu.max_steps after allocation
    assert _flag(command, "--ds.attn_implementation") == "sdpa" and _flag(command, "--vllm.sync_backend") == "gloo"
    assert _flag(command, "--actor.model_name_or_path") == str(tmp_path / "runs/openrlhf_tiny/model")
    assert not (tmp_path / "runs").exists()  # a dry run builds nothing
    out = _dry_run(str(RECIPES / "tiny_cpu_grpo.yaml"), cwd=tmp_path)
    command = next(line for line in out.splitlines() if line.startswith("openrlhf: "))
    assert "CPPO off" in out and _flag(command, "--data.max_samples") == str(20 * 16)


def test_worked_cpu_recipes_dry_run(tmp_path):
    """The worked-arithmetic testbed's recipes: the positions and lengths of the task, its reward file,
    allocation in the CPPO ones, P = 0 through the hook (signal/* logged) in the GRPO one, early
    stopping with prefix caching in the early-stop one."""
    for name, prompts in (("worked_cpu_cppo", 128), ("worked_cpu_grpo", 16), ("worked_cpu_early_stop", 128)):
        out = _dry_run(str(RECIPES / f"{name}.yaml"), cwd=tmp_path)
        command = next(line for line in out.splitlines() if line.startswith("openrlhf: "))
        assert _flag(command, "--rollout.batch_size") == str(prompts)
        assert _flag(command, "--data.max_samples") == str(20 * prompts)
        assert _flag(command, "--rollout.max_new_tokens") == "96" and _flag(command, "--data.max_len") == "128"
        assert float(_flag(command, "--actor.adam.lr")) == 1e-4  # as recipes/worked_cpu.yaml
        assert _flag(command, "--reward.remote_url") == str(RECIPES / "reward_worked.py")
        assert _flag(command, "--actor.model_name_or_path") == str(tmp_path / "runs/openrlhf_worked/model")
        assert "CPPO off" not in out
        # early stopping: segments of 16 tokens, each continuing its prefix from vLLM's prefix cache
        assert ("early_stop(segment=16" in out) == ("--vllm.enable_prefix_caching" in command) == (
            name == "worked_cpu_early_stop")
    assert not (tmp_path / "runs").exists()  # a dry run builds nothing

@pytest.mark.parametrize("name", CLUSTER)
def test_cluster_recipes_with_the_cpu_override_keep_their_flags(name, tmp_path):
    recipe = yaml.safe_load((RECIPES / name).read_text())["openrlhf"]
    toy = yaml.safe_load((RECIPES / "cpu_toy.yaml").read_text())["openrlhf"]
    out = _dry_run(str(RECIPES / name), "--cpu", str(RECIPES / "cpu_toy.yaml"), cwd=tmp_path)
    command = next(line for line in out.splitlines() if line.startswith("openrlhf: "))
    for key, value in recipe.items():
        if key in toy or key == "rollout.batch_size" or value is True or value is False:
            continue
        if "${" in str(value):
            continue
        assert _flag(command, f"--{key}") == str(value), key
    assert _flag(command, "--rollout.max_new_tokens") == "6"


def test_reward_scores_the_completion_after_the_prompt():
    from cppo_megatron.integrations.openrlhf.reward import completion_text, reward_func

    prompt = "<|im_start|>12+30="
    assert completion_text(prompt + "42<|im_end|><|endoftext|>", prompt) == "42"
    out = reward_func([prompt + "42<|im_end|>", prompt + "41<|im_end|>", prompt + "4 2"], [prompt] * 3, ["42"] * 3)
    assert out["rewards"].tolist() == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="does not start"):
        completion_text("x", prompt)



def test_worked_reward_grades_the_steps_against_the_prompt():
    """reward_worked.py as OpenRLHF loads it (by path): the question comes from the prompt."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("reward_worked", ROOT / "recipes" / "openrlhf" / "reward_worked.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    prompt = "<|im_start|>47+8-25+63="
    good = "47+8=55\n55-25=30\n30+63=93\n<answer>93</answer>"
    slip = "47+8=55\n55-25=31\n31+63=94\n<answer>94</answer>"
    lucky = "47+8=55\n55-25=30\n30+63=92\n<answer>93</answer>"
    queries = [prompt + t + "<|im_end|>" for t in (good, slip, lucky, "<answer>93")]
    out = module.reward_func(queries, [prompt] * 4, ["93"] * 4)
    assert out["rewards"].tolist() == out["scores"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert out["extra_logs"]["formatted"].tolist() == [1.0, 1.0, 1.0, 0.0]
    assert out["extra_logs"]["steps"].tolist() == pytest.approx([1.0, 1 / 3, 2 / 3, 0.0])
    with pytest.raises(ValueError, match="2 queries, 1 prompts"):
        module.reward_func(queries[:2], [prompt], ["93"])
    with pytest.raises(ValueError, match="no question like"):
        module.reward_func(["<|im_start|>hello 93"], ["<|im_start|>hello "], ["93"])

# every OpenRLHF line a seam cites (file, line, what the line must contain)
CITED = [
    ("utils/deepspeed/deepspeed.py", 97, "torch.cuda.set_device("),
    ("trainer/ray/launcher.py", 136, "torch.cuda.current_device()"),
    ("trainer/ray/launcher.py", 190, "torch.cuda.current_device()"),
    ("trainer/ray/ppo_actor.py", 148, "torch.cuda.current_device()"),
    ("trainer/ray/ppo_actor.py", 171, "torch.cuda.current_device()"),
    ("trainer/ray/ppo_actor.py", 627, "torch.cuda.current_device()"),
    ("utils/deepspeed/deepspeed.py", 614, "torch.cuda.current_device()"),
    ("utils/deepspeed/deepspeed.py", 633, "torch.cuda.current_device()"),
    ("trainer/ppo_utils/replay_buffer.py", 40, 'torch.device(f"cuda:{torch.cuda.current_device()}")'),
    ("trainer/ppo_utils/replay_buffer.py", 104, "torch.cuda.current_device()"),
    ("utils/distributed_util.py", 10, "torch.cuda.synchronize()"),
    ("trainer/ray/launcher.py", 65, "torch.cuda.synchronize()"),
    ("trainer/ray/ppo_actor.py", 605, "torch.cuda.synchronize()"),
    ("trainer/ray/ppo_actor.py", 436, "stream=torch.cuda.current_stream()"),
    ("models/ring_attn_utils.py", 3, "from flash_attn"),
    ("utils/distributed_util.py", 25, "PyNcclCommunicator("),
    ("trainer/ray/ppo_actor.py", 147, "stateless_init_process_group("),
    ("trainer/ray/vllm_worker_wrap.py", 20, "stateless_init_process_group("),
    ("trainer/ray/vllm_worker_wrap.py", 40, 'device="cuda"'),
    ("trainer/ray/vllm_worker_wrap.py", 46, "stream=torch.cuda.current_stream()"),
    ("trainer/ray/vllm_worker_wrap.py", 48, "model.load_weights("),
    ("trainer/ray/ppo_actor.py", 427, "empty_cache=count == num_params"),
]


@pytest.mark.parametrize(("relpath", "line", "text"), CITED, ids=[f"{p}:{n}" for p, n, _ in CITED])
def test_each_cited_openrlhf_line_is_what_the_seam_answers(relpath, line, text):
    from cppo_megatron.integrations.openrlhf.pinned import openrlhf_dir

    source = (openrlhf_dir() / relpath).read_text().splitlines()
    assert text in source[line - 1], f"{relpath}:{line} is now {source[line - 1].strip()!r}: OpenRLHF moved"


def test_the_torch_cuda_calls_those_lines_make_fail_on_this_cpu_build():
    """Why each torch.cuda seam is needed: without it the cited call raises here."""
    out = _python("""
        import torch
        assert not torch.cuda.is_available()
        for name, args in (("set_device", (0,)), ("current_device", ()), ("synchronize", ()), ("current_stream", ())):
            try:
                getattr(torch.cuda, name)(*args)
                print(name, "ok")
            except (RuntimeError, AssertionError, AttributeError):
                print(name, "raises")
    """)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["set_device", "raises", "current_device", "raises", "synchronize", "raises",
                                  "current_stream", "raises"]


def test_vllm_plugin_entry_point_is_registered_and_inert_without_the_switch():
    out = _python("""
        import sys
        from importlib.metadata import entry_points
        (ep,) = [e for e in entry_points(group="vllm.general_plugins") if e.name == "cppo_openrlhf_cpu"]
        ep.load()()
        print("finders", sum(type(f).__name__ == "_Finder" for f in sys.meta_path))
    """)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "finders 0" in out.stdout
