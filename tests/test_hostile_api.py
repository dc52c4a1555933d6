"""Misuse of the public Python API: each is refused at once with an error naming the argument,
key or tensor, never accepted to go silently wrong later (no outer step, NaN parameters)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import pytest
import torch
from fault_hook import FailsAfterStepping

import mergekit_loco as ml


def tiny() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    """A Linear(4, 3) with its inner (SGD) and outer (SGD, momentum) optimizers."""
    model = torch.nn.Linear(4, 3)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9)
    return model, inner, outer


# -- DiLoCo: construction ------------------------------------------------------------------------
@pytest.mark.parametrize("sync_every", [2.5, float("nan"), 3.0, True, "3", None])
def test_sync_every_must_be_an_int(sync_every):
    model, inner, outer = tiny()
    with pytest.raises(TypeError, match="sync_every must be an int >= 1"):
        ml.DiLoCo(model, inner, outer, aggregator="mean", sync_every=sync_every)


@pytest.mark.parametrize("sync_every", [0, -1])
def test_sync_every_must_be_at_least_one(sync_every):
    model, inner, outer = tiny()
    with pytest.raises(ValueError, match=f"sync_every must be >= 1, got {sync_every}"):
        ml.DiLoCo(model, inner, outer, aggregator="mean", sync_every=sync_every)


def test_no_inner_optimizer_is_refused():
    model, _, outer = tiny()
    with pytest.raises(ValueError, match="inner_optimizer is empty"):
        ml.DiLoCo(model, [], outer, aggregator="mean")


@pytest.mark.parametrize("device", ["gpu0", 3.5])
def test_a_backup_device_that_is_no_device_is_named(device):
    """Before: torch's own ``Invalid device string: 'gpu0'``."""
    model, inner, outer = tiny()
    with pytest.raises(ValueError, match=re.escape(f"backup_device: {device!r} is not a device")):
        ml.DiLoCo(model, inner, outer, aggregator="mean", backup_device=device)


def test_inner_optimizer_of_another_model_is_refused():
    model, inner, outer = tiny()
    stranger = torch.optim.SGD(torch.nn.Linear(4, 3).parameters(), lr=0.1)
    with pytest.raises(ValueError, match="inner_optimizer 0 holds a tensor that is not a param"):
        ml.DiLoCo(model, stranger, outer, aggregator="mean")
    with pytest.raises(ValueError, match="inner_optimizer 1 holds a tensor that is not a param"):
        ml.DiLoCo(model, [inner, stranger], outer, aggregator="mean")


def test_inner_optimizer_that_is_not_an_optimizer_is_refused():
    model, _, outer = tiny()
    with pytest.raises(TypeError, match="inner_optimizer 0 is a Tensor, not a torch optimizer"):
        ml.DiLoCo(model, [model.weight.detach()], outer, aggregator="mean")


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """One inner step of ``optimizer`` on a fixed batch."""
    model(torch.ones(2, 4)).pow(2).sum().backward()
    optimizer.step()
    optimizer.zero_grad()


def test_an_outer_optimizer_that_is_an_inner_one_is_refused():
    """``DiLoCo(model, opt, opt)`` was accepted: each outer step fired the inner post-step hook,
    so rounds shrank to sync_every - 1 inner steps. The outer optimizer holds the same
    parameters as the inner ones (that is how it steps the model), so only the object is
    refused, also where an inner optimizer wraps it (as the training loop's does)."""
    from mergekit_loco.train.config import TrainConfig
    from mergekit_loco.train.workers import InnerOptimizer

    model, inner, _ = tiny()
    with pytest.raises(ValueError, match="outer_optimizer is inner_optimizer 0 .*pass a sep"):
        ml.DiLoCo(model, inner, inner, aggregator="mean", sync_every=2)
    second = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="outer_optimizer is inner_optimizer 1"):
        ml.DiLoCo(model, [inner, second], second, aggregator="mean", sync_every=2)
    wrapper = InnerOptimizer(model, TrainConfig(), total_steps=10)
    with pytest.raises(ValueError, match="outer_optimizer is inner_optimizer 0 "):
        ml.DiLoCo(model, wrapper, wrapper.optimizers[-1], aggregator="mean", sync_every=2)
    outer = torch.optim.SGD(model.parameters(), lr=0.7)  # same parameters, its own object
    with ml.DiLoCo(model, inner, outer, aggregator="mean", sync_every=2) as driver:
        for _ in range(6):
            step(model, inner)
    assert (driver.outer_steps, driver.local_steps) == (3, 0)  # 6 steps, rounds of 2


def test_entering_a_driver_twice_is_refused_and_leaving_removes_only_its_hooks():
    """A nested ``with driver:`` registered the hooks twice (each step counted twice) and
    leaked the first pair: outer steps then fired outside the block."""
    model, inner, outer = tiny()
    user_steps = []
    inner.register_step_post_hook(lambda *args: user_steps.append(1))  # the user's own hook
    driver = ml.DiLoCo(model, inner, outer, aggregator="mean", sync_every=4)
    with driver:
        with pytest.raises(RuntimeError, match=r"DiLoCo driver \(aggregator mean, sync_every 4\)"
                           " is already entered"):  # fmt: skip
            with driver:
                pass
        step(model, inner)
        assert driver.local_steps == 1  # counted once
    for _ in range(8):  # outside the block: the driver counts nothing, the user's hook still runs
        step(model, inner)
    assert (driver.local_steps, driver.outer_steps, len(user_steps)) == (1, 0, 9)
    with driver:  # entered again: the round goes on
        for _ in range(3):
            step(model, inner)
    assert (driver.local_steps, driver.outer_steps) == (0, 1)


def test_arguments_of_the_wrong_kind_are_named_not_left_to_fail_inside():
    """Before: ``'NoneType' object is not iterable``, ``dictionary update sequence element #0
    has length 1``, ``AssertionError: Torch not compiled with CUDA enabled``."""
    model, inner, outer = tiny()
    for options, error, message in (
        ({"exclude": None}, TypeError, "exclude: a list of parameter names, not None"),
        ({"aggregator_options": "density=0.5"}, TypeError, "aggregator_options: a mapping"),
        ({"backup_device": "cuda:99"}, ValueError, "backup_device: 'cuda:99' is not a device"),
    ):
        with pytest.raises(error, match=re.escape(message)):
            ml.DiLoCo(model, inner, outer, aggregator="ties", **options)


def test_optimizers_over_parts_of_the_model_are_not_taken_for_two_workers():
    """Muon for one part and AdamW for the other is one worker (before: taken for two, and the
    second's first step failed as out of its turn)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    second = torch.optim.SGD(model[1].parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=0.7)
    with pytest.raises(ValueError, match="inner_optimizer 1 steps other parameters than"):
        ml.DiLoCo(model, [first, second], outer, aggregator="mean")


def test_keyword_typos_are_named_as_typos_and_wrong_kinds_as_such(tmp_path):
    """Before: ``method 'mean' does not take 'momentm'``, ``... 'forse'``; a custom method's
    result of another shape was written, or failed inside torch; numpy deltas, modules given as
    state dicts and wrong path kinds failed deep inside."""
    with pytest.raises(TypeError, match=r"OuterOptimizer\(\) got an unexpected keyword 'momentm' "
                       r"\(did you mean momentum\?\)"):  # fmt: skip
        ml.OuterOptimizer({"w": torch.zeros(2)}, momentm=0.9)
    out = tmp_path / "out.safetensors"
    with pytest.raises(TypeError, match=r"keyword 'forse' \(did you mean force\?\)"):
        ml.merge_checkpoints(["a", "b"], "base", "ta", out, forse=True)
    for options, message in (
        ({"models": None}, "models: a list of checkpoints (paths), not None"),
        ({"models": ["a", 3]}, "models: a path (str or Path), not 3"),
        ({"out": None}, "out: a path (str or Path), not None"),
        ({"max_shard_bytes": True}, "max_shard_bytes: an int (bytes per shard), not True"),
        ({"max_shard_bytes": "1GB"}, "max_shard_bytes: an int (bytes per shard), not '1GB'"),
    ):
        args = {"models": ["a", "b"], "base": "base", "method": "ta", "out": out} | options
        with pytest.raises(TypeError, match=re.escape(message)):
            ml.merge_checkpoints(**args)
    assert not out.exists()
    with pytest.raises(TypeError, match=r"worker delta 1 maps 'w' to a ndarray, not a torch"):
        ml.OuterOptimizer({"w": torch.zeros(2)}).step([{"w": torch.ones(2).numpy()}])
    model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="finetuned must map tensor names to tensors"):
        ml.TaskVector.from_state_dicts(model.named_parameters(), model.state_dict())
    with pytest.raises(TypeError, match="base must map tensor names to tensors"):
        ml.TaskVector.from_state_dicts(model.state_dict(), model)


@dataclass(frozen=True)
class FirstRow(ml.MergeMethod):
    """A method of one's own whose result is the first row: another shape."""

    name = "first-row"

    def merge_tensor(self, name, deltas):
        return deltas[0][0]


def test_a_method_whose_result_has_another_shape_is_named():
    message = "first-row: merge_tensor of tensor 'w' returned a [3] tensor; it must return one "
    message += "tensor of the deltas' shape, [4, 3]"
    with pytest.raises(TypeError, match=re.escape(message)):
        FirstRow().merge([ml.TaskVector({"w": torch.ones(4, 3)})])


# -- DiLoCo: a failed step, a changed model --------------------------------------------------------
@dataclass(frozen=True)
class FailsOnce(ml.MergeMethod):
    """The mean, but its first aggregation raises (a peer timing out, say)."""

    name = "fails-once"
    calls: dict = field(default_factory=dict)

    def local_term(self, name, delta, worker_index):
        self.calls[len(self.calls)] = name
        if len(self.calls) == 1:
            raise TimeoutError("the first aggregation fails")
        return delta

    def finish(self, name, total, workers):
        return total / workers


@pytest.mark.parametrize("workers", [1, 2])
def test_a_failed_outer_step_keeps_the_round_and_sync_retries_it(workers):
    """Before: the round's deltas were dropped and the retried sync() did nothing."""

    def run(method):
        torch.manual_seed(0)
        model, _, outer = tiny()
        inners = [torch.optim.SGD(model.parameters(), lr=0.1) for _ in range(workers)]
        driver = ml.DiLoCo(model, inners, outer, aggregator=method, sync_every=2)
        with driver:
            for inner in inners:
                step(model, inner)
                if inner is inners[-1] and isinstance(method, FailsOnce):
                    with pytest.raises(TimeoutError):
                        step(model, inner)
                    with pytest.raises(RuntimeError, match="outer step of round 1 failed"):
                        step(model, inners[0])  # no inner step while the step is due
                    assert len(driver.state_dict()["pending"]) == workers
                    assert driver.sync() is not None
                else:
                    step(model, inner)
        assert driver.outer_steps == 1 and not driver.pending
        return [p.detach().clone() for p in model.parameters()]

    for retried, plain in zip(run(FailsOnce()), run("mean"), strict=True):
        assert torch.equal(retried, plain)


def test_state_dict_before_the_first_block_holds_the_weights_loaded_after_construction():
    """Before: the construction-time weights, which a resume loaded over the pretrained ones."""
    model, inner, outer = tiny()
    driver = ml.DiLoCo(model, inner, outer, aggregator="mean", sync_every=2)
    with torch.no_grad():
        model.weight.fill_(0.5)
    assert torch.equal(driver.state_dict()["global_params"]["weight"], model.weight.detach())


def test_a_parameter_frozen_or_unfrozen_after_construction_is_refused_before_the_step():
    """Before: an unfrozen parameter trained on each worker, was never merged, and took the
    outer optimizer's step on its stale inner gradient."""
    for change in ("unfreeze", "freeze"):
        model, _, _ = tiny()
        model.weight.requires_grad_(change == "freeze")
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        outer = torch.optim.SGD(model.parameters(), lr=0.5)
        driver = ml.DiLoCo(model, inner, outer, aggregator="mean", sync_every=1)
        changed = model.weight if change == "unfreeze" else model.bias
        changed.requires_grad_(change == "unfreeze")
        before = changed.detach().clone()
        now = "trainable" if change == "unfreeze" else "frozen"
        with driver, pytest.raises(RuntimeError, match=f"parameter '.*' is {now} now"):
            model(torch.ones(2, 4)).pow(2).sum().backward()
            inner.step()
        assert torch.equal(changed, before) and driver.outer_steps == 0


def test_a_model_cast_after_construction_gives_the_global_dtype():
    """``model.double()`` after construction (before: theta_global stayed float32, and every
    outer step rounded the model through it)."""
    model, inner, outer = tiny()
    driver = ml.DiLoCo(model, inner, outer, aggregator="mean", sync_every=1)
    model.double()
    with driver:
        model(torch.ones(2, 4, dtype=torch.float64)).pow(2).sum().backward()
        inner.step()
    assert {t.dtype for t in driver.global_params.values()} == {torch.float64}


def test_an_outer_step_that_overflows_leaves_the_model_on_the_global_parameters():
    model = torch.nn.Linear(2, 1).half()
    with torch.no_grad():
        model.weight.fill_(3e4)
    inner = torch.optim.SGD(model.parameters(), lr=1.0)
    outer = torch.optim.SGD(model.parameters(), lr=5.0)
    driver = ml.DiLoCo(model, inner, outer, aggregator="mean", sync_every=1)
    with driver, pytest.raises(FloatingPointError, match="outer step left parameter 'weight'"):
        model.weight.grad = torch.full((1, 2), -1e4, dtype=torch.float16)
        inner.step()  # delta 1e4; 3e4 + 5 * 1e4 overflows float16
    assert torch.equal(model.weight.detach(), torch.full((1, 2), 3e4, dtype=torch.float16))


# -- DiLoCo: load_state_dict ----------------------------------------------------------------------
def saved_state(sync_every: int = 2) -> dict:
    """The state of a driver after one outer step and one step into the next turn."""
    model, inner, outer = tiny()
    driver = ml.DiLoCo(model, inner, outer, aggregator="mean", sync_every=sync_every)
    with driver:
        for _ in range(sync_every + 1):
            model(torch.ones(2, 4)).sum().backward()
            inner.step()
            inner.zero_grad()
    state = driver.state_dict()
    assert state["outer_steps"] == 1 and state["local_steps"] == 1
    return state


def fresh_driver(sync_every: int = 2, workers: int = 1) -> tuple[torch.nn.Module, ml.DiLoCo]:
    model, _, outer = tiny()
    inners = [torch.optim.SGD(model.parameters(), lr=0.1) for _ in range(workers)]
    return model, ml.DiLoCo(model, inners, outer, aggregator="mean", sync_every=sync_every)


def test_a_valid_state_still_loads():
    state = saved_state()
    _, driver = fresh_driver()
    driver.load_state_dict(state)
    assert driver.local_steps == 1 and driver.outer_steps == 1


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"local_steps": 2}, ValueError, r"'local_steps' is 2, outside \[0, sync_every=2\)"),
        ({"local_steps": 5}, ValueError, r"'local_steps' is 5, outside \[0, sync_every=2\)"),
        ({"local_steps": -1}, ValueError, r"'local_steps' is -1, outside"),
        ({"local_steps": 1.0}, TypeError, r"'local_steps' must be an int"),
        ({"local_steps": True}, TypeError, r"'local_steps' must be an int"),
        ({"outer_steps": -3}, ValueError, r"'outer_steps' is -3, below 0"),
        ({"outer_steps": "1"}, TypeError, r"'outer_steps' must be an int"),
        ({"local_step": 0}, ValueError, r"unknown key 'local_step'"),
        ({"pending": "x"}, TypeError, r"'pending' must be a list"),
        ({"pending": [{}]}, ValueError, r"'pending' holds 1 finished turns"),
        ({"outer": None}, TypeError, r"'outer' must be an optimizer state_dict"),
        ({"global_params": [1.0]}, TypeError, r"global_params must map parameter names"),
        ({"global_params": {"weight": torch.zeros(3, 4)}}, ValueError, r"tensor 'bias' differs"),
        (
            {"global_params": {"weight": torch.full((3, 4), float("nan")), "bias": torch.zeros(3)}},
            ValueError,
            r"global 'weight' holds NaN or Inf",
        ),
        (
            {"outer": torch.optim.Adam(torch.nn.Linear(4, 3).parameters()).state_dict()},
            ValueError,
            r"saved by another kind of optimizer than this SGD: it has the setting",
        ),
        (
            {"outer": {"state": {}, "param_groups": [{"params": [0]}, {"params": [1]}]}},
            ValueError,
            r"parameter groups of \[1, 1\] tensors, but the outer optimizer has \[2\]",
        ),
    ],
)
def test_a_state_this_driver_cannot_go_on_from_is_refused(change, error, message):
    """Nothing changes: the model and the counters are as they were."""
    state = {**saved_state(), **change}
    model, driver = fresh_driver()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(error, match=message):
        driver.load_state_dict(state)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert driver.local_steps == 0 and driver.outer_steps == 0 and driver.pending == []


@pytest.mark.parametrize("key", ["global_params", "local_steps", "outer_steps", "outer"])
def test_a_state_missing_a_key_names_it(key):
    state = saved_state()
    del state[key]
    _, driver = fresh_driver()
    with pytest.raises(ValueError, match=f"lacks the key '{key}'"):
        driver.load_state_dict(state)


def test_a_state_saved_with_a_larger_sync_every_is_refused():
    _, driver = fresh_driver(sync_every=1)
    with pytest.raises(ValueError, match=r"'local_steps' is 1, outside \[0, sync_every=1\)"):
        driver.load_state_dict(saved_state(sync_every=3))


def test_pending_turns_must_hold_the_parameters_as_tensors():
    state = saved_state()
    weight = state["global_params"]["weight"]
    _, driver = fresh_driver(workers=2)
    with pytest.raises(ValueError, match="pending turn 0 tensor 'bias' differs"):
        driver.load_state_dict({**state, "pending": [{"weight": weight}]})
    with pytest.raises(TypeError, match="pending turn 0 'bias' is a str, not a tensor"):
        driver.load_state_dict({**state, "pending": [{"weight": weight, "bias": "x"}]})
    driver.load_state_dict({**state, "pending": [dict(state["global_params"])]})
    assert len(driver.pending) == 1


# -- OuterOptimizer -------------------------------------------------------------------------------
@pytest.mark.parametrize("lr", [float("nan"), float("inf"), -float("inf"), 0.0, -0.5])
def test_outer_lr_must_be_finite_and_positive(lr):
    with pytest.raises(ValueError, match="OuterOptimizer lr must be finite and > 0"):
        ml.OuterOptimizer({"w": torch.zeros(2)}, lr=lr)


@pytest.mark.parametrize("momentum", [float("nan"), float("inf"), -0.1, 1.0, 1.5])
def test_outer_momentum_must_lie_in_zero_one(momentum):
    with pytest.raises(ValueError, match=r"OuterOptimizer momentum must lie in \[0, 1\)"):
        ml.OuterOptimizer({"w": torch.zeros(2)}, lr=0.7, momentum=momentum)


@pytest.mark.parametrize(("option", "value"), [("lr", "0.7"), ("momentum", None), ("lr", True)])
def test_outer_rates_must_be_numbers(option, value):
    with pytest.raises(TypeError, match=f"OuterOptimizer {option} must be a real number"):
        ml.OuterOptimizer({"w": torch.zeros(2)}, **{"lr": 0.7, option: value})


def test_outer_params_must_be_floating_and_nesterov_a_bool():
    """An integer parameter was accepted and failed at the first step, leaving ``.grad`` set;
    ``nesterov="yes"`` or None went to torch unchecked."""
    with pytest.raises(ValueError, match="params: 'ids' is torch.int64; only floating tensors"):
        ml.OuterOptimizer({"w": torch.zeros(2), "ids": torch.zeros(3, dtype=torch.long)})
    for nesterov in ("yes", None, 1):
        with pytest.raises(TypeError, match="OuterOptimizer nesterov must be True or False"):
            ml.OuterOptimizer({"w": torch.zeros(2)}, momentum=0.9, nesterov=nesterov)


def test_a_failed_outer_step_leaves_no_gradient_behind():
    params = {"w": torch.zeros(2)}
    outer = ml.OuterOptimizer(params, lr=0.5)

    def broken_step(*args, **kwargs):
        raise RuntimeError("the optimizer failed")

    outer.sgd.step = broken_step
    with pytest.raises(RuntimeError, match="the optimizer failed"):
        outer.step([ml.TaskVector({"w": torch.ones(2)})])
    assert params["w"].grad is None


def test_outer_step_takes_any_iterable_of_deltas_once():
    deltas = [ml.TaskVector({"w": torch.full((2,), value)}) for value in (1.0, 3.0)]
    params = {"w": torch.zeros(2, dtype=torch.float64)}
    ml.OuterOptimizer(params, lr=0.5).step(delta for delta in deltas)
    assert params["w"].tolist() == [1.0, 1.0]  # 0 + 0.5 * mean(1, 3)
    with pytest.raises(TypeError, match="step: worker delta 2 is a list, not a TaskVector"):
        ml.OuterOptimizer({"w": torch.zeros(2)}).step([deltas[0], [1.0]])


class Unnamed(ml.MergeMethod):
    """A custom method without a ``name``."""

    def merge_tensor(self, name, deltas):
        return deltas[0]


class NoMath(ml.MergeMethod):
    """A custom method with a name and no math."""

    name = "no-math"


@pytest.mark.parametrize(
    ("method", "message"),
    [
        (Unnamed(), "Unnamed: a merge method needs a name, a non-empty str"),
        (NoMath(), "no-math: declare local_term and finish .*, or merge_tensor"),
    ],
)
def test_a_method_object_without_a_name_or_math_is_refused_when_given(method, message):
    model, inner, outer = tiny()
    with pytest.raises(TypeError, match=message):
        ml.DiLoCo(model, inner, outer, aggregator=method)
    with pytest.raises(TypeError, match=message):
        ml.OuterOptimizer({"w": torch.zeros(2)}, aggregator=method)
    with pytest.raises(TypeError, match=message):
        method.merge([ml.TaskVector({"w": torch.ones(2)})])


def stepped_outer() -> ml.OuterOptimizer:
    """An outer optimizer with momentum, one step taken (its momentum buffer exists)."""
    outer = ml.OuterOptimizer({"w": torch.zeros(2), "b": torch.zeros(3)}, lr=0.7, momentum=0.9)
    outer.step([ml.TaskVector({"w": torch.ones(2), "b": torch.ones(3)})])
    return outer


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda s: {**s, "extra": 1}, "must hold 'steps_taken' and 'sgd' (and 'names'), nothing"),
        (lambda s: {**s, "names": ["w", "c"]}, "parameter names are not this optimizer's ('b'"),
        (lambda s: {**s, "names": ["w", 3]}, "parameter names are not this optimizer's"),
        (lambda s: {**s, "sgd": {**s["sgd"], "state": {0: {"momentum_buffer": torch.full((2,),
         float("inf"))}}}}, "the momentum of 'w' holds NaN or Inf"),
        (lambda s: {**s, "steps_taken": -1}, "'steps_taken' must be an int >= 0, got -1"),
        (lambda s: {**s, "steps_taken": 1.5}, "'steps_taken' must be an int >= 0, got 1.5"),
        (lambda s: {**s, "sgd": [1]}, "'sgd' must be an SGD state_dict"),
        (lambda s: {**s, "sgd": {**s["sgd"], "state": {7: {"momentum_buffer": torch.zeros(2)}}}},
         "holds a state for parameter 7"),
        (lambda s: {**s, "sgd": {**s["sgd"], "state": {0: {"momentum_buffer": torch.zeros(5)}}}},
         "the momentum of 'w' is [5], but the parameter is [2]"),
    ],
)  # fmt: skip
def test_an_outer_state_of_another_optimizer_is_refused_before_any_change(change, message):
    outer = stepped_outer()
    before = outer.state_dict()
    with pytest.raises(ValueError, match=re.escape(message)):
        outer.load_state_dict(change(outer.state_dict()))
    assert outer.steps_taken == before["steps_taken"] == 1
    assert torch.equal(outer.momentum_buffers["w"], before["sgd"]["state"][0]["momentum_buffer"])
    fresh = ml.OuterOptimizer({"w": torch.zeros(2), "b": torch.zeros(3)}, lr=0.7, momentum=0.9)
    fresh.load_state_dict(before)  # a state of its own kind loads
    saved_buffer = before["sgd"]["state"][1]["momentum_buffer"]
    assert fresh.steps_taken == 1 and torch.equal(fresh.momentum_buffers["b"], saved_buffer)


def test_an_outer_state_is_matched_to_the_parameters_by_name():
    """Before: by position, so an optimizer over ``{b, a}`` took a's momentum for b's."""
    saved = stepped_outer().state_dict()
    swapped = ml.OuterOptimizer({"b": torch.zeros(3), "w": torch.zeros(2)}, lr=0.7, momentum=0.9)
    swapped.load_state_dict(saved)
    assert swapped.momentum_buffers.keys() == {"w", "b"}
    assert torch.equal(swapped.momentum_buffers["w"], torch.full((2,), -1.0))  # g = -merged
    assert torch.equal(swapped.momentum_buffers["b"], torch.full((3,), -1.0))
    legacy = {key: saved[key] for key in ("steps_taken", "sgd")}  # saved before names: position
    same_order = ml.OuterOptimizer({"w": torch.zeros(2), "b": torch.zeros(3)}, momentum=0.9)
    same_order.load_state_dict(legacy)
    assert same_order.momentum_buffers["b"].shape == (3,)


def test_nesterov_without_momentum_and_a_step_that_overflows_are_named():
    with pytest.raises(ValueError, match="nesterov=True needs momentum > 0"):
        ml.OuterOptimizer({"w": torch.zeros(2)}, nesterov=True)
    params = {"w": torch.full((2,), 6e4, dtype=torch.float16)}
    delta = ml.TaskVector({"w": torch.full((2,), 1e4, dtype=torch.float16)})
    with pytest.raises(FloatingPointError, match="outer step left parameter 'w' not finite"):
        ml.OuterOptimizer(params, lr=1.0).step([delta])  # 6e4 + 1e4 > 65504


@pytest.mark.parametrize("failure", ["overflow", "raises after stepping"])
def test_a_failed_outer_step_leaves_the_momentum_as_it_was(failure):
    """A retried step ends on the bits of a step that never failed. Before: the failed step's
    pseudo-gradient stayed in the momentum buffer, so the retry counted it twice."""

    def run(fail: bool) -> list[torch.Tensor]:
        model = torch.nn.Linear(2, 1, bias=False).half()
        with torch.no_grad():
            model.weight.fill_(1000.0)
        inner = torch.optim.SGD(model.parameters(), lr=1.0)
        outer = FailsAfterStepping(model.parameters(), lr=1.0, momentum=0.9, nesterov=True)
        driver = ml.DiLoCo(model, inner, outer, aggregator="mean", sync_every=1)
        with driver:
            for round_index in range(2):
                if fail and round_index == 1:
                    if failure == "overflow":  # 1019 + 1e4 * 27.1 passes float16's 65504
                        outer.param_groups[0]["lr"] = 1e4
                    else:
                        outer.armed = True
                    with pytest.raises((FloatingPointError, RuntimeError)):
                        model.weight.grad = torch.full((1, 2), -10.0, dtype=torch.float16)
                        inner.step()
                    outer.param_groups[0]["lr"] = 1.0
                    assert driver.sync() is not None  # the retry
                else:
                    model.weight.grad = torch.full((1, 2), -10.0, dtype=torch.float16)
                    inner.step()
        buffer = outer.state[model.weight]["momentum_buffer"]
        return [model.weight.detach().clone(), buffer.clone()]

    retried, plain = run(fail=True), run(fail=False)
    assert torch.equal(plain[0], torch.full((1, 2), 1046.0, dtype=torch.float16))  # 1019 + 27.1
    for got, expected in zip(retried, plain, strict=True):
        assert torch.equal(got, expected)


def test_an_outer_optimizer_step_that_overflows_changes_nothing():
    """Before: the parameters were left at Inf and the momentum had taken the step."""
    params = {"w": torch.full((2,), 3e4, dtype=torch.float16)}
    outer = ml.OuterOptimizer(params, lr=1.0, momentum=0.5)
    outer.step([ml.TaskVector({"w": torch.full((2,), 8.0, dtype=torch.float16)})])
    before = params["w"].clone(), outer.momentum_buffers["w"].clone()
    delta = ml.TaskVector({"w": torch.full((2,), 4e4, dtype=torch.float16)})
    with pytest.raises(FloatingPointError, match="outer step left parameter 'w' not finite"):
        outer.step([delta])  # 3e4 + 4e4 + 0.5 * 8 > 65504
    assert torch.equal(params["w"], before[0])
    assert torch.equal(outer.momentum_buffers["w"], before[1])
    assert outer.steps_taken == 1


def test_outer_params_must_map_names_to_tensors():
    with pytest.raises(TypeError, match="params must be a mapping of name -> tensor"):
        ml.OuterOptimizer([torch.zeros(2)], lr=0.7)
    with pytest.raises(TypeError, match="params: 'w' is a list, not a tensor"):
        ml.OuterOptimizer({"w": [0.0, 0.0]}, lr=0.7)


def test_outer_params_that_share_memory_are_refused():
    """Tied embeddings under two names (a state_dict lists both; before: the step was applied
    twice, 0.2 for a delta of 0.1), one tensor twice, overlapping views of one buffer: refused
    naming both; disjoint views of one buffer (a flat parameter buffer) step once each."""

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(5, 3)
            self.head = torch.nn.Linear(3, 5, bias=False)
            self.head.weight = self.embed.weight

    flat = torch.zeros(10)
    shared = torch.zeros(2)
    for params, names in [
        (Tied().state_dict(), "'embed.weight' and 'head.weight'"),
        ({"a": shared, "b": shared}, "'a' and 'b'"),
        ({"low": flat[:6], "high": flat[4:]}, "'low' and 'high'"),  # in memory order
        ({"rows": flat.view(2, 5), "column": flat.view(2, 5)[:, 4]}, "'rows' and 'column'"),
    ]:
        with pytest.raises(ValueError, match=re.escape(f"params: {names} share memory")):
            ml.OuterOptimizer(params, lr=1.0)
    params = {"low": flat[:5], "high": flat[5:], "odd": torch.zeros(4)[1::2]}
    outer = ml.OuterOptimizer(params, lr=1.0)
    outer.step([ml.TaskVector({name: torch.ones_like(t) for name, t in params.items()})])
    assert torch.equal(flat, torch.ones(10)) and params["odd"].tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="params is empty"):
        ml.OuterOptimizer({}, lr=1.0)


def test_valid_outer_options_still_step():
    params = {"w": torch.zeros(2, dtype=torch.float64)}
    outer = ml.OuterOptimizer(params, lr=0.5, momentum=0.0)
    outer.step([ml.TaskVector({"w": torch.ones(2, dtype=torch.float64)})])
    assert torch.equal(params["w"], torch.full((2,), 0.5, dtype=torch.float64))


def test_outer_step_with_deltas_of_different_shapes_names_the_tensor():
    params = {"w": torch.zeros(2, 2), "b": torch.zeros(2)}
    outer = ml.OuterOptimizer(params, "mean", lr=1.0, momentum=0.9)
    good = ml.TaskVector({"w": torch.ones(2, 2), "b": torch.ones(2)})
    bad = ml.TaskVector({"w": torch.ones(2, 3), "b": torch.ones(2)})
    with pytest.raises(ValueError, match=r"worker delta 2: tensor 'w' is \[2, 3\] but the para"):
        outer.step([good, bad])
    assert torch.equal(params["w"], torch.zeros(2, 2)) and outer.steps_taken == 0


# -- merge methods and TaskVector -----------------------------------------------------------------
@pytest.mark.parametrize("method", ["mean", "ta", "ties", "tsv", "iso-c"])
def test_merge_of_deltas_of_different_shapes_names_the_tensor(method):
    first = ml.TaskVector({"b": torch.ones(3), "w": torch.ones(3, 4)})
    second = ml.TaskVector({"b": torch.ones(3), "w": torch.ones(4, 3)})
    with pytest.raises(ValueError, match=r"tensor 'w' is \[4, 3\] in task vector 2 but \[3, 4\]"):
        ml.get_method(method).merge([first, second])


def test_task_vector_refuses_values_that_are_not_tensors():
    with pytest.raises(TypeError, match="the delta of 'w' is a str, not a torch.Tensor"):
        ml.TaskVector({"w": "x"})
    with pytest.raises(TypeError, match="the delta of 'b' is a list"):
        ml.TaskVector({"w": torch.zeros(2), "b": [1.0]})
    with pytest.raises(TypeError, match="TaskVector takes a mapping of tensor name -> delta"):
        ml.TaskVector([torch.zeros(2)])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("method", ml.list_methods())
def test_every_method_refuses_a_delta_holding_nan_or_inf_naming_it(method, bad):
    """One check for every method: no NaN spread through a sum, no LinAlgError from an SVD."""
    good = ml.TaskVector({"w": torch.randn(6, 5, generator=torch.Generator().manual_seed(0))})
    poisoned = torch.ones(6, 5)
    poisoned[2, 3] = bad
    expected = rf"{re.escape(method)}: delta 2 of tensor 'w' holds NaN or Inf"
    with pytest.raises(ValueError, match=expected):
        ml.get_method(method).merge([good, ml.TaskVector({"w": poisoned})])
    with pytest.raises(ValueError, match=expected):
        ml.get_method(method).merge_tensor("w", [good["w"], poisoned])


@pytest.mark.parametrize("method", [m for m in ml.list_methods() if m != "ties"])
def test_meta_deltas_have_no_values_to_check(method):
    """(ties reads values to trim, a k-th magnitude, so it never took meta tensors.)"""
    merged = ml.get_method(method).merge_tensor("w", [torch.empty(6, 5, device="meta")] * 2)
    assert merged.shape == (6, 5) and merged.device.type == "meta"


def test_a_finite_delta_whose_sum_overflows_is_merged():
    """The finiteness check sums a delta first; a float16 sum past 65504 is not a NaN entry."""
    big = torch.full((64,), 60000.0, dtype=torch.float16)
    merged = ml.get_method("mean").merge_tensor("w", [big, big / 2])
    assert torch.equal(merged, torch.full((64,), 45000.0, dtype=torch.float16))


def test_weighted_mean_scales_by_fractions_and_never_overflows_on_the_weights():
    """Before, the raw weights multiplied the deltas first: (5e4, 3e4) on float16 deltas gave
    inf, (1e39, 3e39) on float32 gave NaN, though only their ratios count. Now w_t / W does:
    the same merge as (5, 3) and (1, 3), checked against the float64 formula."""
    a16 = ml.TaskVector({"w": torch.tensor([2.0, -1.0], dtype=torch.float16)})
    b16 = ml.TaskVector({"w": torch.tensor([1.0, 1.0], dtype=torch.float16)})
    exact = (5 * torch.tensor([2.0, -1.0]) + 3 * torch.tensor([1.0, 1.0])) / 8  # [1.625, -0.25]
    for weights in [(5.0, 3.0), (5e4, 3e4)]:
        merged = ml.get_method("mean", weights=weights).merge([a16, b16])["w"]
        assert merged.dtype == torch.float16 and torch.equal(merged.float(), exact)
    a = ml.TaskVector({"w": torch.tensor([1.0, -1.0])})
    b = ml.TaskVector({"w": torch.tensor([-1.0, 1.0])})
    for weights in [(1.0, 3.0), (1e39, 3e39)]:
        assert ml.get_method("mean", weights=weights).merge([a, b])["w"].tolist() == [-0.5, 0.5]
    with pytest.raises(ValueError, match=r"weights \(1e\+39, 3e\+39\) go beyond torch.float32"):
        ml.get_method("ties", density=1.0, weights=(1e39, 3e39)).merge([a, b])


@pytest.mark.parametrize("method", ["mean", "ta", "ties", "iso-c", "iso-cts"])
def test_an_in_memory_merge_that_overflows_is_refused_naming_the_tensor(method):
    """Before, finite float32 deltas near the top of the range came back inf (mean, ta, ties)
    or NaN (iso-c, iso-cts: an overflowed SVD), silently; merge_checkpoints already refused
    it. In float64 the same merge is finite."""
    big = torch.diag(torch.tensor([3e38, 2e38]))
    task_vectors = [ml.TaskVector({"w": big}), ml.TaskVector({"w": big})]
    options = {"density": 1.0} if method == "ties" else {}
    with pytest.raises(
        ValueError,
        match=f"{method}: tensor 'w': the merge of finite deltas overflows torch.float32",
    ):
        ml.get_method(method, **options).merge(task_vectors)
    wide = ml.get_method(method, **options).merge([tv.to(torch.float64) for tv in task_vectors])
    assert torch.isfinite(wide["w"]).all()


def test_merge_across_ranks_takes_a_method_name_and_names_a_wrong_argument():
    """Before: a method name ended in ``'str' object has no attribute 'is_sum'`` and one
    TaskVector alone in ``KeyError: 0``."""
    from mergekit_loco.dist import merge_across_ranks

    one, two = ml.TaskVector({"w": torch.ones(2)}), ml.TaskVector({"w": torch.full((2,), 3.0)})
    merged, _ = merge_across_ranks("mean", [one, two])  # one process: its deltas are all
    assert merged["w"].tolist() == [2.0, 2.0]
    with pytest.raises(TypeError, match="method must be a MergeMethod or its name, not 1"):
        merge_across_ranks(1, [one])
    with pytest.raises(TypeError, match=r"takes a list of worker deltas \(\[tau_1, tau_2"):
        merge_across_ranks("mean", one)


def test_merge_checkpoints_force_must_be_a_bool(tmp_path):
    """Before, ``force="no"`` (truthy) overwrote an existing output."""
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"keep")
    for option in ("force", "progress"):
        with pytest.raises(TypeError, match=f"{option} must be True or False, not 'no'"):
            ml.merge_checkpoints(["a", "b"], "base", "ta", out, **{option: "no"})
    assert out.read_bytes() == b"keep"
