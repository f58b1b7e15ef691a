"""Selective rollout (GRESO) in OpenRLHF 0.11.2: skip prompts before generation.

Inert unless the run's CPPO config sets ``selective.enabled`` (``install(cfg)``, called by
``hook.install``). Who draws prompts: in OpenRLHF's synchronous loop one process, the
``PPOTrainer`` Ray actor, holds the prompt dataloader and calls ``SamplesGenerator.generate_samples``
(``trainer/ppo_trainer.py:477-489,530``); the actor ranks (``PolicyModelActor``) only receive
finished experiences. So there is one history, in that process: identical on every rank by
construction (no rank draws, none records).

The seams (OpenRLHF 0.11.2, each pinned by source hash in ``pinned.SEAMS``):

- **The prompt index.** OpenRLHF's ``PromptDataset`` keeps no row number: ``__getitem__(idx)``
  (``datasets/prompts_dataset.py:95``) returns ``(datasource, prompt, label, image)``, collated
  into batches of one (``prepare_datasets``, ``trainer/ppo_trainer.py:42-49``). ``__getitem__`` is
  wrapped so that, for the train dataset only (registered by the wrapped
  ``SamplesGenerator.__init__``, ``samples_generator.py:43``), the datasource comes back as an
  ``IndexedSource``: a ``str`` equal to it that also carries ``idx``, the row of the train data set
  the sampler picked. That row is stable across restarts with the same data: OpenRLHF builds the
  data set deterministically (``blending_datasets``: each file's first ``--data.max_samples`` rows,
  concatenated, or interleaved with ``--train.seed``; then ``select(range(max_samples))``).
- **The draw** (``SamplesGenerator._generate_vllm``, ``samples_generator.py:140``): for the train
  dataloader's iterator (evaluation passes through), OpenRLHF's own ``_collect_prompt_batch`` gets
  an iterator of *kept* prompts instead. Each ``next`` takes candidates from the dataloader in its
  order and asks the core (``fill_batch`` with ``cppo.seed`` and the step) until one is kept; the
  skipped ones are used up (the dataloader moved past them: its checkpointed state includes them),
  so the call still dispatches ``--rollout.batch_size`` prompts unless the epoch ends first. The
  returned ``prompts_consumed`` counts the skipped ones too. Each generated sample is tagged with
  its prompt's index (its group matched to a kept prompt with the same prompt and label: OpenRLHF
  returns groups in the order vLLM finishes them; two kept rows with identical prompt and label are
  the same problem and may swap outcomes).
- **The record**: the CPPO hook (``hook.prune_rollout_samples``, the start of
  ``make_experience_batch``) sees every generated group's rewards before pruning; ``record_step``
  files each group's outcome under its prompt index (zero variance on the rewards the advantage
  uses, after OpenRLHF's length penalties; easy = zero variance and every reward as returned
  ``>= 1.0``), adapts the rates (after the first pass over the data set, by default) and returns
  the step's ``selective/*`` metrics, which ride on the survivors' ``info`` into OpenRLHF's logs.
- **The checkpoint**: the history is prompt-draw state, so it rides where OpenRLHF keeps its own:
  ``PPOTrainer.fit`` puts ``prompts_dataloader.state_dict()`` into the client states of every
  checkpoint (``ppo_trainer.py:553-560``; each actor rank's ``save_checkpoint`` stores them inside
  its DeepSpeed checkpoint, ``ppo_actor.py:661-674``) and, when it resumes, hands them back to
  ``prompts_dataloader.load_state_dict`` (``ppo_trainer.py:514-518``). The train dataloader's
  ``StatefulDataLoader.state_dict`` / ``load_state_dict`` (torchdata) are wrapped: the history,
  rates and counters ride in that dict under ``STATE_KEY`` and come back with it. (The trainer's own
  methods cannot be wrapped: Ray copies every method of an actor class onto the class it ships when
  ``@ray.remote`` runs, ``ray/util/tracing/tracing_helper.py``, so ``BasePPOTrainer``'s methods in
  the trainer actor are those copies.)

Refused (``check_args``, by the launcher and again at the first draw): ``--train.async_enable``
(prompts are drawn in another actor, ahead of the step that records them),
``--algo.dynamic_filtering_enable`` (its dropped groups never reach the hook, so the groups
selective rollout learns from would go unrecorded) and ``--rollout.vllm_generate_batch_size``
other than ``--rollout.batch_size`` (one call's groups would be trained over several steps).
"""

from __future__ import annotations

import functools
import logging
import sys
import warnings
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ...config import CPPOConfig
from ...core import FilledBatch, check_int
from ...core.selective_run import SelectiveRun
from ..importhook import after_import, remove
from ..wrap import unwrap, wrap
from . import observers
from .checkpoint import resumed_step

__all__ = [
    "DRAW_ATTR", "INDEX_ATTR", "STATE_KEY", "IndexedSource", "OpenRLHFSelective", "SelectiveDraw", "check_args",
    "enabled", "install", "record_step", "state_of", "uninstall",
]  # fmt: skip

logger = logging.getLogger(__name__)

STATE_KEY = "cppo_selective"  # its entry in the train dataloader's state (OpenRLHF's checkpoint client states)
INDEX_ATTR = "_cppo_prompt_index"  # on each generated rollout Experience: its prompt's row in the train data set
DRAW_ATTR = "_cppo_selective_draw"  # on each: the SelectiveDraw of the generation call that made it
DATASET_MODULE = "openrlhf.datasets.prompts_dataset"
GENERATOR_MODULE = "openrlhf.trainer.ppo_utils.samples_generator"
LOADER_MODULE = "torchdata.stateful_dataloader.stateful_dataloader"  # OpenRLHF's prompt dataloader class
WRAP_TAG = __name__

_CONFIG: CPPOConfig | None = None
# the train data sets whose items carry their row, and the train dataloaders whose state carries the
# history (both registered by SamplesGenerator.__init__; the dataloader maps to its generator)
_TRAIN_DATASETS: weakref.WeakSet[Any] = weakref.WeakSet()
_TRAIN_LOADERS: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
# each SamplesGenerator's run state, kept beside the host object (it dies with it)
_STATES: weakref.WeakKeyDictionary[Any, OpenRLHFSelective] = weakref.WeakKeyDictionary()


def enabled() -> bool:
    """Whether this process runs selective rollout (``install`` got a config that selects it)."""
    return _CONFIG is not None


# ---------------------------------------------------------------------------------- refusals
def check_args(args: Any) -> list[str]:
    """Launch-time (and first-draw) check of OpenRLHF's parsed ``args`` for a run with
    ``cppo.selective.enabled``: ValueError naming flag, value and fix for what is not built; else
    the notes the dry run prints (one line each)."""
    if bool(getattr(args.train, "async_enable", False)):
        raise ValueError(
            "cppo.selective.enabled=true with --train.async_enable: the asynchronous trainer draws prompts in "
            "another actor, steps ahead of the one that records their groups, so the skip decisions could not "
            "see the history they depend on (not built); remove --train.async_enable or cppo.selective.enabled"
        )
    if bool(getattr(args.algo, "dynamic_filtering_enable", False)):
        raise ValueError(
            "cppo.selective.enabled=true with --algo.dynamic_filtering_enable: OpenRLHF's filter drops the "
            "zero-variance groups inside the samples generator, before the hook where selective rollout records "
            "outcomes, so exactly the groups it learns from would go unrecorded (not built); remove "
            "--algo.dynamic_filtering_enable or cppo.selective.enabled"
        )
    gen = getattr(args.rollout, "vllm_generate_batch_size", None)
    if gen and int(gen) != int(args.rollout.batch_size):
        raise ValueError(
            f"cppo.selective.enabled=true with --rollout.vllm_generate_batch_size {gen}: one generation call's "
            f"groups would be trained (and recorded) over several steps of {args.rollout.batch_size} prompts, "
            "while the skips were decided for the first; leave --rollout.vllm_generate_batch_size unset"
        )
    workers = int(getattr(args.data, "dataloader_num_workers", 0) or 0)
    notes = [
        f"selective rollout: each step draws prompts from OpenRLHF's prompt dataloader until "
        f"{args.rollout.batch_size} are kept; a prompt whose recent groups all had equal rewards is skipped "
        "(used up, replaced by the next one). At the end of an epoch a step generates fewer (the dataloader ends "
        "there, as in plain OpenRLHF)"
    ]
    if workers > 0:
        notes.append(f"selective rollout with --data.dataloader_num_workers {workers}: the workers must be forked "
                     "(Linux's default) so that they carry the prompt index; tested with 0")
    return notes


# ---------------------------------------------------------------------------------- the prompt index
class IndexedSource(str):
    """A ``PromptDataset`` item's datasource (equal to it as a string) carrying ``row``, the index
    ``__getitem__`` was called with, and ``original``, the datasource as the data set holds it."""

    row: int
    original: Any

    def __new__(cls, original: Any, row: int) -> IndexedSource:
        obj = super().__new__(cls, str(original))
        obj.row = int(row)
        obj.original = original
        return obj

    def __reduce__(self):  # DataLoader workers pickle items: keep the row
        return (IndexedSource, (self.original, self.row))


def _row_of(batch: Any, drawn: int) -> tuple[int, Any]:
    """(row, the batch as OpenRLHF's dataloader made it) of one dataloader batch of one prompt."""
    try:
        sources, prompts, labels, images = batch
    except (TypeError, ValueError):
        raise ValueError(f"selective rollout: the prompt dataloader yielded {type(batch).__name__}, not OpenRLHF's "
                         "(datasources, prompts, labels, images) batch") from None
    if len(prompts) != 1:
        raise ValueError(f"selective rollout: the prompt dataloader yielded {len(prompts)} prompts in one batch; "
                         "OpenRLHF 0.11.2 batches its prompts one by one (prepare_datasets), which the hook relies on")
    source = sources[0]
    if not isinstance(source, IndexedSource):
        raise ValueError(
            f"selective rollout: prompt #{drawn} of the step came from the dataloader without its row index (the "
            "train PromptDataset's items are tagged in this process; a DataLoader worker started with 'spawn' does "
            "not carry it): set --data.dataloader_num_workers 0"
        )
    return source.row, ([source.original], prompts, labels, images)


# ---------------------------------------------------------------------------------- one generation call
@dataclass(eq=False)
class SelectiveDraw:
    """One ``_generate_vllm`` call's candidates: every prompt drawn for step ``step``, kept or
    skipped (``rounds``: one ``FilledBatch`` per prompt handed to OpenRLHF, plus the last, empty
    one when the epoch ended), and the kept prompts' (row, prompt, label) in draw order."""

    step: int
    serial: int
    rounds: list[FilledBatch]
    kept: list[tuple[int, str, Any]]
    exhausted: bool = False

    @property
    def drawn(self) -> list[int]:
        return [int(i) for fb in self.rounds for i in fb.drawn.tolist()]

    @property
    def skipped(self) -> list[int]:
        return [int(i) for fb in self.rounds for i in fb.skipped.tolist()]

    @property
    def kept_rows(self) -> list[int]:
        return [row for row, _, _ in self.kept]

    def to_record(self) -> dict:
        d = [fb.decision for fb in self.rounds]
        return {"serial": self.serial, "step": self.step, "drawn": self.drawn, "skipped": self.skipped,
                "kept": self.kept_rows, "exhausted": self.exhausted,
                "skip_prob": [float(p) for x in d for p in x.skip_prob.tolist()],
                "streak": [int(s) for x in d for s in x.streak.tolist()],
                "p_easy": d[0].rates.p_easy if d else None, "p_hard": d[0].rates.p_hard if d else None}


class _KeptPrompts(Iterator):
    """The iterator OpenRLHF's ``_collect_prompt_batch`` draws from: each ``next`` takes candidates
    from the dataloader's iterator until the core keeps one, and returns that one's batch."""

    def __init__(self, state: OpenRLHFSelective, source: Any, draw: SelectiveDraw) -> None:
        self.state, self.source, self.draw = state, source, draw
        self.num_drawn = 0

    def __next__(self):
        batches: list[Any] = []

        def take(n: int) -> list[int]:
            rows = []
            for _ in range(n):
                try:
                    batch = next(self.source)
                except StopIteration:
                    self.draw.exhausted = True
                    break
                row, batch = _row_of(batch, self.num_drawn)
                self.num_drawn += 1
                rows.append(row)
                batches.append(batch)
            return rows

        fb = self.state.fill(take, 1)  # at most 1 + num_prompts draws: the epoch ends first
        self.draw.rounds.append(fb)
        if fb.kept.numel() == 0:  # the epoch ended while skipping
            raise StopIteration
        batch = batches[-1]  # the one kept is the last drawn: fill stops at the first kept, or forces the last
        self.draw.kept.append((int(fb.kept[0]), batch[1][0], batch[2][0]))
        return batch


# ---------------------------------------------------------------------------------- the run state
class OpenRLHFSelective(SelectiveRun):
    """The core's driver (``SelectiveRun``) with OpenRLHF's side: the generation calls of a step
    (``SelectiveDraw``s, pending until the hook records the step) and the step they decide for.

    Args:
        cfg: the run's ``CPPOConfig`` (its ``selective`` section; ``seed`` seeds the draws).
        num_prompts: rows in the train data set (one pass = one epoch).
        step: the step the next generation call decides for (OpenRLHF's global step before it,
            0-based: the hook's count; a resumed run starts at the checkpoint's).
        group_size: G (``--rollout.n_samples_per_prompt``), for the tokens-saved estimate.
    """

    def __init__(self, cfg: CPPOConfig, *, num_prompts: int, step: int = 0, group_size: int = 1) -> None:
        super().__init__(cfg, num_prompts=num_prompts, group_size=group_size, warn=logger.warning)
        self.next_step = check_int("step (OpenRLHF's global step)", step, minimum=0)
        self.pending: list[SelectiveDraw] = []  # this step's generation calls, not yet recorded
        self._serial = 0
        self._open = False

    def _open_step(self) -> None:
        if not self._open:  # whether this step moves the rates is decided at its first call
            self.start_step(self.next_step)
            self._open = True

    # ------------------------------------------------------------------ before generation
    def begin_call(self) -> SelectiveDraw:
        """A new generation call for ``next_step``."""
        self._open_step()
        self._serial += 1
        draw = SelectiveDraw(step=self.next_step, serial=self._serial, rounds=[], kept=[])
        self.pending.append(draw)
        return draw

    # ------------------------------------------------------------------ after rewards
    def record(self, step: int, rows: Sequence[int], rewards: torch.Tensor, raw_rewards: torch.Tensor,
               group: torch.Tensor, completion_lengths: torch.Tensor) -> dict[str, float]:
        """File the step's generated groups, adapt the rates, count; the step's ``selective/*`` metrics.

        Args:
            step: the hook's step (OpenRLHF's global step before this one); must be the step the
                draws were decided for.
            rows: [M] the prompt index of each generated group, in rollout order.
            rewards: [N] float after OpenRLHF's length penalties (zero variance: what the advantage uses).
            raw_rewards: [N] float as the reward function returned them (easy: all >= 1).
            group: [N] int64 position of each sample's group in ``rows``.
            completion_lengths: [N] tokens generated per completion (the estimate's mean).
        """
        wrong = sorted({d.step for d in self.pending} - {step})
        if wrong:
            raise RuntimeError(f"selective rollout: the prompts of hook step {step} were drawn for step(s) {wrong}; "
                               "one generation call per step is required (leave --rollout.vllm_generate_batch_size "
                               "unset)")
        self.next_step = step
        self._open_step()
        out = self.file_groups(torch.as_tensor(list(rows), dtype=torch.int64), rewards.to(torch.float64), group,
                               easy_values=raw_rewards.to(torch.float64), completion_lengths=completion_lengths)
        self.pending, self._open = [], False
        self.next_step = step + 1
        return out

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict[str, Any]:
        """History (its event log), rates, running counters, and the data set's size and the step
        they belong to."""
        return {**super().state_dict(), "num_prompts": self.num_prompts, "step": self.next_step}

    def load_state_dict(self, state: dict[str, Any], *, step: int | None = None) -> None:
        """Restore ``state_dict()`` saved at OpenRLHF's global step ``step`` (the checkpoint's; None:
        the saved one)."""
        if not isinstance(state, dict):
            raise ValueError(f"selective rollout checkpoint state must be a dict, got {type(state).__name__}")
        saved_step = state.get("step")
        if step is not None and saved_step is not None and int(saved_step) != int(step):
            raise ValueError(f"selective rollout: the checkpoint of global step {step} holds the history of step "
                             f"{saved_step}; it was not saved by this run's hook")
        saved_n = state.get("num_prompts")
        if saved_n is not None and int(saved_n) != self.num_prompts:
            warnings.warn(f"cppo: the selective-rollout history was saved over a train data set of {saved_n} prompts, "
                          f"this run has {self.num_prompts}: prompt indices may name other prompts now (same "
                          "--data.prompt_dataset, --data.max_samples and --data.prompt_probs keep them)", stacklevel=2)
        super().load_state_dict({k: state[k] for k in ("history", "rates", "totals") if k in state})
        resumed = saved_step if step is None else step
        if resumed is None:
            raise ValueError("selective rollout: the checkpoint state has no step; pass load_state_dict(state, "
                             "step=OpenRLHF's global step)")
        self.next_step = int(resumed)
        self.pending, self._open = [], False


def state_of(generator: Any) -> OpenRLHFSelective:
    """The generator's ``OpenRLHFSelective``, created on first use from the installed config, its
    train data set and the step OpenRLHF resumes at."""
    if generator not in _STATES:
        if _CONFIG is None:
            raise RuntimeError("selective rollout is not installed in this process (selective.install(cfg))")
        _STATES[generator] = OpenRLHFSelective(_CONFIG, num_prompts=len(generator.prompts_dataloader.dataset),
                                               step=resumed_step(generator.args),
                                               group_size=int(generator.args.rollout.n_samples_per_prompt))
    return _STATES[generator]


# ---------------------------------------------------------------------------------- the hook's call
def record_step(samples: Sequence[Any], raw_rewards: torch.Tensor, rewards: torch.Tensor, group_ids: torch.Tensor,
                *, step: int) -> tuple[dict[str, float], dict] | None:
    """File the outcome of every generated group of one rollout (called by the CPPO hook before it
    prunes); returns (``selective/*`` metrics, the step's account for the audit) or None when the run
    has no selective rollout.

    Args:
        samples: the step's single-sample rollout Experiences, each tagged with ``INDEX_ATTR`` and
            ``DRAW_ATTR`` by the generator.
        raw_rewards: [N] float, rewards as the reward function returned them (easy: all >= 1).
        rewards: [N] float, after OpenRLHF's length penalties (what the advantage uses: zero variance).
        group_ids: [N] int64 the hook's groups (consecutive, one per generated prompt).
        step: the hook's step.
    """
    if not enabled():
        return None
    draws: dict[int, SelectiveDraw] = {}
    rows: list[int] = []
    for i, s in enumerate(samples):
        draw, row = getattr(s, DRAW_ATTR, None), getattr(s, INDEX_ATTR, None)
        if draw is None or row is None:
            raise ValueError(
                f"selective rollout is on but rollout sample {i} carries no prompt index: OpenRLHF's samples generator "
                "is not hooked in the trainer process (the hook installs it with the experience maker)"
            )
        draws.setdefault(id(draw), draw)
        rows.append(int(row))
    state = _state_of_draws(list(draws.values()))
    n = len(samples)
    gids = torch.as_tensor(group_ids, dtype=torch.int64)
    if raw_rewards.numel() != n or rewards.numel() != n or gids.numel() != n:
        raise ValueError(f"record_step: {n} samples, {raw_rewards.numel()} raw rewards, {rewards.numel()} rewards and "
                         f"{gids.numel()} group ids must match")
    group_rows: list[int] = []
    for g in torch.unique_consecutive(gids).tolist():
        members = (gids == g).nonzero().squeeze(1).tolist()
        its = {rows[j] for j in members}
        if len(its) != 1:
            raise ValueError(f"selective rollout, step {step}: group {g} mixes prompt indices {sorted(its)}")
        group_rows.append(its.pop())
    pos = torch.unique_consecutive(gids, return_inverse=True)[1]  # a group's position keys repeats apart
    lengths = torch.cat([torch.as_tensor(s.response_length).reshape(-1) for s in samples]).to(torch.float64)
    metrics = state.record(step, group_rows, rewards, raw_rewards, pos, lengths)
    _, zv, easy = state.last_filed
    account = {"step": step, "drawn": int(metrics["selective/prompts_drawn"]),
               "skipped": int(metrics["selective/prompts_skipped"]),
               "generated": int(metrics["selective/prompts_generated"]), "serials": sorted(d.serial for d in
                                                                                           draws.values()),
               "rows": group_rows, "zero_variance": zv.tolist(), "easy": easy.tolist(),
               "p_easy": state.rates.p_easy, "p_hard": state.rates.p_hard}
    for s in samples:  # recorded: the tags need not travel on to the model actors
        s.__dict__.pop(DRAW_ATTR, None)
        s.__dict__.pop(INDEX_ATTR, None)
    return metrics, account


def _state_of_draws(draws: list[SelectiveDraw]) -> OpenRLHFSelective:
    # by identity: a copied sample's draw belongs to no run (an error, not a silent second history)
    states = {id(s): s for s in _STATES.values() if any(d is p for d in draws for p in s.pending)}
    if len(states) != 1:
        raise RuntimeError(f"selective rollout: the rollout's draws belong to {len(states)} runs in this process; "
                           "expected one (a rollout recorded twice?)")
    return next(iter(states.values()))


# ---------------------------------------------------------------------------------- the seams
def _match_groups(draw: SelectiveDraw, experiences: list, group_size: int) -> None:
    """Tag each returned sample with its kept prompt's index: each request's G completions are
    consecutive (``samples_generator.py:163-165``); a run is matched to the first kept prompt with
    its prompt and label not matched yet (OpenRLHF returns them in completion order)."""
    waiting: dict[tuple[str, str], deque[int]] = {}
    for row, prompt, label in draw.kept:
        waiting.setdefault((prompt, repr(label)), deque()).append(row)
    i = 0
    while i < len(experiences):
        key = (experiences[i].prompts[0], repr((getattr(experiences[i], "labels", None) or [None])[0]))
        j = i
        while j < len(experiences) and j - i < group_size and (
                experiences[j].prompts[0], repr((experiences[j].labels or [None])[0])) == key:
            j += 1
        queue = waiting.get(key)
        if not queue:
            raise RuntimeError(f"selective rollout: OpenRLHF returned a group for prompt {key[0][:60]!r} that was not "
                               "kept by this call's draw")
        row = queue.popleft()
        for exp in experiences[i:j]:
            setattr(exp, INDEX_ATTR, row)
            setattr(exp, DRAW_ATTR, draw)
        i = j
    left = [r for q in waiting.values() for r in q]
    if left:
        raise RuntimeError(f"selective rollout: kept prompts {left} came back without a group")


def _wrap_generate(original):
    @functools.wraps(original)
    def _generate_vllm(self, dataloader_iter, num_prompts, dynamic_filtering, **generate_kwargs):
        # evaluation draws from its own iterator; only the train dataloader's prompts are decided
        if not enabled() or dataloader_iter is None or dataloader_iter is not getattr(self, "_dataloader_iter", None):
            return original(self, dataloader_iter, num_prompts, dynamic_filtering, **generate_kwargs)
        check_args(self.args)
        state = state_of(self)
        draw = state.begin_call()
        experiences, consumed, exhausted = original(self, _KeptPrompts(state, dataloader_iter, draw), num_prompts,
                                                    dynamic_filtering, **generate_kwargs)
        group_size = int(generate_kwargs.get("n_samples_per_prompt", self.args.rollout.n_samples_per_prompt))
        _match_groups(draw, experiences, group_size)
        if observers.HUB.recording():
            observers.HUB.record("selective", role="generator", **draw.to_record())
        skipped = len(draw.skipped)
        logger.info("selective rollout, step %d: %d prompts drawn, %d skipped, %d generated", draw.step,
                    len(draw.drawn), skipped, len(draw.kept))
        # OpenRLHF counts the prompts it consumed from the dataloader: the skipped ones too
        return experiences, consumed + skipped, exhausted

    return _generate_vllm


def _wrap_generator_init(original):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if not enabled():
            return
        loader = getattr(self, "prompts_dataloader", None)
        dataset = getattr(loader, "dataset", None)
        if dataset is not None:
            _TRAIN_DATASETS.add(dataset)
        if loader is not None:
            _TRAIN_LOADERS[loader] = self

    return __init__


def _wrap_getitem(original):
    @functools.wraps(original)
    def __getitem__(self, idx):
        item = original(self, idx)
        if self not in _TRAIN_DATASETS:
            return item
        source, *rest = item
        return (IndexedSource(source, int(idx)), *rest)

    return __getitem__


def _wrap_loader_state(original):
    @functools.wraps(original)
    def state_dict(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        generator = _TRAIN_LOADERS.get(self) if enabled() else None
        if generator is not None and generator in _STATES and isinstance(out, dict):
            out = {**out, STATE_KEY: _STATES[generator].state_dict()}
        return out

    return state_dict


def _wrap_loader_load(original):
    @functools.wraps(original)
    def load_state_dict(self, state_dict, *args, **kwargs):
        generator = _TRAIN_LOADERS.get(self) if enabled() else None
        if isinstance(state_dict, dict) and STATE_KEY in state_dict:
            saved = state_dict[STATE_KEY]
            state_dict = {k: v for k, v in state_dict.items() if k != STATE_KEY}
        else:
            saved = None
        out = original(self, state_dict, *args, **kwargs)
        if generator is not None:
            # OpenRLHF restores the dataloader exactly when it resumes (PPOTrainer.fit, ppo_trainer.py:514-518)
            state = state_of(generator)
            step = resumed_step(generator.args)
            if saved is None:
                warnings.warn(f"cppo: the checkpoint of global step {step} has no selective-rollout state "
                              f"({STATE_KEY} in its data_loader_state_dict); resuming with an empty history and "
                              "the initial rates", stacklevel=2)
                state.next_step = step
            else:
                state.load_state_dict(saved, step=step)
                logger.info("selective rollout: resumed at step %d with the history of %d prompts", step,
                            state.history.num_prompts)
        return out

    return load_state_dict


# Each patch is called by ``after_import`` when its module has been imported, or at once when it is
# in ``sys.modules`` already, which can be while it is still executing (the hook installs with the
# experience maker, imported from inside other modules' imports): a class not defined yet is left
# alone, and its module's own callback wraps it when the import ends.
def _patch_dataset(module) -> None:
    cls = getattr(module, "PromptDataset", None)
    if cls is not None:
        wrap(cls, "__getitem__", _wrap_getitem, tag=WRAP_TAG)


def _patch_generator(module) -> None:
    cls = getattr(module, "SamplesGenerator", None)
    if cls is not None:
        wrap(cls, "__init__", _wrap_generator_init, tag=WRAP_TAG)
        wrap(cls, "_generate_vllm", _wrap_generate, tag=WRAP_TAG)


def _patch_loader(module) -> None:
    cls = getattr(module, "StatefulDataLoader", None)
    if cls is not None:
        wrap(cls, "state_dict", _wrap_loader_state, tag=WRAP_TAG)
        wrap(cls, "load_state_dict", _wrap_loader_load, tag=WRAP_TAG)


_PATCHES = ((DATASET_MODULE, _patch_dataset), (GENERATOR_MODULE, _patch_generator), (LOADER_MODULE, _patch_loader))


def install(cfg: CPPOConfig) -> bool:
    """Selective rollout in this process when ``cfg.selective.enabled`` (the seams are wrapped as
    their modules are imported; idempotent); otherwise removes it. Returns whether it is on."""
    global _CONFIG
    if not isinstance(cfg, CPPOConfig):
        raise ValueError(f"selective.install expects a CPPOConfig, got {type(cfg).__name__}")
    if not cfg.selective.enabled:
        uninstall()
        return False
    _CONFIG = cfg
    for module, patch in _PATCHES:
        after_import(module, patch)
    return True


_SEAMS = {DATASET_MODULE: ("PromptDataset", ("__getitem__",)),
          GENERATOR_MODULE: ("SamplesGenerator", ("__init__", "_generate_vllm")),
          LOADER_MODULE: ("StatefulDataLoader", ("state_dict", "load_state_dict"))}


def uninstall() -> None:
    """Remove the wrappers and forget the config (tests; a run without selective rollout)."""
    global _CONFIG
    _CONFIG = None
    for module_name, patch in _PATCHES:
        remove(patch)
        cls_name, methods = _SEAMS[module_name]
        cls = getattr(sys.modules.get(module_name), cls_name, None)
        for name in methods if cls is not None else ():
            unwrap(cls, name, tag=WRAP_TAG)
