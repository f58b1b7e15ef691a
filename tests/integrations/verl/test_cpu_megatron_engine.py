"""veRL's Megatron engine in the CPU mode, seam by seam, in fresh processes (no Ray):

- the seams are installed with ``VERL_PLATFORM=cpu`` only;
- veRL's own ``MegatronEngineWithLMHead`` at TP 2 (sequence parallel on, 2 gloo ranks) on a
  model with sharp outputs and non-trivial norm weights: log-probs equal HF's within bf16
  tolerance on packed (thd) and padded (bshd) inputs, ``get_per_tensor_param`` returns exactly
  the HF safetensors (bf16), one ``train_batch``'s grad norm equals HF's for the same loss and
  moves the log-probs; the packed run drains the export and trains on a second thread (Ray
  runs async worker methods off the main thread);
- TP 2 x DP 2 with the distributed optimizer: the same step as DP 1;
- the pieces: the per-thread mode, the masks, the norm, the RNG tracker, vocabulary padding.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from .conftest import ROOT

pytestmark = pytest.mark.verl
pytest.importorskip("megatron.core", reason="megatron-core is not installed (extra: megatron)")
# the route this environment has: mbridge (.venv, Python 3.11) or Megatron-Bridge (.venv-bridge, 3.12)
ROUTE = "mbridge" if importlib.util.find_spec("mbridge") else "megatron-bridge"
if ROUTE == "megatron-bridge":
    pytest.importorskip("megatron.bridge", reason="neither mbridge nor Megatron-Bridge is installed")

HERE = os.path.dirname(os.path.abspath(__file__))
# bf16 engine vs HF bf16, log-probs down to about -7 (op order differs): measured max 0.041
LOGPROB_MAX_ABS, LOGPROB_MEAN_ABS = 0.1, 0.02


def make_sharp_model(out, tok_dir=None):
    """A random Qwen2 (untied head, GQA, qkv bias) with large weights and norm weights away from 1,
    so a wrong norm, mask or weight shows in the log-probs; the exported tiny tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=24, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    m = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
            elif n.endswith("bias"):
                p.normal_(0, 0.2)
    m.save_pretrained(out, safe_serialization=True)
    from cppo_megatron.tasks import build_task
    from cppo_megatron.trainer.config import load_recipe
    from cppo_megatron.trainer.export import char_to_hf_tokenizer
    from cppo_megatron.trainer.models import build_model

    r = load_recipe(ROOT / "recipes" / "tiny_cpu.yaml")
    _, tok = build_model(r.model, build_task(r.task).alphabet, seed=0)
    hf_tok, _ = char_to_hf_tokenizer(tok)
    hf_tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def sharp_model(tmp_path_factory):
    return make_sharp_model(tmp_path_factory.mktemp("sharp"))


def run_engine(model_dir, tmp, runs: str, *, tp: int = 2, world: int = 2, pp: int = 1) -> dict:
    """``runs``: PACKED:THREAD pairs (megatron_engine_worker.py), one engine each, one launch."""
    from cppo_megatron.distributed.launch import free_port

    out = tmp / f"engine_{world}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VERL_PLATFORM": "cpu", "RAY_AUTH_MODE": "disabled",
           "CPPO_TEST_BRIDGE": ROUTE, "CPPO_TEST_PP": str(pp)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), "--master-port",
           str(free_port()), os.path.join(HERE, "megatron_engine_worker.py"), str(model_dir), str(out), str(tp), runs]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-6000:]
    return json.loads(out.read_text())


def check_engine(r, *, tp: int = 2):
    assert r["engine"] == "MegatronEngineWithLMHead" and r["dp"] == 1
    assert (r["packed"], r["thread"]) in ((True, True), (False, False))
    diffs = [abs(a - b) for x, y in zip(r["log_probs"], r["hf"]) for a, b in zip(x, y)]
    assert [len(x) for x in r["log_probs"]] == [len(x) for x in r["hf"]] == [4, 8, 11, 6]
    assert max(diffs) <= LOGPROB_MAX_ABS and sum(diffs) / len(diffs) <= LOGPROB_MEAN_ABS, (max(diffs), diffs)
    # what veRL's weight sync sends: every HF tensor, bit-identical to the safetensors in bf16
    assert sorted(r["sent"]) == r["safetensors"], (sorted(r["sent"]), r["safetensors"])
    assert all(r["sent_equal"].values()), [k for k, v in r["sent_equal"].items() if not v]
    # TP 2 with sequence parallel: the norms' partial weight grads are summed over TP, so the
    # total grad norm is HF's for the same loss (bf16 engine vs fp32 HF: measured 8.488 vs 8.471)
    assert r["grad_norm"] == pytest.approx(r["hf_grad_norm"], rel=0.01)
    # ... and the TP ranks' copies of the replicated weights (norms, biases) stay identical
    assert r["tp_replica_max_diff"] == 0.0
    moved = max(abs(a - b) for x, y in zip(r["log_probs"], r["after"]) for a, b in zip(x, y))
    assert moved > 0.05  # one update with lr 1e-2 raised the batch's log-likelihood


@pytest.fixture(scope="module")
def tp2(sharp_model, tmp_path_factory):
    """One launch, 2 ranks (TP 2): a packed engine exported and stepped on a second thread,
    then a padded engine on the main thread."""
    return run_engine(sharp_model, tmp_path_factory.mktemp("eng"), "1:1,0:0")


@pytest.fixture(scope="module")
def packed_on_thread(tp2):
    return tp2["runs"][0]


@pytest.fixture(scope="module")
def padded(tp2):
    return tp2["runs"][1]


def test_engine_tp2_packed_log_probs_export_and_step_on_a_second_thread(packed_on_thread):
    check_engine(packed_on_thread)
    after = [a for row in packed_on_thread["after"] for a in row]
    before = [a for row in packed_on_thread["log_probs"] for a in row]
    assert sum(after) > sum(before)  # the loss was -mean log p


def test_engine_tp2_padded_log_probs_export_and_step(padded, packed_on_thread):
    check_engine(padded)
    # the padded (causal | padding mask) and packed (block-diagonal causal) paths agree
    d = max(abs(a - b) for x, y in zip(padded["log_probs"], packed_on_thread["log_probs"]) for a, b in zip(x, y))
    assert d <= LOGPROB_MAX_ABS
    assert padded["grad_norm"] == pytest.approx(packed_on_thread["grad_norm"], rel=0.05)


@pytest.fixture(scope="module")
def tp2_dp2(sharp_model, tmp_path_factory):
    """One launch, 4 ranks (TP 2 x DP 2): a padded engine, then the checkpoint resume run."""
    if ROUTE == "megatron-bridge":  # CI time: DP 2 with the distributed optimizer runs in the V1 loop there
        pytest.skip("Megatron-Bridge: TP 2 x DP 2 runs in test_cpu_megatron_bridge.py's V1 CPPO run")
    tmp = tmp_path_factory.mktemp("eng")
    return run_engine(sharp_model, tmp, f"0:0,resume:{tmp / 'ckpt'}", world=4)["runs"]


def test_engine_tp2_dp2_distributed_optimizer_steps_like_dp1(padded, tp2_dp2):
    """TP 2 x DP 2 (4 ranks) with veRL's default distributed optimizer (optimizer state and the
    fp32 main weights sharded over DP, gradients reduce-scattered, weights all-gathered, on
    gloo): both DP ranks get the same batch, so the step must equal the DP 1 run's exactly."""
    r = tp2_dp2[0]
    assert r["dp"] == 2 and padded["dp"] == 1
    assert r["log_probs"] == padded["log_probs"]
    assert r["grad_norm"] == pytest.approx(padded["grad_norm"], rel=1e-6)
    assert max(abs(a - b) for x, y in zip(r["after"], padded["after"]) for a, b in zip(x, y)) <= 1e-6
    assert r["tp_replica_max_diff"] == 0.0 and r["sent_equal"] == padded["sent_equal"]


def test_engine_resumes_exactly_from_its_checkpoint_tp2_dp2(tp2_dp2):
    """veRL's Megatron checkpoint, saved after one step and loaded into a new engine, continues
    exactly: every rank's optimizer shard (moments, Adam step, lr) is what it saved, the LR
    schedule continues, and the next step gives the same weights (log-probs) as the engine that
    never stopped. Without CPU seam 7 the load fails (AssertionError, distrib_optimizer.py:642) or,
    with the shared step tensor of distrib_optimizer.py:817-823, the step after it uses Adam's bias
    correction of step 16 instead of 2."""
    ranks = tp2_dp2[1]["resume"]
    assert [r["dp"] for r in ranks] == [2, 2, 2, 2]
    for r in ranks:
        assert r["saved"]["tensors"] > 0 and r["saved"]["steps"] == [1.0]
        assert r["loaded"] == r["saved"], r["rank"]
        assert r["b_scheduler_steps"] == 1
        assert r["a_after"]["steps"] == [2.0] and r["b_after"] == r["a_after"], r["rank"]
        assert r["b_log_probs"] == r["a_log_probs"]


PROBE = r"""
import json
import sys
sys.path.insert(0, sys.argv[1])
import verl
from megatron_engine_worker import seams_installed
print(json.dumps(seams_installed()))
"""


def probe(platform):
    env = {k: v for k, v in os.environ.items() if k != "VERL_PLATFORM"}
    if platform:
        env["VERL_PLATFORM"] = platform
    out = subprocess.run([sys.executable, "-c", PROBE, HERE], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_megatron_seams_installed_only_in_cpu_mode(tp2):
    # with VERL_PLATFORM=cpu (the engine run's processes): all seven (Megatron-Bridge: and the TE
    # placeholder, gone from sys.modules after the two modules that import TE)
    bridge = {"te_placeholder": True} if ROUTE == "megatron-bridge" else {}
    assert tp2["seams"] == {"cpu_engine": True, "cpu_value_engine": True, "layer_spec": True,
                            "attention": True, "seed": True, "methods": True, "optimizer_state": True,
                            "current_device": "cpu", **bridge}
    if ROUTE == "megatron-bridge":
        return  # without the CPU mode `import megatron.bridge` fails here: Transformer Engine is CUDA-only
    off = probe(None)  # a GPU machine's veRL (no VERL_PLATFORM): nothing of it
    assert off == {"cpu_engine": False, "cpu_value_engine": False, "layer_spec": False, "attention": False,
                   "seed": False, "methods": False, "optimizer_state": False, "current_device": None}


# ------------------------------------------------------------------------------ pieces, in-process
def test_engine_mode_is_entered_on_the_calling_thread(monkeypatch):
    from cppo_megatron.integrations.verl.cpu import megatron_engine as me

    monkeypatch.setattr(me, "needed", lambda: True)

    def work():
        p = torch.nn.Parameter(torch.zeros(2, dtype=torch.bfloat16))
        return str(torch.zeros(1, device="cuda").device), p.type(), str(torch.ones(1).to(0).device)

    wrapped = me._in_mode(work)
    out: dict = {}
    with me.engine_cpu_mode():  # entered on the main thread only ...
        assert work() == ("cpu", "torch.cuda.BFloat16Tensor", "cpu")
        th = threading.Thread(target=lambda: out.update(bare=_try(work), wrapped=_try(wrapped)))
        th.start()
        th.join()
    # ... does not reach another thread (a torch function mode is per thread); the wrapper does
    assert isinstance(out["bare"], Exception) and out["wrapped"] == ("cpu", "torch.cuda.BFloat16Tensor", "cpu")

    def gen():
        yield torch.zeros(1, device="cuda").device.type

    th = threading.Thread(target=lambda: out.update(gen=_try(lambda: list(me._wrap_result(gen())))))
    th.start()
    th.join()
    assert out["gen"] == ["cpu"]  # a returned generator runs in the mode on the thread that drains it


def _try(fn):
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return exc


def test_attention_masks():
    from cppo_megatron.integrations.verl.cpu.megatron_engine import (
        attention_mask_from_cu_seqlens,
        attention_mask_from_padding,
    )

    m = attention_mask_from_padding(torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool))
    assert m.shape == (2, 1, 3, 3)
    assert m[0, 0].int().tolist() == [[0, 1, 1], [0, 0, 1], [0, 0, 1]]  # causal | key padding
    assert m[1, 0].int().tolist() == [[0, 1, 1], [0, 0, 1], [0, 0, 0]]
    p = attention_mask_from_cu_seqlens(torch.tensor([0, 2, 5], dtype=torch.int32), 6)[0, 0].int().tolist()
    assert p == [[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1], [1, 1, 0, 1, 1, 1], [1, 1, 0, 0, 1, 1], [1, 1, 0, 0, 0, 1],
                 [1, 1, 1, 1, 1, 0]]
    with pytest.raises(ValueError, match="bad cu_seqlens"):
        attention_mask_from_cu_seqlens(torch.tensor([0, 4, 2]), 6)


def test_rms_norm_is_hf_qwen2():
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    from cppo_megatron.integrations.verl.cpu.layer_spec import rms_norm

    hf = Qwen2RMSNorm(16, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        hf.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16) * 3
    assert torch.equal(rms_norm(x, hf.weight, 1e-6), hf(x))


def _megatron_tracker_on_cpu(monkeypatch):
    """megatron-core's own ``CudaRNGStatesTracker`` logic, run on the CPU generator: its CUDA state
    accessors answer with torch's CPU state (the tracker code itself runs unchanged)."""
    from megatron.core.tensor_parallel import random as mrandom

    monkeypatch.setattr(mrandom, "_get_cuda_rng_state", lambda *a, **k: torch.get_rng_state())
    monkeypatch.setattr(mrandom, "_set_cuda_rng_state", lambda state, *a, **k: torch.set_rng_state(state))
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda *a, **k: torch.get_rng_state())
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: torch.manual_seed(seed))
    # model_parallel_cuda_manual_seed replaces the module's tracker: put the original back afterwards
    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER", mrandom._CUDA_RNG_STATE_TRACKER)
    monkeypatch.setattr(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED", mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    return mrandom


def _tracker_script(tracker) -> list:
    """Draws from the caller's stream and from named streams: plain, repeated and nested forks,
    and a get_states / set_states round trip (what megatron's layers and checkpoints do)."""
    torch.manual_seed(1)
    tracker.add("a", 5)
    tracker.add("b", 7)
    out = [torch.rand(2)]
    with tracker.fork("a"):
        out.append(torch.rand(3))
    out.append(torch.rand(2))  # the caller's stream continues where it was
    with tracker.fork("a"):
        out.append(torch.rand(3))  # the named stream continues where the last fork left it
    with tracker.fork("b"):
        out.append(torch.rand(2))
        with tracker.fork("a"):
            out.append(torch.rand(2))
        out.append(torch.rand(2))  # back on b
        with tracker.fork("b"):
            out.append(torch.rand(2))  # a nested fork of the same stream continues it
        out.append(torch.rand(2))
    saved = tracker.get_states()
    with tracker.fork("a"):
        out.append(torch.rand(3))
    tracker.set_states(saved)
    with tracker.fork("a"):
        out.append(torch.rand(3))  # restored: the same draws again
    out.append(torch.rand(2))
    out.append(torch.get_rng_state())
    return out


def test_cpu_rng_tracker_forks_like_megatrons(monkeypatch):
    from cppo_megatron.integrations.verl.cpu.megatron_engine import CPURNGStatesTracker

    mrandom = _megatron_tracker_on_cpu(monkeypatch)
    ours = _tracker_script(CPURNGStatesTracker())
    theirs = _tracker_script(mrandom.CudaRNGStatesTracker())
    assert len(ours) == len(theirs)
    for i, (x, y) in enumerate(zip(ours, theirs)):
        assert torch.equal(x, y), f"draw {i} differs from megatron-core's tracker: {x} vs {y}"
    # by value, without megatron: stream "a" is seed 5's sequence, split over the forks
    a = torch.rand(9, generator=torch.Generator().manual_seed(5))
    assert torch.equal(ours[1], a[:3]) and torch.equal(ours[3], a[3:6])
    assert torch.equal(ours[9], ours[10])  # set_states replays the saved stream
    default = torch.rand(4, generator=torch.Generator().manual_seed(1))
    assert torch.equal(torch.cat([ours[0], ours[2]]), default)  # forks leave the caller's stream alone
    t = CPURNGStatesTracker()
    t.add("a", 5)
    with pytest.raises(ValueError, match="seed 5"):
        t.add("b", 5)
    with pytest.raises(KeyError):
        with t.fork("nope"):
            pass


def test_cpu_rng_tracker_seeds_megatrons_named_streams(monkeypatch):
    """``seed_cpu_rng_tracker(seed)`` holds the streams ``model_parallel_cuda_manual_seed(seed)``
    makes (data-parallel, tensor-parallel per TP rank, expert), compared draw by draw."""
    from megatron.core import parallel_state as mpu

    from cppo_megatron.integrations.verl.cpu.megatron_engine import seed_cpu_rng_tracker

    mrandom = _megatron_tracker_on_cpu(monkeypatch)
    names = (mrandom._DATA_PARALLEL_RNG_TRACKER_NAME, mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME,
             mrandom._EXPERT_PARALLEL_RNG_TRACKER_NAME)
    for tp_rank, ep_rank, etp_rank in ((0, 0, 0), (1, 2, 1)):
        monkeypatch.setattr(mpu, "get_tensor_model_parallel_rank", lambda r=tp_rank: r)
        monkeypatch.setattr(mpu, "get_expert_model_parallel_rank", lambda r=ep_rank: r)
        monkeypatch.setattr(mpu, "get_expert_tensor_parallel_rank", lambda r=etp_rank: r)
        mrandom.model_parallel_cuda_manual_seed(11, tp_rank=tp_rank, ep_rank=ep_rank, etp_rank=etp_rank,
                                                force_reset_rng=True)
        theirs = mrandom.get_cuda_rng_tracker()
        ours = seed_cpu_rng_tracker(11)
        assert mrandom.get_cuda_rng_tracker() is ours
        for name in names:
            draws = []
            for tracker in (ours, theirs):
                with tracker.fork(name):
                    draws.append(torch.rand(4))
            assert torch.equal(draws[0], draws[1]), f"stream {name} at tp_rank {tp_rank}: {draws}"
        with ours.fork(mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME):
            nxt = torch.rand(2)
        expect = torch.rand(6, generator=torch.Generator().manual_seed(11 + 2718 + tp_rank))[4:]
        assert torch.equal(nxt, expect)


def test_pad_vocab_copies_the_pad_row(tmp_path):
    from transformers import AutoModelForCausalLM

    from cppo_megatron.integrations.verl.cpu.vocab import pad_vocab

    make_sharp_model(tmp_path)
    before = AutoModelForCausalLM.from_pretrained(tmp_path)
    # 24 rows already divide 8: unchanged; a multiple of 7 makes them 28
    assert pad_vocab(tmp_path, 8) == 24 and pad_vocab(tmp_path, 7) == 28
    after = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert after.config.vocab_size == 28
    for get in ("get_input_embeddings", "get_output_embeddings"):
        w0, w1 = getattr(before, get)().weight, getattr(after, get)().weight
        assert torch.equal(w1[:24], w0) and torch.equal(w1[24:], w0[0].expand(4, -1))
    with pytest.raises(ValueError, match="multiple=0"):
        pad_vocab(tmp_path, 0)
