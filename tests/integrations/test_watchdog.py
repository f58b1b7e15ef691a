"""The dead-worker watchdog (cppo_megatron.integrations.watchdog): which deaths it reports, the
line it prints, the grace before it ends a job, and a real Ray driver that would otherwise
wait forever."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import time

import pytest

ray = pytest.importorskip("ray")
from ray.core.generated import common_pb2  # noqa: E402

from cppo_megatron.integrations import watchdog  # noqa: E402

Reason = common_pb2.ActorDiedErrorContext


def _dead(name, pid, reason=Reason.WORKER_DIED, job="01000000", cls="WorkerDict", state="DEAD"):
    ctx = Reason(reason=reason, pid=pid, name=name, class_name=cls, actor_id=bytes(16),
                 error_message="The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR "
                               "Worker exit detail: Worker unexpectedly exits. Some common causes include: (1) OOM")
    return {"Name": name, "ActorClassName": cls, "JobID": job, "State": state, "Pid": pid,
            "Address": {"IPAddress": "10.0.0.7"}, "DeathCause": common_pb2.ActorDeathCause(actor_died_error_context=ctx)}


TABLE = {
    "a": _dead("xWorkerDict_0:1", 101),
    "b": _dead("xWorkerDict_0:0", 100, reason=Reason.RAY_KILL),        # killed on purpose by the host
    "c": _dead("", 102, reason=Reason.OUT_OF_SCOPE, cls="Helper"),      # its handle went away
    "d": _dead("other", 103, job="02000000"),                          # another job
    "e": _dead("alive", 104, state="ALIVE"),
    "f": _dead("yWorkerDict_0:2", 105, reason=Reason.OWNER_DIED),      # died because its owner did
}


def test_only_unexpected_deaths_of_this_job_are_reported_root_causes_first():
    dead = watchdog.dead_actors("01000000", TABLE)
    assert [(d.name, d.pid, d.reason) for d in dead] == [("xWorkerDict_0:1", 101, "WORKER_DIED"),
                                                       ("yWorkerDict_0:2", 105, "OWNER_DIED")]
    line = dead[0].describe()
    assert "'xWorkerDict_0:1' (WorkerDict), pid 101 on 10.0.0.7, rank 1 of placement group 0, died (WORKER_DIED)" in line
    assert "Some common causes" not in line  # Ray's list of guesses is cut
    assert sorted(d.pid for d in watchdog.dead_actors(None, TABLE)) == [101, 103, 105]  # every job


def test_the_watchdog_reports_once_and_ends_the_job_after_the_grace():
    out = io.StringIO()
    dog = watchdog.Watchdog(30.0, resume_hint=lambda: "Rerun the same command to resume from step 1.", out=out)
    healthy = {"e": TABLE["e"]}
    assert dog.check("01000000", healthy, now=0.0) is False and out.getvalue() == ""
    assert dog.check("01000000", TABLE, now=10.0) is False  # first sight: reported, grace starts
    assert dog.check("01000000", TABLE, now=39.9) is False
    assert dog.check("01000000", TABLE, now=40.0) is True
    lines = out.getvalue().splitlines()
    assert len(lines) == 1, lines  # each death is reported once
    assert lines[0].startswith(watchdog.PREFIX) and "'xWorkerDict_0:1'" in lines[0] and "pid 101" in lines[0]
    assert "within 30 s" in lines[0] and lines[0].endswith("Rerun the same command to resume from step 1.")


def test_grace_from_the_environment(monkeypatch):
    monkeypatch.delenv(watchdog.ENV_GRACE, raising=False)
    assert watchdog.grace_from_env() == watchdog.DEFAULT_GRACE_S
    monkeypatch.setenv(watchdog.ENV_GRACE, "off")
    assert watchdog.grace_from_env() is None and watchdog.start() is None
    monkeypatch.setenv(watchdog.ENV_GRACE, "45")
    assert watchdog.grace_from_env() == 45.0
    monkeypatch.setenv(watchdog.ENV_GRACE, "soon")
    with pytest.raises(ValueError, match="CPPO_DEAD_WORKER_GRACE_S='soon'"):
        watchdog.grace_from_env()


def test_explain_finds_the_dead_actor_behind_a_host_error():
    from ray.exceptions import ActorDiedError, RayTaskError

    ctx = Reason(reason=Reason.WORKER_DIED, pid=23824, name="LhQg7JWorkerDict_0:1", class_name="WorkerDict",
                 node_ip_address="192.0.2.2", ray_namespace="ns", actor_id=bytes(16),
                 error_message="The actor is dead because its worker process has died.")
    died = ActorDiedError(cause=ctx)
    wrapped = RayTaskError("TaskRunner.run", "traceback", died)  # what the driver's ray.get raises
    for exc in (died, wrapped):
        dead = watchdog.explain(exc)
        assert (dead.name, dead.class_name, dead.pid, dead.node_ip) == ("LhQg7JWorkerDict_0:1", "WorkerDict", 23824,
                                                                        "192.0.2.2")
    assert watchdog.explain(ValueError("bad value")) is None


def test_explain_names_the_worker_rays_memory_monitor_killed():
    from ray.exceptions import OutOfMemoryError

    # Ray 2.55's message (shortened), as an OpenRLHF CPU run on a crowded machine got it
    msg = ("1 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 192.0.2.2, ID: "
           "699bccfd14) was 22.45GB / 23.54GB (0.953697), which exceeds the memory usage threshold of 0.950000; Ray "
           "killed 1 worker(s) based on the killing policy: [(Actor(125e98bf): job ID=01000000, lease ID=0200, task "
           "name=PolicyModelActor.__init__, required resources={CPU_group_1: 1}, pid=3217, actual memory used=0.41GB, "
           "worker ID=ce5ce4)]; To see more information about memory usage on this node")
    dead = watchdog.explain(OutOfMemoryError(msg))
    assert (dead.class_name, dead.pid, dead.node_ip, dead.reason) == ("PolicyModelActor", 3217, "192.0.2.2", "OOM")
    assert dead.describe().endswith("died (OOM): Ray's memory monitor killed it: node memory 22.45GB / 23.54GB")


DRIVER = textwrap.dedent('''
    import os, signal, sys, time
    import ray
    from cppo_megatron.integrations import watchdog

    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=sys.argv[1])

    @ray.remote
    class Rank:
        def pid(self):
            return os.getpid()

        def wait_for_peer(self):  # a survivor blocked on its dead peer, never returning
            time.sleep(3600)

    survivor, victim = Rank.options(name="rank0").remote(), Rank.options(name="rank1").remote()
    pid = ray.get(victim.pid.remote())
    watchdog.start(lambda: "resume hint here")
    os.kill(pid, signal.SIGKILL)
    print("killed", pid, flush=True)
    ray.get(survivor.wait_for_peer.remote())  # no timeout: without the watchdog this waits an hour
''')


def test_a_driver_waiting_on_a_survivor_ends_within_the_grace(tmp_path):
    env = {**os.environ, watchdog.ENV_GRACE: "5", "RAY_AUTH_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    temp = f"/tmp/cppo-wd-{os.getpid()}"
    t0 = time.monotonic()
    try:
        out = subprocess.run([sys.executable, "-c", DRIVER, temp], capture_output=True, text=True, env=env,
                             timeout=240, start_new_session=True)
    finally:
        subprocess.run(["rm", "-rf", temp])
    elapsed = time.monotonic() - t0
    log = out.stdout + out.stderr
    pid = int(log.split("killed ", 1)[1].split()[0])
    assert out.returncode != 0 and elapsed < 200, (out.returncode, elapsed, log[-3000:])
    line = next(ln for ln in log.splitlines() if ln.startswith(watchdog.PREFIX))
    assert f"'rank1' (Rank), pid {pid}" in line and "resume hint here" in line, line
    assert "did not stop 5 s after" in log


def test_a_fork_with_the_watchdog_running_is_clean():
    """Ray forks its helpers from the driver: threading's after-fork hook calls ``_stop()`` on every
    other thread, so a Thread subclass must not shadow it (an attribute ``_stop`` printed five
    'Exception ignored ... TypeError' tracebacks into every veRL CPU log)."""
    code = textwrap.dedent("""
        import os
        from cppo_megatron.integrations.watchdog import Watchdog
        w = Watchdog(grace_s=5, poll_s=0.05)
        w.start()  # no Ray here: it waits for ray.init
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        w.stop(); w.join(5)
        print("forked", flush=True)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "forked" in out.stdout, out.stderr[-2000:]
    assert "Exception ignored" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]


def test_watched_names_the_dead_worker_behind_the_hosts_error_and_stops_the_watchdog(monkeypatch, capsys):
    from ray.exceptions import ActorDiedError

    stopped = []

    class Dog:
        def stop(self):
            stopped.append(True)

    monkeypatch.setattr(watchdog, "start", lambda hint: Dog())
    ctx = Reason(reason=Reason.WORKER_DIED, pid=23824, name="LhQg7JWorkerDict_0:1", class_name="WorkerDict",
                 node_ip_address="192.0.2.2", ray_namespace="ns", actor_id=bytes(16),
                 error_message="The actor is dead because its worker process has died.")
    with pytest.raises(ActorDiedError), watchdog.watched("veRL", lambda: "Rerun to resume."):
        raise ActorDiedError(cause=ctx)
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"{watchdog.PREFIX} veRL stopped because Ray actor 'LhQg7JWorkerDict_0:1' (WorkerDict)")
    assert err.endswith(". Rerun to resume.") and stopped == [True]
    with pytest.raises(ValueError, match="bad value"), watchdog.watched("OpenRLHF", lambda: "hint"):
        raise ValueError("bad value")  # not a dead worker: no line
    with watchdog.watched("OpenRLHF", lambda: "hint") as dog:
        assert isinstance(dog, Dog)
    assert capsys.readouterr().err == "" and stopped == [True, True, True]
    with pytest.raises(ValueError, match="host must name the host"), watchdog.watched("", lambda: ""):
        pass
