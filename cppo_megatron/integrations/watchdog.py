"""A dead Ray worker ends the job, with a message that names it: the driver-side watchdog of
``cppo-megatron verl`` and ``cppo-megatron openrlhf``.

Both hosts drive their model ranks from one process (veRL's TaskRunner, OpenRLHF's PPOTrainer)
through ``ray.get`` on every rank's call. When a rank's process dies (OOM killer, a segfault, a
preempted node), Ray marks its actor DEAD and the pending call raises ``ActorDiedError``; the
hosts then fail on their own (measured on CPU: 10-15 s after the kill, docs/integrations/*.md).
Two things are still missing there: the error is buried in a page of tracebacks, and nothing
bounds the wait where the host is not waiting on the dead rank itself — a trainer polling a
replay buffer that a dead rollout worker will never fill, surviving ranks blocked in a
collective with the dead peer while the driver waits on them, a ``ray.get`` without a timeout.

``Watchdog`` (a daemon thread in the driver) polls Ray's actor table (GCS; no dashboard needed)
every ``poll_s``. When an actor of this job died unexpectedly (worker process or node died, its
owner died, OOM-killed; not ``ray.kill`` or going out of scope), it prints one line naming it
(Ray actor name, class, pid, node, Ray's reason) and what to do to resume; if the job has not
ended ``grace_s`` later, it interrupts the driver and then exits it with status 3, so the job
always ends. Neither host restarts a dead rank (their actors have ``max_restarts=0``: a
restarting actor is not DEAD), so this is right on GPUs too; ``CPPO_DEAD_WORKER_GRACE_S``
sets the grace (default 120 s; ``off`` disables the watchdog).

``explain(exc)`` turns the host's own ``ActorDiedError`` (raised first in the usual case) into
the same one-line message.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

__all__ = ["ENV_GRACE", "EXIT_CODE", "DeadActor", "Watchdog", "dead_actors", "explain", "grace_from_env", "start",
           "watched"]

ENV_GRACE = "CPPO_DEAD_WORKER_GRACE_S"
DEFAULT_GRACE_S = 120.0
EXIT_CODE = 3
# ActorDiedErrorContext reasons that mean "this rank is gone and nobody will bring it back"
_FATAL_REASONS = {"WORKER_DIED", "NODE_DIED", "OWNER_DIED"}
PREFIX = "cppo: dead worker:"


@dataclass(frozen=True)
class DeadActor:
    """One actor Ray reports DEAD: its Ray name ('' when unnamed), class, pid, node IP, Ray's
    reason (WORKER_DIED, NODE_DIED, OWNER_DIED, OOM) and Ray's own explanation."""

    name: str
    class_name: str
    pid: int
    node_ip: str
    reason: str
    detail: str = ""

    def describe(self) -> str:
        cls = self.class_name.rsplit(".", 1)[-1]  # veRL's colocated class is 'create_colocated_worker_cls.<locals>.X'
        who = f"Ray actor {self.name!r} ({cls})" if self.name else f"Ray actor of class {cls}"
        rank = re.search(r"_(\d+):(\d+)$", self.name or "")
        where = f", rank {rank.group(2)} of placement group {rank.group(1)}" if rank else ""
        detail = f": {_short(self.detail).rstrip('.')}" if self.detail else ""
        return f"{who}, pid {self.pid} on {self.node_ip or 'this node'}{where}, died ({self.reason}){detail}"


def _short(text: str, limit: int = 200) -> str:
    # Ray's messages run to several sentences of possible causes; keep what happened
    text = " ".join(text.split())
    m = re.search(r"Worker exit type: (\S+) Worker exit detail: (.*?\.)(?:\s|$)", text)
    if m:
        text = f"exit type {m.group(1)}, {m.group(2)}"
    else:
        text = re.split(r"(?<=[.])\s+(?=Some common causes|There are some potential)", text)[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def grace_from_env() -> float | None:
    """Seconds to wait for the host to stop after a death (None: the watchdog is off)."""
    raw = os.environ.get(ENV_GRACE, "").strip().lower()
    if not raw:
        return DEFAULT_GRACE_S
    if raw in ("off", "none", "0", "false", "no"):
        return None
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_GRACE}={raw!r}: expected seconds (e.g. 120) or 'off'") from None
    if value <= 0:
        raise ValueError(f"{ENV_GRACE}={raw!r}: must be > 0 seconds, or 'off'")
    return value


def _from_table_entry(info: dict) -> DeadActor | None:
    """A DEAD actor-table entry (``ray._private.state.actors()``) -> DeadActor, or None when it
    ended on purpose (``ray.kill``, out of scope) or is alive."""
    if info.get("State") != "DEAD":
        return None
    cause = info.get("DeathCause")
    reason, detail = "UNSPECIFIED", ""
    if cause is not None:
        if cause.HasField("oom_context"):
            reason, detail = "OOM", cause.oom_context.error_message
        elif cause.HasField("actor_died_error_context"):
            ctx = cause.actor_died_error_context
            reason, detail = ctx.Reason.Name(ctx.reason), ctx.error_message
        else:
            return None  # a failed constructor or runtime env: the host raises that itself
    if reason not in _FATAL_REASONS and reason != "OOM":
        return None
    address = info.get("Address") or {}
    return DeadActor(name=str(info.get("Name") or ""), class_name=str(info.get("ActorClassName") or "?"),
                     pid=int(info.get("Pid") or 0), node_ip=str(address.get("IPAddress", "")), reason=reason,
                     detail=detail)


def dead_actors(job_id: str | None = None, table: dict | None = None) -> list[DeadActor]:
    """Actors of ``job_id`` (hex; None: every job) that died unexpectedly, root causes first
    (an actor whose owner died is listed after the ones that died by themselves).

    ``table``: the actor table as ``ray._private.state.actors()`` returns it (read when None)."""
    if table is None:
        from ray._private import state

        table = state.actors()
    out = []
    for info in table.values():
        if job_id is not None and str(info.get("JobID", "")) != job_id:
            continue
        dead = _from_table_entry(info)
        if dead is not None:
            out.append(dead)
    return sorted(out, key=lambda d: (d.reason == "OWNER_DIED", d.name, d.pid))


_NAME = re.compile(r"^\s*name:\s*(\S+)", re.M)
_CLASS = re.compile(r"^\s*class_name:\s*(\S+)", re.M)
_PID = re.compile(r"^\s*pid:\s*(\d+)", re.M)
_IP = re.compile(r"^\s*ip:\s*(\S+)", re.M)
_OOM_TASK = re.compile(r"task name=([\w.]+)")
_OOM_PID = re.compile(r"task name=[\w.]+, .*?pid=(\d+)")
_OOM_MEM = re.compile(r"Memory on the node \(IP: ([\d.]+), ID: \w+\) was ([\d.]+GB / [\d.]+GB)")


def explain(exc: BaseException) -> DeadActor | None:
    """The dead actor behind a host's exception (``ActorDiedError``, possibly wrapped in the
    ``RayTaskError`` of the call that waited on it; ``OutOfMemoryError`` when Ray's memory monitor
    killed the worker), or None for any other error."""
    try:
        from ray.exceptions import ActorDiedError, OutOfMemoryError
    except ImportError:  # pragma: no cover - Ray is installed wherever a host runs
        return None
    seen = set()
    stack: list[BaseException | None] = [exc]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ActorDiedError):
            text = str(e)
            cls = _CLASS.search(text)
            name = _NAME.search(text)
            pid = _PID.search(text)
            ip = _IP.search(text)
            detail = text.split("The actor is dead because", 1)
            return DeadActor(name=name.group(1) if name else "", class_name=cls.group(1) if cls else "?",
                             pid=int(pid.group(1)) if pid else 0, node_ip=ip.group(1) if ip else "",
                             reason="WORKER_DIED",
                             detail=("The actor is dead because" + detail[1]) if len(detail) == 2 else "")
        if isinstance(e, OutOfMemoryError):  # Ray's memory monitor killed a worker (node above its threshold)
            text = " ".join(str(e).split())
            task = _OOM_TASK.search(text)
            pid = _OOM_PID.search(text)
            mem = _OOM_MEM.search(text)
            return DeadActor(name="", class_name=task.group(1).split(".")[0] if task else "?",
                             pid=int(pid.group(1)) if pid else 0, node_ip=mem.group(1) if mem else "", reason="OOM",
                             detail=f"Ray's memory monitor killed it: node memory {mem.group(2)}" if mem else "")
        stack += [getattr(e, "cause", None), e.__cause__, e.__context__]
    return None


class Watchdog(threading.Thread):
    """The driver's watchdog (see the module docstring).

    Args:
        grace_s: seconds between the first sight of a dead actor and ending the job.
        resume_hint: called when a death is reported; returns what the user does next (one
            sentence: which checkpoint a rerun resumes from), or ''.
        poll_s: how often Ray's actor table is read.
        exit_fn: ends the process (tests pass a recorder).
        out: where the lines go (stderr).
    """

    interrupt_wait_s = 15.0  # after interrupting the driver, how long its own exit may take before exit_fn

    def __init__(self, grace_s: float, resume_hint: Callable[[], str] = lambda: "", poll_s: float = 2.0,
                 exit_fn: Callable[[int], None] = os._exit, out=None) -> None:
        super().__init__(name="cppo-dead-worker-watchdog", daemon=True)
        if not grace_s > 0 or not poll_s > 0:
            raise ValueError(f"Watchdog: grace_s and poll_s must be > 0, got {grace_s!r}, {poll_s!r}")
        self.grace_s, self.poll_s = float(grace_s), float(poll_s)
        self.resume_hint, self.exit_fn = resume_hint, exit_fn
        self.out = out
        self.reported: list[DeadActor] = []
        self.first_seen: float | None = None
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()

    def _say(self, line: str) -> None:
        stream = self.out or sys.stderr
        print(line, file=stream, flush=True)

    def _job_id(self) -> str | None:
        import ray

        while not self._halt.is_set():
            if ray.is_initialized():
                return ray.get_runtime_context().get_job_id()
            self._halt.wait(self.poll_s)
        return None

    def check(self, job_id: str | None, table: dict | None = None, now: float | None = None) -> bool:
        """One poll: report new deaths; True when the grace is over (the job must end now)."""
        now = time.monotonic() if now is None else now
        dead = dead_actors(job_id, table)
        new = [d for d in dead if d not in self.reported]
        if new:
            if self.first_seen is None:
                self.first_seen = now
            self.reported += new
            root = new[0]
            hint = self.resume_hint()
            self._say(f"{PREFIX} {root.describe()}. The run cannot continue without it: it stops now or within "
                      f"{self.grace_s:g} s ({ENV_GRACE}).{(' ' + hint) if hint else ''}")
        return self.first_seen is not None and now - self.first_seen >= self.grace_s

    def run(self) -> None:
        try:
            job_id = self._job_id()
        except Exception:  # noqa: BLE001 - a watchdog must never take the run down by itself
            return
        while not self._halt.is_set():
            try:
                over = self.check(job_id)
            except Exception as exc:  # noqa: BLE001
                self._say(f"cppo: the dead-worker watchdog stopped: Ray's actor table is unreadable ({exc})")
                return
            if over:
                self._say(f"{PREFIX} the host did not stop {self.grace_s:g} s after "
                          f"{self.reported[0].describe()}; ending the job (exit status {EXIT_CODE})")
                _thread.interrupt_main()
                if not self._halt.wait(self.interrupt_wait_s):
                    self.exit_fn(EXIT_CODE)
                return
            self._halt.wait(self.poll_s)


def start(resume_hint: Callable[[], str] = lambda: "") -> Watchdog | None:
    """Start the watchdog in this (driver) process unless ``CPPO_DEAD_WORKER_GRACE_S=off``."""
    grace = grace_from_env()
    if grace is None:
        return None
    dog = Watchdog(grace, resume_hint)
    dog.start()
    return dog


@contextlib.contextmanager
def watched(host: str, resume_hint: Callable[[], str]) -> Iterator[Watchdog | None]:
    """Run a host's training under the watchdog (``start``; stopped on the way out). When the block
    ends with an error a dead worker explains (``explain``), one line on stderr says so:
    ``cppo: dead worker: <host> stopped because <who and why>. <resume_hint()>``; the error goes on.

    host: the host's name as the line says it ("veRL"); resume_hint: what rerunning does now."""
    if not isinstance(host, str) or not host:
        raise ValueError(f"watched: host must name the host (e.g. 'veRL'), got {host!r}")
    dog = start(resume_hint)
    try:
        yield dog
    except BaseException as exc:
        dead = explain(exc)
        if dead is not None:
            print(f"{PREFIX} {host} stopped because {dead.describe()}. {resume_hint()}", file=sys.stderr, flush=True)
        raise
    finally:
        if dog is not None:
            dog.stop()
