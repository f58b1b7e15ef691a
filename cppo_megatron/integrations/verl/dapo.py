"""DAPO's dynamic sampling (``algorithm.filter_groups``) together with CPPO, in veRL 0.9.1.

Where veRL filters. Only the V1 trainer's sync ``ReplayBuffer`` does (``replay_buffer.py``):
``_dapo_filtered_keys`` (261-314) marks every finished group whose filter metric is equal over all
its completions; ``sample`` (421-511) evicts them (``_evict_terminal_groups`` -> ``_clear_groups``),
earns 2 refill credits per evicted group and spends them through the trainer's
``_add_prompts_to_generate`` (fresh prompts from the dataloader, at most ``max_inflight_gen_batches``
x ``data.train_batch_size`` in flight); once ``data.train_batch_size`` groups are sampleable it
drains what is still generating, selects ``data.train_batch_size`` groups and clears the rest
(``discarded_surplus_samples``). Nothing stays in the buffer for the next step. The legacy
``RayPPOTrainer.fit`` never reads ``algorithm.filter_groups``; the async buffer
(``ReplayBufferAsync``) refills one prompt per eviction and carries groups across steps.

Semantics with CPPO: the filter runs inside ``replay_buffer.sample``, before ``_balance_batch``
(the pruning seam, hook.py), so veRL's filter comes first and CPPO prunes the groups that passed
it to the recipe's kept count. The buffer's batch is ``data.train_batch_size``, read after
CPPO's allocation grew it, so allocation and the refill agree: the refill draws until the
allocated number of prompts whose filter metric varies is there.

The filter metric (``algorithm.filter_groups.metric``, ``_dapo_filtered_keys`` 261-314): ``reward``
is veRL's canonical reward, ``rm_scores`` summed per completion, the quantity CPPO's advantages
come from; any other name is read from each completion's ``reward_extra_info`` (what the reward
function returned besides ``score``: ``acc`` in veRL's DAPO scripts), and a finished group without
it stops the run (veRL raises). A group is dropped when its metric is equal over all its
completions. Under another metric than ``reward`` a group can pass with all rewards equal (e.g.
acc varies but the score does not): its advantages are all zero, so CPPO prunes its completions
first; the hook counts such groups (``cppo/filter_passed_zero_variance``) and the audit names them.

This module holds the guards (``check_filter_groups``, ``filter_groups_warnings``; the launcher
calls them through ``runconfig.check_compatible``), the audit recorders of every prompt drawn,
filtered and discarded (``recorders``, installed by ``audit.install`` in audit mode, on any
platform), and ``account_step``, which balances one step's records.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "REWARD_METRIC",
    "StepAccount",
    "account_step",
    "check_filter_groups",
    "config_get",
    "equal_reward_groups",
    "filter_groups_enabled",
    "filter_groups_warnings",
    "filter_metric",
    "metric_values",
    "recorders",
]

# veRL's canonical filter metric: rm_scores summed per completion (replay_buffer.py:32,278,292), the
# same sum CPPO's advantages and survivors come from (hook.py); any other name is a reward_extra_info field
REWARD_METRIC = "reward"
REPLAY_BUFFER = ("verl.trainer.ppo.v1.replay_buffer", "ReplayBuffer")


def config_get(node: Any, dotted: str, default: Any = None) -> Any:
    """``node.a.b.c`` for ``dotted`` = "a.b.c" in a veRL config (an OmegaConf node or a plain dict),
    or ``default`` where a part is missing, not a mapping, or the value is None."""
    for part in dotted.split("."):
        if node is None or not hasattr(node, "get"):
            return default
        node = node.get(part, None)
    return default if node is None else node


def filter_groups_enabled(config: Any) -> bool:
    """``algorithm.filter_groups.enable`` of a veRL config (False when the group is absent)."""
    if not hasattr(config, "get"):
        raise TypeError(f"filter_groups_enabled: expected a veRL config mapping, got {type(config).__name__}")
    return bool(config_get(config, "algorithm.filter_groups.enable", False))


def filter_metric(config: Any) -> str | None:
    """The metric veRL's replay buffer filters on (``algorithm.filter_groups.metric``, as a string);
    None when the filter is off or no metric is set."""
    if not filter_groups_enabled(config):
        return None
    metric = config_get(config, "algorithm.filter_groups.metric", None)
    return str(metric) if metric not in (None, "") else None


def check_filter_groups(config: Any) -> None:
    """Raise ValueError, naming key, value and fix, for a DAPO + CPPO setting veRL 0.9.1 would not
    honour; nothing when ``algorithm.filter_groups.enable`` is off."""
    if not filter_groups_enabled(config):
        return
    if not bool(config_get(config, "trainer.use_v1", True)):
        raise ValueError(
            "algorithm.filter_groups.enable=True with trainer.use_v1=False: veRL 0.9.1's legacy loop "
            "(RayPPOTrainer.fit) never reads algorithm.filter_groups, so every group would train unfiltered; "
            "set trainer.use_v1=true (its sync replay buffer filters and refills) or "
            "algorithm.filter_groups.enable=false"
        )
    mode = str(config_get(config, "trainer.v1.trainer_mode", "sync"))
    if mode != "sync":
        raise ValueError(
            f"algorithm.filter_groups.enable=True with trainer.v1.trainer_mode={mode}: the asynchronous replay "
            "buffer refills one prompt per filtered group and carries groups across steps (and separate_async "
            "samples per local update), for which the plugin's accounting of prompts drawn, filtered and "
            "discarded is not built; set trainer.v1.trainer_mode=sync"
        )
    if filter_metric(config) is None:
        raise ValueError(
            "algorithm.filter_groups.enable=True without algorithm.filter_groups.metric: veRL stops in the "
            "TaskRunner (trainer_base.py:196); set algorithm.filter_groups.metric=reward (rm_scores summed per "
            "completion, what CPPO prunes by) or the reward_extra_info field your reward returns, e.g. acc"
        )
    sampler = config_get(config, "trainer.v1.sampler.custom_sampler", None)
    if sampler is not None and config_get(sampler, "path") and config_get(sampler, "name"):
        raise ValueError(
            f"algorithm.filter_groups.enable=True with trainer.v1.sampler.custom_sampler.name="
            f"{config_get(sampler, 'name')}: "
            "veRL hands algorithm.filter_groups to its built-in replay buffer only (trainer_base.py:164), so what "
            "a custom sampler filters is neither known nor audited; remove trainer.v1.sampler.custom_sampler"
        )
    rm = config_get(config, "reward.reward_model", None)
    if bool(config_get(rm, "enable", False)) and not bool(config_get(rm, "enable_resource_pool", False)):
        raise ValueError(
            "algorithm.filter_groups.enable=True with reward.reward_model.enable=True and "
            "reward.reward_model.enable_resource_pool=False: a colocated reward model scores after the replay "
            "buffer sampled, so the filter has no reward to read (veRL asserts it in the TaskRunner, "
            "trainer_base.py:197); set reward.reward_model.enable_resource_pool=true or use a rule-based reward"
        )


def filter_groups_warnings(config: Any) -> list[str]:
    """DAPO settings that are valid but do nothing in veRL 0.9.1's V1 replay buffer (one line each)."""
    if not filter_groups_enabled(config):
        return []
    limit = int(config_get(config, "algorithm.filter_groups.max_num_gen_batches", 0) or 0)
    if limit > 0:
        return [
            f"algorithm.filter_groups.max_num_gen_batches={limit} is ignored by veRL 0.9.1's V1 replay buffer "
            "(trainer_base.py:202): it refills until the allocated batch has reward variance, with no cap on "
            "generation rounds; algorithm.filter_groups.max_inflight_gen_batches bounds what is in flight"
        ]
    return []


# ------------------------------------------------------------------------------ audit recorders
def _row_rewards(values: Any) -> list[float]:
    import torch

    if getattr(values, "is_nested", False):
        return [float(v.sum()) for v in values.unbind()]
    return [float(torch.as_tensor(v).sum()) for v in values]


def _jsonable(x: Any) -> Any:
    return x if isinstance(x, (int, float, str)) or x is None else str(x) if not hasattr(x, "item") else x.item()


def _record_draws(record: Callable[..., None], original):
    # every prompt V1 submits for generation passes here: the step's batch (prepare_step) and each
    # refill the replay buffer asks for (_add_prompts_to_generate), trainer_base.py:1496
    @functools.wraps(original)
    def _submit_batch_to_rollout(self, batch, *args, **kwargs):
        index = list(batch["index"]) if "index" in batch.keys() else None
        record("draw", step=int(self.global_steps), uids=[str(u) for u in batch["uid"]],
               prompts=[_jsonable(i) for i in index] if index is not None else None,
               n=int(self.config.actor_rollout_ref.rollout.n))
        return original(self, batch, *args, **kwargs)

    return _submit_batch_to_rollout


def metric_values(extra_fields: Any, metric: str) -> list[float | None]:
    """Each completion's ``reward_extra_info[metric]`` as a float (None where it is missing), from
    TransferQueue's ``extra_fields`` column (one entry per completion, a dict or an object whose
    ``data`` is one), read the way veRL's filter reads it (replay_buffer.py:296-302)."""
    if not isinstance(metric, str) or not metric:
        raise ValueError(f"metric_values: metric must be a reward_extra_info field name, got {metric!r}")
    out: list[float | None] = []
    for value in extra_fields:
        fields = getattr(value, "data", value)
        info = fields.get("reward_extra_info", {}) if isinstance(fields, dict) else {}
        out.append(float(info[metric]) if isinstance(info, dict) and metric in info else None)
    return out


def _group_reads(buffer, partition_id: str, uids) -> tuple[dict[str, list[float]], dict[str, list] | None]:
    """Each group's per-completion rewards (rm_scores summed) and, when the buffer filters on another
    metric than ``reward``, that metric's values; read from TransferQueue before the buffer clears
    them. A group with no trajectory (a failed one), or none readable, gets []."""
    import transfer_queue as tq

    metric = str(getattr(buffer, "filter_groups_metric", None) or REWARD_METRIC)
    extra = metric != REWARD_METRIC
    rows: dict[str, list[str]] = {uid: [] for uid in sorted(uids)}
    for key in buffer.partitions[partition_id]:
        uid = key.split("_")[0]
        if uid in rows:
            rows[uid].append(key)
    keys = [k for uid in rows for k in rows[uid]]
    empty: dict[str, list] = {uid: [] for uid in rows}
    if not keys:
        return empty, (dict(empty) if extra else None)
    try:
        data = tq.kv_batch_get(keys=keys, partition_id=partition_id,
                               select_fields=["rm_scores"] + (["extra_fields"] if extra else []))
        rewards = iter(_row_rewards(data["rm_scores"]))
        values = iter(metric_values(list(data["extra_fields"]), metric)) if extra else None
    except Exception:  # noqa: BLE001 - the audit must not stop a run; the account then shows the gap
        return empty, (dict(empty) if extra else None)
    by_uid = {uid: [next(rewards) for _ in rows[uid]] for uid in rows}
    return by_uid, (None if values is None else {uid: [next(values) for _ in rows[uid]] for uid in rows})


def _record_evictions(record: Callable[..., None], original):
    # the filter's verdict for one poll of the buffer (replay_buffer.py:344): the groups it drops,
    # each with its rewards and, under another metric than reward, that metric's values (the
    # accounting checks that the metric is equal over each)
    @functools.wraps(original)
    def _evict_terminal_groups(self, global_steps, partition_id, eviction_reasons, *args, **kwargs):
        stale, dapo, failed = (set(x) for x in eviction_reasons[:3])
        if partition_id == "train" and (stale or dapo or failed):
            rewards, values = _group_reads(self, partition_id, dapo)
            extra = {} if values is None else {"filter_values": values}
            record("evict", step=int(global_steps), filtered=rewards, failed=sorted(failed), stale=sorted(stale),
                   metric=self.filter_groups_metric, **extra)
        return original(self, global_steps, partition_id, eviction_reasons, *args, **kwargs)

    return _evict_terminal_groups


def _record_clears(record: Callable[..., None], original):
    # every group the sync buffer removes unsampled, with its rewards (and filter values): the evicted
    # ones and the surplus it discards once the batch is full (replay_buffer.py:241, called at :380, :498)
    @functools.wraps(original)
    def _clear_groups(self, partition_id, uids, *args, **kwargs):
        if partition_id == "train" and uids:
            steps = self.prompt_global_steps[partition_id]
            rewards, values = _group_reads(self, partition_id, set(uids))
            extra = {} if values is None else {"filter_values": values}
            record("clear", rewards=rewards, submitted={uid: _jsonable(steps.get(uid)) for uid in sorted(uids)},
                   **extra)
        return original(self, partition_id, uids, *args, **kwargs)

    return _clear_groups


def recorders(record: Callable[..., None]) -> dict[tuple[str, str], dict[str, Callable]]:
    """(module, class) -> {method: wrapper factory} writing through ``record`` (``audit.record``:
    passed in, so that audit imports this module and not the other way round); ``audit.install``
    wraps them when CPPO_VERL_AUDIT is set."""
    return {
        ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer"): {"_submit_batch_to_rollout":
                                                              functools.partial(_record_draws, record)},
        REPLAY_BUFFER: {"_evict_terminal_groups": functools.partial(_record_evictions, record),
                        "_clear_groups": functools.partial(_record_clears, record)},
    }


# ------------------------------------------------------------------------------ accounting
@dataclass(frozen=True)
class StepAccount:
    """Where every prompt one V1 step drew went (uids: veRL's per-draw prompt ids).

    ``drawn = filtered + failed + surplus + passed + carried``; the sync buffer carries nothing, so
    ``carried`` must be empty, as must ``unexplained`` (groups filtered, discarded or pruned at this
    step that it never drew). Completions: each drawn prompt generated ``group_size``; they end
    filtered, discarded, or at CPPO's seam, where ``kept + pruned == completions_passed``.

    ``metric`` is the filter's (``algorithm.filter_groups.metric``). Its verdicts are checked on the
    recorded values: a filtered group whose metric varies (``varied_filtered``) or a group that passed
    (reached CPPO or was discarded as surplus) whose metric is equal (``constant_passed``) is a
    problem. Groups that passed with all rewards equal (``zero_variance_passed``, ``_surplus``) are a
    problem under ``reward`` (the filter should have dropped them) and a count under any other
    metric (``cppo/filter_passed_zero_variance``: CPPO prunes their zero advantages first)."""

    step: int
    group_size: int
    drawn: tuple[str, ...]
    filtered: tuple[str, ...]
    failed: tuple[str, ...]
    surplus: tuple[str, ...]
    passed: tuple[str, ...]
    carried: tuple[str, ...]
    unexplained: tuple[str, ...]
    completions_filtered: int
    completions_surplus: int
    completions_passed: int
    kept: int
    pruned: int
    zero_variance_passed: tuple[str, ...]
    varied_filtered: tuple[str, ...]
    zero_variance_surplus: tuple[str, ...]
    metric: str = REWARD_METRIC
    constant_passed: tuple[str, ...] = ()

    @property
    def completions_generated(self) -> int:
        return self.group_size * len(self.drawn)

    def problems(self) -> list[str]:
        """What does not add up, one line each (empty when the step is fully accounted for)."""
        out = []
        parts = len(self.filtered) + len(self.failed) + len(self.surplus) + len(self.passed) + len(self.carried)
        if parts != len(self.drawn):
            out.append(f"step {self.step}: {len(self.drawn)} prompts drawn but filtered {len(self.filtered)} + failed "
                       f"{len(self.failed)} + surplus {len(self.surplus)} + passed {len(self.passed)} + carried "
                       f"{len(self.carried)} = {parts}")
        names = ["carried", "unexplained", "varied_filtered", "constant_passed"]
        if self.metric == REWARD_METRIC:
            names[2:2] = ["zero_variance_passed"]
            names.append("zero_variance_surplus")
        for name in names:
            if getattr(self, name):
                out.append(f"step {self.step}: {name} {list(getattr(self, name))[:5]}")
        seen = self.completions_filtered + self.completions_surplus + self.completions_passed
        if not self.failed and seen != self.completions_generated:
            out.append(f"step {self.step}: {self.completions_generated} completions generated ({len(self.drawn)} x "
                       f"G={self.group_size}) but {seen} accounted for (filtered {self.completions_filtered}, "
                       f"surplus {self.completions_surplus}, passed {self.completions_passed})")
        if self.kept + self.pruned != self.completions_passed:
            out.append(f"step {self.step}: kept {self.kept} + pruned {self.pruned} != {self.completions_passed} "
                       "completions passed to CPPO")
        return out


def equal_reward_groups(uids: list, rewards: list[float]) -> list[str]:
    """The groups (by uid, in order of first appearance) of two or more rows whose rewards are all
    equal: no reward signal, all advantages zero. ``uids`` and ``rewards``: one per row."""
    if len(uids) != len(rewards):
        raise ValueError(f"equal_reward_groups: {len(uids)} uids for {len(rewards)} rewards")
    groups: dict[str, list[float]] = defaultdict(list)
    for uid, reward in zip(uids, rewards, strict=True):
        groups[str(uid)].append(float(reward))
    return [uid for uid, values in groups.items() if len(values) > 1 and not _varies(values)]


def _varies(values: list) -> bool:
    known = [v for v in values if v is not None]  # a missing metric value (veRL stops the run on it)
    return len(known) > 1 and max(known) != min(known)


def _filter_values(records: list[dict], kind: str, key: str) -> dict[str, list]:
    # the filter metric's values where recorded (another metric than reward), else the rewards
    out: dict[str, list] = {}
    for r in records:
        if r.get("kind") == kind:
            out.update(r.get("filter_values") or r[key])
    return out


def account_step(records: list[dict], step: int, group_size: int) -> StepAccount:
    """Balance one step of a DAPO + CPPO V1 run from its audit records (``audit.read``): the
    ``draw``, ``evict`` and ``clear`` records of this module and the hook's ``prune`` record.

    Raises ValueError naming the value when ``step`` or ``group_size`` is not positive, or when the
    step has no single ``prune`` record (the sync loop prunes once a step)."""
    if not isinstance(step, int) or step < 1:
        raise ValueError(f"account_step: step must be a positive int, got {step!r}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"account_step: group_size must be a positive int, got {group_size!r}")
    prunes = [r for r in records if r.get("kind") == "prune" and r.get("step") == step]
    if len(prunes) != 1:
        raise ValueError(f"account_step: step {step} has {len(prunes)} prune records, expected 1 (sync mode)")
    (prune,) = prunes
    metric = str(prune.get("filter_metric") or REWARD_METRIC)
    drawn = [u for r in records if r.get("kind") == "draw" and r.get("step") == step for u in r["uids"]]
    evicts = [r for r in records if r.get("kind") == "evict" and r.get("step") == step]
    filtered: dict[str, list[float]] = {}
    failed: set[str] = set()
    stale: set[str] = set()
    for r in evicts:
        filtered.update(r["filtered"])
        failed |= set(r["failed"])
        stale |= set(r["stale"])
    cleared: dict[str, list[float]] = {}
    for r in records:
        if r.get("kind") == "clear":
            cleared.update({u: v for u, v in r["rewards"].items() if r["submitted"].get(u) == step})
    evicted = set(filtered) | failed | stale
    surplus = [u for u in cleared if u not in evicted]
    rewards: dict[str, list[float]] = defaultdict(list)
    for uid, reward in zip(prune["uids"], prune["rewards"], strict=True):
        rewards[str(uid)].append(float(reward))
    values: dict[str, list] = defaultdict(list)
    for uid, value in zip(prune["uids"], prune.get("filter_values") or prune["rewards"], strict=True):
        values[str(uid)].append(value)
    passed = list(rewards)
    accounted = evicted | set(surplus) | set(passed)
    drawn_set = set(drawn)
    filtered_values = {u: v for u, v in _filter_values(evicts, "evict", "filtered").items() if u in filtered}
    cleared_values = _filter_values(records, "clear", "rewards")
    return StepAccount(
        step=step, group_size=group_size, drawn=tuple(drawn), filtered=tuple(sorted(filtered)),
        failed=tuple(sorted(failed | stale)), surplus=tuple(sorted(surplus)), passed=tuple(passed),
        carried=tuple(u for u in drawn if u not in accounted),
        unexplained=tuple(sorted(accounted - drawn_set)) + tuple(sorted({u for u in drawn if drawn.count(u) > 1})),
        completions_filtered=sum(len(v) for v in filtered.values()),
        completions_surplus=sum(len(cleared[u]) for u in surplus),
        completions_passed=len(prune["uids"]),
        kept=len(prune["kept"]), pruned=len(prune["uids"]) - len(prune["kept"]),
        zero_variance_passed=tuple(u for u in passed if not _varies(rewards[u])),
        varied_filtered=tuple(sorted(u for u, v in filtered_values.items() if _varies(v))),
        zero_variance_surplus=tuple(u for u in surplus if not _varies(cleared[u])),
        metric=metric,
        constant_passed=() if metric == REWARD_METRIC else tuple(
            [u for u in passed if not _varies(values[u])] + [u for u in surplus if not _varies(cleared_values[u])]),
    )
