import pytest
from omegaconf import OmegaConf

from cppo_megatron import CPPOConfig
from cppo_megatron.config import SelectiveConfig
from cppo_megatron.core import prune
import torch


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"pruning_rate": 1.0}, r"pruning_rate must be in \[0, 1\), got 1.0"),
        ({"pruning_rate": -0.1}, "pruning_rate"),
        ({"pruning_rate": float("nan")}, "pruning_rate"),
        ({"keep_per_group": 0}, "keep_per_group must be >= 1, got 0"),
        ({"keep_per_group": 1.5}, "keep_per_group must be an integer >= 1, got 1.5"),
        ({"keep_per_group": 2, "pruning_rate": 0.5}, "not both"),
        ({"metric": "median"}, "metric must be one of .* got 'median'"),
        ({"scope": "rank"}, "scope"),
        ({"adv_norm": "mad"}, "adv_norm"),
        ({"eps": -1.0}, "eps"),
        ({"use_abs": "yes"}, "use_abs"),
        ({"seed": 1.5}, "seed"),
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
    assert c.selective.enabled is False and c.selective.adapt_after_first_epoch is True
    assert (c.selective.p_easy, c.selective.p_hard) == (selective.DEFAULT_EXPLORATION,) * 2
    assert c.selective.target_zero_variance == selective.DEFAULT_TARGET_ZERO_VARIANCE
    assert c.selective.step_size == selective.DEFAULT_STEP_SIZE
    assert (c.selective.p_min, c.selective.p_max) == (selective.DEFAULT_P_MIN, selective.DEFAULT_P_MAX)


@pytest.mark.parametrize(
    "section, match",
    [
        ({"enabled": "yes"}, "CPPOConfig.selective.enabled must be true or false, got 'yes'"),
        ({"adapt_after_first_epoch": 1}, "selective.adapt_after_first_epoch must be true or false, got 1"),
        ({"p_max": 1.5}, r"CPPOConfig.selective.p_max must be in \(0, 1\], got 1.5"),
        ({"p_min": 0.6, "p_max": 0.4}, r"selective.p_min \(0.6\) is larger than CPPOConfig.selective.p_max \(0.4\); "
                                       "swap them"),
        ({"step_size": float("nan")}, "selective.step_size must be a finite number >= 0, got nan"),
        ({"target_zero_variance": -0.1}, r"selective.target_zero_variance must be in \[0, 1\], got -0.1; the authors"),
        ({"p_easy": 0.99}, r"selective.p_easy = 0.99 is outside \[p_min, p_max\] = \[0.05, 0.95\]"),
    ],
)
def test_the_selective_section_names_its_key_and_value(section, match):
    with pytest.raises(ValueError, match=match):
        CPPOConfig.from_dict({"selective": section})
    with pytest.raises(ValueError, match=match):  # built on its own: the same name (its default)
        CPPOConfig(selective=SelectiveConfig(**section))


def test_a_section_is_read_nested_dotted_or_by_its_deprecated_flat_name():
    nested = CPPOConfig.from_dict({"selective": {"enabled": True, "p_easy": 0.3}})
    dotted = CPPOConfig.from_dict({"selective.enabled": True, "selective.p_easy": 0.3})
    assert nested == dotted == CPPOConfig(selective=SelectiveConfig(enabled=True, p_easy=0.3))
    with pytest.warns(FutureWarning, match="cppo.selective_p_easy is deprecated: write cppo.selective.p_easy"):
        flat = CPPOConfig.from_dict({"selective_rollout": True, "selective_p_easy": 0.3})
    assert flat == nested
    assert CPPOConfig.from_dict(nested.to_dict()) == nested  # to_dict nests the section
    with pytest.raises(ValueError, match="selective_rollout and selective.enabled set the same key"):
        CPPOConfig.from_dict({"selective_rollout": True, "selective": {"enabled": False}})
    with pytest.raises(ValueError, match=r"cppo.selective.p_eazy is not a CPPO setting \(unknown key\)"):
        CPPOConfig.from_dict({"selective.p_eazy": 0.3})
    assert CPPOConfig(selective={"enabled": True, "p_easy": 0.3}) == nested  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="CPPOConfig.selective must be a section of SelectiveConfig keys, got True"):
        CPPOConfig(selective=True)  # type: ignore[arg-type]
    # the omegaconf schema nests it too: YAML / dotlist merges type-check its keys
    merged = OmegaConf.merge(OmegaConf.structured(CPPOConfig), OmegaConf.from_dotlist(["selective.p_easy=0.3",
                                                                                      "selective.enabled=true"]))
    assert CPPOConfig.from_omegaconf(merged) == OmegaConf.to_object(merged) == nested


def test_every_field_is_checked_from_its_metadata_alone():
    """One validator: each field's type from its annotation and its range / choices from ``setting``'s
    metadata (no hand-written check per field); a field added with ``check=`` is validated with no other code."""
    import dataclasses

    from cppo_megatron.config import CHECKS, check_fields, setting

    @dataclasses.dataclass
    class Section:
        share: float = setting(0.5, "a share", check="[0, 1]", fix="the fix")
        count: int | None = setting(None, "a count", check=">= 1")
        mode: str = setting("a", "a mode", choices=("a", "b"))

    check_fields(Section(), "x")
    for kwargs, message in [({"share": 1.5}, "x.share must be in [0, 1], got 1.5; the fix"),
                            ({"share": True}, "x.share must be a finite number in [0, 1], got True; the fix"),
                            ({"count": 0}, "x.count must be >= 1, got 0"),
                            ({"count": "2"}, "x.count must be an integer >= 1, got '2'"),
                            ({"mode": "c"}, "x.mode must be one of ['a', 'b'], got 'c'")]:
        with pytest.raises(ValueError) as err:
            check_fields(Section(**kwargs), "x")
        assert str(err.value) == message
    assert set(CHECKS) == {"> 0", ">= 0", ">= 1", ">= 2", "(0, 1]", "[0, 1]", "[0, 1)"}


def test_the_key_helpers_nest_flatten_and_refuse_by_name():
    import dataclasses

    from cppo_megatron.config import check_fields, flatten_keys, nest_keys, setting

    nested = CPPOConfig(selective=SelectiveConfig(enabled=True)).to_dict()
    flat = flatten_keys(nested)
    assert flat["selective.enabled"] is True and flat["pruning_rate"] is None and "selective" not in flat
    assert CPPOConfig.from_dict(flat) == CPPOConfig.from_dict(nested)

    @dataclasses.dataclass
    class Top:
        name: str = setting("a", "a name")
        count: int = setting(1, "a count")

    # a rename to a key of the same level, given with its new name too: one key set twice
    with pytest.raises(ValueError, match="x: old and count set the same key x.count; keep one"):
        nest_keys(Top, {"old": 2, "count": 3}, where="x", renamed={"old": "count"})
    with pytest.raises(ValueError, match="x.name must be a string, got 3"):
        check_fields(Top(name=3), "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"setting: check must be one of \[.*\], got '> 1'"):
        setting(1, "a count", check="> 1")
    with pytest.raises(ValueError, match="CPPOConfig.from_dict expects a mapping, got list"):
        CPPOConfig.from_dict([("pruning_rate", 0.5)])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="CPPOConfig.from_omegaconf expects a DictConfig or mapping, got str"):
        CPPOConfig.from_omegaconf("pruning_rate=0.5")
    with pytest.raises(ValueError, match="workload_linear and workload_quadratic are both 0"):
        CPPOConfig(workload_linear=0.0, workload_quadratic=0.0)


def test_the_rate_of_a_group_size_is_one_minus_k_over_g():
    assert CPPOConfig(pruning_rate=0.5).rate_for_group(5) == pytest.approx(1 - 2 / 5)  # k = floor(2.5) = 2
    assert CPPOConfig(keep_per_group=2).rate_for_group(6) == pytest.approx(1 - 2 / 6)
    with pytest.raises(ValueError, match="keep_mass=0.9 has no fixed k per group"):
        CPPOConfig(keep_mass=0.9).rate_for_group(6)


def test_describe_names_keep_mass_when_it_decides_the_counts():
    assert CPPOConfig(keep_mass=0.9).describe().startswith("CPPO keep_mass=0.9 metric=")
    assert CPPOConfig(keep_per_group=3).describe().startswith("CPPO keep_per_group=3 metric=")


def test_field_help_gives_each_fields_help_and_refuses_a_non_dataclass():
    from cppo_megatron.core.settings import EarlyStopConfig, field_help

    helps = field_help(CPPOConfig)
    assert list(helps)[:2] == ["pruning_rate", "keep_per_group"]
    assert helps["adv_norm"].startswith("std gives A = (r - mean) / (std + eps)")
    assert field_help(EarlyStopConfig)["segment_tokens"].startswith("tokens generated between two decisions")
    with pytest.raises(ValueError, match="field_help needs a dataclass type .* got 'CPPOConfig'"):
        field_help("CPPOConfig")
    assert field_help(CPPOConfig()) == helps  # an instance reads its class's fields
    with pytest.raises(ValueError, match="got 3"):
        field_help(3)
