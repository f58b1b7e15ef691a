"""The watchdog's in-process entry points that the driver subprocess of tests/integrations/test_watchdog.py
reaches only out of coverage's sight: ``start()`` with a grace, and ``dead_actors`` reading Ray's
actor table itself."""

from __future__ import annotations

import io

import pytest

ray = pytest.importorskip("ray")

from cppo_megatron.integrations import watchdog  # noqa: E402


def test_start_runs_a_watchdog_with_the_grace_from_the_environment_until_stopped(monkeypatch):
    assert not ray.is_initialized()
    monkeypatch.setenv(watchdog.ENV_GRACE, "30")
    dog = watchdog.start(lambda: "resume")
    assert isinstance(dog, watchdog.Watchdog)
    try:
        assert (dog.grace_s, dog.poll_s, dog.resume_hint(), dog.is_alive()) == (30.0, 2.0, "resume", True)
    finally:
        dog.stop()
        dog.join(10)
    assert not dog.is_alive() and dog.reported == []


def test_job_id_is_none_once_stopped_before_ray_started():
    dog = watchdog.Watchdog(5.0, poll_s=0.01, exit_fn=pytest.fail, out=io.StringIO())
    dog.stop()
    assert dog._job_id() is None


def test_dead_actors_reads_rays_actor_table_when_given_none(monkeypatch):
    from ray._private import state

    alive = {"a1": {"State": "ALIVE", "JobID": "01000000", "Name": "x"},
             "a2": {"State": "DEAD", "JobID": "01000000", "DeathCause": None}}  # no cause: not a death we report
    reads = []
    monkeypatch.setattr(state, "actors", lambda: reads.append(1) or alive)
    assert watchdog.dead_actors("01000000") == [] and reads == [1]


def test_job_id_is_rays_once_ray_is_initialised(monkeypatch):
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: type("Ctx", (), {"get_job_id": lambda self: "02000000"})())
    assert watchdog.Watchdog(5.0, poll_s=0.01, exit_fn=pytest.fail)._job_id() == "02000000"


def test_watched_with_the_watchdog_off_starts_none_and_still_names_the_dead_worker(monkeypatch, capsys):
    """``CPPO_DEAD_WORKER_GRACE_S=off``: ``watched`` yields None, starts no thread (nothing to stop on the
    way out), and a host error a dead worker explains still gets its one line."""
    import threading

    from ray.core.generated import common_pb2
    from ray.exceptions import ActorDiedError

    monkeypatch.setenv(watchdog.ENV_GRACE, "off")
    before = {t.name for t in threading.enumerate()}
    ctx = common_pb2.ActorDiedErrorContext(
        reason=common_pb2.ActorDiedErrorContext.WORKER_DIED, pid=31, name="aWorkerDict_0:2", class_name="WorkerDict",
        node_ip_address="192.0.2.9", actor_id=bytes(16), error_message="The actor is dead because it was killed.")
    with pytest.raises(ActorDiedError), watchdog.watched("OpenRLHF", lambda: "Rerun to resume.") as dog:
        assert dog is None and "cppo-dead-worker-watchdog" not in {t.name for t in threading.enumerate()} - before
        raise ActorDiedError(cause=ctx)
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{watchdog.PREFIX} OpenRLHF stopped because Ray actor 'aWorkerDict_0:2' (WorkerDict), "
                          "pid 31")
    assert err.endswith(". Rerun to resume.") and err.count("\n") == 0
    with watchdog.watched("veRL", lambda: "hint") as dog:
        assert dog is None
    assert capsys.readouterr().err == ""
