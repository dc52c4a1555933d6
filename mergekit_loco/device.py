"""The ``--device`` check every command shares: a name torch knows, of a device that is here."""

from __future__ import annotations

import torch


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch device mloco can run on: the CPU or a CUDA device that exists;
    ``auto``: CUDA when available, else the CPU. Anything else (``tpu``, ``meta``, ``mps``, a
    CUDA device this machine lacks) is one ``ValueError`` naming ``--device``, before any
    tensor is read or file written."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"--device: {device!r} is not a device (use cpu or cuda)") from None
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device}: mloco runs on cpu or cuda, not {resolved.type}")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is available here")
    if resolved.type == "cuda" and (resolved.index or 0) >= torch.cuda.device_count():
        raise ValueError(
            f"--device {device}: there are {torch.cuda.device_count()} CUDA devices here"
        )
    return resolved
