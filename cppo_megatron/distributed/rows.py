"""Moving rows between the ranks of a process group, point to point (gloo and NCCL).

``exchange_rows`` sends each rank's chosen rows to their destinations in two batched
rounds (the lengths of ragged rows, then one byte buffer per peer) and returns the rows
this rank receives, ordered by source rank. Fields: a dict name -> value, where a value
is either a tensor ``[n, ...]`` (one row per sequence, "dense") or a list of n tensors
``[L_i, ...]`` whose first dimension varies ("ragged"); dtypes and trailing shapes must
agree across ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from .metadata import comm_device, group_ctx

__all__ = ["FieldValue", "exchange_rows"]

FieldValue = torch.Tensor | list  # dense [n, ...] or ragged: n tensors


@dataclass(frozen=True)
class _Spec:
    name: str
    ragged: bool
    dtype: torch.dtype
    trailing: tuple


def _local_specs(fields: dict) -> dict:
    specs: dict[str, tuple[bool, str, tuple[int, ...]] | None] = {}
    for name, v in fields.items():
        if isinstance(v, torch.Tensor):
            if v.dim() < 1:
                raise ValueError(f"field {name!r} must be [n, ...] (one row per sequence), got a scalar")
            specs[name] = (False, str(v.dtype), tuple(v.shape[1:]))
        elif isinstance(v, (list, tuple)):
            rows = [t for t in v if isinstance(t, torch.Tensor)]
            if len(rows) != len(v):
                raise ValueError(f"field {name!r}: a ragged field must be a list of tensors")
            if not rows:
                specs[name] = None  # unknown on this rank
                continue
            for i, t in enumerate(rows):
                if t.dim() < 1:
                    raise ValueError(f"field {name!r}[{i}] must be [L, ...], got a scalar")
                if t.dtype != rows[0].dtype or t.shape[1:] != rows[0].shape[1:]:
                    raise ValueError(
                        f"field {name!r}[{i}] has dtype {t.dtype} and trailing shape {tuple(t.shape[1:])}; "
                        f"row 0 has {rows[0].dtype}, {tuple(rows[0].shape[1:])}"
                    )
            specs[name] = (True, str(rows[0].dtype), tuple(rows[0].shape[1:]))
        else:
            raise ValueError(f"field {name!r} must be a tensor [n, ...] or a list of tensors, got {type(v).__name__}")
    return specs


def _agree_specs(fields: dict, group) -> list[_Spec]:
    """Every rank must describe the same fields; a rank with no rows learns the spec of the others."""
    mine = _local_specs(fields)
    _, world = group_ctx(group)
    all_specs: list = [None] * world
    dist.all_gather_object(all_specs, mine, group=group)
    names = sorted(all_specs[0])
    out = []
    for r, s in enumerate(all_specs):
        if sorted(s) != names:
            raise ValueError(
                f"rank {r} has fields {sorted(s)} but rank 0 has {names}: every rank needs the same fields"
            )
    for name in names:
        known = [(r, s[name]) for r, s in enumerate(all_specs) if s[name] is not None]
        if not known:
            # nobody has a row: any spec will do
            out.append(_Spec(name, True, torch.float32, ()))
            continue
        r0, ref = known[0]
        for r, s in known[1:]:
            if s != ref:
                raise ValueError(
                    f"field {name!r}: rank {r} has (ragged, dtype, trailing shape) {s} but rank {r0} has {ref}"
                )
        out.append(_Spec(name, ref[0], getattr(torch, ref[1].split(".")[-1]), ref[2]))
    return out


def _numel(shape) -> int:
    return int(np.prod(shape)) if len(shape) else 1


def _p2p(send: dict, recv: dict, group) -> None:
    """send/recv: peer (group rank) -> tensor. One batched round; empty transfers skipped."""
    group = group if group is not None else dist.group.WORLD
    ops = []
    for peer, t in sorted(send.items()):
        if t.numel():
            ops.append(dist.P2POp(dist.isend, t, dist.get_global_rank(group, peer), group))
    for peer, t in sorted(recv.items()):
        if t.numel():
            ops.append(dist.P2POp(dist.irecv, t, dist.get_global_rank(group, peer), group))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()


def _rows_of(fields: dict, spec: _Spec, idx: torch.Tensor):
    """The rows ``idx`` of one field: a list of tensors (ragged) or one tensor [len(idx), ...]."""
    v = fields[spec.name]
    if spec.ragged:
        return [v[i] for i in idx.tolist()]
    return v[idx.to(v.device)]


def _send_indices(send_rows: Sequence[torch.Tensor], d: int) -> torch.Tensor:
    return torch.as_tensor(send_rows[d], dtype=torch.int64)


def _exchange_lengths(fields: dict, ragged: list[_Spec], send_rows: Sequence[torch.Tensor],
                      recv_counts: Sequence[int], rank: int, world: int, dev, group) -> dict[int, torch.Tensor]:
    """Round 1: the leading length of every ragged row sent (receivers cannot know them); returns
    source rank -> [len(ragged) x recv_counts[source]] int64 lengths, field-major (empty without ragged fields)."""
    send_hdr, recv_hdr = {}, {}
    for d in range(world):
        if d == rank or not ragged:
            continue
        row_lens = [[int(t.shape[0]) for t in _rows_of(fields, s, _send_indices(send_rows, d))] for s in ragged]
        send_hdr[d] = torch.tensor(row_lens, dtype=torch.int64, device=dev).reshape(-1)
    for s in range(world):
        if s != rank and ragged:
            recv_hdr[s] = torch.empty(len(ragged) * int(recv_counts[s]), dtype=torch.int64, device=dev)
    _p2p(send_hdr, recv_hdr, group)
    return recv_hdr


def _pack(fields: dict, specs: list[_Spec], idx: torch.Tensor, dev) -> torch.Tensor:
    """One uint8 buffer of the rows ``idx``, field after field (a ragged field's rows concatenated)."""
    parts = []
    for s in specs:
        rows = _rows_of(fields, s, idx)
        if s.ragged:
            t = torch.cat(rows) if rows else torch.empty((0, *s.trailing), dtype=s.dtype)
        else:
            t = rows
        parts.append(t.detach().to(dev).contiguous().reshape(-1).view(torch.uint8))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=dev)


def _itemsize(spec: _Spec) -> int:
    return torch.empty(0, dtype=spec.dtype).element_size()


def _recv_buffer(specs: list[_Spec], ragged: list[_Spec], lens: torch.Tensor, count: int, dev) -> torch.Tensor:
    """The empty uint8 buffer for ``count`` rows from one source whose ragged rows have ``lens``."""
    nbytes = 0
    for sp in specs:
        rows = int(lens[ragged.index(sp)].sum()) if sp.ragged else count
        nbytes += rows * _numel(sp.trailing) * _itemsize(sp)
    return torch.empty(nbytes, dtype=torch.uint8, device=dev)


def _unpack(buf: torch.Tensor, specs: list[_Spec], ragged: list[_Spec], lens: torch.Tensor,
            count: int) -> dict[str, FieldValue]:
    """name -> one source's rows from its buffer (``_pack``'s layout): a list of tensors or one tensor."""
    out: dict[str, FieldValue] = {}
    pos = 0
    for sp in specs:
        if sp.ragged:
            row_counts = lens[ragged.index(sp)].tolist()
            nb = int(sum(row_counts)) * _numel(sp.trailing) * _itemsize(sp)
            # clone first: a byte slice at an unaligned offset cannot be viewed as a wider dtype
            flat = buf[pos : pos + nb].clone().view(sp.dtype).reshape(-1, *sp.trailing)
            out[sp.name] = list(torch.split(flat, row_counts)) if row_counts else []
        else:
            nb = count * _numel(sp.trailing) * _itemsize(sp)
            out[sp.name] = buf[pos : pos + nb].clone().view(sp.dtype).reshape(count, *sp.trailing)
        pos += nb
    return out


def _joined(specs: list[_Spec], out: dict, dev) -> dict[str, FieldValue]:
    """Each field's chunks (one per source rank) as one list (ragged) or one tensor."""
    result: dict[str, FieldValue] = {}
    for sp in specs:
        chunks = out[sp.name]
        if sp.ragged:
            result[sp.name] = [t for ch in chunks for t in ch]
        else:
            empty = torch.empty((0, *sp.trailing), dtype=sp.dtype, device=dev)
            result[sp.name] = torch.cat(chunks) if chunks else empty
    return result


def exchange_rows(
    fields: dict,
    send_rows: Sequence[torch.Tensor],
    recv_counts: Sequence[int],
    *,
    group=None,
    device=None,
    specs: list | None = None,
) -> dict:
    """Move rows between the ranks of ``group`` point to point (a collective: every rank calls it).

    Args:
        fields: name -> a tensor [n, ...] (dense) or a list of n tensors [L_i, ...] (ragged);
            dtypes and trailing shapes must agree across ranks.
        send_rows: W int64 tensors, ``send_rows[d]`` the local row indices sent to rank d.
        recv_counts: W ints, ``recv_counts[s]`` the rows rank s sends here.
        group, device: as in ``gather_metadata``. specs: the fields' agreed specs, when
            already known (skips one collective).

    Returns:
        name -> [sum(recv_counts), ...] tensor or a list of that many tensors: rows ordered
        by source rank, then in the order the source sent them.
    """
    rank, world = group_ctx(group)
    if len(send_rows) != world or len(recv_counts) != world:
        raise ValueError(f"send_rows and recv_counts need one entry per rank ({world})")
    dev = comm_device(group, device)
    specs = specs if specs is not None else _agree_specs(fields, group)
    ragged = [s for s in specs if s.ragged]
    recv_hdr = _exchange_lengths(fields, ragged, send_rows, recv_counts, rank, world, dev, group)

    # round 2: one byte buffer per peer, field after field
    send_buf = {d: _pack(fields, specs, _send_indices(send_rows, d), dev) for d in range(world) if d != rank}
    recv_buf, recv_lens = {}, {}
    for s in range(world):
        if s == rank:
            continue
        c = int(recv_counts[s])
        recv_lens[s] = recv_hdr[s].cpu().reshape(len(ragged), c) if ragged else torch.empty(0, c, dtype=torch.int64)
        recv_buf[s] = _recv_buffer(specs, ragged, recv_lens[s], c, dev)
    _p2p(send_buf, recv_buf, group)

    # unpack in source order; our own rows are copied locally
    out: dict = {s.name: [] for s in specs}
    for src in range(world):
        if src == rank:
            idx = _send_indices(send_rows, rank)
            for sp in specs:
                rows = _rows_of(fields, sp, idx)
                out[sp.name].append([t.to(dev) for t in rows] if sp.ragged else rows.to(dev))
            continue
        for name, rows in _unpack(recv_buf[src], specs, ragged, recv_lens[src], int(recv_counts[src])).items():
            out[name].append(rows)
    return _joined(specs, out, dev)
