"""Supervised warm-up: a from-scratch model first learns the answer format (and some
answers) from the task's targets, so RL starts from non-zero reward."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import torch

from ..tasks import Task


def sft_warmup(model, tok, task: Task, cfg, *, device, seed: int, prompt_template: str,
               evaluate_fn: Callable[[int], dict], log_fn: Callable[[dict], None], progress: bool = True,
               max_time_s: float = 0.0, clock: Callable[[], float] = time.perf_counter) -> dict:
    """Train on prompt + target + EOS (loss on the target tokens only) until held-out
    accuracy reaches ``cfg.target_accuracy``, ``cfg.max_steps``, or ``max_time_s`` on
    ``clock`` (the study's supervised control uses that). Returns the last eval."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    model.train()
    t0 = time.perf_counter()
    last = evaluate_fn(cfg.eval_problems)
    c0 = clock()
    log_fn({"warmup/step": 0.0, **{k.replace("eval/", "warmup/"): v for k, v in last.items()}})
    bar = _bar(cfg.max_steps, progress)
    done = 0
    for step in range(1, cfg.max_steps + 1):
        if last["eval/accuracy"] >= cfg.target_accuracy or (max_time_s and clock() - c0 >= max_time_s):
            break
        done = step
        batch = [task.train[rng.randrange(len(task.train))] for _ in range(cfg.batch_size)]
        seqs, starts = [], []
        for p in batch:
            prompt = tok.prompt_ids(prompt_template.format(question=p.question))
            target = tok.encode(task.sft_target(p)) + [tok.eos_id]
            seqs.append(prompt + target)
            starts.append(len(prompt))
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), tok.pad_id, dtype=torch.long)
        labels = torch.full_like(ids, -100)
        attn = torch.zeros_like(ids)
        for i, (s, st) in enumerate(zip(seqs, starts, strict=True)):
            ids[i, : len(s)] = torch.tensor(s)
            attn[i, : len(s)] = 1
            labels[i, st : len(s)] = ids[i, st : len(s)]
        out = model(input_ids=ids.to(device), attention_mask=attn.to(device), labels=labels.to(device))
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{out.loss.item():.3f}", acc=f"{last['eval/accuracy']:.2f}")
        if step % cfg.eval_every == 0:
            last = evaluate_fn(cfg.eval_problems)
            model.train()
            log_fn({"warmup/step": float(step), "warmup/loss": out.loss.item(), "warmup/time": time.perf_counter() - t0,
                    **{k.replace("eval/", "warmup/"): v for k, v in last.items()}})
    if bar is not None:
        bar.close()
    last = dict(last)
    last["warmup/seconds"] = time.perf_counter() - t0
    last["warmup/steps"] = float(done)
    return last


def _bar(total: int, enabled: bool):
    if not enabled:
        return None
    from ..progress import progress

    return progress(total, "warm-up (SFT)", leave=False)
