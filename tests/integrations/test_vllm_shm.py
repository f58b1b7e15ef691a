"""What vLLM on CPU leaves in /dev/shm when its processes are killed: recorded as it is made and removed
by the launcher (integrations/vllm_shm.py). The registry arithmetic in-process; vLLM's real CPU
shared-memory communicator (its native SHMManager) in a process that is SIGKILLed, where vLLM is
installed (.venv-verl-vllm; about 15 s)."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest

from cppo_megatron.integrations import vllm_shm

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-verl-vllm" / "bin" / "python"


def test_names_are_recorded_only_with_a_registry_and_only_what_was_recorded_is_removed(tmp_path, monkeypatch):
    shm, registry = tmp_path / "shm", tmp_path / "reg.txt"
    shm.mkdir()
    monkeypatch.delenv(vllm_shm.REGISTRY_ENV, raising=False)
    assert vllm_shm.record("shm", "a") is False and not registry.exists()  # no registry: nothing recorded
    monkeypatch.setenv(vllm_shm.REGISTRY_ENV, str(registry))
    names = vllm_shm.cpushm_names("vllm_dist_x-tp:0-[0-1]-cpushm", 2)
    assert names == ["vllm_dist_x-tp:0-[0-1]-cpushm_0", "vllm_dist_x-tp:0-[0-1]-cpushm_1"]
    for name in [*names, names[0]]:  # every rank records the whole group: duplicates count once
        assert vllm_shm.record("shm", name)
    store = tmp_path / "vllm_dist_x"
    other = tmp_path / "notes.txt"
    vllm_shm.record("file", str(store))
    vllm_shm.record("file", str(other))  # not a FileStore of vLLM's: never removed
    vllm_shm.record("shm", "../reg.txt")  # a path out of the shm dir: never removed
    (shm / names[0]).write_bytes(b"x" * 4096)  # rank 1's segment is already gone (its destructor ran)
    (shm / "someone_elses").write_bytes(b"y")
    store.write_bytes(b"z" * 10)
    other.write_text("keep")
    registry.write_text(registry.read_text() + "garbage line\n\n")
    assert vllm_shm.recorded(registry) == [("shm", names[0]), ("shm", names[1]), ("file", str(store)),
                                           ("file", str(other)), ("shm", "../reg.txt")]
    assert vllm_shm.left(registry, shm) == [names[0], str(store), str(other), "../reg.txt"]
    assert vllm_shm.remove_recorded(registry, shm) == ([names[0], str(store)], 4106)
    assert sorted(p.name for p in shm.iterdir()) == ["someone_elses"] and other.exists() and registry.exists()
    assert vllm_shm.remove_recorded(registry, shm) == ([], 0)  # idempotent
    (shm / "a_dir").mkdir()  # a name that cannot be unlinked is skipped, not raised
    vllm_shm.record("shm", "a_dir")
    assert vllm_shm.remove_recorded(registry, shm) == ([], 0) and (shm / "a_dir").is_dir()
    assert vllm_shm.recorded(tmp_path / "missing.txt") == [] and vllm_shm.left(tmp_path / "missing.txt") == []


def test_the_launchers_line_says_what_was_removed(tmp_path, monkeypatch):
    monkeypatch.delenv(vllm_shm.REGISTRY_ENV, raising=False)
    assert vllm_shm.clean_registered("this run") is None  # no registry: a GPU run, or no vLLM
    registry = tmp_path / "reg.txt"
    monkeypatch.setenv(vllm_shm.REGISTRY_ENV, str(registry))
    store = tmp_path / "vllm_dist_y"
    store.write_bytes(b"z" * (3 << 20))
    vllm_shm.record("file", str(store))
    assert vllm_shm.clean_registered("this run") == (
        f"cpu mode: removed 1 shared-memory segments / files vLLM left from this run (3.0 MiB; recorded in {registry})")
    assert vllm_shm.clean_registered("this run") is None and not store.exists()


def test_bad_records_are_named_and_an_unwritable_registry_never_stops_a_run(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="kind must be one of \\('shm', 'file'\\)"):
        vllm_shm.record("dir", "a")
    with pytest.raises(ValueError, match="name one line"):
        vllm_shm.record("shm", "a\nb")
    with pytest.raises(ValueError, match="world_size >= 1, got 'g', 0"):
        vllm_shm.cpushm_names("g", 0)
    monkeypatch.setenv(vllm_shm.REGISTRY_ENV, str(tmp_path / "no-such-dir" / "reg.txt"))
    assert vllm_shm.record("shm", "a") is False


def test_the_seams_record_before_vllm_and_verl_make_them(tmp_path, monkeypatch):
    """The three wrappers over stand-ins of vLLM's and veRL's classes: the names recorded, then the call."""
    import types

    monkeypatch.setenv(vllm_shm.REGISTRY_ENV, str(tmp_path / "reg.txt"))
    seen: list[str] = []

    class Shm:
        group_name = "vllm_dist_a-tp:0-[0-1-2]-cpushm"
        communicator = types.SimpleNamespace(world_size=3)

        def _init_cpu_shm(self):
            seen.append(str(vllm_shm.recorded(tmp_path / "reg.txt")))
            return 7

    class Worker:
        distributed_init_method = "file:///tmp/vllm_dist_a"

        def init_device(self):
            return "ok"

    class Sender:
        shm = types.SimpleNamespace(name="/verl_weights_ab")

        def _init_buffer(self):
            return None

    for module_cls, patch in ((Shm, vllm_shm._patch_communicator), (Worker, vllm_shm._patch_worker),
                              (Sender, vllm_shm._patch_sender)):
        module = types.ModuleType("m")
        setattr(module, {Shm: "_CPUSHMDistributed", Worker: "CPUWorker", Sender: "BucketedWeightSender"}[module_cls],
                module_cls)
        patch(module)
        patch(module)  # idempotent
    assert Shm()._init_cpu_shm() == 7 and "cpushm_2" in seen[0]  # recorded before the segments exist
    assert Worker().init_device() == "ok" and Sender()._init_buffer() is None
    Sender.shm = None  # veRL's non-shared-memory path (a device buffer): nothing to record
    Sender()._init_buffer()
    Worker.distributed_init_method = "tcp://127.0.0.1:1"
    Worker().init_device()  # a TCP store leaves no file
    assert vllm_shm.recorded(tmp_path / "reg.txt") == [
        *[("shm", f"vllm_dist_a-tp:0-[0-1-2]-cpushm_{r}") for r in range(3)], ("file", "/tmp/vllm_dist_a"),
        ("shm", "verl_weights_ab")]
    with pytest.raises(RuntimeError, match="m.CPUWorker.init_device is gone"):
        vllm_shm._patch_worker(types.ModuleType("m"))

    class Ring:
        def __init__(self, creator):
            self.is_creator, self.shared_memory = creator, types.SimpleNamespace(name="psm_ab")

    module = types.ModuleType("m")
    module.ShmRingBuffer = Ring  # type: ignore[attr-defined]
    vllm_shm._patch_ring(module)
    Ring(False)  # a reader opens the creator's segment: not its own
    assert ("shm", "psm_ab") not in vllm_shm.recorded(tmp_path / "reg.txt")
    Ring(True)
    assert vllm_shm.recorded(tmp_path / "reg.txt")[-1] == ("shm", "psm_ab")


def test_install_waits_for_each_module_it_patches():
    from cppo_megatron.integrations import importhook

    hooks = ((vllm_shm.COMMUNICATOR_MODULE, vllm_shm._patch_communicator),
             (vllm_shm.WORKER_MODULE, vllm_shm._patch_worker), (vllm_shm.RING_MODULE, vllm_shm._patch_ring),
             (vllm_shm.SENDER_MODULE, vllm_shm._patch_sender))
    try:
        vllm_shm.install()
        vllm_shm.install()  # idempotent
        for module, fn in hooks:
            assert importhook.pending(fn) == [module]
    finally:  # the rest of the session imports these modules unpatched
        for _, fn in hooks:
            importhook.remove(fn)


def test_the_vllm_plugin_installs_only_with_a_registry(monkeypatch):
    calls = []
    monkeypatch.setattr(vllm_shm, "install", lambda: calls.append(1))
    monkeypatch.delenv(vllm_shm.REGISTRY_ENV, raising=False)
    vllm_shm.register()
    assert calls == []
    monkeypatch.setenv(vllm_shm.REGISTRY_ENV, "/tmp/x")
    vllm_shm.register()
    assert calls == [1]
    from importlib.metadata import entry_points

    assert "cppo_megatron.integrations.vllm_shm:register" in {e.value for e in entry_points(group="vllm.general_plugins")}


PROBE = """
import os, signal, sys
from vllm.plugins import load_general_plugins
load_general_plugins()  # as every vLLM process does: our entry point installs the recorders (a registry is set)
import torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
from types import SimpleNamespace
import vllm._custom_ops  # loads vllm._C, where the shm ops live
from vllm.distributed.device_communicators import cpu_communicator
from vllm.distributed.device_communicators.shm_broadcast import ShmRingBuffer
ring = ShmRingBuffer(1, 1024, 2)  # a message queue's segment, as the engine core and workers make them
print(ring.shared_memory.name, flush=True)
comm = SimpleNamespace(unique_name="tp:0", ranks=[0], world_size=1, rank=0, device_group=dist.group.WORLD)
print(cpu_communicator._CPUSHMDistributed(comm).group_name, flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # how a Ray-killed vLLM worker ends: no destructor runs
"""


@pytest.mark.skipif(not VLLM_PYTHON.is_file(), reason="no .venv-verl-vllm (scripts/setup_verl_vllm.sh)")
def test_a_killed_vllm_cpu_communicator_leaves_exactly_what_was_recorded_and_the_cleanup_removes_it(tmp_path):
    ident = f"vllm_dist_cppotest{uuid.uuid4().hex[:12]}"
    registry = tmp_path / "reg.txt"
    env = {**os.environ, "VLLM_DIST_IDENT": ident, vllm_shm.REGISTRY_ENV: str(registry),
           "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    out = subprocess.run([str(VLLM_PYTHON), "-c", PROBE, str(tmp_path / "store")], env=env, capture_output=True,
                         text=True, timeout=300)
    try:
        assert out.returncode == -9, out.stderr[-3000:]
        ring, group = out.stdout.strip().splitlines()[-2:]
        name = f"{group}_0"
        assert name == f"{ident}-tp:0-[0]-cpushm_0"
        assert vllm_shm.recorded(registry) == [("shm", ring.lstrip("/")), ("shm", name)]
        leaked = vllm_shm.SHM_DIR / name
        assert leaked.stat().st_size >= 2 << 20  # vLLM's own: 2 MiB per OpenMP thread and the contexts
        removed, freed = vllm_shm.remove_recorded(registry)
        # the ring's segment goes too: by us, or first by Python's resource tracker, which outlived the process
        assert name in removed and freed >= 2 << 20 and vllm_shm.left(registry) == []
    finally:
        for p in vllm_shm.SHM_DIR.glob(f"{ident}*"):
            p.unlink()
