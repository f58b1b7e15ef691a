"""Both hosts' DAPO checks with group filtering off: nothing to refuse, nothing to note."""

import types

from omegaconf import OmegaConf

from cppo_megatron.integrations.openrlhf import filtering
from cppo_megatron.integrations.verl import dapo


def test_verl_filter_groups_off_has_no_warnings_even_with_a_generation_cap():
    off = OmegaConf.create({"algorithm": {"filter_groups": {"enable": False, "max_num_gen_batches": 3}}})
    assert dapo.filter_groups_warnings(off) == [] and dapo.filter_groups_warnings(OmegaConf.create({})) == []


def test_openrlhf_dynamic_filtering_off_checks_nothing():
    args = types.SimpleNamespace(algo=types.SimpleNamespace(dynamic_filtering_enable=False),
                                 rollout=types.SimpleNamespace(vllm_generate_batch_size=64, batch_size=8))
    assert filtering.check_args(args) == []  # a generate batch != batch size is DAPO's concern only
