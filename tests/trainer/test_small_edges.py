"""The trainer's small helpers at their edges (scripts/coverage_floor.py found these branches
unreached): update and log-prob metrics, the tokenizers, stop requests, injected faults, the cosine
schedule, the metrics log on a fresh run and a resume, evaluation without problems. Each by value or
message."""

from __future__ import annotations

import math
import signal
import sys
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cppo_megatron.trainer import faults, interrupts
from cppo_megatron.trainer.evaluate import evaluate
from cppo_megatron.trainer.logger import MetricsLogger, read_metrics
from cppo_megatron.trainer.metrics import logprob_diff, logprob_diff_sums, update_metrics
from cppo_megatron.trainer.policy import KeptBatch, lr_factor
from cppo_megatron.trainer.tokenizer import CharTokenizer, HFTokenizer

STEP = dict(loss=1.0, pg_loss=0.5, kl=0.1, clipfrac=0.0, ratio_max=1.2, grad_norm=2.0)


def test_update_metrics_need_steps_with_every_key():
    with pytest.raises(ValueError, match="^update_metrics: no optimizer steps$"):
        update_metrics([], lr=1.0, tokens=1, sequences=1, micro_batches=1)
    with pytest.raises(ValueError, match=r"^update_metrics: optimizer step 1 lacks \['grad_norm'\]$"):
        update_metrics([STEP, {k: v for k, v in STEP.items() if k != "grad_norm"}], lr=1.0, tokens=1, sequences=1,
                       micro_batches=1)


def test_log_prob_differences_of_rows_with_and_without_tokens():
    sums = logprob_diff_sums([torch.tensor([0.0, -1.0]), torch.zeros(0)], [torch.tensor([0.5, -1.0]), torch.zeros(0)])
    assert sums.tolist() == [0.5, 2.0, 0.5]
    with pytest.raises(ValueError, match="^logprob_diff: 1 rows of sampler log-probs for 2 trainer rows$"):
        logprob_diff_sums([torch.zeros(1)], [torch.zeros(1), torch.zeros(1)])
    with pytest.raises(ValueError, match="^logprob_diff: 2 sampler log-probs for completion 1 of 3 tokens$"):
        logprob_diff_sums([torch.zeros(1), torch.zeros(2)], [torch.zeros(1), torch.zeros(3)])


def test_the_log_prob_difference_is_the_mean_over_tokens_and_warns_above_its_threshold():
    sums = torch.tensor([0.5, 2.0, 0.375], dtype=torch.float64)  # summed over ranks; the largest maxed
    assert logprob_diff(sums) == {"rollout/logprob_diff": 0.25, "rollout/logprob_diff_max": 0.375}
    with pytest.warns(UserWarning, match=r"^rollout/logprob_diff=0.2500 exceeds 0.2: the rollout engine and the "
                                         r"trainer disagree$"):
        assert logprob_diff(sums, 0.2)["rollout/logprob_diff"] == 0.25
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # at the threshold, or on a rank that does not warn (None): silent
        assert logprob_diff(sums, 0.25)["rollout/logprob_diff"] == 0.25
        assert logprob_diff(sums, None)["rollout/logprob_diff"] == 0.25
        # no completion token on any rank: 0, not a division by zero
        assert logprob_diff(torch.zeros(3, dtype=torch.float64), 0.0) == {"rollout/logprob_diff": 0.0,
                                                                          "rollout/logprob_diff_max": 0.0}


def test_a_byte_level_character_tokenizer_decodes_utf8():
    tok = CharTokenizer(None)
    ids = tok.encode("é=5")
    assert tok.decode(ids) == "é=5" and tok.state() == {"kind": "char", "alphabet": None}


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    """A real transformers tokenizer: the one export_hf writes for the tiny recipe's model."""
    transformers = pytest.importorskip("transformers")
    from cppo_megatron.tasks import build_task
    from cppo_megatron.trainer.config import load_recipe
    from cppo_megatron.trainer.export import export_hf
    from cppo_megatron.trainer.models import build_model
    from tests.recipes import recipe_path

    r = load_recipe(recipe_path("tiny_cpu"), ["model.hidden_size=32", "model.num_layers=1"])
    model, tok = build_model(r.model, build_task(r.task).alphabet, seed=0)
    out = tmp_path_factory.mktemp("hf")
    export_hf(model, tok, out)
    return transformers.AutoTokenizer.from_pretrained(out)


def test_an_hf_tokenizer_applies_its_chat_template_with_a_system_prompt(hf_tokenizer):
    tok = HFTokenizer(hf_tokenizer, chat_template=True, system_prompt="1+1=2")
    messages = [{"role": "system", "content": "1+1=2"}, {"role": "user", "content": "3+4="}]
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tok.prompt_ids("3+4=") == hf_tokenizer.encode(expected, add_special_tokens=False)
    assert tok.vocab_size == len(hf_tokenizer) and tok.state() == {"kind": "hf"}
    assert tok.decode(tok.encode("12+3")) == "12+3"


def test_an_hf_tokenizer_needs_an_eos(hf_tokenizer):
    import copy

    no_eos = copy.deepcopy(hf_tokenizer)
    no_eos.eos_token = None
    with pytest.raises(ValueError, match="^the tokenizer has no eos token; generation could never stop$"):
        HFTokenizer(no_eos)


def test_a_second_signal_after_the_window_abandons_the_step(monkeypatch, capsys):
    clock = iter([100.0, 101.0, 104.5])
    monkeypatch.setattr(interrupts.time, "monotonic", lambda: next(clock))
    stop = interrupts.StopRequest()
    stop._handler(signal.SIGTERM, None)
    assert stop.requested and "SIGTERM: finishing the current step" in capsys.readouterr().err
    stop._handler(signal.SIGINT, None)  # 1 s later: the same request (torchrun forwards Ctrl-C again)
    with pytest.raises(KeyboardInterrupt):
        stop._handler(signal.SIGINT, None)  # 4.5 s after the first


def test_outside_the_main_thread_signals_stay_as_they_were():
    before = signal.getsignal(signal.SIGTERM)
    seen = []

    def body():
        with interrupts.StopRequest() as stop:
            seen.append(stop.previous)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == [{}] and signal.getsignal(signal.SIGTERM) is before


def test_injected_faults(monkeypatch, tmp_path):
    with pytest.raises(ValueError, match=r"^CPPO_MEGATRON_FAULT='update:x:0:raise': each fault is PHASE:STEP:RANK:"):
        faults.parse("update:x:0:raise")
    log = tmp_path / "faults.log"
    monkeypatch.setenv(faults.ENV, "update:2:1:raise")
    monkeypatch.setenv(faults.ENV + "_LOG", str(log))
    faults.maybe_inject("update", 2, 0)  # another rank: nothing
    with pytest.raises(RuntimeError, match=r"^injected fault \(CPPO_MEGATRON_FAULT\) on rank 1 in the update of step 2$"):
        faults.maybe_inject("update", 2, 1)
    assert log.read_text().split()[:4] == ["1", "update", "2", "raise"]


def test_the_cosine_schedule_decays_to_a_tenth_after_its_warmup():
    cfg = SimpleNamespace(mu=1, lr_warmup_steps=2, lr_schedule="cosine")
    factors = [lr_factor(i, cfg, total_steps=6) for i in range(7)]
    assert factors[:2] == [0.5, 1.0] and factors[2] == 1.0
    assert factors[4] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert factors[6] == pytest.approx(0.1)


def test_a_kept_batch_needs_one_completion_per_prompt():
    with pytest.raises(ValueError, match="^2 prompts for 1 completions$"):
        KeptBatch(prompts=[[1], [2]], completions=[[3]])


def test_the_metrics_log_starts_fresh_or_keeps_the_resumed_steps(tmp_path):
    path = Path(tmp_path) / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\nnot json\n{"kind": "eval"}\n')
    MetricsLogger(tmp_path, tensorboard=False, resume_step=1).close()
    assert read_metrics(path) == [{"step": 1}, {"kind": "eval"}]  # later steps and broken lines dropped
    MetricsLogger(tmp_path, tensorboard=False).close()  # a new run: the old log goes
    assert read_metrics(path) == []


def _tb_scalars(tb_dir: Path, tag: str) -> list[tuple[int, float]]:
    """What TensorBoard would draw for ``tag`` from every event file in ``tb_dir``."""
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    mux = EventMultiplexer({"run": str(tb_dir)})
    mux.Reload()
    return [(e.step, e.value) for e in mux.Scalars("run", tag)]


def test_tensorboard_starts_fresh_or_purges_past_the_resumed_step(tmp_path):
    pytest.importorskip("tensorboard")
    tb_dir = Path(tmp_path) / "tensorboard"
    for rerun in ("first", "second"):  # the same out_dir twice, without --resume
        logger = MetricsLogger(tmp_path, tensorboard=True)
        for step in (1, 2, 3):
            logger.log({"reward/mean": float(step if rerun == "first" else 10 * step)}, step)
        logger.close()
    assert len(list(tb_dir.glob("events.out.tfevents.*"))) == 1  # the first run's file went
    assert _tb_scalars(tb_dir, "reward/mean") == [(1, 10.0), (2, 20.0), (3, 30.0)]
    logger = MetricsLogger(tmp_path, tensorboard=True, resume_step=1)  # crashed after step 3, resumed at 1
    for step in (2, 3):
        logger.log({"reward/mean": float(100 * step)}, step)
    logger.close()
    assert _tb_scalars(tb_dir, "reward/mean") == [(1, 10.0), (2, 200.0), (3, 300.0)]


def test_evaluation_needs_problems():
    with pytest.raises(ValueError, match="^evaluate: no problems$"):
        evaluate(None, None, None, [], 4)


def test_without_tensorboard_installed_the_metrics_log_is_written_alone(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # what a missing package raises
    logger = MetricsLogger(tmp_path, tensorboard=True)
    assert logger.tb is None
    logger.log({"reward/mean": 0.5}, 1)
    logger.close()
    assert read_metrics(Path(tmp_path) / "metrics.jsonl") == [{"reward/mean": 0.5}]
    assert not (Path(tmp_path) / "tensorboard").exists()


def test_the_backends_refuse_what_their_callers_must_not_pass():
    """Checks on the loop's side of the backend interface (the loop never passes these), by message."""
    from cppo_megatron.trainer.backends.hf import HFBackend
    from cppo_megatron.trainer.backends.megatron import MegatronBackend

    batch = SimpleNamespace(local_rows=torch.tensor([0, 1]), num_rows=3)  # a rank holding 2 of 3 rows
    with pytest.raises(ValueError, match="^HFBackend: this process must hold every row of the step$"):
        HFBackend.place(SimpleNamespace(), batch, torch.tensor([0]), torch.zeros(3))
    with pytest.raises(RuntimeError, match=r"^reference log-probs need train.beta > 0 \(HFBackend.start builds the "
                                           r"reference\)$"):
        HFBackend.logprobs(SimpleNamespace(ref_model=None), SimpleNamespace(payload=(None, None)), reference=True)
    with pytest.raises(ValueError, match=r"^MegatronBackend.update needs the old-policy log-probs "
                                         r"\(needs_old_logprobs is True\)$"):
        MegatronBackend.update(SimpleNamespace(), SimpleNamespace(), None, None, step=1)


def test_the_hf_update_refuses_inputs_its_loss_cannot_use():
    """``HFPolicy.update``'s checks, each before any weight moves, by message."""
    from cppo_megatron.trainer.policy import HFPolicy

    batch = KeptBatch([[3, 4], [3, 4], [5]], [[6], [7, 8], [9]])
    adv, lp = torch.zeros(3), torch.zeros(3, 2)

    def update(mu, beta, advantages, old, ref):
        return HFPolicy.update(SimpleNamespace(cfg=SimpleNamespace(mu=mu, beta=beta)), batch, [[0, 1, 2]],
                               advantages, old, ref, norm_constant=1.0)

    with pytest.raises(ValueError, match="^mu > 1 needs the old-policy log-probs$"):
        update(2, 0.0, adv, None, None)
    with pytest.raises(ValueError, match="^beta > 0 needs the reference log-probs$"):
        update(2, 0.04, adv, lp, None)
    with pytest.raises(ValueError, match=r"^advantages must be \[N\] = \[3\], got shape \(3, 1\)$"):
        update(1, 0.04, adv.unsqueeze(1), None, lp)


def test_a_phase_timer_without_a_callback_times_only_its_phase():
    from cppo_megatron.trainer.metrics import PHASES
    from cppo_megatron.trainer.step import PhaseTimer

    timer = PhaseTimer(torch.device("cpu"))
    with timer.phase("reward"):
        torch.ones(1000).sum()
    assert timer.seconds["reward"] > 0 and all(timer.seconds[p] == 0.0 for p in PHASES if p != "reward")


def test_a_phase_timer_on_cuda_waits_for_the_device_before_reading_the_clock(monkeypatch):
    """On a GPU a phase ends when its queued kernels have run: one ``torch.cuda.synchronize`` per phase
    (stood in for here: this machine has no GPU), none on the CPU."""
    from cppo_megatron.trainer.step import PhaseTimer

    synced: list[float] = []  # the phase's seconds when the timer synchronized
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: synced.append(timer.seconds["update"]))
    timer = PhaseTimer(torch.device("cuda"))
    with timer.phase("update"):
        pass
    first = timer.seconds["update"]
    with timer.phase("update"):
        pass
    assert synced == [0.0, first] and timer.seconds["update"] > first  # each time before the clock was read
    cpu = PhaseTimer(torch.device("cpu"))
    with cpu.phase("update"):
        pass
    assert len(synced) == 2


def test_without_matplotlib_the_report_has_no_plot(tmp_path, monkeypatch):
    from cppo_megatron.trainer.report import write_report

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what a missing package raises: ImportError
    (tmp_path / "metrics.jsonl").write_text('{"kind": "step", "step": 1, "wall": 2.0, "time/step": 2.0}\n')
    write_report(tmp_path, "t", plots=True)
    assert not (tmp_path / "report.png").exists()
    assert "![report](report.png)" not in (tmp_path / "report.md").read_text()


def test_a_rank_that_cannot_see_its_own_probe_file_says_so(tmp_path):
    """A filesystem that does not show a rank its own write (``filesystem_peers``): named, with the probe's
    path; alone (no other rank's file seen either) and beside a rank whose file it does see."""
    from cppo_megatron.trainer.checkpoint import filesystem_peers

    def lose_own(rank, others):
        def barrier():
            for probe in (tmp_path / "checkpoints").glob(".fs-probe-*"):
                (probe / f"rank{rank:05d}").unlink(missing_ok=True)
                for other in others:
                    (probe / f"rank{other:05d}").touch()
        return barrier

    for rank, others in ((0, ()), (1, (0,))):
        with pytest.raises(RuntimeError, match=rf"^checkpoint probe: rank {rank} cannot see its own file under "
                                               rf"{tmp_path}/checkpoints/\.fs-probe-tok$"):
            filesystem_peers(tmp_path, rank, gather=lambda obj: ["tok"], barrier=lose_own(rank, others))
