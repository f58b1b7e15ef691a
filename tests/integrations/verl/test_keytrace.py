"""The key trace (``CPPO_VERL_KEYS``) and the report built from it (``keyreport``).

The trace patches OmegaConf and veRL's config dataclasses process-wide, so it runs in a fresh
interpreter here, as in a veRL process: the real 14B Megatron recipe composed by hydra, its
actor section converted by veRL's own ``omega_conf_to_dataclass`` (as imported by
``engine_workers``), read from a file whose lines the test knows."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from cppo_megatron.integrations.verl.diagnostics import keyreport, keytrace

from .conftest import RECIPES, ROOT

READER = textwrap.dedent('''\
    import copy, pickle
    from omegaconf import OmegaConf
    import cppo_megatron.integrations.verl  # noqa: F401  (installs the trace: CPPO_VERL_KEYS is set)
    import verl.workers.engine_workers as ew
    from tests.integrations.verl.conftest import RECIPES, compose

    cfg = compose(RECIPES, "qwen2.5-14b-math-megatron-cppo")


    def read():
        arr = cfg.actor_rollout_ref
        n = arr.rollout.n
        n = arr.rollout.n
        actor = ew.omega_conf_to_dataclass(arr.actor)
        pp = actor.engine.pipeline_model_parallel_size
        again = pickle.loads(pickle.dumps(copy.deepcopy(actor)))
        lr = again.optim.lr
        ray_init = OmegaConf.to_container(cfg.ray_kwargs.ray_init)
        everything = OmegaConf.to_container(cfg)
        epochs = cfg.actor_rollout_ref.actor.get("ppo_epochs")
        return n, pp, lr, ray_init, everything, epochs


    read()
''')


def _run(tmp_path, env_on: bool):
    (tmp_path / "reader.py").write_text(READER)
    env = {"PYTHONPATH": f"{ROOT}:{tmp_path}", "PATH": "/usr/bin:/bin", "RAY_AUTH_MODE": "disabled"}
    if env_on:
        env[keytrace.ENV] = str(tmp_path / "keys")
    code = ("import reader, sys\nfrom omegaconf import DictConfig\n"
            "from cppo_megatron.integrations.wrap import is_wrapped\n"
            f"print(is_wrapped(DictConfig.__dict__['__getattr__'], {keytrace.WRAP_TAG!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1] == "True"


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("keytrace")
    assert _run(tmp, env_on=True)
    return {(r["key"], r["site"].rsplit("/", 1)[-1], r["how"]): r for r in keytrace.read(tmp / "keys")}


def _line(text: str) -> int:
    return READER.splitlines().index(text) + 1


def test_leaf_reads_are_recorded_once_per_site_with_their_value(traced):
    site = f"reader.py:{_line('    n = arr.rollout.n')}"
    rec = traced[("actor_rollout_ref.rollout.n", site, "config")]
    assert rec["value"] == "16" and rec["pid"] > 0
    second = f"reader.py:{_line('    n = arr.rollout.n') + 1}"
    assert ("actor_rollout_ref.rollout.n", second, "config") in traced  # a second line is a second site
    assert sum(1 for k in traced if k[0] == "actor_rollout_ref.rollout.n") == 2  # each line once
    epochs_line = '    epochs = cfg.actor_rollout_ref.actor.get("ppo_epochs")'
    get = f"reader.py:{_line(epochs_line)}"
    assert traced[("actor_rollout_ref.actor.ppo_epochs", get, "config")]["value"] == "2"


def test_containers_and_conversions_are_not_reads_of_every_key(traced):
    keys = {k[0] for k in traced}
    assert "actor_rollout_ref" not in keys and "actor_rollout_ref.actor" not in keys
    # omega_conf_to_dataclass read every actor key to build the dataclass; only what was read after counts
    actor_keys = {k for k in keys if k.startswith("actor_rollout_ref.actor.")}
    assert actor_keys == {"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size",
                          "actor_rollout_ref.actor.optim.lr", "actor_rollout_ref.actor.ppo_epochs"}


def test_dataclass_fields_are_recorded_under_the_config_key_they_came_from(traced):
    pp = f"reader.py:{_line('    pp = actor.engine.pipeline_model_parallel_size')}"
    rec = traced[("actor_rollout_ref.actor.megatron.pipeline_model_parallel_size", pp, "dataclass")]
    assert rec["value"] == "2"  # the 14B recipe's PP, through McoreActorConfig.engine (= its megatron)
    lr = f"reader.py:{_line('    lr = again.optim.lr')}"
    assert traced[("actor_rollout_ref.actor.optim.lr", lr, "dataclass")]["value"] == "1e-06"  # deepcopy + pickle


def test_mappings_handed_on_whole_but_not_the_whole_tree(traced):
    site = f"reader.py:{_line('    ray_init = OmegaConf.to_container(cfg.ray_kwargs.ray_init)')}"
    assert ("ray_kwargs.ray_init", site, "whole") in traced
    everything = f"reader.py:{_line('    everything = OmegaConf.to_container(cfg)')}"
    assert not [k for k in traced if k[1] == everything]


def test_nothing_is_installed_without_the_variable(tmp_path):
    assert _run(tmp_path, env_on=False) is False
    assert not (tmp_path / "keys").exists()


def _trace(tmp_path, records):
    d = tmp_path / "trace"
    d.mkdir()
    (d / "keys-1.jsonl").write_text("".join(json.dumps({"pid": 1, **r}) + "\n" for r in records))
    return d


def test_report_rows(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("hydra:\n  searchpath: []\ndefaults: [x]\ncppo:\n  pruning_rate: 0.875\n"
                      "data:\n  train_batch_size: 32\n  max_response_length: 2048\n"
                      "trainer:\n  nnodes: 2\n  logger: [console]\n"
                      "actor_rollout_ref:\n  rollout:\n    gpu_memory_utilization: 0.5\n    n: 16\n"
                      "ray_kwargs:\n  ray_init:\n    num_cpus: 8\n")
    toy = tmp_path / "toy.yaml"
    toy.write_text("description: d\ndata:\n  train_batch_size: 4\n")
    w = "ray::WorkerDict.init_model"
    trace = _trace(tmp_path, [
        {"key": "data.train_batch_size", "value": "32", "site": "verl/trainer/main_ppo.py:177", "how": "config",
         "process": "python"},
        {"key": "actor_rollout_ref.rollout.response_length", "value": "6", "site": "verl/a.py:3", "how": "dataclass",
         "process": w},
        {"key": "actor_rollout_ref.rollout.n", "value": "16", "site": "verl/b.py:9", "how": "config", "process": w},
        {"key": "actor_rollout_ref.rollout.n", "value": "16", "site": "verl/b.py:10", "how": "config", "process": w},
        {"key": "trainer.logger", "value": "['console']", "site": "verl/c.py:1", "how": "config",
         "process": "ray::TaskRunner.run"},
        {"key": "ray_kwargs.ray_init", "value": "'<mapping>'", "site": "verl/trainer/main_ppo.py:72", "how": "whole",
         "process": "python"},
        {"key": "cppo.pruning_rate", "value": "0.875", "site": "cppo_megatron/x.py:5", "how": "config",
         "process": "python"},
        {"key": "trainer.nnodes", "value": "2", "site": "cppo_megatron/y.py:1", "how": "config", "process": "python"},
    ])
    aliases = {"data.max_response_length": ["actor_rollout_ref.rollout.response_length"]}
    rows = {r.key: r for r in keyreport.key_rows(recipe, toy, trace, aliases)}
    assert set(rows) == {"cppo.pruning_rate", "data.train_batch_size", "data.max_response_length", "trainer.nnodes",
                         "trainer.logger", "actor_rollout_ref.rollout.gpu_memory_utilization",
                         "actor_rollout_ref.rollout.n", "ray_kwargs.ray_init.num_cpus"}
    assert rows["data.train_batch_size"].status == "overridden" and rows["data.train_batch_size"].override == 4
    r = rows["actor_rollout_ref.rollout.n"]
    assert r.status == "read by veRL" and r.verl_sites == ["verl/b.py:9", "verl/b.py:10"] and r.processes == ["worker"]
    assert rows["data.max_response_length"].verl_sites == [
        "verl/a.py:3 (as actor_rollout_ref.rollout.response_length)"]  # through its interpolation
    assert rows["ray_kwargs.ray_init.num_cpus"].verl_sites == ["verl/trainer/main_ppo.py:72"]  # the mapping, whole
    assert rows["ray_kwargs.ray_init.num_cpus"].processes == ["driver"]
    assert rows["cppo.pruning_rate"].status == rows["trainer.nnodes"].status == "read by cppo-megatron"
    assert rows["actor_rollout_ref.rollout.gpu_memory_utilization"].status == "not read"
    table = keyreport.markdown(list(rows.values()))
    assert ("8 keys in the recipe: 1 replaced by the override file; of the 7 run as written, 4 read by veRL, "
            "2 by cppo-megatron only, 1 by nobody: actor_rollout_ref.rollout.gpu_memory_utilization.") in table
    assert "| `data.train_batch_size` | 32 | **4** |" in table


def test_report_follows_the_real_configs_interpolations():
    cfg = keyreport.composed_config(RECIPES / "qwen2.5-7b-math-megatron-cppo.yaml", RECIPES / "cpu_toy.yaml")
    aliases = keyreport.interpolation_aliases(cfg)
    assert "actor_rollout_ref.rollout.response_length" in aliases["data.max_response_length"]
    assert "ray_kwargs.ray_init.num_gpus" in aliases["trainer.n_gpus_per_node"]
    assert "actor_rollout_ref.ref.megatron.vanilla_mbridge" in aliases["actor_rollout_ref.actor.megatron.vanilla_mbridge"]
