"""The first contact with ``mloco``: what starting it imports, what its help shows, how it answers
the commands a newcomer types first (the card's ``merge`` without ``-o`` or ``--base``)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import MISSING, fields
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mergekit_loco.cli import COMMANDS, app, main
from mergekit_loco.cli.catalog import method_catalog
from mergekit_loco.cli.merge import DEFAULT_SHARD_SIZE, parse_size

TINY = Path(__file__).resolve().parents[1] / "examples" / "tiny"
HEAVY_MODULES = ("torch", "transformers", "mergekit_loco.train.loop", "mergekit_loco.merge")
IMPORTS_AFTER = """
import json, sys
from mergekit_loco.cli import main
try:
    main(json.loads(sys.argv[1]))
except SystemExit:
    pass
print(json.dumps(sorted(name for name in sys.modules if name in json.loads(sys.argv[2]))))
"""


def modules_imported_by(args: list[str], watched=HEAVY_MODULES) -> list[str]:
    """Which of ``watched`` a fresh interpreter has imported after ``mloco ARGS``."""
    done = subprocess.run(
        [sys.executable, "-c", IMPORTS_AFTER, json.dumps(args), json.dumps(watched)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_main(capsys, *args) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exited:
        main([str(arg) for arg in args])
    captured = capsys.readouterr()
    return exited.value.code, captured.out, captured.err


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        [],
        ["methods"],
        ["methods", "ties"],
        ["mrege"],
        ["merge", "--help"],
        ["report", "--help"],
        ["train", "--help"],
        ["--version"],
    ],  # fmt: skip
)
def test_starting_imports_neither_torch_nor_the_trainer(args):
    assert modules_imported_by(args) == []


def test_version_is_the_installed_distributions(capsys):
    from importlib.metadata import version

    code, out, err = run_main(capsys, "--version")
    assert (code, out, err) == (0, f"mloco {version('mergekit_loco')}\n", "")


def test_a_merge_does_not_import_transformers(tmp_path):
    """Copying the tokenizer files is a file copy: transformers stays unloaded."""
    args = ["merge", f"{TINY}/ft1", f"{TINY}/ft2", "--base", f"{TINY}/base", "-m", "ta"]
    imported = modules_imported_by(
        [*args, "-o", str(tmp_path / "m"), "-q"], ("torch", "transformers")
    )
    assert imported == ["torch"]
    assert (tmp_path / "m" / "tokenizer.json").is_file()


def test_method_catalog_agrees_with_the_imported_registry():
    from mergekit_loco.methods import METHODS

    catalog = method_catalog()
    assert [info.name for info in catalog] == list(METHODS)
    for info, method_class in zip(catalog, METHODS.values(), strict=True):
        assert info.needs_base == method_class.needs_base, info.name
        assert info.doc == method_class.__doc__.strip().replace("\n    ", "\n"), info.name
        defaults = {f.name: f.default for f in fields(method_class)}
        assert MISSING not in defaults.values() and info.parameters == defaults, info.name


# -- help -----------------------------------------------------------------------------------------
def help_of(*args: str) -> str:
    result = CliRunner().invoke(app, [*args, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("name", list(COMMANDS))
def test_help_shows_plain_flags_and_ends_with_examples_that_parse(name):
    text = help_of(name)
    assert "<bool>" not in text
    assert "--help" in text and "--debug" in text
    lines = [line.strip() for line in text.strip().splitlines()]
    examples = COMMANDS[name].examples
    assert 2 <= len(examples) <= 3
    assert lines[-len(examples) - 1 :] == ["Examples", *(f"$ {line}" for line in examples)]
    for example in examples:
        words = shlex.split(example, comments=True)
        command = COMMANDS[words[1]].load(words[1])
        command.make_context(words[1], words[2:])  # raises on an unknown option or bad value


@pytest.mark.parametrize("columns", ["60", "80"])
@pytest.mark.parametrize("name", list(COMMANDS))
def test_help_at_a_narrow_width_cuts_no_name_and_no_word(name, columns):
    """Before: rich's option table cut ``--allow-config-chan…`` and long defaults at 80
    columns (and whenever the help was piped). Every option name and every word of the help
    texts must appear whole."""
    text = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": columns}).output
    assert "…" not in text
    command = COMMANDS[name].load(name)
    words = set(text.replace("\n", " ").split())
    for param in command.params:
        names = (*param.opts, *param.secondary_opts) if param.param_type_name == "option" else ()
        for option in names:
            assert option in text, option
        for word in (param.help or "").split():
            joined = "".join(text.split())  # click may break a long word at a hyphen
            assert word in words or word in joined, (param.name, word)


@pytest.mark.parametrize("name", list(COMMANDS))
def test_listed_summary_is_the_first_sentence_of_the_help(name):
    command = COMMANDS[name].load(name)
    assert command.help.split("\n\n")[0].replace("\n", " ").startswith(COMMANDS[name].summary)


def test_usage_names_arguments_in_capitals():
    assert "Usage: mloco merge [OPTIONS] [MODELS...]" in help_of("merge")  # optional: --config
    assert "Usage: mloco report [OPTIONS] RESULTS..." in help_of("report")
    top = help_of()
    assert "<bool>" not in top and all(name in top for name in COMMANDS)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["merge", "a", "b", "-m", "iso-c", "--rank-aware", "true"], "write --rank-aware to turn"),
        (["merge", "a", "b", "-m", "iso-c", "--force=yes"], "write --force to turn it on"),
        (["train", "--nesterov", "false"], "write --nesterov or --no-nesterov"),
    ],
)
def test_a_flag_given_a_value_is_told_it_is_a_flag(capsys, args, expected):
    code, _, stderr = run_main(capsys, *args)
    assert code == 2 and stderr.count("\n") == 1
    assert "is a flag and takes no value" in stderr and expected in stderr


def test_default_shard_size_is_the_writers():
    from mergekit_loco.io import DEFAULT_MAX_SHARD_BYTES

    assert parse_size(DEFAULT_SHARD_SIZE) == DEFAULT_MAX_SHARD_BYTES


@pytest.mark.parametrize(("text", "size"), [
    ("1.1GB", 1_100_000_000),  # exact: float gives 1100000000.0000002
    ("0.5KiB", 512),
    (" 7 b ", 7),
    ("1" + "0" * 400, 10**400),  # before: "cannot convert float infinity to integer"
    ("2.9999", 2),  # whole bytes, rounded down
])  # fmt: skip
def test_shard_sizes_are_read_exactly(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize(("text", "reason"), [
    ("0", "is less than one byte"),
    ("0.4B", "is less than one byte"),
    ("5 parsecs", "is not a size like 5GB"),
    ("-1GB", "is not a size like 5GB"),
    ("1e3", "is not a size like 5GB"),
])  # fmt: skip
def test_bad_shard_sizes_name_the_option(text, reason):
    with pytest.raises(ValueError, match=r"^--shard-size: ") as error:
        parse_size(text)
    assert reason in str(error.value)


# -- the card's commands and first mistakes -------------------------------------------------------
@pytest.fixture
def single_files(tmp_path, monkeypatch):
    """The bundled tiny base and two fine-tunes as single .safetensors files, in the cwd."""
    monkeypatch.chdir(tmp_path)
    for name, folder in (("base", "base"), ("a", "ft1"), ("b", "ft2")):
        model = (TINY / folder / "model.safetensors").read_bytes()
        (tmp_path / f"{name}.safetensors").write_bytes(model)
    return tmp_path


def test_merge_without_base_says_what_base_is_and_the_whole_command(single_files, capsys):
    code, _, stderr = run_main(capsys, "merge", "a.safetensors", "b.safetensors", "-m", "iso-c")
    assert code == 2 and stderr.count("\n") == 1
    assert "needs --base: the pre-trained checkpoint the models were fine-tuned from" in stderr
    corrected = stderr.split("Run: ")[1].split(" (only")[0]
    assert corrected == "mloco merge a.safetensors b.safetensors -m iso-c --base BASE"
    assert list(single_files.glob("merged*")) == []
    fixed = shlex.split(corrected.replace("BASE", "base.safetensors"))[1:]
    code, stdout, _ = run_main(capsys, *fixed)
    assert code == 0
    assert "merged-iso-c.safetensors (no -o given)" in stdout  # the summary's output row
    assert (single_files / "merged-iso-c.safetensors").is_file()
    code, stdout, stderr = run_main(capsys, *fixed)
    assert code == 2 and stdout == ""  # nothing announced for an output that is refused
    assert stderr == (
        "error: merged-iso-c.safetensors: output file exists; add --force to replace it, "
        "or choose another -o\n"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.safetensors", "a.safetensors", "--base", "base.safetensors", "-m", "ta"],
         "error: missing.safetensors: no such file or folder\n"),
        (["a.safetensors", "b.safetensors", "--base", "gone.safetensors", "-m", "ta"],
         "error: gone.safetensors: no such file or folder\n"),
        (["a.safetensors", "b.safetensors", "--base", "base.safetensors", "-m", "ties",
          "--density", "1.5"], "error: ties: density must lie in (0, 1], got 1.5\n"),
        (["a.safetensors", "b.safetensors", "--base", "base.safetensors", "-m", "iso-c",
          "--option", "spectral=svd"], "error: iso-c: spectral must be one of ('exact', 'ns'), "
         "not 'svd'\n"),
        (["a.safetensors", "b.safetensors", "-m", "mean", "--scale", "2"], "error: --scale 2 "
         "needs --base: without a base there is no task vector (model - base) to scale, and the "
         "merge is the mean of the models; give --base or drop --scale\n"),
        (["a.safetensors", "b.safetensors", "--base", "base.safetensors", "-m", "ties",
          "--lora-output"], None),
    ],
)  # fmt: skip
def test_a_merge_refused_announces_no_output(single_files, capsys, args, message):
    """A default -o is named only in the summary of a merge that was written, never before an
    error (before: ``writing merged-ta (no -o given)``, then the error)."""
    code, stdout, stderr = run_main(capsys, "merge", *args)
    assert (code, stdout) == (2, "") and stderr.startswith("error: ")
    assert message is None or stderr == message
    assert list(single_files.glob("merged*")) == []


def test_an_existing_default_output_does_not_hide_another_error(single_files, capsys):
    """The output check runs where the writer runs it, after the checks of the models."""
    (single_files / "merged-ta.safetensors").write_bytes(b"old")
    code, stdout, stderr = run_main(capsys, "merge", "a.safetensors", "a.safetensors", "--base",
                                    "base.safetensors", "-m", "ta")  # fmt: skip
    assert (code, stdout) == (2, "") and "given twice" in stderr, stderr
    assert (single_files / "merged-ta.safetensors").read_bytes() == b"old"


def test_mean_without_output_names_a_folder_after_folders(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    code, stdout, _ = run_main(capsys, "merge", TINY / "ft1", TINY / "ft2", "-m", "mean")
    assert code == 0 and "merged-mean (no -o given)" in stdout
    assert (tmp_path / "merged-mean" / "config.json").is_file()


def test_report_of_a_missing_folder_says_it_does_not_exist(tmp_path, capsys):
    code, _, stderr = run_main(capsys, "report", tmp_path / "nosuch")
    assert code == 2
    missing = tmp_path / "nosuch"
    assert (
        stderr == f"error: {missing}: does not exist (give a folder written by mloco compare -o)\n"
    )


# -- threads --------------------------------------------------------------------------------------
def test_threads_follow_the_flag_then_the_environment_then_the_idle_cores(monkeypatch):
    from mergekit_loco.cli import threads

    assert threads.choose_threads(3) == (3, "--threads")
    with pytest.raises(ValueError, match="--threads must be at least 1"):
        threads.choose_threads(0)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert threads.choose_threads(None) == (2, "OMP_NUM_THREADS")
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(threads.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(threads, "physical_cores", lambda: 4)
    monkeypatch.setattr(threads.time, "sleep", lambda seconds: None)
    for idle_jiffies, expected in ((0, 1), (30, 1), (70, 3), (100, 4)):  # of 100, on 4 CPUs
        samples = iter([(0, 0), (idle_jiffies, 100)])
        monkeypatch.setattr(threads, "cpu_times", samples.__next__)
        assert threads.choose_threads(None)[0] == expected, idle_jiffies
    monkeypatch.setattr(threads, "cpu_times", lambda: None)
    assert threads.choose_threads(None) == (4, "4 physical cores")


def test_physical_cores_and_cpu_times_read_the_kernel_files_by_hand(tmp_path, monkeypatch):
    """CPU lists as Linux writes them (one thread per core, two as ``0,4`` or ``0-1``) divide
    the 8 logical CPUs; the ``cpu`` line of /proc/stat gives (idle + iowait, the sum of the
    first eight counters); a missing or garbled file falls back (all CPUs; no sample)."""
    from mergekit_loco.cli import threads

    monkeypatch.setattr(threads, "usable_cores", lambda: 8)
    siblings = tmp_path / "thread_siblings_list"
    for text, cores in (("0\n", 8), ("0,4\n", 4), ("0-1\n", 4), ("0-3\n", 2), ("x-y", 8)):
        siblings.write_text(text)
        assert threads.physical_cores(siblings) == cores, text
    assert threads.physical_cores(tmp_path / "missing") == 8
    stat = tmp_path / "stat"
    stat.write_text("cpu  10 1 5 70 4 2 3 5 9 9\ncpu0 5 0 2 35 2 1 1 2 0 0\n")
    assert threads.cpu_times(stat) == (70 + 4, 10 + 1 + 5 + 70 + 4 + 2 + 3 + 5)
    for garbled in ("", "intr 1 2 3 4 5\n", "cpu 1 2 x 4 5\n", "cpu 1 2 3\n"):
        stat.write_text(garbled)
        assert threads.cpu_times(stat) is None, garbled
    assert threads.cpu_times(tmp_path / "missing") is None


@pytest.mark.parametrize(
    ("args", "advice"),
    [
        (["compare", "--aggregators", "diloco,iso-c"],
         "('iso-c' is a merge method; the presets that aggregate with it: isoloco, isoloco-ns, "
         "isoc-sgd)"),
        (["compare", "--aggregators", "mean"],
         "('mean' is a merge method; the presets that aggregate with it: diloco, diloco-sgd)"),
        (["train", "--preset", "ta"],
         "('ta' is a merge method; no preset aggregates with it (mloco train --aggregator ta "
         "does))"),
        (["train", "--preset", "linear"],
         "('linear' is mergekit's name of the merge method mean; the presets that aggregate with "
         "it: diloco, diloco-sgd)"),
    ],
)  # fmt: skip
def test_a_method_given_as_a_preset_is_answered_with_the_presets_that_use_it(
    capsys, tmp_path, args, advice
):
    """``--aggregators diloco,iso-c`` (a method where a preset goes; before: only ``unknown
    preset``) names the presets whose aggregator it is, from the preset table; nothing runs."""
    code, out, err = run_main(capsys, *args, "--output" if args[0] == "compare" else "--out",
                              tmp_path / "out")  # fmt: skip
    assert code == 2 and out == ""
    assert err.startswith("error: unknown preset ") and err.rstrip().endswith(advice), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "args, advice",
    [
        (["methods", "iso_c"], "(did you mean iso-c?)"),
        (["methods", "TIES"], "(did you mean ties?)"),
        (["methods", "task_arithmetic"], "(mergekit's task_arithmetic is ta here;"),
        (["merge", "a", "b", "--method", "isoc"], "(did you mean iso-c?)"),
        (["merge", "a", "b", "--method", "dar"], "(did you mean dare?)"),
        (["train", "--preset", "IsoLoCo"], "(did you mean isoloco?)"),
        (["train", "--preset", "diloco_sgd"], "(did you mean diloco-sgd?)"),
        (["train", "--preset", "iso_c"],
         "('iso_c' is close to the merge method iso-c; the presets that aggregate with it: "
         "isoloco, isoloco-ns, isoc-sgd)"),
        (["compare", "--aggregators", "diloco,isoloco_ns", "-o", "out"],
         "(did you mean isoloco-ns?)"),
    ],
)  # fmt: skip
def test_a_misspelt_method_or_preset_is_answered_with_the_name_it_misspells(
    capsys, tmp_path, monkeypatch, args, advice
):
    """Case, ``_`` for ``-`` or a dropped letter get a "did you mean"; the error comes first:
    merge without ``-o`` announces no default output and creates nothing."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(capsys, *args)
    assert code == 2 and out == "", out
    assert err.startswith("error: unknown ") and advice in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_name_far_from_every_method_gets_no_guess(capsys):
    code, _, err = run_main(capsys, "methods", "soup")
    assert code == 2 and "did you mean" not in err
    assert "choose one of mean, ta, ties, dare, breadcrumbs, tsv, iso-c, iso-cts" in err


@pytest.mark.parametrize(
    "args",
    [
        ["merge", f"{TINY}/ft1", f"{TINY}/ft2", "--base", f"{TINY}/base", "-m", "ta", "-o"],
        ["merge", f"{TINY}/ft1", f"{TINY}/ft2", "-m", "mean", "--lora-output", "-o"],
        ["train", "--model", "micro", "--out"],
        ["compare", "--aggregators", "diloco", "-o"],
        ["report", str(TINY), "-o"],
    ],
    ids=["merge", "merge-lora", "train", "compare", "report"],
)
def test_an_output_in_a_missing_folder_is_refused_naming_it(capsys, tmp_path, args):
    """``-o /nonexistent/dir/m1`` (before: the missing folders were created): every command
    that writes an output the user names refuses, naming the missing folder; nothing is made."""
    output = tmp_path / "nonexistent" / "dir" / "m1"
    code, out, err = run_main(capsys, *args, output)
    assert code == 2 and "Traceback" not in err
    option = args[-1]
    assert err == (
        f"error: {output}: the folder {output.parent} does not exist; create it first or correct "
        f"{option} (a command creates its output, and ./runs, but no other folder)\n"
    )
    assert not (tmp_path / "nonexistent").exists()


def test_runs_is_the_one_missing_folder_a_command_creates(capsys, tmp_path, monkeypatch):
    """``-o runs/NAME`` (the docs' habit, and train's default --out runs/train) in a folder
    without ``runs/`` creates it; one level deeper is refused."""
    monkeypatch.chdir(tmp_path)
    merge = ["merge", f"{TINY}/ft1", f"{TINY}/ft2", "-m", "mean", "-q", "-o"]
    assert run_main(capsys, *merge, "runs/soup.safetensors")[0] in (0, None)
    assert (tmp_path / "runs" / "soup.safetensors").is_file()
    code, _, err = run_main(capsys, *merge, "runs/typo/soup.safetensors")
    assert code == 2 and "the folder runs/typo does not exist" in err
    code, _, err = run_main(capsys, *merge, "~/soup.safetensors")  # as --out=~/soup passes it
    assert code == 2 and err.rstrip().endswith("; ~ is not expanded after -o=, write -o ~/... or "
                                               "$HOME/...")  # fmt: skip
    assert not (tmp_path / "~").exists()


def test_methods_with_a_name_shows_that_method_in_full(capsys):
    """``mloco methods ties`` (before: ``Got unexpected extra argument``): that method's
    parameters with their defaults and its whole description, RST markup removed."""
    code, out, err = run_main(capsys, "methods", "ties")
    assert code in (0, None), err
    lines = out.splitlines()
    assert lines[0] == "ties" and lines[1].startswith("  parameters: density=0.2, weights=None")
    assert "zero_sign: the sign an entry whose sum is exactly 0 takes" in out
    assert "``" not in out and ":data:" not in out and "mean  (no --base needed)" not in out
    code, _, err = run_main(capsys, "methods", "soup")
    assert code == 2 and err.startswith("error: unknown merge method 'soup'; choose one of mean")


INTERLEAVING_WRITER = """
import sys
from mergekit_loco.cli.common import print_error, print_warning
for index in range(400):
    (print_error if index % 2 else print_warning)(sys.argv[1] * 200)
"""


def test_error_lines_of_processes_sharing_one_stderr_never_interleave():
    """Four processes (as torchrun's ranks) each write 400 long error and warning lines to one
    pipe at once: every line read back is whole, one process's letter from start to end."""
    read_end, write_end = os.pipe()
    writers = [
        subprocess.Popen([sys.executable, "-c", INTERLEAVING_WRITER, letter], stderr=write_end)
        for letter in "abcd"
    ]
    os.close(write_end)
    with open(read_end, encoding="utf-8") as pipe:
        lines = pipe.read().splitlines()
    assert [writer.wait() for writer in writers] == [0, 0, 0, 0]
    whole = {f"{kind}: {letter * 200}" for kind in ("error", "warning") for letter in "abcd"}
    assert len(lines) == 1600 and set(lines) == whole
