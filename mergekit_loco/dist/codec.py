"""What travels: payload codecs (as is, bf16, int8 with per-row scales) and flat buffers.

A collective sends one flat buffer per dtype; :class:`Codec` packs tensors into it and unpacks
them, encoding floating payloads when compression is asked for.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import torch

COMPRESSIONS = ("bf16", "int8")
#: int8 compression: one float32 absmax scale per row of this many entries of a tensor.
INT8_ROW = 256


class Codec:
    """Payload encoding: the tensor itself, bf16, or int8 with one absmax scale per row of
    :data:`INT8_ROW` entries (``x ~ scale * q``, ``scale = max|x| / 127``, q in [-127, 127]).
    Non-floating tensors always travel as they are."""

    def __init__(self, compression: str | None, device: torch.device | str = "cpu"):
        if compression is not None and compression not in COMPRESSIONS:
            raise ValueError(
                f"compression must be None or one of {COMPRESSIONS}, not {compression!r}"
            )
        self.compression = compression
        self.device = torch.device(device)

    def _applies(self, dtype: torch.dtype) -> bool:
        if self.compression == "bf16":
            return dtype.is_floating_point and dtype.itemsize > 2
        return self.compression == "int8" and dtype.is_floating_point

    def payload_dtype(self, dtype: torch.dtype) -> torch.dtype:
        if not self._applies(dtype):
            return dtype
        return torch.bfloat16 if self.compression == "bf16" else torch.uint8

    def packed_numel(self, shapes: Sequence[Sequence[int]], dtype: torch.dtype) -> int:
        """Entries of :meth:`pack`'s buffer for tensors of these shapes."""
        numels = [math.prod(shape) for shape in shapes]
        if self._applies(dtype) and self.compression == "int8":
            return sum(numels) + 4 * sum(-(-numel // INT8_ROW) for numel in numels)
        return sum(numels)

    def width(self, dtype: torch.dtype) -> float:
        """Payload bytes per entry (int8: exact up to each tensor's last row)."""
        if self._applies(dtype) and self.compression == "int8":
            return 1 + 4 / INT8_ROW
        return self.payload_dtype(dtype).itemsize

    def pack(self, tensors: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """One new flat buffer holding ``tensors`` (all of ``dtype``), encoded. int8 rows never
        span two tensors, so each tensor has its own scales: ``[q_1 .. q_k | scales_1 ..]``."""
        if not self._applies(dtype) or self.compression == "bf16":
            return flatten(tensors, self.payload_dtype(dtype), self.device)
        encoded = [_int8_encode(tensor) for tensor in tensors]
        quantized = flatten([q for q, _ in encoded], torch.int8, self.device)
        scales = flatten([scale for _, scale in encoded], torch.float32, self.device)
        return torch.cat([quantized.view(torch.uint8), scales.view(torch.uint8)])

    def unpack(
        self, payload: torch.Tensor, shapes: Sequence[Sequence[int]], dtype: torch.dtype
    ) -> list[torch.Tensor]:
        """The tensors of :meth:`pack`, decoded to ``dtype``."""
        if not self._applies(dtype):
            return unflatten(payload, shapes)
        if self.compression == "bf16":
            return unflatten(payload.to(dtype), shapes)
        numels = [math.prod(shape) for shape in shapes]
        quantized = payload[: sum(numels)].view(torch.int8).split(numels)
        scales = payload[sum(numels) :].clone().view(torch.float32)
        scales = scales.split([-(-numel // INT8_ROW) for numel in numels])
        return [
            _int8_decode(q, scale, shape, dtype)
            for q, scale, shape in zip(quantized, scales, shapes, strict=True)
        ]


def _int8_encode(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)``: rows of :data:`INT8_ROW` entries, ``scale = max|row| / 127`` (float32,
    divided in float32 at least: a float16 ``1e-5 / 127`` is subnormal, ``3e-6 / 127`` 0),
    ``q = round(x / scale)`` in [-127, 127]."""
    flat = tensor.reshape(-1)
    rows = torch.nn.functional.pad(flat, (0, -flat.numel() % INT8_ROW)).view(-1, INT8_ROW)
    tiny = torch.finfo(torch.float32).tiny
    peak = rows.abs().amax(dim=1)
    scale = (peak.to(torch.promote_types(peak.dtype, torch.float32)) / 127).to(torch.float32)
    scale = scale.clamp(min=tiny)
    quantized = torch.round(rows / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return quantized.view(-1)[: flat.numel()], scale


def _int8_decode(quantized, scale, shape, dtype: torch.dtype) -> torch.Tensor:
    padding = -quantized.numel() % INT8_ROW
    rows = torch.nn.functional.pad(quantized.to(torch.float32), (0, padding)).view(-1, INT8_ROW)
    return (rows * scale[:, None]).view(-1)[: quantized.numel()].to(dtype).view(shape)


def flatten(tensors: Sequence[torch.Tensor], dtype: torch.dtype, device) -> torch.Tensor:
    """One new flat buffer (never a view of an input)."""
    if not tensors:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat([tensor.reshape(-1).to(dtype) for tensor in tensors])


def unflatten(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    sizes = [math.prod(shape) for shape in shapes]
    return [piece.view(shape) for piece, shape in zip(flat.split(sizes), shapes, strict=True)]


def by_dtype(dtypes: Sequence[torch.dtype]) -> Iterator[tuple[torch.dtype, list[int]]]:
    """Indices grouped by dtype, groups in order of first appearance (the same on every rank)."""
    groups: dict[torch.dtype, list[int]] = {}
    for index, dtype in enumerate(dtypes):
        groups.setdefault(dtype, []).append(index)
    yield from groups.items()


