"""WarmupCosine at hand-picked steps (S = 100, W = 10, floor 0.1)."""

import math

import pytest
import torch

from mergekit_loco.train.schedule import WarmupCosine


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (0, 0.1),  # warmup starts at 0.1 x lr
        (5, 0.55),  # halfway: 0.1 + 0.9 * 5/10
        (10, 1.0),  # peak
        (55, 0.55),  # cosine midpoint: 0.1 + 0.9 * (1 + cos(pi/2)) / 2
        (40, 0.1 + 0.45 * (1 + math.cos(math.pi / 3))),  # 30 of 90 decay steps
        (100, 0.1),  # end of decay
        (150, 0.1),  # past the end it stays at the floor
    ],
)
def test_values(step, expected):
    assert WarmupCosine(100, 0.1)(step) == pytest.approx(expected, abs=1e-12)


def test_no_warmup_starts_at_peak():
    schedule = WarmupCosine(7, warmup_fraction=0.0)
    assert schedule(0) == pytest.approx(1.0)
    assert schedule(7) == pytest.approx(0.1)


def test_lambda_lr_drives_the_optimizer_and_saves_its_parameters():
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=2.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, WarmupCosine(20, 0.1))
    lrs = []
    for _ in range(4):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs == pytest.approx([0.2, 1.1, 2.0, 2.0 * (0.1 + 0.45 * (1 + math.cos(math.pi / 18)))])
    state = scheduler.state_dict()
    assert state["lr_lambdas"][0] == {"total_steps": 20, "warmup_steps": 2, "floor": 0.1}


def test_bad_arguments():
    with pytest.raises(ValueError, match="total_steps"):
        WarmupCosine(0)
    with pytest.raises(ValueError, match="warmup_fraction"):
        WarmupCosine(10, 1.0)
