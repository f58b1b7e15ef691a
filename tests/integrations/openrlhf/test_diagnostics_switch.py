"""Diagnostics are installed only when asked for: a fresh process of an OpenRLHF run (the worker
setup hook every Ray worker runs, or the patched source's ``install_from_env``) gets the hook and
the features' seams; the audit only under ``CPPO_OPENRLHF_AUDIT``. The seam hands its decision to
the subscribed observers once per step; the audit's ``prune`` record is built from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from cppo_megatron import CPPOConfig
from cppo_megatron.core import prune
from cppo_megatron.integrations.openrlhf import diagnostics, hook, observers

pytestmark = pytest.mark.openrlhf

PROBE = """
import json, sys
from cppo_megatron.integrations import importhook
from cppo_megatron.integrations.openrlhf import hook, observers, worker



class RemoteExperienceMaker:  # a stand-in for OpenRLHF's class, which the patched source hooks
    def make_experience_batch(self, rollout_samples):
        return rollout_samples

    def compute_advantages_and_returns(self, experiences):
        return experiences


if sys.argv[1] == "worker":
    # every Ray worker of a run the launcher starts; a model actor never imports the experience
    # maker, yet its audit records the rows it trains on
    worker.setup()
    hooked = None
else:
    hooked = hook.install_from_env(RemoteExperienceMaker) and hook.is_installed(RemoteExperienceMaker)
print(json.dumps({
    "hooked": hooked,
    "callbacks": sorted({fn.__module__.rsplit(".", 1)[1] + "." + fn.__qualname__
                         for fns in importhook._AFTER.values() for fn in fns}),
    "diagnostics": sorted(m.rsplit(".", 1)[1] for m in sys.modules
                          if m.startswith("cppo_megatron.integrations.openrlhf.diagnostics.")),
    "observers": observers.HUB.subscribed(),
}))
"""
# what a CPPO run installs in every process: OpenRLHF's experience maker and samples generator on import
GPU_PATH = ["filtering.install_generator", "hook._install_on_import"]
AUDIT = "cppo_megatron.integrations.openrlhf.diagnostics.audit"
AUDITED = {"callbacks": ["audit._patch_actor", "audit._patch_strategy", "filtering.install_generator"],
           "diagnostics": ["audit"], "observers": {"prune": [f"{AUDIT}.prune_record"], "record": [f"{AUDIT}.record"]}}


def probe(tmp_path, entry: str, **switches: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in diagnostics.SWITCHES and not k.startswith("CPPO_OPENRLHF")}
    env["CPPO_OPENRLHF_CONFIG"] = json.dumps({"pruning_rate": 0.5})
    env.update({k: str(tmp_path / v) for k, v in switches.items()})
    out = subprocess.run([sys.executable, "-c", PROBE, entry], capture_output=True, text=True, env=env, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


NONE = {"diagnostics": [], "observers": {"prune": [], "record": []}}


def test_a_default_process_imports_and_installs_no_diagnostic(tmp_path):
    assert probe(tmp_path, "worker") == {"hooked": None, "callbacks": GPU_PATH, **NONE}
    assert probe(tmp_path, "patched") == {"hooked": True, "callbacks": ["filtering.install_generator"], **NONE}


def test_the_audit_switch_installs_the_audit_in_a_worker(tmp_path):
    got = probe(tmp_path, "worker", CPPO_OPENRLHF_AUDIT="audit")
    assert got == {"hooked": None, **AUDITED, "callbacks": sorted(AUDITED["callbacks"] + ["hook._install_on_import"])}


def test_the_patched_source_installs_the_audit_with_the_hook(tmp_path):
    # no worker setup hook: the hook's install_from_env installs what the switch asks
    assert probe(tmp_path, "patched", CPPO_OPENRLHF_AUDIT="audit") == {"hooked": True, **AUDITED}


def test_requested_names_the_switch_when_set(monkeypatch):
    monkeypatch.delenv(diagnostics.AUDIT_ENV, raising=False)
    assert diagnostics.requested() == [] and diagnostics.install() == []
    monkeypatch.setenv(diagnostics.AUDIT_ENV, "")  # empty: off, as the audit reads it
    assert diagnostics.requested() == []
    monkeypatch.setenv(diagnostics.AUDIT_ENV, "/x")
    assert diagnostics.requested() == [diagnostics.AUDIT_ENV]


GROUPS = [("p0", [1, 0, 0, 0]), ("p1", [1, 1, 0, 1]), ("p2", [0, 0, 0, 0]), ("p3", [0.5, 1, 0, 0.25])]
GROUP_IDS = torch.tensor([g for g, (_, r) in enumerate(GROUPS) for _ in r])
REWARDS = torch.tensor([float(x) for _, r in GROUPS for x in r])


def _prune(make_args, make_maker, make_rollout, train_batch: int = 1):
    args = make_args("--algo.advantage.estimator", "group_norm", "--rollout.n_samples_per_prompt", "4",
                     "--rollout.micro_batch_size", "1", "--train.batch_size", str(train_batch))
    samples = make_rollout(GROUPS)
    cfg = CPPOConfig(pruning_rate=0.5, eps=1e-9)
    survivors = hook.prune_rollout_samples(make_maker(args), samples, cfg)
    return samples, survivors, prune(REWARDS, GROUP_IDS, cfg, step=0).selection.kept.tolist()


def test_the_seam_hands_its_decision_to_each_subscriber_once(make_args, make_maker, make_rollout):
    seen: list[observers.PruneDecision] = []
    observers.HUB.on_prune(seen.append)
    try:
        samples, survivors, kept = _prune(make_args, make_maker, make_rollout)
    finally:
        observers.HUB.remove(seen.append)
    (d,) = seen
    assert d.step == 0 and d.samples is not None and len(d.samples) == len(samples) == 16
    assert torch.equal(d.rewards, REWARDS) and torch.equal(d.group_ids, GROUP_IDS)
    # k = 2 of G = 4 by |advantage|: 0 (+1.5), 6 (-1.5), 13 (+1.32), 14 (-1.02); 2, 5, 9, 10 win seeded ties
    assert d.result.selection.kept.tolist() == kept == [0, 2, 5, 6, 9, 10, 13, 14]
    # the survivors in the order passed on (no rebalancing with one actor: ascending)
    assert d.survivors == [int(s.info["uid"]) for s in survivors] == kept
    assert (d.account, d.ledgers, d.selective) == (None, [], None)  # no filter, no selective rollout
    assert all("cppo_row" not in s.info for s in samples)  # a default run adds no audit row ids


def test_the_audit_records_the_decision_and_tags_the_rows(make_args, make_maker, make_rollout, audit_on, tmp_path):
    from cppo_megatron.integrations.openrlhf.diagnostics import audit

    audit_on(tmp_path)
    # train.batch_size 3: OpenRLHF needs a multiple of 3, so the core's 8 are topped up to 9 (the next
    # in the core's order, row 4: a seeded tie in p1); selected stays the core's choice
    samples, survivors, kept = _prune(make_args, make_maker, make_rollout, train_batch=3)
    passed_on = [int(s.info["uid"]) for s in survivors]
    assert passed_on == [0, 2, 4, 5, 6, 9, 10, 13, 14] and kept == [0, 2, 5, 6, 9, 10, 13, 14]
    (rec,) = audit.read(tmp_path, "prune")
    assert {k: rec[k] for k in ("step", "rows", "group_ids", "selected", "survivors", "account", "ledgers",
                                "selective")} == {
        "step": 0, "rows": list(range(16)), "group_ids": GROUP_IDS.tolist(), "selected": kept,
        "survivors": passed_on, "account": None, "ledgers": [], "selective": None}
    assert rec["prompts"] == [p for p, r in GROUPS for _ in r] and rec["rewards"] == REWARDS.tolist()
    assert [float(s.info["cppo_row"]) for s in survivors] == [float(i) for i in passed_on]
