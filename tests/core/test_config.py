import pytest
from omegaconf import OmegaConf

from cppo_megatron import CPPOConfig
from cppo_megatron.core import prune
import torch


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"pruning_rate": 1.0}, r"pruning_rate must be in \[0, 1\), got 1.0"),
        ({"pruning_rate": -0.1}, "pruning_rate"),
        ({"pruning_rate": float("nan")}, "pruning_rate"),
        ({"keep_per_group": 0}, "keep_per_group must be an integer >= 1, got 0"),
        ({"keep_per_group": 2, "pruning_rate": 0.5}, "not both"),
        ({"metric": "median"}, "metric must be one of .* got 'median'"),
        ({"scope": "rank"}, "scope"),
        ({"adv_norm": "mad"}, "adv_norm"),
        ({"eps": -1.0}, "eps"),
        ({"use_abs": "yes"}, "use_abs"),
        ({"seed": 1.5}, "seed"),
        ({"selective_rollout": "yes"}, "selective_rollout must be true or false, got 'yes'"),
        ({"selective_adapt_after_first_epoch": 1}, "selective_adapt_after_first_epoch must be true or false, got 1"),
        ({"selective_p_max": 1.5}, r"selective_p_max must be a probability in \(0, 1\], got 1.5"),
        ({"selective_p_min": 0.6, "selective_p_max": 0.4}, r"selective_p_min \(0.6\) is larger than selective_p_max "
                                                           r"\(0.4\); swap them"),
        ({"selective_step_size": float("nan")}, "selective_step_size must be a finite number >= 0, got nan"),
        ({"selective_target_zero_variance": -0.1}, r"selective_target_zero_variance must be a share in \[0, 1\]"),
    ],
)
def test_invalid_fields_name_field_and_value(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CPPOConfig(**kwargs)


def test_k_larger_than_group_is_an_error():
    cfg = CPPOConfig(keep_per_group=9)
    with pytest.raises(ValueError, match="keep_per_group=9 is larger than a group of 8"):
        cfg.keep_for_group(8)
    with pytest.raises(ValueError, match="keep_per_group=9"):
        prune(torch.rand(8), torch.zeros(8, dtype=torch.long), cfg)


def test_k_formula_and_default():
    assert CPPOConfig().rate == 0.875
    assert CPPOConfig().keep_for_group(16) == 2
    assert CPPOConfig(pruning_rate=0.9375).keep_for_group(16) == 1
    assert CPPOConfig(pruning_rate=0.99).keep_for_group(16) == 1  # at least one
    assert CPPOConfig(pruning_rate=0.5).keep_for_group(7) == 3
    assert CPPOConfig(pruning_rate=0.0).is_grpo


def test_structured_config_round_trip_and_unknown_keys():
    schema = OmegaConf.structured(CPPOConfig)
    merged = OmegaConf.merge(schema, OmegaConf.from_dotlist(["pruning_rate=0.75", "scope=batch"]))
    cfg = CPPOConfig.from_omegaconf(merged)
    assert cfg.pruning_rate == 0.75 and cfg.scope == "batch"
    with pytest.raises(ValueError, match="unknown key"):
        CPPOConfig.from_dict({"pruning_rat": 0.5})
    with pytest.raises(Exception):
        OmegaConf.merge(schema, OmegaConf.from_dotlist(["pruning_rate=abc"]))
    # to_object runs the same validation
    bad = OmegaConf.merge(schema, {"metric": "nope"})
    with pytest.raises(ValueError, match="metric"):
        OmegaConf.to_object(bad)


def test_p0_reproduces_grpo_exactly():
    gen = torch.Generator().manual_seed(0)
    r = torch.rand(48, generator=gen)
    g = torch.arange(48) % 6
    for scope in ("group", "batch"):
        res = prune(r, g, CPPOConfig(pruning_rate=0.0, scope=scope))
        assert res.selection.kept.tolist() == list(range(48))
        assert res.selection.num_pruned == 0
    adv_grpo = torch.empty(48)
    for gid in range(6):
        m = g == gid
        adv_grpo[m] = (r[m] - r[m].mean()) / (r[m].std() + 1e-6)
    assert torch.allclose(res.advantages, adv_grpo, atol=1e-6)


def test_selective_defaults_are_the_core_constants():
    """The recipe defaults and the core's (the authors' values) cannot drift apart."""
    from cppo_megatron.core import selective

    c = CPPOConfig()
    assert c.selective_rollout is False and c.selective_adapt_after_first_epoch is True
    assert (c.selective_p_easy, c.selective_p_hard) == (selective.DEFAULT_EXPLORATION,) * 2
    assert c.selective_target_zero_variance == selective.DEFAULT_TARGET_ZERO_VARIANCE
    assert c.selective_step_size == selective.DEFAULT_STEP_SIZE
    assert (c.selective_p_min, c.selective_p_max) == (selective.DEFAULT_P_MIN, selective.DEFAULT_P_MAX)
