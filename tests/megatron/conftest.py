"""Fixtures of the megatron tests that run in the pytest process itself."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def one_rank():
    """This process as the only rank of a gloo group (what run_local gives each worker). Its tests
    are marked ``in_process_dist`` (tests/conftest.py runs them last)."""
    import torch.distributed as dist

    import cppo_megatron.megatron as cm
    from cppo_megatron.distributed import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    cm.destroy_parallel()
    dist.destroy_process_group()
