"""What the OpenRLHF integration relies on in the pinned OpenRLHF release, read from source.

Nothing here imports OpenRLHF's modules (they pull deepspeed, flash-attn and vLLM): the
installed files are located with ``importlib.util.find_spec`` and parsed with ``ast``.

- ``SEAMS``: the functions the hook wraps or depends on, with a hash of their source in
  the pinned version. ``check_drift()`` recomputes them: a changed hash means OpenRLHF
  moved under the hook and the integration must be re-checked before the pin is raised.
- ``pinned_parser()``: the real ``argparse`` parser of ``openrlhf.cli.train_ppo_ray``
  (built inside its ``__main__`` block, so it is rebuilt from that block's statements).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import importlib.metadata as md
import importlib.util
import textwrap
from pathlib import Path

from ..._optional import MissingDependency

PINNED_VERSION = "0.11.2"

# (file inside the openrlhf package, dotted name inside the file) -> sha256[:16] of its source
SEAMS: dict[tuple[str, str], str] = {
    # the hook wraps these two; the advantage step is run with the arguments it reads
    ("trainer/ppo_utils/experience_maker.py", "RemoteExperienceMaker.make_experience_batch"): "c1c7f9794384589f",
    ("trainer/ppo_utils/experience_maker.py",
     "RemoteExperienceMaker.compute_advantages_and_returns"): "7f5f69b8647e91f7",
    # micro-batching of the survivors and the "enough samples for every actor" condition
    ("trainer/ppo_utils/experience_maker.py", "RemoteExperienceMaker.split_rollout_samples"): "4666b971b926e2cb",
    ("trainer/ray/launcher.py", "RayActorGroup.async_run_method_batch"): "8bbc7ba8d7f7ecd9",
    # length penalties, applied by the hook to the full rollout before the group statistics
    ("trainer/ppo_utils/length_penalty.py", "apply_length_penalties"): "d5d6d7ff6bbd34c1",
    # the rollout samples' fields (prompts, labels, rewards, info) and how they are merged
    ("trainer/ppo_utils/experience.py", "Experience"): "91f90b8a8ccaf342",
    # both trainers reach the seam through this one method (the async TrainingActor inherits it)
    ("trainer/ppo_trainer.py", "BasePPOTrainer.train_step"): "7fbb0b95ea71cec0",
    # resume (checkpoint.py): where the step, weights, optimizer and dataloader are saved and
    # restored, the checkpoint tags the hook's step comes from, and the prompt draw it continues
    ("trainer/ppo_trainer.py", "PPOTrainer.fit"): "6f5590a9c7bb071c",
    ("trainer/ppo_trainer.py", "BasePPOTrainer.init_checkpoint_states"): "b4c60c2f04bf3a07",
    ("trainer/ppo_trainer.py", "BasePPOTrainer.save_logs_and_checkpoints"): "77eefda69d3bc952",
    ("trainer/ray/ppo_actor.py", "PolicyModelActor.init_model_from_pretrained"): "10d388c5a29aa03f",
    ("trainer/ray/ppo_actor.py", "PolicyModelActor.save_checkpoint"): "12645c42bd350818",
    ("utils/deepspeed/deepspeed.py", "DeepspeedStrategy.save_ckpt"): "9c0b2afbf86b7111",
    ("utils/deepspeed/deepspeed.py", "DeepspeedStrategy.load_ckpt"): "4e88305c12e0adde",
    ("utils/deepspeed/deepspeed.py", "DeepspeedStrategy.setup_dataloader"): "786cdca220c6c8b5",
    ("trainer/ppo_utils/samples_generator.py", "SamplesGenerator.generate_samples"): "3d524afe664ef9f1",
    # DAPO's filter (filtering.py): the loop that drops and refills groups, the per-completion
    # step it wraps to see the dropped ones, and the dataloader draw it counts (batch size 1)
    ("trainer/ppo_utils/samples_generator.py", "SamplesGenerator._generate_vllm"): "906d7c8a7369b6be",
    ("trainer/ppo_utils/samples_generator.py",
     "SamplesGenerator._process_response_into_experience"): "ccbffe0f5e3c5d25",
    ("trainer/ppo_utils/samples_generator.py", "_collect_prompt_batch"): "df02f677c3805745",
    # selective rollout (selective.py): the train PromptDataset's item access (the row index rides on
    # its datasource), its one-prompt batches, the generator that names the train data set, and the
    # draw in _generate_vllm / _collect_prompt_batch above; the checkpoint rides on
    # save_logs_and_checkpoints / init_checkpoint_states above
    ("datasets/prompts_dataset.py", "PromptDataset.__getitem__"): "e040191a679e8c60",
    ("datasets/prompts_dataset.py", "PromptDataset.collate_fn"): "e0b652b353e5f100",
    ("trainer/ppo_trainer.py", "prepare_datasets"): "55832fcd023e6916",
    ("trainer/ppo_utils/samples_generator.py", "SamplesGenerator.__init__"): "9165efcf7c1099ff",
}


def openrlhf_dir() -> Path:
    """The installed ``openrlhf`` package directory (imports only its empty ``__init__``)."""
    spec = importlib.util.find_spec("openrlhf")
    if spec is None or not spec.submodule_search_locations:
        raise MissingDependency(
            "OpenRLHF is not installed. GPU machine: pip install 'cppo-megatron[openrlhf]'; "
            f"CPU (tests, dry runs): pip install --no-deps -c constraints/cpu.txt openrlhf=={PINNED_VERSION}"
        )
    return Path(list(spec.submodule_search_locations)[0])


def installed_version() -> str | None:
    try:
        return md.version("openrlhf")
    except md.PackageNotFoundError:
        return None


def source_of(relpath: str, dotted: str, root: Path | None = None) -> str:
    """Source text of a class or function (``Class.method`` allowed) in an OpenRLHF file."""
    path = (root or openrlhf_dir()) / relpath
    text = path.read_text()
    node: ast.AST = ast.parse(text)
    for part in dotted.split("."):
        found = None
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and child.name == part:
                found = child
                break
        if found is None:
            raise LookupError(f"{dotted} not found in {path} (OpenRLHF {installed_version()})")
        node = found
    return textwrap.dedent(ast.get_source_segment(text, node, padded=True) or "")


def source_hash(relpath: str, dotted: str, root: Path | None = None) -> str:
    return hashlib.sha256(source_of(relpath, dotted, root).encode()).hexdigest()[:16]


def check_drift(root: Path | None = None) -> list[str]:
    """One line per seam whose source differs from the pinned version (empty: no drift)."""
    problems = []
    for (relpath, dotted), want in SEAMS.items():
        try:
            got = source_hash(relpath, dotted, root)
        except (LookupError, OSError) as exc:
            problems.append(f"{relpath}:{dotted}: {exc}")
            continue
        if got != want:
            problems.append(
                f"{relpath}:{dotted}: source hash {got} differs from OpenRLHF {PINNED_VERSION}'s {want}"
            )
    return problems


def pinned_parser(root: Path | None = None) -> argparse.ArgumentParser:
    """The argument parser of ``openrlhf.cli.train_ppo_ray``, rebuilt from its ``__main__`` block.

    Runs the block's statements up to ``args = parser.parse_args()`` (they only call
    ``argparse``), so flags, types, defaults and choices are OpenRLHF's own.
    """
    path = (root or openrlhf_dir()) / "cli" / "train_ppo_ray.py"
    tree = ast.parse(path.read_text(), filename=str(path))
    mains = [
        n
        for n in tree.body
        if isinstance(n, ast.If) and "__main__" in ast.dump(n.test) and "__name__" in ast.dump(n.test)
    ]
    if not mains:
        raise LookupError(f"no `if __name__ == '__main__'` block in {path}")
    # the stdlib imports the block may use
    body: list[ast.stmt] = [n for n in tree.body
                            if isinstance(n, ast.Import) and all(a.name in ("argparse", "os") for a in n.names)]
    body += [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "datetime"]
    for stmt in mains[-1].body:
        if isinstance(stmt, ast.Assign) and "parse_args" in ast.dump(stmt.value):
            break
        body.append(stmt)
    namespace: dict = {"__name__": "openrlhf_train_ppo_ray_parser"}
    exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)  # noqa: S102
    parser = namespace.get("parser")
    if not isinstance(parser, argparse.ArgumentParser):
        raise LookupError(f"the __main__ block of {path} did not build `parser`")
    parser.prog = "openrlhf.cli.train_ppo_ray"
    return parser


def known_flags(parser: argparse.ArgumentParser | None = None) -> set[str]:
    parser = parser or pinned_parser()
    return {opt for action in parser._actions for opt in action.option_strings}
