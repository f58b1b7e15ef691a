"""trainer.sizing.ram_bytes where /proc/meminfo cannot be read (not Linux, a sandbox): the physical
memory from sysconf."""

import os
from pathlib import Path

from cppo_megatron.trainer import sizing


def test_ram_bytes_without_proc_meminfo_is_the_physical_memory(monkeypatch):
    def unreadable(self, *args, **kwargs):
        raise PermissionError(f"{self}: denied")

    monkeypatch.setattr(Path, "read_text", unreadable)
    physical = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    assert sizing.ram_bytes("MemAvailable") == physical and sizing.ram_bytes("MemTotal") == physical
