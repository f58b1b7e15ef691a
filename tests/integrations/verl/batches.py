"""Real veRL batches for the tests: a DataProto (legacy loop) of B prompts x G completions
with rewards on the last response token, as veRL's reward loop leaves them (``rm_scores``)."""

from __future__ import annotations

import numpy as np
import torch

PROMPT_LEN = 6
RESPONSE_LEN = 10


def rewards_table(seed: int, prompts: int, group: int) -> torch.Tensor:
    """[B, G] 0/1 rewards plus a 0.1 format bonus; one all-zero group (no signal)."""
    g = torch.Generator().manual_seed(seed)
    r = (torch.rand(prompts, group, generator=g) < 0.4).float() + 0.1 * (torch.rand(prompts, group, generator=g) < 0.5)
    r[0] = 0.0
    return r


def make_dataproto(rewards: torch.Tensor, seed: int = 0):
    """DataProto with prompts/responses/input_ids/attention_mask/position_ids/response_mask,
    rm_scores [N, T], uid ("p<b>"), prompt_text and row_id (the original row) per completion."""
    from tensordict import TensorDict
    from verl.protocol import DataProto

    b, g = rewards.shape
    n = b * g
    gen = torch.Generator().manual_seed(seed)
    prompt_len = torch.randint(2, PROMPT_LEN + 1, (b,), generator=gen).repeat_interleave(g)
    resp_len = torch.randint(2, RESPONSE_LEN + 1, (n,), generator=gen)
    pos_p = torch.arange(PROMPT_LEN)
    pos_r = torch.arange(RESPONSE_LEN)
    prompt_mask = (pos_p.unsqueeze(0) >= PROMPT_LEN - prompt_len.unsqueeze(1)).long()  # left padded
    response_mask = (pos_r.unsqueeze(0) < resp_len.unsqueeze(1)).long()
    prompts = torch.randint(3, 100, (b, PROMPT_LEN), generator=gen).repeat_interleave(g, 0) * prompt_mask
    responses = torch.randint(3, 100, (n, RESPONSE_LEN), generator=gen) * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    rm_scores = torch.zeros(n, RESPONSE_LEN)
    rm_scores[torch.arange(n), resp_len - 1] = rewards.reshape(-1)
    batch = TensorDict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp_min(0),
            "response_mask": response_mask,
            "rm_scores": rm_scores,
            "row_id": torch.arange(n),
        },
        batch_size=(n,),
    )
    uid = np.array([f"p{i // g}" for i in range(n)], dtype=object)
    text = np.array([f"question {i // g}" for i in range(n)], dtype=object)
    return DataProto(batch=batch, non_tensor_batch={"uid": uid, "prompt_text": text})
