"""veRL's DEFAULT Megatron route on CPU: NVIDIA Megatron-Bridge 0.5.1 (``vanilla_mbridge: false``,
``verl/workers/engine/megatron/transformer_impl.py:339-342``) on megatron-core 0.18.2, in the Python
3.12 environment ``.venv-bridge`` (``bash scripts/setup_bridge.sh``; skipped elsewhere).

- the engine at TP 2 x PP 2 (4 gloo ranks, no Ray): log-probs against HF, the weight export
  bit-identical to the safetensors, one step moving the log-probs (TP 2 and TP 2 x DP 2 run through
  ``test_cpu_megatron_engine.py``, which takes this environment's route);
- the unmodified ``main_ppo`` V1 loop with CPPO (P = 0.75, allocation) at TP 2 x DP 2 on the
  Megatron-Bridge engine: per step exactly the core's survivors trained with their full-group
  advantages, DP loads, exact weight syncs (the checks of the mbridge runs);
- the CPU-mode seams of this route (``test_cpu_megatron_engine.py``'s seam check): the Transformer
  Engine placeholder served its two modules and is gone from ``sys.modules``.
"""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.verl
pytest.importorskip("megatron.bridge", reason="Megatron-Bridge is not installed (scripts/setup_bridge.sh)")

from .test_cpu_e2e import run_verl  # noqa: E402
from .test_cpu_megatron_e2e import P, check_dp_loads, check_rows_and_advantages, check_syncs, tiny_model  # noqa: E402,F401
from .test_cpu_megatron_engine import check_engine, run_engine, sharp_model  # noqa: E402,F401

# veRL's default: Megatron-Bridge for the actor and the reference
BRIDGE = ["actor_rollout_ref.actor.megatron.vanilla_mbridge=false",
          "actor_rollout_ref.ref.megatron.vanilla_mbridge=false",
          "actor_rollout_ref.rollout.name=hf"]  # .venv-bridge (Python 3.12) has no vLLM: HF generate


def test_no_mbridge_here():
    # the route under test is Megatron-Bridge alone: the deprecated mbridge is not installed
    assert importlib.util.find_spec("mbridge") is None
    from importlib.metadata import version

    assert version("megatron-bridge") == "0.5.1" and version("megatron-core") == "0.18.2"


def test_bridge_engine_tp2_pp2_log_probs_export_and_step(sharp_model, tmp_path_factory):  # noqa: F811
    r = run_engine(sharp_model, tmp_path_factory.mktemp("bpp"), "0:0", world=4, pp=2)
    (run,) = r["runs"]
    assert r["seams"]["layer_spec"] is True  # the TE-free provider spec was used
    check_engine(run)


def test_v1_cppo_on_megatron_bridge_tp2_dp2_trains_the_core_survivors(tiny_model, tmp_path_factory):  # noqa: F811
    run = run_verl("tiny_cpu_megatron_cppo.yaml", tmp_path_factory.mktemp("bv1"), tiny_model,
                   f"cppo.pruning_rate={P}", *BRIDGE)
    check_rows_and_advantages(run, pruning_rate=P, loop="v1")
    check_dp_loads(run)
    check_syncs(run, tiny_model)
