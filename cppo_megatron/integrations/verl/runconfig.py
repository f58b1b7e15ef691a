"""The ``cppo`` config group inside a veRL config, and the allocation helper.

``apply_allocation`` is what makes ``cppo.pruning_rate=0.875`` the paper's setting in one
line: ``data.train_batch_size`` (prompts per step) grows by G/k = 1/(1-P) so the survivors
of a step are exactly the completions the recipe's mini-batches expect (the released veRL
port's rule). With ``cppo.allocation=false`` the prompts stay and the mini-batch sizes shrink
by k/G instead, so they still follow the kept count.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import warnings
import weakref
from dataclasses import dataclass
from typing import Any, cast

from ...config import ESTIMATOR_NAME, CPPOConfig, SelectiveConfig, renamed_key
from .dapo import check_filter_groups, config_get, filter_groups_warnings, filter_metric
from .layout import dp_size

__all__ = [
    "ESTIMATOR",
    "PLUGIN_MODULE",
    "PREPARED_ENV",
    "AllocationPlan",
    "RunSettings",
    "AGENT_NAME",
    "apply_allocation",
    "apply_early_stop",
    "cppo_config_once",
    "apply_selective",
    "check_early_stop",
    "check_selective",
    "noop_warning",
    "cppo_config_from",
    "is_cppo",
    "check_compatible",
    "dp_size",
    "early_stop_enabled",
    "export_plugin_to_workers",
    "host_warnings",
    "prepare",
    "selective_enabled",
    "settings_of",
    "unprepared_message",
]

ESTIMATOR = ESTIMATOR_NAME  # the name veRL configs select it by (defined in cppo_megatron.config)
PLUGIN_MODULE = "cppo_megatron.integrations.verl"
# set in the Ray workers' environment by ``prepare``: the hook knows allocation was applied
PREPARED_ENV = "CPPO_VERL_PREPARED"


def is_cppo(config: Any) -> bool:
    """True when the veRL config selects the ``cppo`` advantage estimator."""
    algorithm = config.get("algorithm", None) if hasattr(config, "get") else None
    return algorithm is not None and str(algorithm.get("adv_estimator", "")) == ESTIMATOR


def cppo_config_from(config: Any) -> CPPOConfig:
    """The ``CPPOConfig`` of a veRL config's ``cppo`` group (defaults when absent)."""
    from omegaconf import OmegaConf

    node = config.get("cppo", None) if hasattr(config, "get") else None
    if node is None:
        return CPPOConfig()
    values = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)
    if not isinstance(values, dict):
        raise ValueError(f"cppo: must be a mapping of CPPO settings, got {type(values).__name__}: {values!r}")
    for old in [str(k) for k in values if renamed_key(str(k))]:
        # a deprecated flat name (a recipe's group may add it) wins over the group's default of the new key
        new = str(renamed_key(old))
        warnings.warn(f"cppo.{old} is deprecated: write cppo.{new} (same meaning)", FutureWarning, stacklevel=2)
        section, key = new.split(".")
        values.setdefault(section, {})[key] = values.pop(old)
    return CPPOConfig.from_dict(cast("dict[str, Any]", values))  # an unknown key is an error naming it


# id(config) -> (a weak reference to it, its CPPOConfig): parsed once per config object
_PARSED: dict[int, tuple[weakref.ref, CPPOConfig]] = {}


def cppo_config_once(config: Any) -> CPPOConfig:
    """``cppo_config_from(config)``, parsed on the first call for this config object and kept while
    it lives. veRL builds a new agent loop for every rollout request, all over their worker's one
    trainer config, so the early-stopping loop reads its settings here (one parse per worker and
    run, not per request). By identity, not by value: a DictConfig hashes by printing itself. A
    config that takes no weak reference (a plain dict) is parsed on every call."""
    held = _PARSED.get(id(config))
    if held is not None and held[0]() is config:
        return held[1]
    cfg = cppo_config_from(config)
    try:
        ref = weakref.ref(config, _forget)
    except TypeError:  # a dict, a list: no weak reference, no cache
        return cfg
    _PARSED[id(config)] = (ref, cfg)
    return cfg


def _forget(ref: weakref.ref) -> None:
    # the config died: drop its entry (and only its own, should the id be in use again)
    for key, (held, _) in list(_PARSED.items()):
        if held is ref:
            del _PARSED[key]


@dataclass(frozen=True)
class RunSettings:
    """What the hooks read of a veRL config, read once per run (``settings_of``) instead of at
    every seam of every step.

    Args:
        cppo: the run selects the ``cppo`` estimator (``algorithm.adv_estimator``); when False the
            other fields keep their defaults and the hooks only log ``signal/*``.
        cfg: the run's ``CPPOConfig`` (``cppo`` group).
        selective: ``cppo.selective.enabled`` (and cppo).
        early_stop: ``cppo.early_stop.enabled`` (and cppo).
        filter_metric: DAPO's filter metric when ``algorithm.filter_groups`` is on, else None.
        group_size: G, ``actor_rollout_ref.rollout.n``.
        actor_mini_batch: ``actor_rollout_ref.actor.ppo_mini_batch_size`` (prompts).
        critic_mini_batch: ``critic.ppo_mini_batch_size`` (prompts; 0 when the config has none).
        critic_warmup: ``trainer.critic_warmup`` (steps before the actor updates).
    """

    cppo: bool = False
    cfg: CPPOConfig = dataclasses.field(default_factory=CPPOConfig)
    selective: bool = False
    early_stop: bool = False
    filter_metric: str | None = None
    group_size: int = 1
    actor_mini_batch: int = 0
    critic_mini_batch: int = 0
    critic_warmup: int = 0

    @classmethod
    def read(cls, config: Any) -> RunSettings:
        """Read ``config`` (a veRL ``DictConfig``) once; a malformed ``cppo`` group is an error
        naming the key (``cppo_config_from``)."""
        if not is_cppo(config):
            return cls()
        cfg = cppo_config_from(config)
        return cls(
            cppo=True, cfg=cfg, selective=bool(cfg.selective.enabled), early_stop=bool(cfg.early_stop.enabled),
            filter_metric=filter_metric(config), group_size=int(config_get(config, "actor_rollout_ref.rollout.n", 1)),
            actor_mini_batch=int(config_get(config, "actor_rollout_ref.actor.ppo_mini_batch_size", 0) or 0),
            critic_mini_batch=int(config_get(config, "critic.ppo_mini_batch_size", 0) or 0),
            critic_warmup=int(config_get(config, "trainer.critic_warmup", 0) or 0),
        )


# each trainer's settings, kept beside the host object (it dies with it): one read per run
_SETTINGS: weakref.WeakKeyDictionary[Any, RunSettings] = weakref.WeakKeyDictionary()


def settings_of(trainer: Any) -> RunSettings:
    """The run's ``RunSettings``, read from ``trainer.config`` on the first call and kept for the
    trainer's life (a veRL trainer runs one config)."""
    settings = _SETTINGS.get(trainer)
    if settings is None:
        settings = _SETTINGS[trainer] = RunSettings.read(trainer.config)
    return settings


@dataclass(frozen=True)
class AllocationPlan:
    """What ``apply_allocation`` changed: prompts per step before/after, the mini-batch
    sizes (prompts, veRL's unit), k of G, and the completions kept per step."""

    group_size: int
    keep: int
    train_batch_size_before: int
    train_batch_size: int
    actor_mini_batch_before: int
    actor_mini_batch: int
    kept_per_step: int
    allocation: bool
    warning: str = ""  # set when the settings ask for pruning that cannot happen (G = 1, k = G)
    # allocation=false: micro-batch sizes shrunk so they divide the kept sequences per rank
    micro_batches: tuple[tuple[str, int, int], ...] = ()

    def describe(self) -> str:
        line = (
            f"CPPO allocation={self.allocation}: keep {self.keep} of G={self.group_size}; "
            f"data.train_batch_size {self.train_batch_size_before} -> {self.train_batch_size} prompts; "
            f"actor.ppo_mini_batch_size {self.actor_mini_batch_before} -> {self.actor_mini_batch}; "
            f"{self.kept_per_step} completions kept per step"
        )
        line += "".join(f"; {key} {a} -> {b}" for key, a, b in self.micro_batches)
        return f"{line}\n{self.warning}" if self.warning else line


def noop_warning(cfg: CPPOConfig, group_size: int) -> str:
    """The warning line for settings that prune nothing (empty when they do prune)."""
    reason = cfg.noop_reason(group_size)
    if reason is None:
        return ""
    return (
        f"warning: cppo {reason}. Set actor_rollout_ref.rollout.n (G) > 1 and cppo.pruning_rate >= 1/G, "
        "or run plain GRPO (algorithm.adv_estimator=grpo)"
    )


def check_compatible(config: Any) -> None:
    """Raise ValueError for veRL settings CPPO cannot run with, naming the key."""
    algorithm = config.algorithm
    if bool(algorithm.get("use_kl_in_reward", False)):
        raise ValueError(
            "algorithm.use_kl_in_reward=True is not compatible with cppo: the KL reward needs the "
            "old-policy log-probs, which pruning runs before. Use the KL loss "
            "(actor_rollout_ref.actor.use_kl_loss=True), as the paper does."
        )
    cfg = cppo_config_from(config)
    if cfg.metric == "importance":
        raise ValueError(
            "cppo.metric=importance is not supported under veRL: its 1/pi weights would have to reach "
            "veRL's policy loss per row, through _balance_batch's reordering and the V1 loop's fixed field "
            "list, and veRL's loss divides by the kept set's tokens, not the full batch's. Use the embedded "
            "trainer or the Megatron backend (`cppo-megatron train`), or metric=smallest."
        )
    if cfg.keep_mass is not None:
        raise ValueError(
            f"cppo.keep_mass={cfg.keep_mass} is not supported under veRL: veRL's batch and mini-batch "
            "sizes are fixed per step and sized from a fixed k per prompt. Set cppo.pruning_rate or "
            "cppo.keep_per_group (keep_mass runs in the embedded trainer)."
        )
    if not bool(algorithm.get("norm_adv_by_std_in_grpo", True)) and cfg.adv_norm == "std":
        raise ValueError(
            "algorithm.norm_adv_by_std_in_grpo=False (Dr. GRPO) but cppo.adv_norm=std: the cppo "
            "estimator follows cppo.adv_norm; set cppo.adv_norm=none"
        )
    trainer = config.trainer
    if not bool(trainer.get("use_v1", True)) and not bool(trainer.get("balance_batch", True)):
        raise ValueError(
            "trainer.balance_batch=False with trainer.use_v1=False: the legacy loop skips "
            "_balance_batch, the seam CPPO prunes at. Set trainer.balance_batch=True."
        )
    if bool(trainer.get("use_v1", True)) and trainer.get("v1", {}).get("trainer_mode", "sync") == "separate_async":
        # veRL's own rule on the recipe's sizes (trainer_separate_async.py:59), checked here before
        # allocation changes them; async_modes.py keeps veRL's assert true after allocation
        psync = int(trainer.v1.get("separate_async", {}).get("parameter_sync_step", 1))
        b, mini = int(config.data.train_batch_size), int(config.actor_rollout_ref.actor.ppo_mini_batch_size)
        if psync < 1 or b != psync * mini:
            raise ValueError(
                f"trainer.v1.trainer_mode=separate_async: data.train_batch_size={b} must equal "
                f"trainer.v1.separate_async.parameter_sync_step={psync} x actor.ppo_mini_batch_size={mini} "
                f"(veRL's rule: each local update trains one mini-batch), counted before CPPO's allocation; "
                f"set data.train_batch_size={max(psync, 1) * mini}"
            )
    # DAPO (algorithm.filter_groups): veRL's V1 sync replay buffer filters and refills before the seam;
    # what it cannot honour with CPPO is refused there (dapo.py)
    check_filter_groups(config)
    # CPPO settings veRL cannot honour are refused rather than ignored
    if cfg.dynamic_sampling:
        raise ValueError(
            "cppo.dynamic_sampling=true is not supported under veRL: the plugin prunes at _balance_batch, "
            "after veRL generated the step's batch, and cannot draw replacement prompts; set "
            "cppo.dynamic_sampling=false and use veRL's own DAPO filter, algorithm.filter_groups.enable=true "
            "on the V1 loop (trainer.use_v1=true), which drops zero-variance groups and refills before CPPO "
            "prunes, or use the embedded trainer (cppo-megatron train)"
        )
    check_selective(config)
    check_early_stop(config)
    if cfg.two_wave.enabled:
        raise ValueError(
            "cppo.two_wave.enabled=true is not built for veRL: veRL generates every group whole before the "
            "plugin's seam; set cppo.two_wave.enabled=false, or run two waves in the embedded trainer "
            "(cppo-megatron train, backend=hf)"
        )
    node = config.get("cppo", None)
    if node is not None and node.get("equal_size", None) is False:
        raise ValueError(
            "cppo.equal_size=false cannot be honoured under veRL: veRL gives every data-parallel rank "
            "the same number of sequences, so the core balancer always runs with equal sizes; set "
            "cppo.equal_size=true"
        )


# ---------------------------------------------------------------------------- selective rollout
def selective_enabled(config: Any) -> bool:
    """True when the veRL config selects the cppo estimator and ``cppo.selective.enabled``."""
    return is_cppo(config) and bool(cppo_config_from(config).selective.enabled)


def check_selective(config: Any) -> None:
    """Raise ValueError, naming key, value and fix, for a selective-rollout setting the hooks do not
    honour in veRL 0.9.1; nothing when ``cppo.selective.enabled`` is off."""
    if not selective_enabled(config):
        return
    if not bool(config_get(config, "trainer.use_v1", True)):
        raise ValueError(
            "cppo.selective.enabled=true with trainer.use_v1=false: the hook sits in the V1 trainer's "
            "dataloader seam (PPOTrainer._fetch_one_gen_batch); the legacy loop (RayPPOTrainer.fit) is not "
            "hooked. Set trainer.use_v1=true or cppo.selective.enabled=false"
        )
    mode = str(config_get(config, "trainer.v1.trainer_mode", "sync"))
    if mode != "sync":
        raise ValueError(
            f"cppo.selective.enabled=true with trainer.v1.trainer_mode={mode}: the asynchronous modes draw "
            "prompts ahead of the step that trains them and carry groups (and in-flight prompts in their "
            "checkpoints) across steps, for which recording every generated group under its step is not "
            "built; set trainer.v1.trainer_mode=sync"
        )
    if bool(config_get(config, "algorithm.filter_groups.enable", False)):
        raise ValueError(
            "cppo.selective.enabled=true with algorithm.filter_groups.enable=true: DAPO's filter evicts "
            "zero-variance groups inside the replay buffer before the seam where selective rollout records "
            "outcomes, so exactly the groups it learns from would go unrecorded (not built yet); set "
            "algorithm.filter_groups.enable=false or cppo.selective.enabled=false"
        )
    sampler = config_get(config, "trainer.v1.sampler.custom_sampler", None)
    if sampler is not None and config_get(sampler, "path") and config_get(sampler, "name"):
        raise ValueError(
            f"cppo.selective.enabled=true with trainer.v1.sampler.custom_sampler.name="
            f"{config_get(sampler, 'name')}: "
            "a custom replay buffer decides which generated groups reach the step, so outcomes could go "
            "unrecorded; remove trainer.v1.sampler.custom_sampler"
        )
    gen = config_get(config, "data.gen_batch_size", None)
    if gen not in (None, 1):
        raise ValueError(
            f"cppo.selective.enabled=true with data.gen_batch_size={gen}: the hook replaces each skipped prompt "
            "by the next one from the dataloader, one prompt per fetch; set data.gen_batch_size=1 (or leave it "
            "unset: cppo-megatron verl sets it)"
        )


def apply_selective(config: Any) -> None:
    """Set ``data.gen_batch_size=1`` (one prompt per dataloader fetch) for a selective-rollout run;
    nothing otherwise. Call after ``check_selective``."""
    if not selective_enabled(config):
        return
    from omegaconf import OmegaConf, open_dict

    with open_dict(config):
        OmegaConf.update(config, "data.gen_batch_size", 1, merge=False, force_add=True)



# ---------------------------------------------------------------------------- early stopping
AGENT_NAME = "cppo_early_stop"  # the agent loop early stopping registers (early_stop_loop.py)


def early_stop_enabled(config: Any) -> bool:
    """The run selects the cppo estimator and ``cppo.early_stop.enabled``."""
    return is_cppo(config) and bool(cppo_config_from(config).early_stop.enabled)


def check_early_stop(config: Any) -> None:
    """ValueError naming key, value and fix for what early stopping does not run with in veRL."""
    if not early_stop_enabled(config):
        return
    es = cppo_config_from(config).early_stop
    refusals = [
        (not bool(config_get(config, "trainer.use_v1", True)), "trainer.use_v1=false",
         "the predictor's checkpoint and the seam's TransferQueue reads are built for the V1 loop; set "
         "trainer.use_v1=true"),
        (str(config_get(config, "trainer.v1.trainer_mode", "sync")) != "sync",
         f"trainer.v1.trainer_mode={config_get(config, 'trainer.v1.trainer_mode')}",
         "the asynchronous modes generate a step's groups with an older predictor and carry partial rollouts; "
         "set trainer.v1.trainer_mode=sync"),
        (bool(config_get(config, "algorithm.filter_groups.enable", False)), "algorithm.filter_groups.enable=true",
         "DAPO's filter reads every reward of a group, and a stopped completion has none; turn one of them off"),
        (es.features != "logprob", f"cppo.early_stop.features={es.features}",
         "veRL's server hands out the sampled tokens' log-probs only; set cppo.early_stop.features=logprob"),
        (str(config_get(config, "actor_rollout_ref.rollout.agent.default_agent_loop", "single_turn_agent"))
         not in ("single_turn_agent", AGENT_NAME),
         "actor_rollout_ref.rollout.agent.default_agent_loop="
         f"{config_get(config, 'actor_rollout_ref.rollout.agent.default_agent_loop')}",
         "early stopping wraps the single-turn agent loop; multi-turn (tool) loops are not built"),
        (bool(config_get(config, "actor_rollout_ref.rollout.multi_turn.enable", False)),
         "actor_rollout_ref.rollout.multi_turn.enable=true", "multi-turn rollouts are not built"),
    ]
    for bad, what, fix in refusals:
        if bad:
            raise ValueError(f"cppo.early_stop.enabled=true with {what}: {fix}")


def apply_early_stop(config: Any) -> list[str]:
    """Select the ``cppo_early_stop`` agent loop and the rollout log-probs; returns what changed."""
    if not early_stop_enabled(config):
        return []
    from omegaconf import OmegaConf, open_dict

    changed = []
    with open_dict(config):
        for key, value in (("actor_rollout_ref.rollout.agent.default_agent_loop", AGENT_NAME),
                           ("actor_rollout_ref.rollout.calculate_log_probs", True)):
            if OmegaConf.select(config, key) != value:
                OmegaConf.update(config, key, value, merge=False, force_add=True)
                changed.append(f"{key}={value} (cppo.early_stop)")
    return changed



def host_warnings(config: Any) -> list[str]:
    """CPPO settings that are valid but have no effect in a veRL run (one line each)."""
    cfg = cppo_config_from(config)
    default = {f.name: f.default for f in dataclasses.fields(CPPOConfig)}
    out = []
    if not cfg.dynamic_sampling and cfg.max_refill_rounds != default["max_refill_rounds"]:
        out.append(
            f"cppo.max_refill_rounds={cfg.max_refill_rounds} has no effect under veRL: refill rounds belong to "
            "cppo.dynamic_sampling, which veRL runs do not support; remove it"
        )
    if not cfg.selective.enabled:  # then none of the section's other keys is read
        initial = SelectiveConfig()
        out += [f"cppo.selective.{f.name}={getattr(cfg.selective, f.name)} has no effect under veRL: it belongs to "
                "cppo.selective.enabled, which is off; set cppo.selective.enabled=true or remove it"
                for f in dataclasses.fields(SelectiveConfig)
                if getattr(cfg.selective, f.name) != getattr(initial, f.name)]
    return out + filter_groups_warnings(config)


def unprepared_message(config: Any) -> str:
    """What a CPPO run launched by veRL's own ``main_ppo`` (plugin loaded, ``prepare`` never
    called) misses, and what to do: one line."""
    cfg = cppo_config_from(config)
    group_size = int(config.actor_rollout_ref.rollout.n)
    keep = cfg.keep_for_group(group_size)
    b = int(config.data.train_batch_size)
    mini = int(config.actor_rollout_ref.actor.ppo_mini_batch_size)
    if cfg.allocation:
        missing = (f"allocation was not applied: data.train_batch_size={b} prompts keep {keep} of G={group_size} "
                   f"completions each, {b * keep} per step instead of {b * group_size} (the paper's setting draws "
                   f"data.train_batch_size={b * group_size / keep:g})")
    else:
        missing = (f"with cppo.allocation=false the mini-batches were not shrunk to the kept count: "
                   f"actor.ppo_mini_batch_size={mini} prompts where {mini * keep / group_size:g} would follow "
                   f"the {keep} of {group_size} kept completions")
    return (f"cppo: this veRL run did not start through `cppo-megatron verl` (python -m "
            f"cppo_megatron.integrations.verl.main), so {missing}; run it through that entry point with the same "
            f"overrides, or set the sizes yourself and export {PREPARED_ENV}=1 to silence this")


def apply_allocation(config: Any) -> AllocationPlan:
    """Resize prompts per step (allocation on) or the mini-batches (allocation off) in place.

    Call once, before veRL builds its dataloader. Errors name the value that does not divide.
    """
    from omegaconf import open_dict

    cfg = cppo_config_from(config)
    group_size = int(config.actor_rollout_ref.rollout.n)
    keep = cfg.keep_for_group(group_size)
    b = int(config.data.train_batch_size)
    actor = config.actor_rollout_ref.actor
    mini = int(actor.ppo_mini_batch_size)
    use_critic = bool(config.get("critic", {}).get("enable", False)) if config.get("critic") else False
    with open_dict(config):
        if cfg.allocation:
            if (b * group_size) % keep:
                raise ValueError(
                    f"allocation: data.train_batch_size={b} x rollout.n={group_size} / keep={keep} is not "
                    "an integer number of prompts; pick a pruning rate with G(1-P) dividing G*b"
                )
            new_b = b * group_size // keep
            config.data.train_batch_size = new_b
            gen = config.data.get("gen_batch_size", None)
            if gen and new_b % int(gen):
                raise ValueError(
                    f"allocation: data.gen_batch_size={gen} does not divide the grown "
                    f"data.train_batch_size={new_b}"
                )
            new_mini = mini
            kept = b * group_size
        else:
            new_b = b
            if (mini * keep) % group_size:
                raise ValueError(
                    f"allocation=false: actor.ppo_mini_batch_size={mini} x keep={keep} / rollout.n="
                    f"{group_size} is not an integer; mini-batches could not follow the kept count"
                )
            new_mini = mini * keep // group_size
            actor.ppo_mini_batch_size = new_mini
            if use_critic:
                cm = int(config.critic.ppo_mini_batch_size)
                if (cm * keep) % group_size:
                    raise ValueError(f"allocation=false: critic.ppo_mini_batch_size={cm} x {keep} / {group_size}")
                config.critic.ppo_mini_batch_size = cm * keep // group_size
            kept = b * keep
            micro = _shrink_micro_batches(config, kept, new_mini * group_size)
    return AllocationPlan(group_size, keep, b, new_b, mini, new_mini, kept, cfg.allocation,
                          noop_warning(cfg, group_size), tuple(micro) if not cfg.allocation else ())


# per-GPU micro-batch sizes (sequences) that must divide the sequences a DP rank gets per pass,
# and the role whose pass they size (``layout.dp_size`` says over how many DP ranks that pass splits)
MICRO_BATCH_KEYS = (
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "actor"),
    ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", "actor"),
    ("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", "ref"),
)


def _shrink_micro_batches(config: Any, kept_rows: int, mini_rows: int) -> list[tuple[str, int, int]]:
    """allocation=false keeps only ``kept_rows`` sequences per step (``mini_rows`` per
    mini-batch): a micro-batch size set for the full batch may no longer divide a DP rank's
    share (veRL asserts it does). Shrink each fixed size to its gcd with the share of its role's
    data-parallel rank (``layout.dp_size``: under TP/PP/SP the world is not the DP size); dynamic batch
    sizes (token budgets) need nothing. Returns (key, before, after) for each change."""
    from omegaconf import OmegaConf

    if bool(OmegaConf.select(config, "actor_rollout_ref.actor.use_dynamic_bsz", default=False)):
        return []
    changed = []
    for key, role in MICRO_BATCH_KEYS:
        value = OmegaConf.select(config, key, default=None)
        if value is None or int(value) <= 0:
            continue
        dp = dp_size(config, role)
        share = math.gcd(kept_rows // dp, mini_rows // dp) or 1
        new = math.gcd(int(value), share)
        if new != int(value):
            OmegaConf.update(config, key, new, merge=False)
            changed.append((key.split(".", 1)[1], int(value), new))
    return changed


def export_plugin_to_workers(config: Any, extra_env: dict[str, str] | None = None) -> None:
    """Add ``VERL_USE_EXTERNAL_MODULES=cppo_megatron.integrations.verl`` to the Ray runtime env
    so every Ray process (the TaskRunner above all) loads the plugin even where entry points
    are not scanned."""
    from omegaconf import open_dict

    with open_dict(config):
        if config.get("ray_kwargs") is None:
            config.ray_kwargs = {}
        if config.ray_kwargs.get("ray_init") is None:
            config.ray_kwargs.ray_init = {}
        ray_init = config.ray_kwargs.ray_init
        if ray_init.get("runtime_env") is None:
            ray_init.runtime_env = {}
        env = ray_init.runtime_env
        if env.get("env_vars") is None:
            env.env_vars = {}
        mods = [m for m in str(env.env_vars.get("VERL_USE_EXTERNAL_MODULES", "") or "").split(",") if m]
        if PLUGIN_MODULE not in mods:
            mods.append(PLUGIN_MODULE)
        env.env_vars.VERL_USE_EXTERNAL_MODULES = ",".join(mods)
        for name, value in (extra_env or {}).items():
            env.env_vars[name] = value


def prepare(config: Any) -> AllocationPlan | None:
    """Everything ``main`` does to a composed veRL config before handing it to veRL:
    validate the ``cppo`` group, check compatibility, apply allocation, export the plugin.
    Returns the allocation plan, or None when the run is not CPPO (e.g. a GRPO recipe)."""
    export_plugin_to_workers(config)
    if not is_cppo(config):
        return None
    cppo_config_from(config)
    check_compatible(config)
    for message in host_warnings(config):
        warnings.warn(message, stacklevel=2)
    plan = apply_allocation(config)
    apply_selective(config)
    for message in apply_early_stop(config):
        print(f"cppo: {message}", file=sys.stderr)
    export_plugin_to_workers(config, {PREPARED_ENV: "1"})
    return plan


# mappings veRL hands on verbatim (to ray.init, to the HF model config): any key is valid there
FREE_FORM = ("ray_kwargs.ray_init.", "actor_rollout_ref.model.override_config.")


def overlay_mismatches(overlay: Any, base: Any, prefix: str = "") -> list[str]:
    """Keys of ``overlay`` (a recipe) that ``base`` (veRL's composed config) lacks, or whose
    value type differs from veRL's. Hydra composition accepts new keys silently, so a typo in
    a recipe would otherwise go unnoticed. Returns "key: reason" lines (empty when fine)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    problems = []
    for key in overlay:
        if not prefix and key in ("hydra", "defaults", "cppo", "cppo_cpu"):
            continue
        path = f"{prefix}{key}"
        if path.startswith(FREE_FORM):
            continue
        if key not in base.keys():  # `in` is False for veRL's mandatory "???" values
            problems.append(f"{path}: not a key of veRL's config")
            continue
        value = (cast(dict, OmegaConf.to_container(overlay, resolve=False))[key] if isinstance(overlay, DictConfig)
                 else overlay[key])
        node = base._get_node(key)
        if isinstance(value, dict):
            if isinstance(node, DictConfig):
                problems += overlay_mismatches(overlay[key], base[key], path + ".")
            elif not (node._is_none() or node._is_missing()):
                problems.append(f"{path}: a mapping where veRL has {type(node._value()).__name__}")
            continue
        if value is None or node._is_none() or node._is_missing() or node._is_interpolation():
            continue
        known = node if isinstance(node, (DictConfig, ListConfig)) else node._value()
        if isinstance(known, (DictConfig, ListConfig)):
            ok = isinstance(value, list) == isinstance(known, ListConfig)
        elif isinstance(known, bool):
            ok = isinstance(value, bool)
        elif isinstance(known, (int, float)):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        else:
            ok = isinstance(value, type(known)) or isinstance(value, str) and value.startswith("${")
        if not ok:
            problems.append(f"{path}: {value!r} ({type(value).__name__}) where veRL has {type(known).__name__}")
    return problems
