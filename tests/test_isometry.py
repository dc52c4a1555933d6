"""The compact Householder form of a scaled partial isometry, against the matrix built from an
SVD in float64 (and its length against the count written out)."""

from __future__ import annotations

import pytest
import torch

from mergekit_loco.methods.isometry import compact, compact_length, expand


def scaled_isometry(shape, dtype, seed=0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    left, _, right_h = torch.linalg.svd(
        torch.randn(shape, generator=generator, dtype=torch.float64), full_matrices=False
    )
    return torch.tensor(0.37, dtype=dtype), (left @ right_h).to(dtype)


@pytest.mark.parametrize("shape", [(16, 16), (40, 12), (12, 24), (1, 5), (7, 1), (96, 96)])
@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-13), (torch.float32, 5e-6)])
def test_round_trip_is_the_matrix_up_to_rounding(shape, dtype, tolerance):
    scale, isometry = scaled_isometry(shape, dtype)
    packed = compact(scale, isometry)
    tall, wide = max(shape), min(shape)
    # strictly-lower reflectors + tau + signs + scale
    assert (
        packed.numel()
        == compact_length(shape)
        == tall * wide - wide * (wide + 1) // 2 + 2 * wide + 1
    )
    rebuilt = expand(packed, shape)
    assert rebuilt.shape == shape and rebuilt.dtype == dtype
    expected = scale.double() * isometry.double()
    assert (rebuilt.double() - expected).abs().max() <= tolerance * float(scale)


def test_a_square_isometry_travels_in_about_half_the_numbers():
    assert compact_length((384, 384)) == 384 * 384 - 384 * 381 // 2 + 1
    assert compact_length((384, 384)) / 384**2 < 0.51
