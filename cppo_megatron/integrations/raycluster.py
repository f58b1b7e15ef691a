"""A Ray cluster of several nodes on ONE machine, started the way a cluster is: ``ray start --head``
and ``ray start --address=HEAD`` per further node, each node with its own resources (logical GPUs
in the CPU modes). For tests and the CPU demos of multi-node recipes (docs/records/verl_cpu_mode.md,
"Two Ray nodes on one machine").

On a shared machine it keeps to itself: its own ``--temp-dir`` (so ``ray.init()`` elsewhere, which
reads ``/tmp/ray/ray_current_cluster``, never finds it), its own ports (never Ray's defaults),
and ``stop()`` ends only the processes whose command line names that temp dir — never ``ray stop``,
which would end every Ray process of the machine.

    with LocalRayCluster(temp_dir, nodes=2, gpus_per_node=2) as cluster:
        ... ray_kwargs.ray_init.address=cluster.address ...
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["LocalRayCluster", "free_ports"]


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (none of Ray's defaults)."""
    import socket

    socks: list = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
            socks.append(s)
            if port not in (6379, 8265, 10001, 8076, 52365) and port not in ports:
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports


class LocalRayCluster:
    """``nodes`` Ray nodes on this machine, ``gpus_per_node`` logical GPUs and ``cpus_per_node``
    CPUs each, under ``temp_dir`` (a short path: Ray's socket names must stay under 107 bytes)."""

    def __init__(self, temp_dir: str | Path, *, nodes: int = 2, gpus_per_node: int = 2, cpus_per_node: int = 8,
                 env: dict[str, str] | None = None, timeout: float = 180.0) -> None:
        if nodes < 1 or gpus_per_node < 0 or cpus_per_node < 1:
            raise ValueError(f"LocalRayCluster: nodes={nodes}, gpus_per_node={gpus_per_node}, "
                             f"cpus_per_node={cpus_per_node}: need nodes >= 1, gpus >= 0, cpus >= 1")
        self.temp_dir = Path(temp_dir).resolve()
        if len(str(self.temp_dir)) > 60:
            raise ValueError(f"LocalRayCluster: temp_dir {self.temp_dir} is too long for Ray's socket paths; "
                             "use a short one (e.g. under /tmp)")
        self.nodes, self.gpus_per_node, self.cpus_per_node = nodes, gpus_per_node, cpus_per_node
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", **(env or {})}
        self.env.pop("RAY_ADDRESS", None)
        self.timeout = timeout
        self.address = ""
        self.log = self.temp_dir / "ray_start.log"

    def _ray(self) -> list[str]:
        exe = Path(sys.executable).with_name("ray")
        return [str(exe)] if exe.exists() else [sys.executable, "-m", "ray.scripts.scripts"]

    def _start(self, args: list[str]) -> None:
        # per node: its own raylet, object manager, metrics, runtime-env agent and worker ports
        p = free_ports(6)
        cmd = [*self._ray(), "start", *args, f"--temp-dir={self.temp_dir}", f"--num-cpus={self.cpus_per_node}",
               f"--num-gpus={self.gpus_per_node}", f"--node-manager-port={p[0]}", f"--object-manager-port={p[1]}",
               f"--metrics-export-port={p[2]}", f"--runtime-env-agent-port={p[3]}",
               f"--dashboard-agent-listen-port={p[4]}", f"--dashboard-agent-grpc-port={p[5]}",
               "--min-worker-port=0", "--max-worker-port=0", "--disable-usage-stats"]
        with open(self.log, "a") as log:
            log.write(" ".join(cmd) + "\n")
            log.flush()
            out = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env, timeout=self.timeout)
        if out.returncode != 0:
            tail = self.log.read_text().splitlines()[-15:]
            self.stop()
            raise RuntimeError(f"ray start failed (exit {out.returncode}); see {self.log}:\n" + "\n".join(tail))

    def start(self) -> LocalRayCluster:
        """Start the head and the other nodes; waits until all nodes are alive."""
        self.temp_dir.mkdir(parents=True, exist_ok=True)
        gcs, dashboard, client = free_ports(3)
        self._start(["--head", f"--port={gcs}", "--node-ip-address=127.0.0.1", "--include-dashboard=false",
                     f"--dashboard-port={dashboard}", f"--ray-client-server-port={client}"])
        self.address = f"127.0.0.1:{gcs}"
        for _ in range(self.nodes - 1):
            self._start([f"--address={self.address}", "--node-ip-address=127.0.0.1"])
        self.wait_nodes()
        return self

    def alive_nodes(self) -> list[dict]:
        """The cluster's alive nodes as Ray reports them (NodeID, Resources)."""
        code = (f"import json, ray; ray.init(address={self.address!r}, logging_level='ERROR');"
                "print(json.dumps([{'NodeID': n['NodeID'], 'Resources': n['Resources']}"
                " for n in ray.nodes() if n['Alive']])); ray.shutdown()")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=self.env, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"could not list the nodes of {self.address}: {out.stderr.strip()[-500:]}")
        import json

        return json.loads(out.stdout.strip().splitlines()[-1])

    def wait_nodes(self) -> None:
        deadline = time.monotonic() + self.timeout
        while True:
            nodes = self.alive_nodes()
            if len(nodes) >= self.nodes:
                return
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"only {len(nodes)} of {self.nodes} Ray nodes came up at {self.address}")
            time.sleep(1.0)

    def pids(self) -> list[int]:
        """Processes of this cluster: those whose command line names its temp dir (GCS, raylets,
        workers and agents all carry the session directory beneath it)."""
        mine, key = [], str(self.temp_dir).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if key in cmdline:
                mine.append(int(entry.name))
        return mine

    def stop(self, grace: float = 10.0) -> None:
        """End this cluster's processes (SIGTERM, then SIGKILL after ``grace`` s), by process id."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and self.pids():
                time.sleep(0.2)
        self.address = ""

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> LocalRayCluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
