"""merge_across_ranks on real gloo process groups (2 and 4 processes) against the single-process
``method.merge`` of the same deltas; bytes against formulas written here; dead and hung peers."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mergekit_loco.dist import (
    Codec,
    assign_owners,
    available_plans,
    gather_then_merge,
    merge_across_ranks,
    plan_bytes,
    verify_identical,
)
from mergekit_loco.methods import MergeMethod, get_method
from mergekit_loco.task_vector import TaskVector

WORKERS = 4  # R: 2 ranks x 2 workers, or 4 ranks x 1 worker
SHAPES = {
    "embed.weight": (40, 12),  # tall
    "layers.0.q.weight": (16, 16),
    "layers.0.up.weight": (24, 12),
    "layers.0.down.weight": (12, 24),  # wide
    "layers.0.norm.weight": (16,),
    "layers.0.up.bias": (24,),
    "conv.weight": (2, 3, 4),
}
NUMEL = sum(math.prod(shape) for shape in SHAPES.values())
METHODS = [
    ("mean", {}),
    ("ta", {}),
    ("ties", {"density": 0.5}),
    ("dare", {"density": 0.7, "seed": 3}),
    ("breadcrumbs", {"density": 0.8, "gamma": 0.1}),
    ("tsv", {}),
    ("iso-c", {}),
    ("iso-c", {"spectral": "ns"}),
    ("iso-cts", {"common_fraction": 0.5}),
    ("iso-cts", {"spectral": "ns"}),
]
TOLERANCE = {torch.float64: 1e-9, torch.float32: 2e-5, torch.bfloat16: 2e-2}


@dataclass(frozen=True)
class IndexWeighted(MergeMethod):
    """``sum_t (t + 1) tau_t``: not a built-in, so it runs on the ``owner`` plan, and the result
    depends on the global worker order."""

    name = "index-weighted"

    def merge_tensor(self, name, deltas):
        return sum((index + 1) * delta for index, delta in enumerate(deltas))


def all_deltas(dtype: torch.dtype) -> list[TaskVector]:
    """R deltas with a shared component (so Iso-CTS has a common subspace), built on every rank."""
    generator = torch.Generator().manual_seed(1234)
    shared = {
        n: torch.randn(s, generator=generator, dtype=torch.float64) for n, s in SHAPES.items()
    }
    return [
        TaskVector(
            {
                name: (
                    base + 0.5 * torch.randn(base.shape, generator=generator, dtype=base.dtype)
                ).to(dtype)
                for name, base in shared.items()
            }
        )
        for _ in range(WORKERS)
    ]


def assert_close(got: TaskVector, expected: TaskVector, tolerance: float, label: str) -> None:
    assert list(got) == list(expected), label
    for name in expected:
        scale = expected[name].abs().max().item()
        torch.testing.assert_close(
            got[name], expected[name], rtol=tolerance, atol=tolerance * scale, msg=f"{label} {name}"
        )


def relative_error(got: TaskVector, expected: TaskVector) -> float:
    error = sum(float((got[n].double() - expected[n].double()).norm() ** 2) for n in expected)
    return (error / sum(float(expected[n].double().norm() ** 2) for n in expected)) ** 0.5


def digests(tensors: TaskVector) -> list[str]:
    return [
        hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for t in tensors.values()
    ]


def everyone(value) -> list:
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def init(rank: int, world: int, store: str, timeout_s: float) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )


# -- equality, identity and bytes: every method and plan, in one process group per world size ---
def check_all_methods(rank: int, world: int, store: str) -> None:
    init(rank, world, store, timeout_s=60)
    per_rank = WORKERS // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        deltas = all_deltas(dtype)
        local = deltas[mine]
        width = dtype.itemsize
        naive = (world - 1) * per_rank * NUMEL * width
        layout = [(name, delta.shape, delta.dtype) for name, delta in local[0].items()]
        totals: dict[tuple[str, str], int] = {}
        for name, params in [*METHODS, ("index-weighted", {})]:
            method = IndexWeighted() if name == "index-weighted" else get_method(name, **params)
            expected = method.merge(deltas)
            label = f"{name}{params} {dtype} P={world}"
            for plan in available_plans(method):
                got, stats = merge_across_ranks(method, local, plan=plan)
                assert_close(got, expected, TOLERANCE[dtype], f"{label} plan={plan}")
                assert len(set(map(tuple, everyone(digests(got))))) == 1, f"{label} {plan} differs"
                assert stats.plan == plan and stats.bytes_naive == naive
                totals[(label, plan)] = sum(everyone(stats.bytes_sent))
                assert totals[(label, plan)] == plan_bytes(plan, method, layout, per_rank, world)
            _, chosen = merge_across_ranks(method, local)
            cheapest = min(totals[(label, p)] for p in available_plans(method))
            assert sum(everyone(chosen.bytes_sent)) == cheapest, f"{label}: auto is not cheapest"
            if name in ("tsv", "iso-cts"):
                assert chosen.bytes_sent < naive, f"{label}: {chosen.bytes_sent} >= naive {naive}"

        if dtype == torch.bfloat16:  # spectral sums and factors travel in float32: see below
            continue
        # the byte model, written out: ring all-reduce 2 (P-1) / P of the payload per rank
        mean_bytes = merge_across_ranks(get_method("mean"), local)[1].bytes_sent
        assert mean_bytes == 2 * (world - 1) * NUMEL * width // world
        # Iso-C sends exactly the bytes of mean: reduce-scatter + all-gather = one all-reduce
        _, iso_stats = merge_across_ranks(get_method("iso-c"), local, plan="all-reduce")
        iso_bytes = everyone(iso_stats.bytes_sent)
        assert sum(iso_bytes) == world * mean_bytes
        if world == 2:
            assert iso_bytes == [mean_bytes, mean_bytes]
        # TSV's low-rank plan, written out: each rank sends V r (m + n + 1) factor entries of
        # every matrix it does not own, and (P - 1) copies of the merged matrices it owns; the
        # vectors travel as an all-reduce; summed over ranks
        _, tsv_stats = merge_across_ranks(get_method("tsv"), local, plan="low-rank")
        rank_r = {shape: int(min(shape) / WORKERS) for shape in SHAPES.values() if len(shape) == 2}
        entries = sum(
            per_rank * rank_r[shape] * (shape[0] + shape[1] + 1) + shape[0] * shape[1]
            if len(shape) == 2
            else 2 * math.prod(shape)
            for shape in SHAPES.values()
        )
        # The results are relayed when one owner holds more than its share: owner o sends
        # piece i of its L_o entries to rank i, then each rank its pieces to all others; that
        # adds sum_o (L_o - piece_o) to the total and caps the largest sender.
        owned = [0] * world
        shapes = list(SHAPES.values())
        for shape, owner in zip(shapes, assign_owners(shapes, world), strict=True):
            owned[owner] += math.prod(shape)
        pieces = [[n // world + (i < n % world) for i in range(world)] for n in owned]
        relay = [
            owned[q] - pieces[q][q] + (world - 1) * sum(p[q] for p in pieces) for q in range(world)
        ]
        relayed = max(relay) < (world - 1) * max(owned)
        assert relayed == (world == 4)  # the 40 x 12 embedding is 35% of the model
        extra = sum(owned[q] - pieces[q][q] for q in range(world)) if relayed else 0
        assert sum(everyone(tsv_stats.bytes_sent)) == ((world - 1) * entries + extra) * width
        if world == 2 and dtype == torch.float64:
            # Iso-CTS's low-rank plan, written out (P = 2, V = 2, R = 4, float64): d = 12 gives
            # k = 8, p = 1; d = 16 gives k = 12, p = 1. Per matrix the cheaper route, deltas
            # (V m n) or factors (m n sum + m c basis + V p (m+n+1)), c = m - k when m <= n and
            # m - k < k (the complement) else k; then the compact result m n - d (d-3)/2 + 1.
            # embed 40x12: 480 + 40*8 + 2*53 = 906 < 960; result 480 - 54 + 1 = 427
            # q 16x16: 256 + 16*4 + 2*33 = 386 < 512; result 256 - 104 + 1 = 153
            # up 24x12: 288 + 24*8 + 2*37 = 554 < 576; result 288 - 54 + 1 = 235
            # down 12x24 (complement): 288 + 12*4 + 2*37 = 410 < 576; result 235
            # vectors (16 + 24 + 24 entries): reduced and delivered, 2 * 64
            _, cts_stats = merge_across_ranks(get_method("iso-cts"), local, plan="low-rank")
            entries = 906 + 427 + 386 + 153 + 554 + 235 + 410 + 235 + 128
            assert sum(everyone(cts_stats.bytes_sent)) == entries * width
        # the naive reference is exact and sends (P-1) V N bytes
        reference, reference_stats = gather_then_merge(get_method("tsv"), local)
        assert_close(reference, get_method("tsv").merge(deltas), TOLERANCE[dtype], "gather")
        assert reference_stats.bytes_sent == naive
    check_compression_and_debug(rank, all_deltas(torch.float32), mine)
    dist.destroy_process_group()
    os._exit(0)  # skips a slow interpreter shutdown; failures raise before this


def check_compression_and_debug(rank: int, deltas: list[TaskVector], mine: slice) -> None:
    local = deltas[mine]
    bounds = {"bf16": (0.01, 0.55), "int8": (0.05, 0.3)}  # (relative error, bytes ratio)
    for name in ("mean", "ties", "iso-c", "tsv", "iso-cts"):
        method = get_method(name)
        expected = method.merge(deltas)
        for compression, (max_error, max_ratio) in bounds.items():
            got, stats = merge_across_ranks(method, local, compression=compression)
            label = f"{name} {compression}"
            assert stats.plan != "owner", f"{label}: compressed before selection"
            assert len(set(map(tuple, everyone(digests(got))))) == 1, f"{label} differs"
            assert relative_error(got, expected) < max_error, label
            _, exact = merge_across_ranks(method, local, plan=stats.plan)
            # TIES's counts travel uncompressed; exact Iso-CTS may send raw deltas (V = 1) and a
            # compact result, which compressed it does not (both perturb before the SVDs)
            bound = {"ties": None, "iso-cts": 1.0}.get(name, max_ratio)
            if bound is not None:
                assert stats.bytes_sent < bound * exact.bytes_sent, label

    # verify_identical: silent on equal tensors, names the tensor that differs
    verify_identical({"same": torch.ones(3)})
    with pytest.raises(RuntimeError, match="'moved' differs from rank"):
        verify_identical({"same": torch.ones(3), "moved": torch.full((2,), float(rank))})

    # debug mode: layouts compared before the merge, checksums after
    os.environ["MLOCO_DEBUG_SYNC"] = "1"
    merge_across_ranks(get_method("iso-c"), local)
    with pytest.raises(ValueError, match="holds other worker deltas"):
        merge_across_ranks(get_method("mean"), local * (1 + rank % 2))
    del os.environ["MLOCO_DEBUG_SYNC"]


@pytest.mark.parametrize("world", [2, 4])
def test_every_method_matches_the_single_process_merge(world, tmp_path):
    """Also: compression keeps ranks identical and the error small; debug checks fire."""
    mp.spawn(check_all_methods, args=(world, str(tmp_path / "store")), nprocs=world)


def check_small_beside_large(rank: int, store: str) -> None:
    """int8 compression keeps each tensor's own scales: a norm 1000 times smaller than the
    matrix beside it comes back with the per-row error of int8 (at most half a step of 1/127 of
    its own largest entry per rank), not rounded to 0 by the matrix's scale. TIES elects signs
    on sums formed in float32 for bfloat16 deltas (hand case: -256 + 2^-7 + 256 + 0 > 0)."""
    init(rank, 2, store, timeout_s=60)
    generator = torch.Generator().manual_seed(11)
    deltas = [
        TaskVector(
            {
                "w": torch.randn(64, 8, generator=generator),
                "ln": 1e-3 * torch.randn(8, generator=generator),
            }
        )  # fmt: skip
        for _ in range(4)
    ]
    local = deltas[rank * 2 : rank * 2 + 2]
    for name in ("mean", "ta"):
        expected = get_method(name).merge(deltas)
        got, stats = merge_across_ranks(get_method(name), local, compression="int8")
        assert stats.plan == "all-reduce"
        for key in ("w", "ln"):
            error = (got[key] - expected[key]).abs().max()
            assert error <= 2 * expected[key].abs().max() / 127, f"{name} {key}: {error}"

    rows = [[-256.0, -1.0], [2.0**-7, -1.0], [256.0, -1.0], [0.0, -1.0]]
    halves = [TaskVector({"v": torch.tensor(row, dtype=torch.bfloat16)}) for row in rows]
    ties = get_method("ties", density=1.0)
    got, stats = merge_across_ranks(ties, halves[rank * 2 : rank * 2 + 2], plan="all-reduce")
    assert got["v"].dtype == torch.bfloat16 and got["v"].tolist() == [128.0, -1.0]
    assert ties.merge(halves)["v"].tolist() == [128.0, -1.0]
    dist.destroy_process_group()
    os._exit(0)


def test_compressed_and_half_precision_sums_keep_small_tensors(tmp_path):
    mp.spawn(check_small_beside_large, args=(str(tmp_path / "store"),), nprocs=2)


def check_tensors_without_entries(rank: int, store: str) -> None:
    """Zero-size tensors beside a real matrix, on every plan of every method: the empty shape
    comes back on every rank and the real matrix equals the single-process merge."""
    init(rank, 2, store, timeout_s=60)
    generator = torch.Generator().manual_seed(9)
    shapes = {"w": (12, 8), "rows": (0, 8), "cols": (8, 0), "v": (0,)}
    deltas = [
        TaskVector(
            {n: torch.randn(s, generator=generator, dtype=torch.float64) for n, s in shapes.items()}
        )
        for _ in range(WORKERS)
    ]
    local = deltas[rank * 2 : rank * 2 + 2]
    for name, params in METHODS:
        method = get_method(name, **params)
        expected = method.merge(deltas)
        for plan in available_plans(method):
            got, _ = merge_across_ranks(method, local, plan=plan)
            assert {n: tuple(t.shape) for n, t in got.items()} == shapes, f"{name} {plan}"
            torch.testing.assert_close(got["w"], expected["w"], rtol=1e-9, atol=1e-9)
    dist.destroy_process_group()
    os._exit(0)


def test_tensors_without_entries_merge_across_ranks(tmp_path):
    mp.spawn(check_tensors_without_entries, args=(str(tmp_path / "store"),), nprocs=2)


def refuse_a_nan_on_one_rank_on_every_plan(rank: int, store: str) -> None:
    """Rank 1's last worker delta holds a NaN: every rank raises the same FloatingPointError on
    every plan of every method, within a 20 s timeout (before: under the owner plan only the
    tensor's owner raised, inside merge_tensor, and the other rank waited out the timeout)."""
    init(rank, 2, store, timeout_s=20)
    generator = torch.Generator().manual_seed(3)
    local = [TaskVector({"w": torch.randn(12, 8, generator=generator)}) for _ in range(2)]
    if rank == 1:
        local[1]["w"][3, 4] = float("nan")
    for name, params in METHODS:
        method = get_method(name, **params)
        for plan in available_plans(method):
            with pytest.raises(FloatingPointError, match="non-finite pseudo-gradient for 'w'"):
                merge_across_ranks(method, local, plan=plan)
    dist.destroy_process_group()
    os._exit(0)


def test_a_nan_on_one_rank_stops_every_rank_on_every_plan(tmp_path):
    mp.spawn(refuse_a_nan_on_one_rank_on_every_plan, args=(str(tmp_path / "store"),), nprocs=2)


def test_int8_codec_round_trip_error_is_a_row_scale():
    codec = Codec("int8")
    values = torch.randn(1000, dtype=torch.float64) * torch.logspace(-3, 3, 1000)
    tiny = torch.full((3,), 1e-6, dtype=torch.float64)  # packed beside: its scale is its own
    payload = codec.pack([values, tiny], torch.float64)
    assert payload.dtype == torch.uint8 and payload.numel() == 1003 + 4 * (4 + 1)
    decoded, tiny_decoded = codec.unpack(payload, [(1000,), (3,)], torch.float64)
    torch.testing.assert_close(tiny_decoded, tiny, rtol=1e-6, atol=0)
    for row in range(4):  # error <= half a step, step = max|x| / 127 of that row
        block = slice(256 * row, 256 * (row + 1))
        step = values[block].abs().max() / 127
        assert (decoded[block] - values[block]).abs().max() <= 0.5 * step * (1 + 1e-6)


@pytest.mark.parametrize("value", [1e-4, 1e-5, 3e-6])
def test_int8_codec_scales_small_half_precision_rows_in_float32(value):
    """float16 rows of 1e-4 .. 3e-6 (before: ``max|x| / 127`` divided in float16 fell into its
    subnormals, -24% at 1e-5, or to 0 at 3e-6, and the row decoded as 0)."""
    codec = Codec("int8")
    values = torch.full((256,), value, dtype=torch.float16)
    (decoded,) = codec.unpack(codec.pack([values], values.dtype), [(256,)], values.dtype)
    exact = values.double()  # one value: q = 127 and scale = value / 127 in float32
    torch.testing.assert_close(decoded.double(), exact, rtol=2e-3, atol=0)


def test_owners_balance_spectral_cost():
    shapes = [(1024, 256), (256, 256), (256, 256), (256, 256), (256, 256), (256,), (64, 64)]
    owners = assign_owners(shapes, 2)
    loads = [0, 0]
    for shape, owner in zip(shapes, owners, strict=True):
        loads[owner] += shape[0] * shape[1] * min(shape) if len(shape) == 2 else shape[0]
    assert owners[0] == 0  # the largest goes first, to rank 0
    assert (
        max(loads) / sum(loads) <= 0.51
    )  # 4 x 256^3 on one side, 1024 x 256^2 + rest on the other


# -- a dead or hung peer ------------------------------------------------------------------------
TIMEOUT_S = 2.0


def survivor_or_victim(rank: int, world: int, store: str, report: str) -> None:
    init(rank, world, store, timeout_s=TIMEOUT_S)
    local = all_deltas(torch.float32)[rank : rank + 1]
    if rank == 1:
        time.sleep(120)  # hung (killed by the test, or outlived by the survivor)
        os._exit(0)
    Path(report).with_suffix(".started").touch()
    start = time.monotonic()
    try:
        merge_across_ranks(get_method("iso-c"), local)
        outcome = {"error": None}
    except RuntimeError as error:
        outcome = {"error": str(error)}
    outcome["seconds"] = time.monotonic() - start
    Path(report).write_text(json.dumps(outcome))
    os._exit(3 if outcome["error"] else 0)


@pytest.mark.parametrize("peer", ["hangs", "dies"])
def test_a_dead_or_hung_peer_ends_the_step_with_a_clear_error(peer, tmp_path):
    context = mp.get_context("spawn")
    report = tmp_path / "report.json"
    store = str(tmp_path / "store")
    processes = [
        context.Process(target=survivor_or_victim, args=(rank, 2, store, str(report)))
        for rank in range(2)
    ]
    for process in processes:
        process.start()
    try:
        started = report.with_suffix(".started")
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started.exists(), "rank 0 never reached the outer step"
        if peer == "dies":
            time.sleep(0.3)
            processes[1].kill()
        processes[0].join(timeout=TIMEOUT_S + 20)
        assert processes[0].exitcode == 3, f"survivor exit code {processes[0].exitcode}"
        outcome = json.loads(report.read_text())
        assert outcome["error"].startswith("rank 0: outer step collective")
        assert "a peer rank likely died or hung" in outcome["error"]
        assert outcome["seconds"] < TIMEOUT_S + 5
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join()


# -- docs/distributed.md ------------------------------------------------------------------------
def test_the_docs_example_runs(tmp_path):
    text = (Path(__file__).parents[1] / "docs" / "distributed.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.DOTALL)
    assert len(blocks) == 1, "docs/distributed.md should hold one python example"
    script = tmp_path / "example.py"
    script.write_text(blocks[0])
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    environment = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    done = subprocess.run(
        [sys.executable, str(script)], env=environment, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "plan low-rank:" in done.stdout
