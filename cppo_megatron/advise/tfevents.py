"""Scalars from TensorBoard event files, without TensorBoard or protobuf installed.

An event file (``events.out.tfevents.*``) is a sequence of TFRecords: an 8-byte little-endian
length, a 4-byte CRC of it, the payload, a 4-byte CRC of the payload. Each payload is a
serialized ``tensorflow.Event`` protobuf; the scalars a trainer logs with torch's
``SummaryWriter.add_scalar`` (veRL's ``_TensorboardAdapter``, OpenRLHF's ``TensorboardLogger``,
the embedded trainer's ``MetricsLogger``) are ``Event.summary.value[i]`` with a ``tag`` and either
``simple_value`` (float) or, in the "new style", a ``tensor`` of one float or double. Only those
fields are decoded; everything else (graphs, histograms, text, images) is skipped by its wire
type. CRCs are not checked: a truncated last record (a writer still running) ends the read.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

__all__ = ["EVENT_FILE_MARK", "read_scalars"]

EVENT_FILE_MARK = "tfevents"  # event files are named events.out.tfevents.<time>.<host>...

# protobuf field numbers (tensorflow/core/util/event.proto, framework/summary.proto, tensor.proto)
_EVENT_STEP, _EVENT_SUMMARY = 2, 5
_SUMMARY_VALUE = 1
_VALUE_TAG, _VALUE_SIMPLE, _VALUE_TENSOR = 1, 2, 8
_TENSOR_DTYPE, _TENSOR_CONTENT, _TENSOR_FLOAT, _TENSOR_DOUBLE = 1, 4, 5, 6
_DT_FLOAT, _DT_DOUBLE = 1, 2


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of one protobuf message: an int for varints, bytes for
    length-delimited fields, the raw 4 or 8 bytes for fixed-width ones."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        field, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value, pos = buf[pos:pos + 8], pos + 8
        elif wire == 2:
            n, pos = _varint(buf, pos)
            value, pos = buf[pos:pos + n], pos + n
        elif wire == 5:
            value, pos = buf[pos:pos + 4], pos + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        if pos > len(buf):
            raise ValueError("truncated protobuf field")
        yield field, wire, value


def _tensor_scalar(buf: bytes) -> float | None:
    """The single float of a scalar ``TensorProto`` (new-style ``add_scalar``), else None."""
    dtype, content, values = 0, b"", []
    for field, _, value in _fields(buf):
        if isinstance(value, int):
            dtype = value if field == _TENSOR_DTYPE else dtype
        elif field == _TENSOR_CONTENT:
            content = value
        elif field == _TENSOR_FLOAT:  # packed (wire 2) or one fixed32 (wire 5)
            values += list(struct.unpack(f"<{len(value) // 4}f", value))
        elif field == _TENSOR_DOUBLE:
            values += list(struct.unpack(f"<{len(value) // 8}d", value))
    if not values and content:
        width = {_DT_FLOAT: 4, _DT_DOUBLE: 8}.get(dtype)
        if width and len(content) == width:
            values = list(struct.unpack("<f" if width == 4 else "<d", content))
    return float(values[0]) if len(values) == 1 else None


def _value(buf: bytes) -> tuple[str, float] | None:
    tag, number = None, None
    for field, wire, value in _fields(buf):
        if isinstance(value, int):
            continue
        if field == _VALUE_TAG and wire == 2:
            tag = value.decode("utf-8", "replace")
        elif field == _VALUE_SIMPLE and wire == 5:
            number = struct.unpack("<f", value)[0]
        elif field == _VALUE_TENSOR and wire == 2:
            number = _tensor_scalar(value)
    return (tag, float(number)) if tag is not None and number is not None else None


def _event(buf: bytes) -> tuple[int, list[tuple[str, float]]]:
    step, scalars = 0, []  # proto3 leaves a default (step 0) out of the record
    for field, wire, value in _fields(buf):
        if field == _EVENT_STEP and isinstance(value, int):
            step = value
        elif field == _EVENT_SUMMARY and wire == 2 and isinstance(value, bytes):
            for f2, w2, v2 in _fields(value):
                if f2 == _SUMMARY_VALUE and w2 == 2 and isinstance(v2, bytes) and (tv := _value(v2)) is not None:
                    scalars.append(tv)
    return step, scalars


def _records(data: bytes) -> Iterator[bytes]:
    pos = 0
    while pos + 12 <= len(data):
        (n,) = struct.unpack_from("<Q", data, pos)
        start, end = pos + 12, pos + 12 + n
        if end + 4 > len(data):
            return  # a record still being written
        yield data[start:end]
        pos = end + 4


def read_scalars(path: str | Path) -> dict[int, dict[str, float]]:
    """``{step: {tag: value}}`` of every scalar in one event file (a later value of the same tag
    and step wins, as in TensorBoard). Raises ValueError naming the file when it is not an
    event file."""
    p = Path(path)
    out: dict[int, dict[str, float]] = {}
    try:
        for record in _records(p.read_bytes()):
            step, scalars = _event(record)
            if not scalars:
                continue
            out.setdefault(step, {}).update(scalars)
    except (ValueError, struct.error) as exc:
        raise ValueError(f"{p} is not a readable TensorBoard event file ({exc})") from exc
    return out
