"""TaskVector: arithmetic, construction from state dicts, application to a base."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mergekit_loco.task_vector import TaskVector, is_mergeable


def vector(**deltas: list[float]) -> TaskVector:
    return TaskVector(
        {name: torch.tensor(values, dtype=torch.float64) for name, values in deltas.items()}
    )


def as_lists(task_vector: TaskVector) -> dict[str, list[float]]:
    return {name: delta.tolist() for name, delta in task_vector.items()}


def test_mapping_protocol_keeps_order():
    tv = vector(b=[1.0], a=[2.0, 3.0])
    assert list(tv) == ["b", "a"] and len(tv) == 2 and "a" in tv
    assert tv["a"].tolist() == [2.0, 3.0]
    assert repr(tv) == "TaskVector(2 tensors, 3 elements)"


def test_arithmetic_is_elementwise():
    a = vector(w=[1.0, -2.0], b=[0.5])
    b = vector(w=[3.0, 4.0], b=[-1.5])
    assert as_lists(a + b) == {"w": [4.0, 2.0], "b": [-1.0]}
    assert as_lists(a - b) == {"w": [-2.0, -6.0], "b": [2.0]}
    assert as_lists(2.0 * a) == as_lists(a * 2.0) == {"w": [2.0, -4.0], "b": [1.0]}
    assert as_lists(-a) == {"w": [-1.0, 2.0], "b": [-0.5]}
    assert as_lists((a + b) - b) == as_lists(a)


def test_arithmetic_does_not_modify_operands():
    a = vector(w=[1.0, 2.0])
    _ = a + a
    _ = 3 * a
    assert a["w"].tolist() == [1.0, 2.0]


def test_arithmetic_rejects_different_tensor_names():
    with pytest.raises(KeyError, match="'v'"):
        _ = vector(w=[1.0]) + vector(w=[1.0], v=[2.0])


def test_arithmetic_never_broadcasts_and_takes_only_task_vectors_and_numbers():
    a = TaskVector({"w": torch.ones(2, 3)})
    for other in (TaskVector({"w": torch.ones(3)}), TaskVector({"w": torch.ones(1, 3)})):
        with pytest.raises(ValueError, match=r"tensor 'w': shape \(2, 3\) differs"):
            a + other
        with pytest.raises(ValueError, match="tensor 'w'"):
            a - other
    for bad in (lambda: a + 1, lambda: a - {"w": torch.ones(2, 3)}, lambda: a * "x",
                lambda: a * torch.ones(2, 3), lambda: True * a):  # fmt: skip
        with pytest.raises(TypeError):  # Python's own "unsupported operand" (before: a broadcast)
            bad()
    assert torch.equal((2.5 * a)["w"], torch.full((2, 3), 2.5))


def test_apply_to_refuses_unknown_names_and_other_shapes_and_keeps_float64():
    """A delta the base cannot take is an error naming it (before: a (2, 3) delta grew a
    (1, 3) base, and a delta under another name was dropped, returning the base unchanged);
    a float64 base keeps its precision: 1 + 1e-12 + 0 stays 1 + 1e-12."""
    base = {"w": torch.zeros(1, 3), "n": torch.tensor([1.0 + 1e-12], dtype=torch.float64)}
    with pytest.raises(ValueError, match=r"tensor 'w': shape \(2, 3\) differs from the base's"):
        TaskVector({"w": torch.ones(2, 3)}).apply_to(base)
    with pytest.raises(KeyError, match="the base has no tensor 'model.w'"):
        TaskVector({"model.w": torch.ones(1, 3)}).apply_to(base)
    merged = TaskVector({"n": torch.zeros(1), "w": torch.ones(1, 3)}).apply_to(base, scale=0.5)
    assert merged["n"].dtype == torch.float64 and merged["n"].item() == 1.0 + 1e-12
    assert torch.equal(merged["w"], torch.full((1, 3), 0.5))


def test_apply_to_refuses_what_it_would_truncate_overflow_or_not_read():
    """Before: a float delta to an integer base tensor was truncated (3 + 0.6 -> 3, 3 - 0.6
    -> 2), a numpy base value ended in torch's promote_types TypeError, and float16 6e4 + 1e4
    came back inf. Integer buffers without a delta are still copied, and a NaN delta (which
    the TaskVector holds) still gives NaN rather than an overflow error."""
    base = {"w": torch.zeros(2), "step": torch.tensor([3, 3])}
    with pytest.raises(
        ValueError, match="the base's 'step' is torch.int64: a delta to it would be truncated"
    ):
        TaskVector({"w": torch.ones(2), "step": torch.tensor([0.6, -0.6])}).apply_to(base)
    assert TaskVector({"w": torch.ones(2)}).apply_to(base)["step"].tolist() == [3, 3]
    with pytest.raises(TypeError, match="the base's 'w' is a ndarray, not a tensor"):
        TaskVector({"w": torch.ones(2)}).apply_to({"w": np.zeros(2)})
    half = {"w": torch.full((2,), 6e4, dtype=torch.float16)}
    with pytest.raises(ValueError, match="'w': base \\+ 1 \\* delta overflows torch.float16"):
        TaskVector({"w": torch.full((2,), 1e4, dtype=torch.float16)}).apply_to(half)
    lowered = TaskVector({"w": torch.full((2,), 1e4)}).apply_to(half, scale=-1.0)["w"]
    assert torch.equal(lowered, torch.full((2,), 5e4).half())  # 6e4 - 1e4, rounded to float16
    nan = TaskVector({"w": torch.tensor([math.nan, 1.0])}).apply_to({"w": torch.zeros(2)})
    assert math.isnan(nan["w"][0]) and nan["w"][1] == 1.0


def test_to_casts_every_delta():
    tv = vector(w=[1.0, 2.0], b=[3.0]).to(torch.float32)
    assert {delta.dtype for delta in tv.values()} == {torch.float32}


def test_is_mergeable_only_for_floating_tensors():
    assert is_mergeable(torch.zeros(2, dtype=torch.bfloat16))
    assert not is_mergeable(torch.zeros(2, dtype=torch.int64))
    assert not is_mergeable(torch.zeros(2, dtype=torch.bool))


def test_from_state_dicts_subtracts_floats_and_skips_integers():
    base = {"w": torch.tensor([1.0, 2.0]), "ids": torch.tensor([0, 1]), "b": torch.tensor([0.5])}
    tuned = {"w": torch.tensor([1.5, 1.0]), "ids": torch.tensor([5, 6]), "b": torch.tensor([2.0])}
    tv = TaskVector.from_state_dicts(tuned, base, dtype=torch.float64)
    assert list(tv) == ["w", "b"]
    assert tv["w"].dtype == torch.float64
    assert as_lists(tv) == {"w": [0.5, -1.0], "b": [1.5]}


def test_from_state_dicts_computes_in_the_requested_dtype():
    base = {"w": torch.tensor([1.0], dtype=torch.bfloat16)}
    tuned = {"w": torch.tensor([1.0078125], dtype=torch.bfloat16)}  # 1 + 2^-7
    tv = TaskVector.from_state_dicts(tuned, base)
    assert tv["w"].dtype == torch.float32 and tv["w"].item() == 2.0**-7


def test_from_state_dicts_rounds_the_difference_once_to_a_narrow_dtype():
    # 0.02 + 1e-4 and 0.02 in bfloat16 are the same number: cast first, the step is lost.
    base = {"w": torch.tensor([0.02, -0.5], dtype=torch.float32)}
    tuned = {"w": torch.tensor([0.02 + 1e-4, -0.5 + 3e-3], dtype=torch.float32)}
    tv = TaskVector.from_state_dicts(tuned, base, dtype=torch.bfloat16)
    exact = (tuned["w"].double() - base["w"].double()).to(torch.bfloat16)
    assert tv["w"].dtype == torch.bfloat16 and torch.equal(tv["w"], exact)
    assert tv["w"][0].item() != 0.0
    wide = TaskVector.from_state_dicts(tuned, base, dtype=torch.float64)
    assert torch.equal(wide["w"], tuned["w"].double() - base["w"].double())


def test_from_state_dicts_names_shape_mismatch():
    with pytest.raises(ValueError, match=r"'layer\.w'.*\(2, 3\).*\(3, 2\)"):
        TaskVector.from_state_dicts({"layer.w": torch.zeros(2, 3)}, {"layer.w": torch.zeros(3, 2)})


def test_from_state_dicts_names_missing_tensor():
    with pytest.raises(KeyError, match="'b'"):
        TaskVector.from_state_dicts(
            {"w": torch.zeros(2)}, {"w": torch.zeros(2), "b": torch.zeros(1)}
        )


def test_apply_to_adds_scaled_delta_in_base_dtype():
    base = {
        "w": torch.tensor([1.0, -2.0, 0.25], dtype=torch.bfloat16),
        "ids": torch.tensor([3, 4]),
    }
    delta = torch.tensor([0.5, 0.125, -1.0])
    merged = TaskVector({"w": delta}).apply_to(base, scale=0.5)
    assert merged["w"].dtype == torch.bfloat16
    expected = (base["w"].double() + 0.5 * delta.double()).to(torch.bfloat16)
    assert torch.equal(merged["w"], expected)
    assert torch.equal(merged["ids"], base["ids"]) and merged["ids"].dtype == torch.int64
    assert merged["ids"].data_ptr() != base["ids"].data_ptr()  # a copy, not an alias


def test_apply_to_computes_in_float32_before_rounding():
    # 1 + 2^-8 + 2^-16 rounds up to 1 + 2^-7 in bf16; rounding the delta to bf16 first
    # (2^-8) would leave an exact tie that rounds to even, i.e. back to 1.
    base = {"w": torch.tensor([1.0], dtype=torch.bfloat16)}
    tv = TaskVector({"w": torch.tensor([2.0**-8 + 2.0**-16])})
    assert tv.apply_to(base)["w"].item() == 1.0 + 2.0**-7
    assert (base["w"] + tv["w"].to(torch.bfloat16)).item() == 1.0


def test_apply_to_inverts_from_state_dicts():
    generator = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(3, 4, generator=generator), "b": torch.randn(4, generator=generator)}
    tuned = {
        name: tensor + 0.1 * torch.randn(tensor.shape, generator=generator)
        for name, tensor in base.items()
    }
    tv = TaskVector.from_state_dicts(tuned, base, dtype=torch.float64)
    rebuilt = tv.apply_to(base)
    for name in base:
        torch.testing.assert_close(rebuilt[name], tuned[name])


def test_a_task_vector_of_parameters_is_data_without_a_graph():
    """``from_state_dicts(named_parameters)`` used to hold deltas that required grad (Iso-CTS
    then raised on them, TIES warned): every delta is detached, with the same values."""
    generator = torch.Generator().manual_seed(3)
    base, tuned = (torch.nn.Linear(3, 4) for _ in range(2))
    with torch.no_grad():
        for module in (base, tuned):
            for param in module.parameters():
                param.copy_(torch.randn(param.shape, generator=generator))
    tv = TaskVector.from_state_dicts(dict(tuned.named_parameters()), dict(base.named_parameters()))
    by_hand = {n: (p - base.state_dict()[n]).detach() for n, p in tuned.named_parameters()}
    for name, delta in tv.items():
        assert not delta.requires_grad and delta.grad_fn is None
        assert torch.equal(delta, by_hand[name])
    held = torch.ones(2, requires_grad=True)
    assert not TaskVector({"w": held})["w"].requires_grad
    assert TaskVector({"w": held})["w"].data_ptr() == held.data_ptr()  # no copy


def test_equality_is_identity_and_task_vectors_hash():
    """Mapping's ``==`` compared tensors (``Boolean value of Tensor ... is ambiguous``)."""
    a, b = vector(w=[1.0, 2.0]), vector(w=[1.0, 2.0])
    assert a == a and a != b and not (a == b)
    assert b in [a, b] and [a, b].index(b) == 1
    assert {a: "first", b: "second"}[b] == "second" and len({a, b, a}) == 2
    assert hash(a) == hash(a)
    assert a != {"w": torch.tensor([1.0, 2.0], dtype=torch.float64)}


def test_to_takes_what_tensor_to_takes():
    tv = vector(w=[1.0, 2.0], b=[3.0])
    for moved in (tv.to("cpu"), tv.to(torch.device("cpu")), tv.to(device="cpu")):
        assert isinstance(moved, TaskVector) and as_lists(moved) == as_lists(tv)
    both = tv.to("cpu", torch.float16)
    assert {delta.dtype for delta in both.values()} == {torch.float16}
    assert as_lists(tv.to(dtype=torch.float32)) == {"w": [1.0, 2.0], "b": [3.0]}


def test_from_state_dicts_names_a_bad_dtype_or_a_value_that_is_not_a_tensor():
    w = {"w": torch.ones(2)}
    with pytest.raises(TypeError, match="dtype must be a torch.dtype, not 'float32'"):
        TaskVector.from_state_dicts(w, w, dtype="float32")
    with pytest.raises(ValueError, match="dtype must be floating point, not torch.int64"):
        TaskVector.from_state_dicts(w, w, dtype=torch.int64)
    with pytest.raises(TypeError, match="tensor 'w' of the fine-tuned model is a NoneType"):
        TaskVector.from_state_dicts({"w": None}, w)
    with pytest.raises(TypeError, match="tensor 'w' of the base is a list"):
        TaskVector.from_state_dicts(w, {"w": [1.0, 1.0]})


def test_apply_to_takes_any_real_scale_and_names_what_it_refuses():
    tv = vector(w=[1.0, -2.0])
    base = {"w": torch.zeros(2, dtype=torch.float64)}
    assert tv.apply_to(base, scale=np.float32(0.5))["w"].tolist() == [0.5, -1.0]
    for scale in ("1", None, True):
        with pytest.raises(TypeError, match="apply_to: scale must be a real number"):
            tv.apply_to(base, scale=scale)
    for scale in (float("nan"), float("inf"), -np.inf, 10**400):
        with pytest.raises(ValueError, match="apply_to: scale .* must be finite"):
            tv.apply_to(base, scale=scale)


def test_scalar_times_task_vector_takes_numpy_scalars_on_either_side():
    tv = vector(w=[1.0, -2.0])
    for product in (np.float64(2) * tv, tv * np.float32(2), np.int64(2) * tv, 2 * tv):
        assert isinstance(product, TaskVector) and product["w"].tolist() == [2.0, -4.0]
    with pytest.raises(TypeError, match="apply_to: base must map tensor names to tensors"):
        tv.apply_to([torch.zeros(2)])
