"""The spectral toolbox against numpy/scipy float64 computations."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import torch

from mergekit_loco.linalg import (
    NS_COEFFICIENTS,
    NS_STEPS,
    frobenius_norm,
    isotropic,
    newton_schulz,
    numerical_rank,
    polar_factor,
    rms_singular_value,
    thin_svd,
)

SHAPES = [(9, 5), (5, 9), (7, 7), (1, 6), (6, 1)]


def random_matrix(shape, seed=0, dtype=torch.float64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def low_rank_matrix(shape, rank, seed=0) -> torch.Tensor:
    left = random_matrix((shape[0], rank), seed)
    right = random_matrix((rank, shape[1]), seed + 1)
    return left @ right


def newton_schulz_on_spectrum(matrix: np.ndarray, steps: int = NS_STEPS) -> np.ndarray:
    """The quintic iteration acts on each singular value: X = U p(...p(s / ||M||_F)) V^T."""
    a, b, c = NS_COEFFICIENTS
    left, singular, right_h = np.linalg.svd(matrix, full_matrices=False)
    x = singular / (np.linalg.norm(matrix) + 1e-7)
    for _ in range(steps):
        x = a * x + b * x**3 + c * x**5
    return left @ np.diag(x) @ right_h


@pytest.mark.parametrize("shape", SHAPES)
def test_thin_svd_reconstructs_with_orthonormal_factors(shape):
    matrix = random_matrix(shape)
    left, singular, right_h = thin_svd(matrix)
    d = min(shape)
    assert left.shape == (shape[0], d) and singular.shape == (d,) and right_h.shape == (d, shape[1])
    torch.testing.assert_close(left @ torch.diag(singular) @ right_h, matrix)
    torch.testing.assert_close(left.mT @ left, torch.eye(d, dtype=torch.float64))
    torch.testing.assert_close(right_h @ right_h.mT, torch.eye(d, dtype=torch.float64))
    assert torch.all(singular[:-1] >= singular[1:])
    np.testing.assert_allclose(singular.numpy(), np.linalg.svd(matrix.numpy(), compute_uv=False))


def test_thin_svd_runs_half_precision_in_float32():
    matrix = random_matrix((6, 4), dtype=torch.float32).to(torch.bfloat16)
    left, singular, right_h = thin_svd(matrix)
    assert left.dtype == singular.dtype == right_h.dtype == torch.float32
    torch.testing.assert_close(left @ torch.diag(singular) @ right_h, matrix.float())


@pytest.mark.parametrize("shape", SHAPES)
def test_polar_factor_matches_scipy_and_is_orthonormal(shape):
    matrix = random_matrix(shape, seed=3)
    polar = polar_factor(matrix)
    expected, _ = scipy.linalg.polar(matrix.numpy(), side="right")
    np.testing.assert_allclose(polar.numpy(), expected, atol=1e-12)
    d = min(shape)
    gram = polar.mT @ polar if shape[0] >= shape[1] else polar @ polar.mT
    torch.testing.assert_close(gram, torch.eye(d, dtype=torch.float64))


@pytest.mark.parametrize("shape", [(9, 5), (5, 9), (6, 6)])
def test_polar_factor_is_the_closest_orthonormal_matrix(shape):
    matrix = random_matrix(shape, seed=4)
    polar = polar_factor(matrix)
    best = torch.linalg.matrix_norm(matrix - polar)
    for seed in range(20):
        # competitors: random orthonormal matrices and small rotations of the polar factor
        if shape[0] >= shape[1]:
            competitor, _ = torch.linalg.qr(random_matrix(shape, seed=100 + seed))
        else:
            competitor = torch.linalg.qr(random_matrix(shape[::-1], seed=100 + seed))[0].mT
        assert best <= torch.linalg.matrix_norm(matrix - competitor) + 1e-12
        skew = random_matrix((shape[1], shape[1]), seed=200 + seed) * 1e-3
        rotation = torch.linalg.matrix_exp(skew - skew.mT)
        assert best <= torch.linalg.matrix_norm(matrix - polar @ rotation) + 1e-12


@pytest.mark.parametrize("shape", [(16, 64), (64, 16), (32, 32), (48, 40)])
def test_newton_schulz_maps_singular_values_near_one(shape):
    orthogonalised = newton_schulz(random_matrix(shape, seed=5))
    singular = torch.linalg.svdvals(orthogonalised)
    assert singular.min() > 0.6 and singular.max() < 1.3


@pytest.mark.parametrize("shape", SHAPES + [(16, 64)])
def test_newton_schulz_equals_the_polynomial_on_the_spectrum(shape):
    matrix = random_matrix(shape, seed=6)
    expected = newton_schulz_on_spectrum(matrix.numpy())
    np.testing.assert_allclose(newton_schulz(matrix).numpy(), expected, atol=1e-10)


def test_newton_schulz_is_close_to_uv_for_well_conditioned_matrices():
    # singular values in [1, 2]: condition number 2
    left, _ = torch.linalg.qr(random_matrix((40, 24), seed=7))
    right, _ = torch.linalg.qr(random_matrix((24, 24), seed=8))
    spectrum = torch.linspace(1.0, 2.0, 24, dtype=torch.float64)
    matrix = left @ torch.diag(spectrum) @ right.mT
    exact = left @ right.mT
    error = torch.linalg.matrix_norm(newton_schulz(matrix) - exact, ord=2)
    assert error < 0.35


def test_newton_schulz_keeps_dtype_and_zero():
    matrix = random_matrix((5, 3), dtype=torch.float32).to(torch.bfloat16)
    assert newton_schulz(matrix).dtype == torch.bfloat16
    assert torch.equal(newton_schulz(torch.zeros(3, 4)), torch.zeros(3, 4))


@pytest.mark.parametrize("shape", SHAPES)
def test_rms_singular_value_is_rms_of_spectrum_and_at_least_the_mean(shape):
    matrix = random_matrix(shape, seed=9)
    singular = np.linalg.svd(matrix.numpy(), compute_uv=False)
    rms = rms_singular_value(matrix).item()
    assert rms == pytest.approx(np.sqrt(np.mean(singular**2)), rel=1e-12)
    assert rms >= singular.mean() - 1e-12


def test_rms_equals_mean_only_for_a_flat_spectrum():
    orthonormal, _ = torch.linalg.qr(random_matrix((8, 5), seed=10))
    flat = 2.5 * orthonormal
    assert rms_singular_value(flat).item() == pytest.approx(2.5, rel=1e-12)
    assert torch.linalg.svdvals(flat).mean().item() == pytest.approx(2.5, rel=1e-12)
    skewed = orthonormal @ torch.diag(torch.tensor([3.0, 1, 1, 1, 1], dtype=torch.float64))
    assert rms_singular_value(skewed).item() > torch.linalg.svdvals(skewed).mean().item() + 0.1


@pytest.mark.parametrize("shape", SHAPES)
def test_isotropic_exact_is_mean_singular_value_times_uv(shape):
    matrix = random_matrix(shape, seed=11)
    left, singular, right_h = np.linalg.svd(matrix.numpy(), full_matrices=False)
    expected = singular.mean() * left @ right_h
    result = isotropic(matrix)
    np.testing.assert_allclose(result.numpy(), expected, atol=1e-12)
    np.testing.assert_allclose(
        np.linalg.svd(result.numpy(), compute_uv=False), singular.mean(), rtol=1e-10
    )


def test_isotropic_on_diagonal_two_by_two():
    result = isotropic(torch.diag(torch.tensor([3.0, 1.0], dtype=torch.float64)))
    torch.testing.assert_close(result, torch.diag(torch.tensor([2.0, 2.0], dtype=torch.float64)))


@pytest.mark.parametrize("shape", SHAPES)
def test_isotropic_ns_is_rms_times_newton_schulz(shape):
    matrix = random_matrix(shape, seed=12)
    d = min(shape)
    rms = np.linalg.norm(matrix.numpy()) / np.sqrt(d)
    expected = rms * newton_schulz_on_spectrum(matrix.numpy())
    np.testing.assert_allclose(isotropic(matrix, "ns").numpy(), expected, atol=1e-10)


def test_isotropic_rank_aware_keeps_the_column_space():
    matrix = low_rank_matrix((7, 5), rank=2, seed=13)
    left, singular, right_h = np.linalg.svd(matrix.numpy(), full_matrices=False)
    expected = singular[:2].mean() * left[:, :2] @ right_h[:2]
    result = isotropic(matrix, rank_aware=True)
    np.testing.assert_allclose(result.numpy(), expected, atol=1e-12)
    assert torch.equal(isotropic(torch.zeros(3, 4), rank_aware=True), torch.zeros(3, 4))


def test_isotropic_rejects_unknown_spectral():
    with pytest.raises(ValueError, match="spectral"):
        isotropic(random_matrix((3, 3)), spectral="fast")


def test_isotropic_keeps_half_precision_dtype():
    matrix = random_matrix((6, 4), dtype=torch.float32).to(torch.bfloat16)
    for spectral in ("exact", "ns"):
        assert isotropic(matrix, spectral).dtype == torch.bfloat16


def test_frobenius_norm_survives_float32_overflow_of_the_squares():
    matrix = random_matrix((9, 5), seed=16, dtype=torch.float32)
    assert torch.equal(frobenius_norm(matrix), torch.linalg.matrix_norm(matrix))
    huge = matrix * 1e19  # squares of about 1e38: their sum overflows float32
    expected = np.linalg.norm(huge.double().numpy())
    assert frobenius_norm(huge).dtype == torch.float32
    np.testing.assert_allclose(float(frobenius_norm(huge)), expected, rtol=1e-6)
    np.testing.assert_allclose(float(rms_singular_value(huge)), expected / np.sqrt(5), rtol=1e-6)
    np.testing.assert_allclose(
        newton_schulz(huge).double().numpy(), newton_schulz(matrix).double().numpy(), atol=1e-6
    )


@pytest.mark.parametrize("rank", [0, 1, 3, 5])
def test_numerical_rank_matches_numpy(rank):
    shape = (8, 5)
    matrix = low_rank_matrix(shape, rank, seed=14) if rank else torch.zeros(shape)
    singular = torch.linalg.svdvals(matrix)
    assert numerical_rank(singular, shape) == rank == np.linalg.matrix_rank(matrix.numpy())


def test_numerical_rank_of_float32_and_empty():
    matrix = low_rank_matrix((10, 6), rank=4, seed=15).float()
    assert numerical_rank(torch.linalg.svdvals(matrix), matrix.shape) == 4
    assert numerical_rank(torch.zeros(0), (0, 3)) == 0


def test_thin_svd_retries_in_float64_when_float32_does_not_converge(monkeypatch):
    """A float32 LAPACK failure (seen once on an Iso-CTS basis) falls back to float64."""
    real_svd = torch.linalg.svd
    calls = []

    def flaky_svd(matrix, full_matrices=True):
        calls.append(matrix.dtype)
        if matrix.dtype == torch.float32:
            raise torch.linalg.LinAlgError("failed to converge")
        return real_svd(matrix, full_matrices=full_matrices)

    monkeypatch.setattr(torch.linalg, "svd", flaky_svd)
    matrix = torch.randn(5, 3, generator=torch.Generator().manual_seed(0))
    left, singular, right_h = thin_svd(matrix)
    assert calls == [torch.float32, torch.float64]
    assert left.dtype == singular.dtype == right_h.dtype == torch.float32
    expected = np.linalg.svd(matrix.double().numpy(), compute_uv=False)
    np.testing.assert_allclose(singular.numpy(), expected, rtol=1e-6)
    np.testing.assert_allclose((left * singular) @ right_h, matrix, atol=1e-5)
