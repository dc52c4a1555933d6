"""The public DiLoCo driver against hand-written float64 rounds (numpy), OuterOptimizer, and
``mloco train``; its state, options and process-group manners."""

from __future__ import annotations

import datetime

import numpy as np
import pytest
import torch
import torch.distributed as dist

import mergekit_loco as ml
from mergekit_loco.task_vector import TaskVector

IN, OUT, LR_INNER, H = 4, 3, 0.05, 3


class Tiny(torch.nn.Module):
    """``y = x W^T + b``; ``frozen`` never trains; ``skip`` trains but is excluded from DiLoCo."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(
            torch.randn(OUT, IN, generator=generator, dtype=torch.float64)
        )
        self.bias = torch.nn.Parameter(torch.randn(OUT, generator=generator, dtype=torch.float64))
        self.frozen = torch.nn.Parameter(torch.ones(2, dtype=torch.float64), requires_grad=False)
        self.skip = torch.nn.Parameter(torch.full((2,), 3.0, dtype=torch.float64))

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((x @ self.weight.T + self.bias - y) ** 2).sum() + (self.skip**2).sum()


def batches(worker: int, rounds: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(100 + worker)
    return [
        (rng.standard_normal((5, IN)), rng.standard_normal((5, OUT))) for _ in range(rounds * H)
    ]


def run_driver(aggregator: str, workers: int, rounds: int, **outer_options) -> Tiny:
    """R simulated workers through DiLoCo, each with its own SGD inner optimizer."""
    model = Tiny()
    inners = [torch.optim.SGD(model.parameters(), lr=LR_INNER) for _ in range(workers)]
    trainable = [model.weight, model.bias]
    outer = torch.optim.SGD(trainable, **outer_options)
    data = [batches(w, rounds) for w in range(workers)]
    with ml.DiLoCo(model, inners, outer, aggregator=aggregator, sync_every=H, exclude=["skip"]):
        for round_index in range(rounds):
            for worker, inner in enumerate(inners):
                for x, y in data[worker][round_index * H : (round_index + 1) * H]:
                    model.loss(torch.from_numpy(x), torch.from_numpy(y)).backward()
                    inner.step()
                    inner.zero_grad()
    return model


def by_hand(aggregator: str, workers: int, rounds: int, lr: float, momentum: float):
    """The same rounds in numpy: gradient 2 r^T x for W, 2 sum(r) for b (r = xW^T + b - y);
    Iso-C: the mean delta's singular values replaced by their mean; Nesterov SGD on -merged."""
    model = Tiny()
    weight, bias = model.weight.detach().numpy().copy(), model.bias.detach().numpy().copy()
    skip = model.skip.detach().numpy().copy()
    data = [batches(w, rounds) for w in range(workers)]
    buffers = None
    for round_index in range(rounds):
        deltas = []
        for worker in range(workers):
            w, b = weight.copy(), bias.copy()
            for x, y in data[worker][round_index * H : (round_index + 1) * H]:
                residual = x @ w.T + b - y
                w, b = w - LR_INNER * 2 * residual.T @ x, b - LR_INNER * 2 * residual.sum(0)
                skip = skip - LR_INNER * 2 * skip  # trained by every turn, never reset
            deltas.append((w - weight, b - bias))
        merged_w = np.mean([d[0] for d in deltas], axis=0)
        merged_b = np.mean([d[1] for d in deltas], axis=0)
        if aggregator == "iso-c":
            left, singular, right_t = np.linalg.svd(merged_w, full_matrices=False)
            merged_w = singular.mean() * left @ right_t
        grads = (-merged_w, -merged_b)
        if buffers is None:
            buffers = [g.copy() for g in grads]
        else:
            buffers = [momentum * buf + g for buf, g in zip(buffers, grads, strict=True)]
        updates = [g + momentum * buf for g, buf in zip(grads, buffers, strict=True)]
        weight, bias = weight - lr * updates[0], bias - lr * updates[1]
    return weight, bias, skip


@pytest.mark.parametrize("aggregator", ["mean", "iso-c"])
def test_driver_equals_rounds_by_hand(aggregator):
    model = run_driver(aggregator, workers=3, rounds=3, lr=0.7, momentum=0.9, nesterov=True)
    weight, bias, skip = by_hand(aggregator, workers=3, rounds=3, lr=0.7, momentum=0.9)
    np.testing.assert_allclose(model.weight.detach().numpy(), weight, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(model.bias.detach().numpy(), bias, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(model.skip.detach().numpy(), skip, rtol=1e-12)
    assert torch.equal(model.frozen, torch.ones(2, dtype=torch.float64))


@pytest.mark.parametrize("aggregator", ["mean", "iso-c", "ties", "tsv"])
def test_driver_with_torch_sgd_equals_outer_optimizer_exactly(aggregator):
    """The same deltas through DiLoCo + torch SGD and through OuterOptimizer: bit-identical."""
    rounds, workers = 3, 2
    model = run_driver(aggregator, workers, rounds, lr=0.6, momentum=0.8, nesterov=True)
    reference = Tiny()
    params = {"weight": reference.weight.detach().clone(), "bias": reference.bias.detach().clone()}
    outer = ml.OuterOptimizer(params, aggregator, lr=0.6, momentum=0.8, nesterov=True)
    data = [batches(w, rounds) for w in range(workers)]
    for round_index in range(rounds):
        deltas = []
        for worker in range(workers):
            reference.weight.data.copy_(params["weight"])
            reference.bias.data.copy_(params["bias"])
            inner = torch.optim.SGD([reference.weight, reference.bias], lr=LR_INNER)
            for x, y in data[worker][round_index * H : (round_index + 1) * H]:
                reference.loss(torch.from_numpy(x), torch.from_numpy(y)).backward()
                inner.step()
                inner.zero_grad()
            deltas.append(
                TaskVector({n: getattr(reference, n).detach() - p for n, p in params.items()})
            )
        outer.step(deltas)
    assert torch.equal(model.weight.detach(), params["weight"])
    assert torch.equal(model.bias.detach(), params["bias"])


@pytest.mark.parametrize("aggregator", ["iso-c", "iso-cts", "mean"])
def test_a_worker_that_diverged_stops_the_outer_step_naming_the_tensor(aggregator):
    """A NaN loss in the step that ends the round: Iso-C and Iso-CTS used to raise torch's SVD
    error. The driver raises the documented FloatingPointError before aggregating; the global
    parameters (and the model, reset to them) are those of before the round."""
    model = Tiny()
    inner = torch.optim.SGD(model.parameters(), lr=LR_INNER)
    outer = torch.optim.SGD([model.weight, model.bias], lr=0.7, momentum=0.9)
    x, y = (torch.from_numpy(array) for array in batches(0, 1)[0])
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    with ml.DiLoCo(model, inner, outer, aggregator=aggregator, sync_every=2, exclude=["skip"]):
        model.loss(x, y).backward()
        inner.step()
        inner.zero_grad()
        (model.loss(x, y) * float("nan")).backward()
        with pytest.raises(FloatingPointError, match=r"^non-finite pseudo-gradient for 'weight'"):
            inner.step()
    assert torch.equal(model.weight.detach(), start["weight"])
    assert torch.equal(model.bias.detach(), start["bias"])
    assert not outer.state  # no momentum buffer: the outer optimizer never stepped


def test_state_dict_resumes_bit_identically_with_adam_outer():
    """Any torch outer optimizer (Adam here); stop after 2 of 4 rounds, restore into a fresh
    model and driver (global parameters on the CPU backup), finish: the same parameters."""

    def driver_for(model):
        inner = torch.optim.SGD(model.parameters(), lr=LR_INNER)
        outer = torch.optim.Adam([model.weight, model.bias], lr=0.1)
        return ml.DiLoCo(model, inner, outer, aggregator="iso-c", sync_every=H,
                         exclude=["skip"], backup_device="cpu")  # fmt: skip

    def train_rounds(model, driver, first, last):
        with driver:
            for x, y in batches(0, 4)[first * H : last * H]:
                model.loss(torch.from_numpy(x), torch.from_numpy(y)).backward()
                driver.inner_optimizers[0].step()
                driver.inner_optimizers[0].zero_grad()

    straight = Tiny()
    straight_driver = driver_for(straight)
    train_rounds(straight, straight_driver, 0, 4)

    first = Tiny()
    first_driver = driver_for(first)
    train_rounds(first, first_driver, 0, 2)
    saved = first_driver.state_dict()
    assert saved["outer_steps"] == 2 and first_driver.last_comm_stats is not None
    assert all(t.device.type == "cpu" for t in first_driver.global_params.values())
    resumed = Tiny()
    resumed.skip.data.copy_(first.skip)  # excluded: the user's own state
    resumed_driver = driver_for(resumed)
    resumed_driver.load_state_dict(saved)
    train_rounds(resumed, resumed_driver, 2, 4)
    for name, param in straight.named_parameters():
        assert torch.equal(param, dict(resumed.named_parameters())[name]), name


def test_bad_arguments_name_the_fault():
    model = Tiny()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="'nope', which is not a parameter"):
        ml.DiLoCo(model, inner, torch.optim.SGD([model.weight], lr=1.0), exclude=["nope"])
    with pytest.raises(ValueError, match="outer_optimizer holds a tensor that is not a param"):
        ml.DiLoCo(model, inner, torch.optim.SGD(model.parameters(), lr=1.0), exclude=["skip"])
    with pytest.raises(ValueError, match="outer_optimizer holds a tensor that is not a param"):
        ml.DiLoCo(model, inner, torch.optim.SGD([torch.zeros(2, requires_grad=True)], lr=1.0))
    frozen_included = [model.weight, model.bias, model.frozen]  # frozen: never stepped
    ml.DiLoCo(model, inner, torch.optim.SGD(frozen_included, lr=1.0), exclude=["skip"])
    with pytest.raises(ValueError, match="sync_every must be >= 1"):
        ml.DiLoCo(model, inner, torch.optim.SGD([model.weight], lr=1.0), sync_every=0)
    with pytest.raises(ValueError, match="does not take 'densty'"):
        trainable = [model.weight, model.bias]
        ml.DiLoCo(model, inner, torch.optim.SGD(trainable, lr=1.0), aggregator="ties",
                  aggregator_options={"densty": 0.5}, exclude=["skip"])  # fmt: skip


def test_compression_without_a_second_rank_is_refused():
    """Simulated workers send nothing: compression would change no number, so the driver and
    OuterOptimizer refuse it rather than report savings that never happened."""
    model = Tiny()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD([model.weight, model.bias, model.skip], lr=1.0)
    for compression in ("bf16", "int8"):
        with pytest.raises(ValueError, match="this process group has 1 rank"):
            ml.DiLoCo(model, inner, outer, compression=compression)
        with pytest.raises(ValueError, match="run under torchrun with 2 or more"):
            ml.OuterOptimizer({"w": torch.zeros(2)}, compression=compression)
    with pytest.raises(ValueError, match="compression must be bf16 or int8, not 'fp8'"):
        ml.OuterOptimizer({"w": torch.zeros(2)}, compression="fp8")


def test_a_state_of_other_shapes_is_refused_before_anything_changes():
    """A state saved from Linear(4, 1) does not load into Linear(4, 3): the global tensors,
    a pending turn or a momentum buffer of another shape are named, and nothing is copied."""

    def driver_of(out_features: int) -> tuple[torch.nn.Module, ml.DiLoCo]:
        model = torch.nn.Linear(4, out_features)
        inners = [torch.optim.SGD(model.parameters(), lr=0.1) for _ in range(2)]
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9)
        return model, ml.DiLoCo(model, inners, outer, sync_every=1)

    model, driver = driver_of(1)
    with driver:
        for turn in range(3):  # a round (two turns) and one turn of the next: momentum, pending
            model(torch.ones(2, 4)).sum().backward()
            driver.inner_optimizers[turn % 2].step()
            model.zero_grad()
    saved = driver.state_dict()
    assert saved["pending"] and saved["outer"]["state"]
    other, target = driver_of(3)
    before = {n: p.detach().clone() for n, p in other.named_parameters()}
    with pytest.raises(
        ValueError, match=r"global 'weight' is \[1, 4\] but parameter 'weight' is \[3, 4\]"
    ):
        target.load_state_dict(saved)
    fitting = {**saved, "global_params": dict(target.state_dict()["global_params"])}
    with pytest.raises(ValueError, match=r"pending turn 0 'weight' is \[1, 4\]"):
        target.load_state_dict(fitting)
    fitting["pending"] = []
    with pytest.raises(ValueError, match=r"outer momentum_buffer of 'weight' is \[1, 4\]"):
        target.load_state_dict(fitting)
    assert all(torch.equal(p, before[n]) for n, p in other.named_parameters())
    assert target.outer_steps == 0 and not target.outer_optimizer.state


def test_simulated_workers_must_be_distinct_and_step_in_turn():
    model = torch.nn.Linear(4, 2)
    first, second = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) for _ in range(2))
    outer = torch.optim.SGD(model.parameters(), lr=0.7)
    with pytest.raises(ValueError, match="lists one optimizer twice"):
        ml.DiLoCo(model, [first, first], outer, sync_every=2)
    driver = ml.DiLoCo(model, [first, second], outer, sync_every=2)
    with driver:
        model(torch.ones(1, 4)).sum().backward()
        first.step()
        stepped = {name: p.detach().clone() for name, p in model.named_parameters()}
        with pytest.raises(RuntimeError, match="inner optimizer 1 stepped during worker 0's turn"):
            second.step()
        assert all(torch.equal(p, stepped[name]) for name, p in model.named_parameters())
        assert first.state and not second.state  # refused before the step: no momentum buffer


def test_exclude_takes_any_name_of_a_tied_weight():
    """A weight tied under two names (head.weight is embed.weight) is excluded by either."""
    model = torch.nn.ModuleDict({"embed": torch.nn.Embedding(5, 3), "head": torch.nn.Linear(3, 5)})
    model["head"].weight = model["embed"].weight
    assert [name for name, _ in model.named_parameters()] == ["embed.weight", "head.bias"]
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    for alias in ("head.weight", "embed.weight"):
        driver = ml.DiLoCo(
            model, inner, torch.optim.SGD([model["head"].bias], lr=1.0), exclude=[alias]
        )
        assert list(driver.params) == ["head.bias"]


def test_driver_leaves_a_process_group_it_did_not_create(tmp_path):
    """One gloo rank: the driver aggregates over it and the group outlives the driver."""
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))  # fmt: skip
    try:
        model = run_driver("mean", workers=1, rounds=2, lr=1.0)
        weight, _, _ = by_hand("mean", workers=1, rounds=2, lr=1.0, momentum=0.0)
        np.testing.assert_allclose(model.weight.detach().numpy(), weight, rtol=1e-10)
        assert dist.is_initialized()
    finally:
        dist.destroy_process_group()


def tiny_driver(outer_params=None, **options):
    model = Tiny()
    inner = torch.optim.SGD(model.parameters(), lr=LR_INNER)
    outer_params = [model.weight, model.bias] if outer_params is None else outer_params(model)
    outer = torch.optim.SGD(outer_params, lr=0.7, momentum=0.9)
    return model, inner, ml.DiLoCo(model, inner, outer, aggregator="mean", sync_every=H,
                                   exclude=["skip"], **options)  # fmt: skip


def inner_steps(model, inner, count, worker=0):
    for x, y in batches(worker, 2)[:count]:
        model.loss(torch.from_numpy(x), torch.from_numpy(y)).backward()
        inner.step()
        inner.zero_grad()


def test_a_trainable_parameter_missing_from_the_outer_optimizer_is_refused():
    with pytest.raises(ValueError, match="trainable parameter 'bias' is not in outer_optimizer"):
        tiny_driver(outer_params=lambda model: [model.weight])


def test_weights_loaded_after_construction_are_the_starting_point():
    """Pretrained weights loaded between DiLoCo(...) and the with-block are theta_global: with a
    zero inner lr, one round moves nothing (not ``0.7 * (loaded - constructed)``)."""
    model, inner, driver = tiny_driver()
    inner.param_groups[0]["lr"] = 0.0
    with torch.no_grad():
        model.weight.add_(1.0)
    loaded = model.weight.detach().clone()
    with driver:
        inner_steps(model, inner, H)
    assert driver.outer_steps == 1 and torch.equal(model.weight, loaded)


def test_sync_at_a_round_boundary_does_nothing_and_early_sync_flushes_the_round():
    model, inner, driver = tiny_driver()
    with driver:
        inner_steps(model, inner, H)
        assert driver.outer_steps == 1
        after_round = model.weight.detach().clone()
        assert driver.sync() is None  # nothing since the last outer step: no momentum step
        assert driver.outer_steps == 1 and torch.equal(model.weight, after_round)
        inner_steps(model, inner, 1)
        worker = model.weight.detach().clone()
        merged = driver.sync()  # one worker: merged = its delta after 1 step
    assert driver.outer_steps == 2
    torch.testing.assert_close(merged["weight"], worker - after_round, rtol=0, atol=0)


def test_arguments_of_the_wrong_kind_are_type_errors_naming_them():
    """Before: AttributeErrors from deep inside (``'str' object has no attribute ...``), or for
    ``exclude="bias"`` "'b' is not a parameter" (the string's letters)."""
    model = Tiny()
    inner = torch.optim.SGD(model.parameters(), lr=LR_INNER)
    outer = torch.optim.SGD(model.parameters(), lr=0.7)
    for arguments, message in [
        (("m", inner, outer), "model: a torch.nn.Module, not str"),
        ((model, inner, "sgd"), "outer_optimizer: a torch.optim.Optimizer"),
    ]:
        with pytest.raises(TypeError, match=message):
            ml.DiLoCo(*arguments)
    with pytest.raises(TypeError, match=r"exclude: a list of parameter names \(\['bias'\]\)"):
        ml.DiLoCo(model, inner, outer, exclude="bias")
    step = ml.OuterOptimizer(dict(model.named_parameters())).step
    with pytest.raises(TypeError, match=r"step takes a list of worker deltas"):
        step(TaskVector({name: torch.zeros_like(p) for name, p in model.named_parameters()}))


def test_sync_before_the_driver_was_entered_is_an_error():
    """Outside ``with driver:`` no inner step is counted; a sync there took no outer step and
    left the model on the worker's parameters, silently. It raises, and changes nothing."""
    model, inner, driver = tiny_driver()
    inner_steps(model, inner, 2)
    moved = model.weight.detach().clone()
    with pytest.raises(RuntimeError, match="before the driver was entered"):
        driver.sync()
    assert driver.outer_steps == 0 and torch.equal(model.weight, moved)


def test_early_sync_before_the_last_simulated_worker_changes_nothing():
    model = Tiny()
    inners = [torch.optim.SGD(model.parameters(), lr=LR_INNER) for _ in range(2)]
    outer = torch.optim.SGD([model.weight, model.bias], lr=0.7)
    driver = ml.DiLoCo(model, inners, outer, aggregator="mean", sync_every=H, exclude=["skip"])
    with driver:
        inner_steps(model, inners[0], 1)
        worker = model.weight.detach().clone()
        with pytest.raises(RuntimeError, match="0 of the 2 local workers' turns done"):
            driver.sync()
    assert driver.local_steps == 1 and driver.pending == []
    assert torch.equal(model.weight, worker)  # worker 0's progress is kept


def test_an_aggregator_that_cannot_merge_the_shapes_fails_at_construction():
    """TSV keeps int(min(3, 4) / 4) = 0 components of the 3 x 4 weight for R = 4 workers."""
    model = Tiny()
    inners = [torch.optim.SGD(model.parameters(), lr=LR_INNER) for _ in range(4)]
    outer = torch.optim.SGD([model.weight, model.bias], lr=0.7)
    with pytest.raises(ValueError, match="'weight' of shape \\(3, 4\\) leaves no singular"):
        ml.DiLoCo(model, inners, outer, aggregator="tsv", sync_every=H, exclude=["skip"])


def test_dir_of_the_package_is_its_public_api():
    assert dir(ml) == sorted(ml.__all__)
