"""advise reads every host's metrics in the formats the hosts write them: veRL's console, file and
TensorBoard loggers and OpenRLHF's console line and TensorBoard logger (driven here through the
hosts' own logger classes, as a run that never loaded this package writes them), this package's
JSON lines, a real veRL CPU run's console and JSONL (an excerpt kept in examples/advise), and
TensorBoard files read without TensorBoard (``advise/tfevents.py``)."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import types
from pathlib import Path

import numpy as np
import pytest

from cppo_megatron.advise import NoTimingKeys, read_run
from cppo_megatron.advise.logs import detect_host, parse_console, parse_jsonl
from cppo_megatron.advise.tfevents import read_scalars

DATA = Path(__file__).resolve().parents[2] / "examples" / "advise"


def _verl_steps(n: int = 3) -> list[dict]:
    return [{"timing_s/gen": np.float64(2.0 + s), "timing_s/old_log_prob": 0.5, "timing_s/update_actor": np.float32(1.25),
             "timing_s/step": 4.0 + s, "actor/pg_loss": -0.001, "training/global_step": s} for s in range(1, n + 1)]


def test_verl_console_lines_from_verls_own_logger_with_a_ray_prefix():
    from verl.utils.logger.aggregate_logger import LocalLogger

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        for s, d in enumerate(_verl_steps(), 1):
            LocalLogger().log(d, step=s)
    # Ray forwards a worker's stdout with a coloured "(TaskRunner pid=...)" prefix
    text = "".join(f"\x1b[36m(TaskRunner pid=4242)\x1b[0m {line}\n" for line in buf.getvalue().splitlines())
    text += "(TaskRunner pid=4242) Training Progress: 100%|##########| 3/3\n"
    steps = parse_console(text)
    assert [s for s, _ in steps] == [1, 2, 3]
    assert steps[1][1] == {"timing_s/gen": 4.0, "timing_s/old_log_prob": 0.5, "timing_s/update_actor": 1.25,
                           "timing_s/step": 6.0, "actor/pg_loss": -0.001, "training/global_step": 2.0}


def test_verl_file_and_tensorboard_loggers(tmp_path, monkeypatch):
    tracking = pytest.importorskip("verl.utils.tracking")
    monkeypatch.setenv("VERL_FILE_LOGGER_PATH", str(tmp_path / "run.jsonl"))
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    t = tracking.Tracking("proj", "exp", default_backend=["file", "tensorboard"])
    for s, d in enumerate(_verl_steps(), 1):
        t.log(d, step=s)
    t.finish()
    from_file = read_run(tmp_path / "run.jsonl")
    from_tb = read_run(tmp_path / "tb")
    assert (from_file.host, from_file.fmt, from_tb.host, from_tb.fmt) == ("verl", "jsonl", "verl", "tensorboard")
    assert [s for s, _ in from_tb.steps] == [1, 2, 3]
    for (_, a), (_, b) in zip(from_file.steps, from_tb.steps, strict=True):
        assert a.keys() == b.keys() and all(a[k] == pytest.approx(b[k], rel=1e-6) for k in a)  # float32 in TB


def test_a_real_verl_cpu_run_console_and_jsonl_agree():
    """examples/advise: the step lines and metrics.jsonl of a real 4-step `cppo-megatron verl`
    GRPO run on CPU (recipes/verl/tiny_cpu_grpo.yaml, hf rollout), unedited."""
    console = read_run(DATA / "verl_cpu_grpo_console.log")
    jsonl = read_run(DATA / "verl_cpu_grpo_metrics.jsonl")
    assert (console.host, console.fmt, jsonl.fmt) == ("verl", "console", "jsonl")
    assert [s for s, _ in console.steps] == [s for s, _ in jsonl.steps] == [1, 2, 3, 4]
    for (_, a), (_, b) in zip(console.steps, jsonl.steps, strict=True):
        for k in ("timing_s/gen", "timing_s/old_log_prob", "timing_s/update_actor", "timing_s/step"):
            assert a[k] == pytest.approx(b[k], rel=1e-12), k
    assert jsonl.steps[1][1]["timing_s/step"] == pytest.approx(6.138, abs=1e-3)


def _openrlhf_status(s: int) -> dict:
    return {"policy_loss": 0.1 * s, "timing/make_experience": 0.75, "timing/ppo_train": 1.5, "timing/broadcast": 0.25,
            "timing/generation": 2.0 + s, "timing/step_total": 4.5 + s}


def test_openrlhf_console_lines_in_its_logging_format():
    from openrlhf.utils.logging_utils import _DATE_FORMAT, _FORMAT, NewLineFormatter

    fmt = NewLineFormatter(_FORMAT, _DATE_FORMAT)
    lines = []
    for s in (1, 2):  # ppo_trainer.py:549 logs f"✨ Global step {global_step}: {log_status}"
        rec = logging.LogRecord("openrlhf", logging.INFO, "ppo_trainer.py", 549, "✨ Global step %d: %s",
                                (s, _openrlhf_status(s)), None)
        lines.append(fmt.format(rec))
    # a value literal_eval cannot read (numpy 2 repr) falls back to the pair pattern; the async trainer has no ✨
    lines.append("(PPOTrainer pid=7) INFO 12-05 10:00:03 ppo_trainer_async.py:241] Global step 3: "
                 "{'policy_loss': np.float64(0.3), 'timing/generation': np.float64(5.0), 'timing/step_total': 7.5}")
    steps = parse_console("\n".join(lines) + "\nINFO 12-05 10:00:04 ppo_trainer.py:580] ⏰ Evaluation start\n")
    assert [s for s, _ in steps] == [1, 2, 3]
    assert steps[0][1] == _openrlhf_status(1)
    assert steps[2][1] == {"policy_loss": 0.3, "timing/generation": 5.0, "timing/step_total": 7.5}
    assert detect_host(steps) == "openrlhf"


def test_openrlhf_tensorboard_logger_strips_its_train_prefix(tmp_path):
    from openrlhf.utils.logging_utils import TensorboardLogger

    args = types.SimpleNamespace(logger=types.SimpleNamespace(tensorboard_dir=str(tmp_path),
                                                              wandb=types.SimpleNamespace(run_name="grpo")))
    tb = TensorboardLogger(args)
    for s in (1, 2, 3):
        tb.log_train(s, {**_openrlhf_status(s), "generated_samples": ["text", 0.5]})
    tb.log_eval(3, {"eval_pass1": 0.4})
    tb.close()
    run = read_run(tmp_path)
    assert (run.host, run.fmt, run.source) == ("openrlhf", "tensorboard", str(tmp_path / "grpo"))
    assert run.steps[1][1] == pytest.approx(_openrlhf_status(2))  # no eval/ keys, no text


def test_this_packages_jsonl_layouts():
    """The OpenRLHF hook's lines (kind train / eval) and the embedded trainer's (kind step / eval / warmup)."""
    text = "\n".join(json.dumps(r) for r in [
        {"step": 1, "kind": "train", "time": 1.0, "data": _openrlhf_status(1)},
        {"step": 1, "kind": "eval", "time": 2.0, "data": {"eval_pass1": 0.3}},
        {"kind": "warmup", "step": 5, "loss": 1.0},
        {"kind": "step", "step": 2, "time/step": 1.5, "time/rollout": 0.5, "ok": True, "name": "x"},
        {"step": True, "data": {}},
        [1, 2],
    ]) + "\nnot json\n"
    steps = parse_jsonl(text)
    assert steps == [(1, _openrlhf_status(1)), (2, {"time/step": 1.5, "time/rollout": 0.5})]


def test_an_embedded_trainer_run_is_read_from_its_directory(tmp_path):
    """A real 3-step `cppo-megatron train` run of the micro recipe, TensorBoard on: its folder
    holds metrics.jsonl and tensorboard/; the JSONL wins, and both say the same."""
    pytest.importorskip("transformers")
    from cppo_megatron.cli import main
    from tests.recipes import MICRO, recipe_path

    out = tmp_path / "run"
    overrides = [o for o in MICRO if not o.startswith(("log.tensorboard", "train.steps"))]
    assert main(["train", recipe_path("tiny_cpu"), *overrides, "log.tensorboard=true", "train.steps=3",
                 f"out_dir={out}"]) == 0
    run = read_run(out)
    assert (run.host, run.fmt, run.source) == ("trainer", "jsonl", str(out / "metrics.jsonl"))
    assert [s for s, _ in run.steps] == [1, 2, 3]
    tb = read_run(next((out / "tensorboard").glob("*tfevents*")))
    assert tb.host == "trainer"
    timed = [(s, d) for s, d in tb.steps if "time/step" in d]  # TensorBoard also has the step-0 evaluation
    for (_, a), (_, b) in zip(run.steps, timed, strict=True):
        assert a["time/step"] == pytest.approx(b["time/step"], rel=1e-6)


def test_a_resumed_run_keeps_the_last_record_of_a_step(tmp_path):
    lines = [json.dumps({"step": s, "data": {"timing_s/step": v}}) for s, v in ((1, 1.0), (2, 2.0), (2, 3.0), (3, 4.0))]
    (tmp_path / "m.jsonl").write_text("\n".join(lines))
    assert read_run(tmp_path / "m.jsonl").steps == ((1, {"timing_s/step": 1.0}), (2, {"timing_s/step": 3.0}),
                                                   (3, {"timing_s/step": 4.0}))


def test_refusals_name_the_path_and_what_to_give(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_run(tmp_path / "missing.log")
    (tmp_path / "plain.log").write_text("hello\nstep:1 - loss:0.5\n")  # console lines but no timing keys
    with pytest.raises(NoTimingKeys, match=r"plain.log: no step timings found .*timing_s/\*"):
        read_run(tmp_path / "plain.log")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(NoTimingKeys, match="empty: no step timings found"):
        read_run(empty)
    for name in ("a", "b"):
        (tmp_path / "two" / name).mkdir(parents=True)
        (tmp_path / "two" / name / "metrics.jsonl").write_text(json.dumps({"step": 1, "data": {"timing_s/step": 1}}))
    with pytest.raises(ValueError, match=r"holds 2 runs' jsonl metrics .*a/metrics.jsonl, .*b/metrics.jsonl"):
        read_run(tmp_path / "two")
    (tmp_path / "bad.tfevents.1").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00" + b"\x00" * 4 + b"\x0a\xff\xff\xff\xff"
                                              + b"\x00" * 4)
    with pytest.raises(ValueError, match="not a readable TensorBoard event file"):
        read_scalars(tmp_path / "bad.tfevents.1")


def test_tfevents_reader_matches_tensorboard_on_old_and_new_style_scalars(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(tmp_path))
    for s in range(3):
        w.add_scalar("timing_s/gen", 1.5 + s, s)  # simple_value
        w.add_scalar("timing_s/step", 3.25 + s, s, new_style=True)  # a float tensor
        w.add_scalar("d", 0.1 + s, s, new_style=True, double_precision=True)  # a double tensor
    w.add_histogram("h", np.arange(5), 1)
    w.add_text("note", "text is skipped", 1)
    w.close()
    f = next(tmp_path.glob("*tfevents*"))
    got = read_scalars(f)
    assert got[0] == pytest.approx({"timing_s/gen": 1.5, "timing_s/step": 3.25, "d": 0.1})
    assert got[2] == pytest.approx({"timing_s/gen": 3.5, "timing_s/step": 5.25, "d": 2.1})
    accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    ea = accumulator.EventAccumulator(str(f))
    ea.Reload()
    assert [(e.step, e.value) for e in ea.Scalars("timing_s/gen")] == [(s, got[s]["timing_s/gen"]) for s in range(3)]
    # a record cut off mid-write (the writer still running; here the text event, written last) ends the read
    (tmp_path / "cut.tfevents.2").write_bytes(f.read_bytes()[:-7])
    assert read_scalars(tmp_path / "cut.tfevents.2") == got


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _varint(n: int) -> bytes:
    out = b""
    while True:
        b = n & 0x7F
        n >>= 7
        out += bytes([b | (0x80 if n else 0)])
        if not n:
            return out


def _msg(field: int, payload: bytes) -> bytes:
    return _key(field, 2) + _varint(len(payload)) + payload


def _record(event: bytes) -> bytes:
    import struct

    return struct.pack("<Q", len(event)) + b"\0" * 4 + event + b"\0" * 4


def test_tfevents_wire_details_by_hand(tmp_path):
    """Hand-encoded events: a tensor_content double (another writer's new-style scalar), a Value with
    an unknown varint field, a non-scalar tensor (skipped), an event without a step (step 0); and a
    record whose protobuf is cut or uses a group (wire type 3): not an event file."""
    import struct

    double = _msg(8, _key(1, 0) + _varint(2) + _msg(4, struct.pack("<d", 2.5)))  # DT_DOUBLE, tensor_content
    value_a = _msg(1, b"a") + _key(99, 0) + _varint(7) + double
    pair = _msg(8, _key(1, 0) + _varint(1) + _msg(5, struct.pack("<2f", 1.0, 2.0)))  # two floats: not a scalar
    value_b = _msg(1, b"b") + pair
    value_i = _msg(1, b"i") + _msg(8, _key(1, 0) + _varint(3) + _msg(4, struct.pack("<i", 4)))  # DT_INT32: skipped
    event = (_key(1, 1) + struct.pack("<d", 1.0) + _key(2, 0) + _varint(5)
             + _msg(5, _msg(1, value_a) + _msg(1, value_b) + _msg(1, value_i)))
    no_step = _msg(5, _msg(1, _msg(1, b"c") + _key(2, 5) + struct.pack("<f", 0.5)))
    (tmp_path / "x.tfevents.1").write_bytes(_record(event) + _record(no_step))
    assert read_scalars(tmp_path / "x.tfevents.1") == {5: {"a": 2.5}, 0: {"c": 0.5}}
    for bad in (_key(5, 2) + _varint(50) + b"short", _key(5, 3)):
        (tmp_path / "bad.tfevents.2").write_bytes(_record(bad))
        with pytest.raises(ValueError, match="not a readable TensorBoard event file"):
            read_scalars(tmp_path / "bad.tfevents.2")


def test_odd_lines_and_files_are_skipped(tmp_path):
    text = ("step:1 - timing_s/step:2.0 - garbage - k:np.float64(nan) - v:inf\n"
            "step:2 - nothing here\n")
    assert parse_console(text) == [(1, {"timing_s/step": 2.0}), (2, {})]
    (tmp_path / "m.jsonl").write_text('{"step": 1, "data": {"timing_s/step": 1.0, "x": NaN}}\n')
    assert read_run(tmp_path / "m.jsonl").steps == ((1, {"timing_s/step": 1.0}),)
    # a .jsonl holding console output is read as a console log; a step without numbers is dropped
    (tmp_path / "c.jsonl").write_text("step:1 - timing_s/step:3.0\nstep:2 - x:y\n")
    run = read_run(tmp_path / "c.jsonl")
    assert (run.fmt, run.steps) == ("console", ((1, {"timing_s/step": 3.0}),))
    # a folder: other JSONL without timings and sub-folders are passed over
    d = tmp_path / "dir"
    (d / "sub").mkdir(parents=True)
    (d / "eval.jsonl").write_text(json.dumps({"step": 1, "data": {"acc": 0.5}}) + "\n")
    (d / "sub" / "run.log").write_text("step:1 - timing_s/step:3.0 - timing_s/gen:1.0\n")
    run = read_run(d)
    assert (run.fmt, run.source) == ("console", str(d / "sub" / "run.log"))
