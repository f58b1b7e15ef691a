"""The watchdog's own loop in this process (test_watchdog.py runs it inside a Ray driver subprocess,
which coverage does not measure): the actor table read through our ``dead_actors`` (stubbed at our
boundary, no Ray started here), the lines it prints, the interrupt, the exit, and how it stops
itself when the table cannot be read. Also the causes of death it reports or ignores."""

from __future__ import annotations

import io
import signal
import threading
import time

import pytest

ray = pytest.importorskip("ray")
from ray.core.generated import common_pb2  # noqa: E402

from cppo_megatron.integrations import watchdog  # noqa: E402

DEAD = watchdog.DeadActor(name="xWorkerDict_0:1", class_name="WorkerDict", pid=101, node_ip="10.0.0.7",
                          reason="WORKER_DIED")


@pytest.fixture(autouse=True)
def python_sigint_handler():
    """Python's own SIGINT handler while a test runs: the watchdog's interrupt is a SIGINT to the main
    thread, and a library an earlier test of the suite loaded may have left a handler of its own
    (the full CI run saw no KeyboardInterrupt within 30 s)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


class JobWatchdog(watchdog.Watchdog):
    """The watchdog of job 01000000 (the real one asks ray.get_runtime_context once Ray is up)."""

    def _job_id(self):
        return "01000000"


def _entry(cause, state="DEAD"):
    return {"Name": "r", "ActorClassName": "Rank", "JobID": "01000000", "State": state, "Pid": 7,
            "Address": {"IPAddress": "10.0.0.9"}, "DeathCause": cause}


def test_a_death_is_reported_then_the_driver_interrupted_after_the_grace(monkeypatch):
    polls = []

    def table(job_id, _table=None):
        polls.append(job_id)
        return [] if len(polls) < 3 else [DEAD]

    monkeypatch.setattr(watchdog, "dead_actors", table)
    out, exits = io.StringIO(), []
    dog = JobWatchdog(0.2, resume_hint=lambda: "Rerun to resume.", poll_s=0.02, exit_fn=exits.append, out=out)
    with pytest.raises(KeyboardInterrupt):  # what the driver's main thread gets (between two bytecodes)
        dog.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(0.01)
    dog.stop()
    dog.join(5)
    lines = out.getvalue().splitlines()
    assert lines == [
        f"{watchdog.PREFIX} Ray actor 'xWorkerDict_0:1' (WorkerDict), pid 101 on 10.0.0.7, rank 1 of placement group "
        f"0, died (WORKER_DIED). The run cannot continue without it: it stops now or within 0.2 s "
        f"({watchdog.ENV_GRACE}). Rerun to resume.",
        f"{watchdog.PREFIX} the host did not stop 0.2 s after Ray actor 'xWorkerDict_0:1' (WorkerDict), pid 101 on "
        f"10.0.0.7, rank 1 of placement group 0, died (WORKER_DIED); ending the job (exit status 3)",
    ]
    assert set(polls) == {"01000000"} and exits == []  # the driver stopped it: no forced exit


def test_a_driver_that_ignores_the_interrupt_is_exited_with_status_3(monkeypatch):
    monkeypatch.setattr(watchdog, "dead_actors", lambda job_id, _table=None: [DEAD])
    exited = threading.Event()
    codes = []
    dog = JobWatchdog(0.05, poll_s=0.01, exit_fn=lambda code: (codes.append(code), exited.set()), out=io.StringIO())
    dog.interrupt_wait_s = 0.2
    try:
        dog.start()
        assert exited.wait(30)
    except KeyboardInterrupt:  # the interrupt arrives while waiting: ignored, as a stuck driver would
        assert exited.wait(30)
    dog.join(5)
    assert codes == [watchdog.EXIT_CODE]


def test_an_unreadable_actor_table_stops_the_watchdog_with_a_line(monkeypatch):
    def unreadable(job_id, _table=None):
        raise ConnectionError("GCS at 10.0.0.1:6379 unreachable")

    monkeypatch.setattr(watchdog, "dead_actors", unreadable)
    out = io.StringIO()
    dog = JobWatchdog(5.0, poll_s=0.01, exit_fn=pytest.fail, out=out)
    dog.start()
    dog.join(10)
    assert not dog.is_alive()
    assert out.getvalue() == ("cppo: the dead-worker watchdog stopped: Ray's actor table is unreadable (GCS at "
                              "10.0.0.1:6379 unreachable)\n")


def test_a_watchdog_that_cannot_learn_its_job_leaves_quietly():
    class NoJob(watchdog.Watchdog):
        def _job_id(self):
            raise RuntimeError("no runtime context")

    out = io.StringIO()
    dog = NoJob(5.0, poll_s=0.01, exit_fn=pytest.fail, out=out)
    dog.start()
    dog.join(10)
    assert not dog.is_alive() and out.getvalue() == ""


def test_before_ray_starts_the_watchdog_waits_and_can_be_stopped():
    assert not ray.is_initialized()
    dog = watchdog.Watchdog(5.0, poll_s=0.01, exit_fn=pytest.fail, out=io.StringIO())
    dog.start()
    time.sleep(0.1)
    assert dog.is_alive()
    dog.stop()
    dog.join(5)
    assert not dog.is_alive()


def _died(name, pid, message):
    ctx = common_pb2.ActorDiedErrorContext(reason=common_pb2.ActorDiedErrorContext.WORKER_DIED, error_message=message)
    return {**_entry(common_pb2.ActorDeathCause(actor_died_error_context=ctx)), "Name": name, "Pid": pid}


def test_a_second_death_is_reported_without_restarting_the_grace(capsys):
    dog = watchdog.Watchdog(30.0)  # out=None: the lines go to stderr
    first = {"a": _died("xWorkerDict_0:1", 101, "first gone.")}
    assert dog.check("01000000", first, now=5.0) is False
    both = {**first, "b": _died("xWorkerDict_0:2", 102, "second gone.")}
    assert dog.check("01000000", both, now=20.0) is False
    assert dog.first_seen == 5.0  # the grace runs from the first death
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and "'xWorkerDict_0:1' (Rank), pid 101" in err[0] and "died (WORKER_DIED): first gone" in err[0]
    assert "'xWorkerDict_0:2' (Rank), pid 102" in err[1] and "died (WORKER_DIED): second gone" in err[1]
    assert dog.check("01000000", both, now=35.0) is True


def test_which_causes_of_death_are_reported():
    oom = common_pb2.ActorDeathCause(oom_context=common_pb2.OomContext(error_message="node memory 23.1GB / 23.5GB"))
    failed_init = common_pb2.ActorDeathCause(creation_task_failure_context=common_pb2.RayException())
    table = {"oom": _entry(oom), "init": _entry(failed_init), "unknown": _entry(None)}
    (dead,) = watchdog.dead_actors("01000000", table)
    assert (dead.reason, dead.detail, dead.pid, dead.node_ip) == ("OOM", "node memory 23.1GB / 23.5GB", 7, "10.0.0.9")


@pytest.mark.parametrize("raw", ["-5", "0.0"])  # '0' means off; 0.0 is a number that is not > 0
def test_a_grace_that_is_not_positive_is_refused(monkeypatch, raw):
    monkeypatch.setenv(watchdog.ENV_GRACE, raw)
    with pytest.raises(ValueError, match=f"CPPO_DEAD_WORKER_GRACE_S='{raw}': must be > 0 seconds, or 'off'"):
        watchdog.grace_from_env()


@pytest.mark.parametrize("grace,poll", [(0, 2.0), (5.0, 0)])
def test_a_watchdog_needs_positive_times(grace, poll):
    with pytest.raises(ValueError, match=f"Watchdog: grace_s and poll_s must be > 0, got {grace!r}, {poll!r}"):
        watchdog.Watchdog(grace, poll_s=poll)
