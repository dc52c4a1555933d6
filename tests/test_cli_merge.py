"""`mloco merge` through its entry points: `python -m mergekit_loco` in a subprocess and typer's
CliRunner in-process (docs/merging.md's commands run in tests/test_readme.py)."""

import errno
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_factory import load_state_dict, make_family, write_state_dict
from typer.testing import CliRunner

from mergekit_loco.cli import app, main
from mergekit_loco.io import CheckpointError
from mergekit_loco.io import writer as writer_module
from mergekit_loco.io.atomic import process_tag

REPO = Path(__file__).resolve().parents[1]
ENTRY_POINT = [sys.executable, "-m", "mergekit_loco"]
runner = CliRunner()


def run_entry_point(*args, cwd=None) -> subprocess.CompletedProcess:
    command = [*ENTRY_POINT, *map(str, args)]
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=120)


def invoke(*args):
    return runner.invoke(app, [str(arg) for arg in args])


def run_main(capsys, *args) -> tuple[int, str, str]:
    """``mloco ARGS`` through :func:`main`, in-process: (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exited:
        main([str(arg) for arg in args])
    captured = capsys.readouterr()
    return exited.value.code, captured.out, captured.err


def assert_one_line_error(stderr: str, *fragments: str) -> None:
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    assert "=True" not in lines[0], "a CLI error names a Python keyword argument"
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def temp_leftovers(folder: Path) -> list[str]:
    return [
        p.name for p in folder.iterdir() if any(k in p.name for k in (".tmp-", ".old-", ".del-"))
    ]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return make_family(tmp_path_factory.mktemp("sharded"), count=2, layout="sharded")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_family(tmp_path_factory.mktemp("files"), count=2, layout="file")


# -- through `python -m mergekit_loco` ---------------------------------------------------------


def test_entry_point_merges_sharded_folders_into_a_loadable_folder(sharded, tmp_path):
    from transformers import LlamaForCausalLM

    base, models = sharded
    out = tmp_path / "merged"
    done = run_entry_point(
        "merge", *models, "--base", base, "--method", "ta", "--scale", "0.5",
        "--shard-size", "4KB", "-o", out,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "tensors merged" in done.stdout and "peak memory" in done.stdout
    assert (out / "model.safetensors.index.json").is_file() and (out / "config.json").is_file()
    merged = LlamaForCausalLM.from_pretrained(out).state_dict()
    base_state = load_state_dict(base)
    model_states = [load_state_dict(model) for model in models]
    for name, theta in base_state.items():
        expected = theta.double() + 0.5 * sum(
            s[name].double() - theta.double() for s in model_states
        )
        torch.testing.assert_close(merged[name].double(), expected, rtol=0, atol=1e-6)


def test_entry_point_bad_input_is_one_line(files, tmp_path):
    base, models = files
    state = load_state_dict(models[1])
    state["lm_head.weight"] = state["lm_head.weight"][:, :-1]
    wrong = write_state_dict(state, tmp_path / "wrong.safetensors")
    done = run_entry_point(
        "merge", models[0], wrong, "--base", base, "--method", "ties", "-o", tmp_path / "out"
    )
    assert done.returncode == 2
    assert_one_line_error(done.stderr, "wrong.safetensors", "'lm_head.weight'", "shape")
    assert not (tmp_path / "out").exists() and temp_leftovers(tmp_path) == []


def test_debug_reraises_the_error(files, tmp_path):
    """--debug lets the exception (and so its traceback) through main()."""
    base, models = files
    ghost = tmp_path / "ghost.safetensors"
    args = [
        "merge",
        models[0],
        ghost,
        "--base",
        base,
        "-m",
        "ta",
        "-o",
        tmp_path / "out",
        "--debug",
    ]
    with pytest.raises(CheckpointError, match="ghost.safetensors: no such file"):
        main([str(arg) for arg in args])
    assert list(tmp_path.iterdir()) == []


def test_usage_errors_are_one_line_through_main(files, capsys):
    base, models = files
    code, _, stderr = run_main(capsys, "merge", *models, "--base", base)
    assert code == 2
    assert_one_line_error(stderr, "Missing option '--method'")
    code, _, stderr = run_main(capsys, "merge", *models, "-o", "x", "-m", "ta", "--sclae", "2")
    assert code == 2
    assert_one_line_error(stderr, "No such option: --sclae")


def test_no_arguments_shows_help(capsys):
    code, stdout, _ = run_main(capsys)
    assert code == 0 and "merge" in stdout and "methods" in stdout


SIGNAL_SCRIPT = """
import os, signal, sys
from mergekit_loco.cli import main
from mergekit_loco.io.writer import CheckpointWriter

write = CheckpointWriter.write
calls = []

def write_then_signal(self, name, tensor):
    calls.append(name)
    if len(calls) == 3:
        os.kill(os.getpid(), getattr(signal, sys.argv[1]))
    write(self, name, tensor)

CheckpointWriter.write = write_then_signal
main(sys.argv[2:])
"""


@pytest.mark.parametrize(
    ("signal_name", "exit_code", "force"), [("SIGINT", 130, False), ("SIGTERM", 143, True)]
)
def test_signal_mid_write_leaves_nothing_partial(sharded, tmp_path, signal_name, exit_code, force):
    """A real signal arrives while the third tensor is written."""
    base, models = sharded
    out = tmp_path / "merged"
    if force:
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"previous merge")
    args = ["merge", *models, "--base", base, "--method", "ties", "-o", out, "--shard-size", "4KB"]
    command = [sys.executable, "-c", SIGNAL_SCRIPT, signal_name, *map(str, args)]
    done = subprocess.run(command + (["--force"] if force else []), capture_output=True, text=True)
    assert done.returncode == exit_code, done.stderr
    assert "Traceback" not in done.stderr
    if signal_name == "SIGINT":
        assert_one_line_error(done.stderr, "interrupted")
    if force:
        assert [p.name for p in out.iterdir()] == ["model.safetensors"]
        assert (out / "model.safetensors").read_bytes() == b"previous merge"
    else:
        assert not out.exists()
    assert temp_leftovers(tmp_path) == []


RENAME_KILL_SCRIPT = """
import os, signal, sys
from mergekit_loco.cli import main

rename = os.rename

def rename_then_die(source, target):
    rename(source, target)
    if ".old-" in os.fspath(target):  # the old merge moved aside, the new one not yet in place
        os.kill(os.getpid(), signal.SIGKILL)

os.rename = rename_then_die
main(sys.argv[1:])
"""


def test_what_a_sigkill_leaves_is_cleared_by_the_next_write(sharded, tmp_path):
    """SIGKILL mid-write leaves a staging folder; SIGKILL while --force swaps the output leaves
    the old merge aside and no output. The next merge of that path clears the first, puts the
    old merge back for the second (nothing lost: without --force it is refused as existing);
    what a live process or another host left stays (before: every leftover stayed for good)."""
    base, models = sharded
    out = tmp_path / "merged"
    args = ["merge", *models, "--base", base, "--method", "ta", "-o", out, "--shard-size", "4KB"]
    command = [sys.executable, "-c", SIGNAL_SCRIPT, "SIGKILL", *map(str, args)]
    assert subprocess.run(command, capture_output=True).returncode == -9
    (killed,) = temp_leftovers(tmp_path)
    assert killed.startswith(".merged.tmp-") and any((tmp_path / killed).iterdir())
    alive = tmp_path / f".merged.tmp-{process_tag()}-live1234"  # this test's own process
    other_host = tmp_path / ".merged.tmp-elsewhere-1-abcd1234"
    for kept in (alive, other_host):
        kept.mkdir()
    dead = killed.split(".tmp-")[1].rsplit("-", 1)[0]  # HOST-PID of the killed merge
    (tmp_path / f".merged.del-{dead}-0123abcd").mkdir()  # an old output it was deleting
    (tmp_path / f".merged.tmp-{dead.rsplit('-', 1)[0]}-{10**30}-x").mkdir()  # no such PID
    assert run_entry_point(*map(str, args)).returncode == 0
    impossible = f".merged.tmp-{dead.rsplit('-', 1)[0]}-{10**30}-x"
    assert sorted(temp_leftovers(tmp_path)) == sorted([alive.name, other_host.name, impossible])
    (tmp_path / impossible).rmdir()
    first = {p.name: p.read_bytes() for p in out.iterdir()}

    command = [sys.executable, "-c", RENAME_KILL_SCRIPT, *map(str, args), "--scale", "0.5"]
    assert subprocess.run([*command, "--force"], capture_output=True).returncode == -9
    assert not out.exists() and any(".merged.old-" in name for name in temp_leftovers(tmp_path))
    refused = run_entry_point(*map(str, args))
    assert refused.returncode == 2 and "output folder exists; add --force" in refused.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == first
    assert sorted(temp_leftovers(tmp_path)) == sorted([alive.name, other_host.name])


# -- every bad input: exit 2, one line naming file and tensor, nothing written ----------------


def corrupt_copy(source: Path, target: Path, how: str) -> Path:
    raw = source.read_bytes()
    header_length = int.from_bytes(raw[:8], "little")
    if how == "header_cut":
        target.write_bytes(raw[: 8 + header_length // 3])
    elif how == "bad_json":
        target.write_bytes(raw[:8] + b"#" * header_length + raw[8 + header_length :])
    elif how == "data_cut":
        target.write_bytes(raw[: len(raw) - 100])
    return target


def bad_input(case: str, tmp_path: Path, files, sharded) -> tuple[list, list[str]]:
    """Command-line arguments for one bad input, and fragments the error line must contain."""
    base, models = files
    out = tmp_path / "out"
    merge = ["merge", models[0]]
    state = load_state_dict(models[1])

    def with_model(model, method="ta", *options):
        return [*merge, model, "--base", base, "--method", method, "-o", out, *options]

    def broken_state(edit) -> Path:
        edit(state)
        return write_state_dict(state, tmp_path / "bad.safetensors")

    if case == "missing_file":
        return with_model(tmp_path / "ghost.safetensors"), ["ghost.safetensors", "no such file"]
    if case == "no_weights_in_folder":
        (tmp_path / "empty").mkdir()
        return with_model(tmp_path / "empty"), ["empty", "no model.safetensors"]
    if case in ("header_cut", "bad_json", "data_cut"):
        broken = corrupt_copy(models[1], tmp_path / "bad.safetensors", case)
        reason = {"header_cut": "header cut", "bad_json": "bad JSON header", "data_cut": "data cut"}
        tensor = ["tensor '"] if case == "data_cut" else []
        return with_model(broken), ["bad.safetensors", reason[case], *tensor]
    if case == "config_json":  # the config.json of a model folder: its folder is suggested
        folder = sharded[1][1]
        return with_model(folder / "config.json"), [
            f"{folder / 'config.json'}: not a safetensors checkpoint; give its model folder "
            f"{folder} instead"
        ]
    if case == "pickle_in_model_folder":
        folder = shutil.copytree(sharded[1][1], tmp_path / "with-bin")
        (folder / "pytorch_model.bin").write_bytes(b"\x80\x04")
        return with_model(folder / "pytorch_model.bin"), [
            "pickle checkpoints are not read",
            f"or give its model folder {folder} instead",
        ]
    if case == "not_safetensors":
        (tmp_path / "notes.txt").write_text("my notes\n")
        return with_model(tmp_path / "notes.txt"), [
            "notes.txt: not a safetensors checkpoint; give a .safetensors file instead"
        ]
    if case == "missing_shard":
        folder = shutil.copytree(sharded[1][1], tmp_path / "sharded-ft")
        shard = sorted(folder.glob("model-*.safetensors"))[1]
        shard.unlink()
        return with_model(folder), ["model.safetensors.index.json", f"missing shard {shard.name}"]
    if case == "missing_key":
        broken = broken_state(lambda s: s.pop("model.norm.weight"))
        return with_model(broken), ["bad.safetensors", "'model.norm.weight'", "missing"]
    if case == "extra_key":
        broken = broken_state(lambda s: s.update(extra=torch.ones(2)))
        return with_model(broken), ["bad.safetensors", "'extra'", "not in the base"]
    if case == "shape":
        broken = broken_state(lambda s: s.update({"lm_head.weight": torch.ones(3, 3)}))
        return with_model(broken), ["bad.safetensors", "'lm_head.weight'", "shape [3, 3]"]
    if case == "kind":
        broken = broken_state(
            lambda s: s.update({"model.norm.weight": torch.ones(16, dtype=torch.int64)})
        )
        return with_model(broken), ["bad.safetensors", "'model.norm.weight'", "integer", "float"]
    if case == "nan":
        broken = broken_state(
            lambda s: s["model.layers.1.mlp.up_proj.weight"].view(-1)[7].fill_(float("nan"))
        )
        return with_model(broken), ["bad.safetensors", "'model.layers.1.mlp.up_proj.weight'", "NaN"]
    if case == "inf":
        broken = broken_state(lambda s: s["model.norm.weight"].view(-1)[0].fill_(float("inf")))
        return with_model(broken), ["bad.safetensors", "'model.norm.weight'", "Inf"]
    if case == "output_exists":
        out.mkdir()
        return with_model(models[1]), [str(out), "exists", "--force"]
    if case == "unknown_method":
        return with_model(models[1], "soup"), ["unknown merge method 'soup'", "iso-cts"]
    if case == "mergekit_method":  # mergekit's names are answered with mloco's
        return with_model(models[1], "task_arithmetic"), [
            "unknown merge method 'task_arithmetic'",
            "(mergekit's task_arithmetic is ta here;",
        ]
    if case == "option_not_taken":
        return with_model(models[1], "iso-c", "--density", "0.5"), [
            "'iso-c' does not take 'density'"
        ]
    if case == "density_range":
        return with_model(models[1], "ties", "--density", "0"), ["density must lie in (0, 1]"]
    if case == "common_fraction_range":
        args = with_model(models[1], "iso-cts", "--common-fraction", "1")
        return args, ["common_fraction must lie in [0, 1)"]
    if case == "dtype":
        return with_model(models[1], "ta", "--dtype", "int8"), ["--dtype must be one of"]
    if case == "shard_size":
        return with_model(models[1], "ta", "--shard-size", "lots"), ["--shard-size", "'lots'"]
    if case == "missing_base":
        return [*merge, models[1], "--method", "ties", "-o", out], ["--base", "mloco merge "]
    if case == "model_twice":
        return with_model(models[0]), [str(models[0]), "given twice", "--config"]
    if case == "base_as_model":
        return with_model(base), [str(base), "is the base", "zero"]
    raise AssertionError(case)


BAD_INPUTS = [
    "missing_file", "no_weights_in_folder", "header_cut", "bad_json", "data_cut", "missing_shard",
    "missing_key", "extra_key", "shape", "kind", "nan", "inf", "output_exists", "unknown_method",
    "option_not_taken", "density_range", "common_fraction_range", "dtype", "shard_size",
    "missing_base", "model_twice", "base_as_model", "config_json", "pickle_in_model_folder",
    "not_safetensors", "mergekit_method",
]  # fmt: skip


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_exits_2_with_one_named_line(files, sharded, tmp_path, case):
    args, fragments = bad_input(case, tmp_path, files, sharded)
    before = sorted(p.name for p in tmp_path.iterdir())
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert_one_line_error(result.stderr, *fragments)
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing new, nothing removed


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file(files, tmp_path):
    base, models = files
    locked = Path(shutil.copy(models[1], tmp_path / "locked.safetensors"))
    locked.chmod(0)
    result = invoke(
        "merge", models[0], locked, "--base", base, "--method", "ta", "-o", tmp_path / "o"
    )
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "locked.safetensors", "cannot read")


@pytest.mark.parametrize(
    ("error_number", "reason"),
    [(errno.ENOSPC, "No space left on device"), (errno.EROFS, "Read-only file system")],
)
def test_full_or_read_only_disk_mid_write_keeps_previous_output(
    files, tmp_path, monkeypatch, error_number, reason
):
    """The disk fails on the third tensor of a --force merge: one line, the old output intact."""
    base, models = files
    out = tmp_path / "merged.safetensors"
    out.write_bytes(b"previous merge")
    add = writer_module.ShardBuilder.add
    calls = []

    def failing_add(self, name, tensor):
        calls.append(name)
        if len(calls) == 3:
            raise OSError(error_number, os.strerror(error_number))
        add(self, name, tensor)

    monkeypatch.setattr(writer_module.ShardBuilder, "add", failing_add)
    result = invoke("merge", *models, "--base", base, "--method", "ta", "-o", out, "--force")
    assert result.exit_code == 2
    assert_one_line_error(result.stderr, "cannot write tensor", "merged.safetensors", reason)
    assert out.read_bytes() == b"previous merge" and temp_leftovers(tmp_path) == []


# -- successful runs in-process ---------------------------------------------------------------


def test_merge_shows_a_progress_bar_on_a_terminal_only(files, tmp_path):
    """`mloco merge` on a terminal (rich told so by TTY_COMPATIBLE=1) draws on stderr a bar
    naming OUT and counting tensors; -q, or stderr not a terminal, draws none; stdout and the
    merged file are the same either way."""
    base, models = files
    results = []
    for index, (terminal, quiet) in enumerate(((True, False), (True, True), (False, False))):
        out = tmp_path / f"merged-{index}.safetensors"
        command = [*ENTRY_POINT, "merge", *map(str, models), "--base", str(base), "-m", "ta",
                   "-o", str(out), *["-q"] * quiet]  # fmt: skip
        env = {**os.environ, "TTY_COMPATIBLE": str(int(terminal)), "COLUMNS": "400"}
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 0, done.stderr
        tensors = len(load_state_dict(base))
        drawn = f"merging into {out}" in done.stderr and f"{tensors}/{tensors}" in done.stderr
        assert drawn == (terminal and not quiet), (terminal, quiet, done.stderr)
        results.append(load_state_dict(out))
    assert all(torch.equal(results[0][name], other[name]) for other in results for name in other)


def test_single_files_in_sharded_folder_out_with_force(files, tmp_path):
    base, models = files
    out = tmp_path / "merged"
    (out).mkdir()
    (out / "model-00001-of-00099.safetensors").write_bytes(b"old")  # a checkpoint's shard
    args = ["merge", *models, "--base", base, "-m", "dare", "--density", "0.5", "--seed", "1"]
    result = invoke(*args, "-o", out, "--shard-size", "8KiB", "--force", "--quiet")
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    names = {p.name for p in out.iterdir()}
    assert "model-00001-of-00099.safetensors" not in names
    assert "model.safetensors.index.json" in names
    assert set(load_state_dict(out)) == set(load_state_dict(base))


def test_mean_without_base_and_float16_output(files, tmp_path):
    _, models = files
    out = tmp_path / "soup.safetensors"
    result = invoke("merge", *models, "--method", "mean", "--dtype", "float16", "-o", out)
    assert result.exit_code == 0, result.output
    assert "merged 2 models with mean" in result.stdout
    states = [load_state_dict(model) for model in models]
    for name, tensor in load_state_dict(out).items():
        expected = (states[0][name].double() + states[1][name].double()) / 2
        assert tensor.dtype == torch.float16
        torch.testing.assert_close(tensor, expected.half(), rtol=2**-10, atol=1e-6)


def test_methods_lists_every_method_with_parameters():
    result = invoke("methods")
    assert result.exit_code == 0
    for name in ("mean", "ta", "ties", "dare", "breadcrumbs", "tsv", "iso-c", "iso-cts"):
        assert re.search(rf"^{re.escape(name)}\b", result.stdout, re.MULTILINE), name
    assert "density=0.2" in result.stdout and "common_fraction=0.8" in result.stdout


def test_dtype_float64_writes_the_float64_formula(files, tmp_path):
    """``--dtype float64 --compute-dtype float64``: ta of float32 inputs, written in float64,
    equals base + sum of deltas computed in float64 here."""
    base, models = files
    out = tmp_path / "ta64.safetensors"
    args = ["merge", *models, "--base", base, "-m", "ta", "--dtype", "float64"]
    result = invoke(*args, "--compute-dtype", "float64", "-o", out, "--quiet")
    assert result.exit_code == 0, result.output
    merged, theta = load_state_dict(out), load_state_dict(base)
    tuned = [load_state_dict(model) for model in models]
    for name, tensor in theta.items():
        if not tensor.is_floating_point():
            continue
        expected = tensor.double() + sum(t[name].double() - tensor.double() for t in tuned)
        assert merged[name].dtype == torch.float64
        torch.testing.assert_close(merged[name], expected, rtol=0, atol=1e-12)


def test_one_model_merges_with_a_warning(files, tmp_path, capsys):
    """``mloco merge ft1 --base base --method ties`` (one model: before, silent): the method is
    applied to that one task vector, with one warning line on stderr; two models give none."""
    base, models = files
    code, _, err = run_main(capsys, "merge", models[0], "--base", base, "--method", "ties",
                            "-o", tmp_path / "one", "-q")  # fmt: skip
    assert code in (0, None) and (tmp_path / "one" / "model.safetensors").is_file()
    assert err == (
        f"warning: only one model given ({models[0]}): the output is --method ties applied to it "
        "alone, nothing is merged; give two or more models to merge them\n"
    )
    code, _, err = run_main(capsys, "merge", *models, "--base", base, "--method", "ties",
                            "-o", tmp_path / "two", "-q")  # fmt: skip
    assert code in (0, None) and err == ""


def soup_inputs(root: Path) -> list[Path]:
    """Three models of equal size, no base: float32, bfloat16 and float32 (with an integer
    buffer they share), values with many significant bits, so any rounding shows."""
    generator = torch.Generator().manual_seed(7)
    paths = []
    for index, dtype in enumerate((torch.float32, torch.bfloat16, torch.float32)):
        state = {
            "w": (torch.randn(16, 8, generator=generator) * 10 ** (index - 1)).to(dtype),
            "b": torch.randn(8, generator=generator).to(dtype),
            "ids": torch.arange(5),
        }
        paths.append(write_state_dict(state, root / f"soup{index}.safetensors"))
    return paths


def test_mean_without_base_refuses_a_scale(tmp_path, capsys):
    """Before, ``merge a b --method mean --scale 0.5`` wrote 0.75 a + 0.25 b (the first model
    stood in for the base), and 0.25 a + 0.75 b with the models swapped. Without a base no task
    vector exists to scale: the CLI, a --config YAML and the Python API refuse, writing
    nothing."""
    from mergekit_loco import merge_checkpoints

    first, second, _ = soup_inputs(tmp_path)
    for scale in ("0.5", "2", "-1", "0"):
        code, _, err = run_main(capsys, "merge", first, second, "--method", "mean",
                                "--scale", scale, "-o", tmp_path / "soup")  # fmt: skip
        assert code == 2
        assert_one_line_error(err, f"--scale {float(scale):g} needs --base", "no task vector")
    config = tmp_path / "soup.yml"
    config.write_text(f"merge_method: mean\nmodels:\n  - model: {first}\n  - model: {second}\n"
                      "parameters: {lambda: 0.5}\n")  # fmt: skip
    code, _, err = run_main(capsys, "merge", "--config", config, "-o", tmp_path / "soup")
    assert code == 2
    assert_one_line_error(err, str(config), "lambda 0.5 needs base_model")
    with pytest.raises(ValueError, match=r"--scale 0\.5 needs --base"):
        merge_checkpoints([first, second], None, "mean", tmp_path / "soup", scale=0.5)
    assert not (tmp_path / "soup").exists() and not temp_leftovers(tmp_path)


def test_mean_without_base_does_not_depend_on_the_model_order(tmp_path, capsys):
    """Before, the first of the equal-sized models stood in for the base: its dtype was the
    output's (bfloat16 first: a bfloat16 soup, else float32) and ``a + (b - a) / 2`` rounded
    differently from ``b + (a - b) / 2``. Now every order gives the same bits: the mean of the
    models in float64, written in the dtype theirs promote to (float32)."""
    import itertools

    paths = soup_inputs(tmp_path)
    states = [load_state_dict(path) for path in paths]
    outputs = []
    for number, order in enumerate(itertools.permutations(range(3))):
        out = tmp_path / f"merged{number}.safetensors"
        code, _, err = run_main(capsys, "merge", *[paths[i] for i in order], "--method", "mean",
                                "-o", out, "-q")  # fmt: skip
        assert code in (0, None), err
        outputs.append(load_state_dict(out))
    for name in ("w", "b"):
        expected = (sum(state[name].double() for state in states) / 3).float()
        for merged in outputs:
            assert merged[name].dtype == torch.float32
            assert torch.equal(merged[name], expected), name
    assert all(torch.equal(merged["ids"], torch.arange(5)) for merged in outputs)


def test_mean_without_base_refuses_integer_tensors_that_differ(tmp_path, capsys):
    """An integer tensor is copied, not merged: without a base, models holding different
    values of it left the choice to their order. Refused, naming the tensor."""
    first, second, _ = soup_inputs(tmp_path)
    state = load_state_dict(second) | {"ids": torch.arange(5) + 1}
    second = write_state_dict(state, tmp_path / "other-ids.safetensors")
    code, _, err = run_main(capsys, "merge", first, second, "--method", "mean",
                            "-o", tmp_path / "soup.safetensors")  # fmt: skip
    assert code == 2
    assert_one_line_error(err, "'ids'", "differs between the models", "give --base")
    assert not (tmp_path / "soup.safetensors").exists()


@pytest.mark.parametrize("dtypes", [(torch.int64, torch.int32), (torch.int32, torch.int64)])
def test_mean_without_base_refuses_equal_integer_values_of_other_dtypes(tmp_path, capsys, dtypes):
    """Equal values as int64 and int32: copying the first model's would let the order choose
    the output's dtype. Refused in either order, naming both dtypes."""
    first, second, _ = soup_inputs(tmp_path)
    paths = []
    for index, (path, dtype) in enumerate(zip((first, second), dtypes, strict=True)):
        state = load_state_dict(path) | {"ids": torch.arange(5).to(dtype)}
        paths.append(write_state_dict(state, tmp_path / f"typed-{index}.safetensors"))
    code, _, err = run_main(capsys, "merge", *paths, "--method", "mean",
                            "-o", tmp_path / "soup.safetensors")  # fmt: skip
    assert code == 2
    assert_one_line_error(err, "'ids'", f"is {dtypes[0]} here but {dtypes[1]}", "give --base")
    assert not (tmp_path / "soup.safetensors").exists()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_a_folder_output_config_names_the_dtype_written(tmp_path, capsys, dtype):
    """Before, ``--dtype bfloat16`` into a folder copied the base's ``"dtype": "float32"``, so
    ``from_pretrained(OUT)`` loaded the bfloat16 weights as float32. Both keys transformers
    reads (``dtype``, and the older ``torch_dtype``, where the config has them) now name the
    dtype written; nothing else in the config changes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base, models = make_family(tmp_path / "family", count=2)
    config = json.loads((base / "config.json").read_text())
    assert config["dtype"] == "float32"
    (base / "config.json").write_text(json.dumps(config | {"torch_dtype": "float32"}))
    out = tmp_path / "merged"
    code, _, err = run_main(capsys, "merge", *models, "--base", base, "-m", "ta",
                            "--dtype", dtype, "-o", out, "-q")  # fmt: skip
    assert code in (0, None), err
    written = json.loads((out / "config.json").read_text())
    assert written == config | {"dtype": dtype, "torch_dtype": dtype}
    assert AutoConfig.from_pretrained(out).dtype == getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(out)
    assert {parameter.dtype for parameter in model.parameters()} == {getattr(torch, dtype)}


def test_a_config_is_left_alone_when_several_dtypes_are_written(tmp_path, capsys):
    """A base of float32 and float64 tensors keeps both in the output: no one dtype to name, so
    the config stays as the base's."""
    base, models = make_family(tmp_path / "family", count=2)
    for path in (base, *models):
        state = load_state_dict(path)
        state["lm_head.weight"] = state["lm_head.weight"].double()
        write_state_dict(state, path / "model.safetensors")
    out = tmp_path / "merged"
    code, _, err = run_main(capsys, "merge", *models, "--base", base, "-m", "ta", "-o", out, "-q")
    assert code in (0, None), err
    assert (out / "config.json").read_bytes() == (base / "config.json").read_bytes()
    assert {t.dtype for t in load_state_dict(out).values()} == {torch.float32, torch.float64}


@pytest.mark.parametrize(
    ("method", "options", "fragment"),
    [
        ("tsv", [], "leaves no singular component"),
        ("iso-cts", ["--common-fraction", "0"], "cannot hold 2 task-specific"),
    ],
)
def test_a_shape_the_method_cannot_merge_fails_before_any_compute(
    tmp_path, capsys, monkeypatch, method, options, fragment
):
    """Before, TSV merged 3000 tensors and only then failed on the last one, a (1, 8) head.
    The method's ``check_shapes`` now runs on the headers: no tensor is merged, nothing is
    written, no output is staged."""
    from mergekit_loco.methods import METHODS

    generator = torch.Generator().manual_seed(0)
    base = {f"t{index:04d}": torch.randn(8, 8, generator=generator) for index in range(400)}
    base["zz_score.weight"] = torch.randn(1 if method == "tsv" else 3, 8, generator=generator)
    paths = [write_state_dict(base, tmp_path / "base.safetensors")]
    for index in range(2):
        tuned = {n: t + 0.1 * torch.randn(t.shape, generator=generator) for n, t in base.items()}
        paths.append(write_state_dict(tuned, tmp_path / f"m{index}.safetensors"))
    merged = []
    monkeypatch.setattr(METHODS[method], "merge_tensor", lambda self, name, d: merged.append(name))
    before = sorted(tmp_path.iterdir())
    code, _, err = run_main(capsys, "merge", *paths[1:], "--base", paths[0], "-m", method,
                            *options, "-o", tmp_path / "out.safetensors")  # fmt: skip
    assert code == 2
    assert_one_line_error(err, f"{method}: tensor 'zz_score.weight'", fragment)
    assert merged == [] and sorted(tmp_path.iterdir()) == before


def test_missing_base_advice_puts_base_before_a_double_dash(files, tmp_path, capsys):
    """Before: ``... -- M1 M2 --base BASE``, where --base is read as a model; the advice, with
    BASE filled in, now runs."""
    base, models = files
    out = tmp_path / "soup.safetensors"
    code, _, err = run_main(capsys, "merge", "--method", "ta", "-o", out, "--", *models)
    assert code == 2
    advice = f"mloco merge --method ta -o {out} --base BASE -- {models[0]} {models[1]}"
    assert_one_line_error(err, advice)
    code, _, err = run_main(capsys, "merge", "-q", *advice.replace("BASE", str(base)).split()[2:])
    assert code in (0, None), err
    assert out.is_file()


@pytest.mark.parametrize("how", ["missing_key", "extra_key", "kind", "shape"])
def test_without_a_base_messages_call_the_stand_in_the_first_model(tmp_path, capsys, how):
    """``--method mean`` without --base: the first model stands in for the base, so messages
    said "of the base (M1)" of a base the user never gave. They now say the first model."""
    first = write_state_dict(
        {"w": torch.ones(4, 3), "b": torch.ones(3)}, tmp_path / "m1.safetensors"
    )
    state = {"w": torch.zeros(4, 3), "b": torch.zeros(3)}
    if how == "missing_key":
        del state["b"]
    elif how == "extra_key":
        state["extra"] = torch.zeros(2)
    elif how == "kind":
        state["b"] = torch.zeros(3, dtype=torch.int64)
    else:
        state["w"] = torch.zeros(3, 4)
    second = write_state_dict(state, tmp_path / "m2.safetensors")
    code, _, err = run_main(capsys, "merge", first, second, "-m", "mean", "-o", tmp_path / "out")
    assert code == 2
    assert_one_line_error(err, str(second), "the first model", str(first))
    assert "base" not in err.replace(str(tmp_path), "").replace("--base", "")


def test_mixed_8_bit_and_16_bit_models_without_a_base_name_both_files(tmp_path, capsys):
    """Before: ``tensor 'w' is torch.float16 and torch.float8_e4m3fn in different models``, no
    file named; now from the headers, before any compute."""
    first = write_state_dict({"w": torch.ones(4, 3).half()}, tmp_path / "half.safetensors")
    second = write_state_dict({"w": torch.ones(4, 3).to(torch.float8_e4m3fn)},
                              tmp_path / "eight.safetensors")  # fmt: skip
    code, _, err = run_main(capsys, "merge", first, second, "-m", "mean", "-o", tmp_path / "out")
    assert code == 2
    assert_one_line_error(err, f"{second}: tensor 'w' is torch.float8_e4m3fn but {first} has it "
                          "in torch.float16", "no common dtype", "give --base")  # fmt: skip
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", [".safetensors", "sub/.safetensors"])
def test_an_output_named_only_dot_safetensors_is_refused(files, tmp_path, capsys, name):
    """Before, ``-o .safetensors`` (no suffix to Python: a dot-file) wrote a hidden folder. It
    is neither ``NAME.safetensors`` nor a folder name: refused, by the CLI and by the API (for
    --lora-output: tests/test_merge_lora.py); ``-o .x.safetensors`` is a (hidden) file, as is
    any name ending in .safetensors."""
    from mergekit_loco import merge_checkpoints
    from mergekit_loco.io.atomic import OutputRefused

    base, models = files
    (tmp_path / "sub").mkdir()
    out = tmp_path / name
    code, _, err = run_main(capsys, "merge", *models, "--base", base, "-m", "ta", "-o", out)
    assert code == 2
    assert_one_line_error(err, f"{out}: '.safetensors' alone names no output", "NAME.safetensors")
    with pytest.raises(OutputRefused, match="alone names no output"):
        merge_checkpoints(models, base, "ta", out, progress=False)
    assert not out.exists() and not temp_leftovers(out.parent)
    hidden = tmp_path / ".x.safetensors"
    code, _, err = run_main(
        capsys, "merge", *models, "--base", base, "-m", "ta", "-o", hidden, "-q"
    )
    assert code in (0, None), err
    assert hidden.is_file()
