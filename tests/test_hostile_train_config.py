"""``mloco train --config`` and the config API with hostile values: a config file cannot say
what to do with the run folder (config.json does not hold it), a YAML bomb or deep nesting is
refused before it expands, and every value of the wrong type, out of range or not finite is one
``error:`` line naming the option, before anything is written."""

from __future__ import annotations

import json
import pickle
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import stdlib_corpus
from hostile import TRAIN, assert_refused, run_cli, snapshot

from mergekit_loco.train.config import TrainConfig, preset_config, resolve_config
from mergekit_loco.train.config_sections import OptionError, RunConfig

FOLDER_ACTIONS = ("resume", "allow_config_change", "force")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    files = ["json/decoder.py", "json/encoder.py", "textwrap.py", "string.py"]
    with stdlib_corpus(tmp_path_factory.mktemp("train_config"), files) as folder:
        yield folder


def train(capsys, tmp_path: Path, *extra: str, without: tuple[str, ...] = ()) -> tuple[int, str]:
    """``mloco train`` of a tiny run into ``tmp_path/out``, less the flags named in ``without``
    (``tokens``: they would override a config file's): (exit code, stderr)."""
    dropped = tuple(f"--{name.replace('_', '-')}=" for name in without)
    tiny = [flag for flag in TRAIN if not flag.startswith(dropped)]
    code, err, _ = run_cli(capsys, "train", *tiny, f"--out={tmp_path / 'out'}", *extra)
    return code, err


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def refused_config(capsys, tmp_path: Path, name: str, text: str) -> tuple[Path, str]:
    """``mloco train --config NAME`` (holding ``text``) of a tiny run, which must be refused in
    one line with nothing written: (the config's path, the line)."""
    config = write(tmp_path, name, text)
    code, err = train(capsys, tmp_path, f"--config={config}")
    line = assert_refused(code, err)
    assert not (tmp_path / "out").exists()
    return config, line


# -- the run folder ------------------------------------------------------------------------------
def test_a_run_config_never_clobbers_a_run(capsys, tmp_path, corpus, stopped):
    """A run started with --force saves no ``force`` in config.json, so ``--config`` of it onto
    another run is refused like any new run there; the config.json of earlier versions, which
    saved ``"force": true``, is refused as a config file. The victim is untouched."""
    forced = tmp_path / "forced"
    shutil.copytree(stopped, forced, symlinks=True)
    (forced / "config.json").write_text("{}")  # proves the run below wrote its own
    code, err, _ = run_cli(capsys, "train", *TRAIN, f"--data={corpus}", f"--out={forced}",
                           "--force", "--stop-after=1")  # fmt: skip
    assert code in (0, None), err
    saved = json.loads((forced / "config.json").read_text())
    assert saved["workers"] == 2 and not set(FOLDER_ACTIONS) & set(saved)
    victim = tmp_path / "victim"
    shutil.copytree(stopped, victim, symlinks=True)
    before = snapshot(victim)
    code, err, _ = run_cli(capsys, "train", f"--config={forced / 'config.json'}", f"--out={victim}")
    assert_refused(code, err, f"{victim} already holds a run")
    old = write(tmp_path, "old.json", json.dumps({**saved, "force": True, "resume": False}))
    code, err, _ = run_cli(capsys, "train", f"--config={old}", f"--out={victim}")
    line = assert_refused(code, err)
    assert line == (
        f"error: force in {old}: a config file cannot say what to do with the run folder; "
        "pass --force instead"
    )
    assert snapshot(victim) == before


@pytest.mark.parametrize(
    ("name", "text", "key"),
    [
        ("run.toml", "force = true\n", "force"),
        ("run.yaml", "resume: true\n", "resume"),
        ("run.json", '{"allow-config-change": true}', "allow_config_change"),
    ],
)
def test_a_config_file_cannot_resume_or_force(capsys, tmp_path, name, text, key):
    config, line = refused_config(capsys, tmp_path, name, text)
    assert line == (
        f"error: {key} in {config}: a config file cannot say what to do with the run folder; "
        f"pass --{key.replace('_', '-')} instead"
    )


def test_old_config_json_with_folder_actions_still_reads(tmp_path):
    """False ones in a --config file are dropped; a run's own config.json of an earlier version
    (``"force": true``, ``"resume": true``) resumes without them; compare's cells keep the
    ``force`` they are built with through ``replace``, and match their old config.json."""
    cell = preset_config("isoloco", out=str(tmp_path), workers=2, global_batch=4, force=True)
    cell = cell.replace(eval_every=0, checkpoint_every=20)
    assert cell.checkpoint.force and not set(FOLDER_ACTIONS) & set(cell.to_dict())
    old = {**cell.to_dict(), "force": True, "resume": True, "allow_config_change": False}
    assert cell.differences(old) == []
    (tmp_path / "config.json").write_text(json.dumps(old))
    resumed = resolve_config(None, out=str(tmp_path), resume=True)
    assert (resumed.checkpoint.resume, resumed.checkpoint.force) == (True, False)
    assert resumed.run_defining() == cell.run_defining()
    config = write(tmp_path, "old.json", json.dumps({**old, "force": False, "resume": False}))
    assert resolve_config(config).run_defining() == cell.run_defining()


# -- YAML from strangers -------------------------------------------------------------------------
def alias_bomb(levels: int = 9) -> str:
    """Anchors whose aliases expand to 10**levels strings (a "billion laughs")."""
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "use", ["seed: *a8\n", "aggregator_options: {x: *a8}\n", "aggregator_options: *a8\n"]
)
def test_a_yaml_alias_bomb_is_refused_before_it_expands(capsys, tmp_path, use):
    bomb = alias_bomb().replace("\n", "\n  ")
    config = write(tmp_path, "bomb.yaml", f"anchors:\n  {bomb}\n{use}")
    started = time.process_time()
    code, err = train(capsys, tmp_path, f"--config={config}")
    assert time.process_time() - started < 0.5
    line = assert_refused(code, err)
    assert (
        line == f"error: {config}: more than 100000 values once YAML aliases are expanded; refused"
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        (
            "deep.yaml",
            "seed: " + "[" * 50_000 + "]" * 50_000,
            "line 1: nested more than 32 levels deep",
        ),
        ("cycle.yaml", "aggregator_options: &o {x: *o}\n", "nested more than 32 levels deep"),
        ("twice.yaml", "workers: 2\nworkers: 4\n", "line 2: key 'workers' appears twice"),
        ("key.yaml", "1: 2\n", "line 1: key 1 is not a string (every mapping key must be)"),
        # YAML 1.1's integers that 1.2 reads otherwise (before: workers 8 and seed 90, silently)
        (
            "octal.yaml",
            "workers: 010\n",
            "line 1: '010' is 8 in YAML 1.1 and 10 in YAML 1.2; write the number in decimal",
        ),
        (
            "base60.yaml",
            "workers: 2\nseed: 1:30\n",
            "line 2: '1:30' is 90 in YAML 1.1 and a "
            "string in YAML 1.2; write the number in decimal",
        ),
    ],
)
def test_yaml_nesting_repeated_and_odd_keys_are_refused(capsys, tmp_path, name, text, message):
    config, line = refused_config(capsys, tmp_path, name, text)
    assert line == f"error: {config}: {message}"


@pytest.mark.parametrize(
    ("name", "text"),
    [("twice.json", '{"workers": 2, "workers": 4}'), ("twice.toml", "workers = 2\nworkers = 4\n")],
)
def test_a_key_given_twice_in_json_or_toml_is_refused(capsys, tmp_path, name, text):
    config, line = refused_config(capsys, tmp_path, name, text)
    assert f"config file {config} cannot be parsed: " in line


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("both.toml", "outer_lr = 0.5\nouter-lr = 0.9\n"),
        ("both.yaml", "outer_lr: 0.5\nouter-lr: 0.9\n"),
        ("both.json", '{"outer_lr": 0.5, "outer-lr": 0.9}'),
    ],
)
def test_one_option_under_two_spellings_is_refused(capsys, tmp_path, name, text):
    """Before, ``outer_lr`` and ``outer-lr`` in one file both read, the last winning (0.9)."""
    config, line = refused_config(capsys, tmp_path, name, text)
    assert line == f"error: {config}: outer_lr and outer-lr are one option, outer_lr; give it once"


def test_yaml_1_2_floats_are_numbers(tmp_path):
    config = write(tmp_path, "run.yaml", "inner_lr: 1e-3\nouter_lr: 5E-1\n")
    resolved = resolve_config(config)
    assert (resolved.inner.lr, resolved.outer.lr) == (1e-3, 0.5)


# -- values ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--grad-clip", "nan"], "--grad-clip must be a finite number, got nan"),
        (["--grad-clip", "inf"], "--grad-clip must be a finite number, got inf"),
        (["--timeout", "inf"], "--timeout must be a finite number, got inf"),
        (["--timeout", "1e300"], "--timeout must be at most 1e9 seconds, got 1e+300"),
        (["--weight-decay", "inf"], "--weight-decay must be a finite number, got inf"),
        (["--weight-decay", "1e39"], "--weight-decay must be at most 3.4e38 (float32), got 1e+39"),
        (["--inner-lr", "1e999"], "--inner-lr must be a finite number, got inf"),
        (["--inner-lr", "1e300"], "--inner-lr must be at most 3.4e38 (float32), got 1e+300"),
        (["--outer-lr", "1e300"], "--outer-lr must be at most 3.4e38 (float32), got 1e+300"),
        (["--chinchilla", "nan"], "--chinchilla must be a finite number, got nan"),
        (["--seed", "-1"], "--seed must be an integer in [0, 2**63), got -1"),
        (["--vocab-size", "4294967296"], "--vocab-size must be at most 2**20, got 4294967296"),
    ],
)
def test_flags_out_of_range_or_not_finite_are_refused(capsys, tmp_path, flags, message):
    without = ("tokens",) if "--chinchilla" in flags else ()
    code, err = train(capsys, tmp_path, *flags, without=without)
    assert assert_refused(code, err) == f"error: {message}"
    assert not (tmp_path / "out").exists()


#: (flat name, a refused value): one for every check of a config section and of the whole config.
REFUSED_VALUES = [
    ("global_batch", 0), ("vocab_size", 0), ("seq_len", 1), ("val_tokens", 5), ("tokens", 0),
    ("val_seed", -1), ("inner_optimizer", "sgd"), ("inner_steps", 0), ("inner_lr", -1.0),
    ("weight_decay", -1.0), ("grad_clip", -1.0), ("warmup_fraction", 2.0), ("outer_lr", -1.0),
    ("outer_momentum", 1.5), ("checkpoint_every", -1), ("keep_checkpoints", 0), ("mode", "x"),
    ("device", "tpu"), ("workers", 0), ("workers", 3), ("eval_every", -1), ("stop_after", 0),
    ("timeout", -1.0), ("seed", -1), ("inner_lr", 1e300), ("model", " "),
]  # fmt: skip


@pytest.mark.parametrize(("key", "value"), REFUSED_VALUES)
def test_a_refused_value_is_named_as_the_user_gave_it(capsys, tmp_path, key, value):
    """The flag (``--global-batch``) for a flag, ``global_batch in FILE`` for a config file's
    key, ``global_batch`` for the Python API (before: ``global_batch`` in all three)."""
    flag = "--" + key.replace("_", "-")
    code, err = train(capsys, tmp_path, f"{flag}={value}", without=(key,))
    assert_refused(code, err, flag)
    assert key not in err or "_" not in key, err

    config = write(tmp_path, "run.toml", f"{key} = {json.dumps(value)}\n")
    code, err = train(capsys, tmp_path, f"--config={config}", without=(key,))
    assert_refused(code, err, f"{key} in {config}")
    assert not (tmp_path / "out").exists()

    with pytest.raises(ValueError) as refused:
        preset_config(**{key: value})
    assert key in str(refused.value) and "--" not in str(refused.value)


def test_a_message_of_two_options_names_each_as_given(capsys, tmp_path):
    config = write(tmp_path, "run.toml", "global_batch = 6\n")
    code, err = train(capsys, tmp_path, f"--config={config}", "--workers=4", without=("workers",
                      "global_batch"))  # fmt: skip
    assert assert_refused(code, err) == (
        f"error: a global batch of 6 (global_batch in {config}) is not divisible by 4 workers "
        "(--workers); each worker's batch is the global batch / R"
    )
    code, err = train(capsys, tmp_path, "--preset=diloco-sgd", "--nesterov")
    assert_refused(code, err, "error: --nesterov needs --outer-momentum > 0")


def test_an_option_error_survives_a_process_boundary():
    """An error of a compare cell crosses from the cell's process to the sweep by pickle: this
    one must arrive whole, names and all."""
    with pytest.raises(OptionError) as refused:
        preset_config(global_batch=6, workers=4)
    copy = pickle.loads(pickle.dumps(refused.value))
    assert str(copy) == str(refused.value)
    assert copy.named({"workers": "--workers"}) == refused.value.named({"workers": "--workers"})
    assert "(--workers)" in copy.named({"workers": "--workers"})


def test_threads_are_bounded(capsys, tmp_path):
    code, err = train(capsys, tmp_path, "--threads", "100000")
    assert_refused(code, err, "--threads 100000 is more than 4 per CPU", "choose at most")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"workers": [1, 2]}', "CONFIG: option 'workers' expects int, got [1, 2]"),
        ('{"workers": {"a": 1}}', "CONFIG: option 'workers' expects int, got {'a': 1}"),
        ('{"workers": "8.0"}', "CONFIG: option 'workers' expects int, got '8.0'"),
        ('{"betas": 5}', "CONFIG: option 'betas' expects a list of 2 numbers, got 5"),
        (
            '{"betas": [0.9, null]}',
            "CONFIG: option 'betas' expects a list of 2 numbers, got [0.9, None]",
        ),
        ('{"inner_lr": "abc"}', "CONFIG: option 'inner_lr' expects float, got 'abc'"),
        (
            '{"inner_lr": 1' + "0" * 400 + "}",
            "CONFIG: option 'inner_lr' expects float, got an integer of about 401 digits",
        ),
        ('{"data": ["stdlib"]}', "CONFIG: option 'data' expects str, got ['stdlib']"),
        ('{"grad_clip": NaN}', "grad_clip in CONFIG must be a finite number, got nan"),
        (
            '{"seed": 18446744073709551616}',
            "seed in CONFIG must be an integer in [0, 2**63), got 18446744073709551616",
        ),
        ('{"seed": -1}', "seed in CONFIG must be an integer in [0, 2**63), got -1"),
        (
            '{"tokens": 1' + "0" * 400 + "}",
            "tokens in CONFIG must be an integer in [0, 2**63), got an integer of about 401 digits",
        ),
        ('{"vocab_size": 1e12}', "vocab_size in CONFIG must be at most 2**20, got 1000000000000"),
        ('{"init": ""}', "init in CONFIG: an empty path (it would mean the current folder)"),
        (
            '{"tokenizer": " "}',
            "tokenizer in CONFIG: an empty path (it would mean the current folder)",
        ),
        # before: "embedded null byte", naming no option
        (
            '{"data": "a\\u0000b"}',
            "data in CONFIG: 'a\\x00b' holds a NUL character, which no path can",
        ),
        (
            '{"init": "a\\u0000b"}',
            "init in CONFIG: 'a\\x00b' holds a NUL character, which no path can",
        ),
    ],
)
def test_config_file_values_are_one_line_naming_the_option(capsys, tmp_path, text, expected):
    """A value of the wrong type, out of range or not finite names the file and the option; a
    huge value is described, never printed."""
    config = write(tmp_path, "run.json", text)
    code, err = train(capsys, tmp_path, f"--config={config}", without=tuple(json.loads(text)))
    assert assert_refused(code, err) == "error: " + expected.replace("CONFIG", str(config))
    assert not (tmp_path / "out").exists()


def test_an_out_folder_with_a_nul_character_is_named(capsys, tmp_path):
    """``out`` from a config file (no --out flag: NUL cannot be in an argument); before:
    ``error: embedded null byte``."""
    config = write(tmp_path, "run.json", '{"out": "a\\u0000b"}')
    code, err, _ = run_cli(capsys, "train", *TRAIN, f"--config={config}")
    assert (
        assert_refused(code, err)
        == f"error: out in {config}: 'a\\x00b' holds a NUL character, which no path can"
    )


@pytest.mark.parametrize("aggregator", ["ties", "mean"])
def test_a_typo_under_aggregator_options_names_the_file(capsys, tmp_path, aggregator):
    """``densty`` under [aggregator_options] (before: "aggregator: method 'mean' does not take
    'densty'", naming no file)."""
    config = write(tmp_path, "run.toml", f'aggregator = "{aggregator}"\n[aggregator_options]\n'
                   "densty = 0.5\n")  # fmt: skip
    code, err = train(capsys, tmp_path, f"--config={config}")
    line = assert_refused(code, err)
    assert line.startswith(
        f"error: aggregator_options in {config}: method {aggregator!r} does not take 'densty' "
        "(it takes "
    )
    assert ("density" in line) == (aggregator == "ties") and "weights" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(seed=-1), "seed must be an integer in [0, 2**63), got -1"),
        (dict(seed=2**64), "seed must be an integer in [0, 2**63), got 18446744073709551616"),
        (dict(data=["stdlib"]), "flags: option 'data' expects str, got ['stdlib']"),
        (dict(betas=(0.9, float("nan"))), "betas must be two numbers in [0, 1), got (0.9, nan)"),
        (dict(init=""), "init: an empty path (it would mean the current folder)"),
        (dict(out=" "), "out: an empty path (it would mean the current folder)"),
    ],
)
def test_the_api_checks_as_the_cli_does(overrides, message):
    with pytest.raises(ValueError) as refused:
        preset_config(**overrides)
    assert str(refused.value) == message


def test_a_config_built_from_its_sections_is_checked_too():
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*63\), got -1"):
        TrainConfig(run=RunConfig(seed=-1))


def test_a_method_option_given_as_a_run_option_says_where_it_goes(tmp_path):
    """``resolve_config(aggregator="ties", density=0.5)`` said only "unknown option"."""
    with pytest.raises(ValueError) as refused:
        resolve_config(aggregator="ties", density=0.5)
    assert str(refused.value) == (
        "flags: unknown option 'density'; it is an aggregator option: pass "
        "aggregator_options={'density': 0.5}"
    )
    config = resolve_config(aggregator="ties", aggregator_options={"density": 0.5})
    assert config.outer.aggregator_options == {"density": 0.5}
    toml = write(tmp_path, "run.toml", 'aggregator = "ties"\ndensity = 0.5\n')
    with pytest.raises(ValueError) as refused:
        resolve_config(toml)
    assert str(refused.value).endswith(
        "run.toml: unknown option 'density'; it is an aggregator option: put it in the "
        "aggregator_options table ([aggregator_options] in TOML)"
    )
    with pytest.raises(ValueError) as refused:
        resolve_config(wokers=4)
    assert str(refused.value) == "flags: unknown option 'wokers'"  # no method takes it


def test_a_new_aggregator_drops_the_old_ones_options_by_replace_as_by_resolve():
    """``preset_config("ties").replace(aggregator="iso-c")`` failed on the preset's density,
    which ``resolve_config(preset="ties", aggregator="iso-c")`` dropped: both drop it now, and
    both check options given with the new aggregator."""
    replaced = preset_config("ties").replace(aggregator="iso-c")
    assert replaced == resolve_config(preset="ties", aggregator="iso-c")
    assert replaced.outer.aggregator_options == {}
    assert preset_config("ties").replace(outer_lr=0.5).outer.aggregator_options == {"density": 0.9}
    given = {"density": 0.5}
    for build in (
        lambda: preset_config("ties").replace(aggregator="iso-c", aggregator_options=given),
        lambda: resolve_config(preset="ties", aggregator="iso-c", aggregator_options=given),
    ):
        with pytest.raises(
            ValueError, match="aggregator_options: method 'iso-c' does not take 'density'"
        ):
            build()
    dare = preset_config("ties").replace(aggregator="dare", aggregator_options={"density": 0.5})
    assert dare.outer.aggregator_options == {"density": 0.5}


@pytest.mark.parametrize(("start", "preset", "flags"), [
    ("diloco", "tsv", {}), ("isoloco-ns", "diloco", {"outer_lr": 0.3}), ("diloco", "dp", {}),
    ("ties", "isoloco", {"workers": 4}),
])  # fmt: skip
def test_replace_with_another_preset_brings_its_values(start, preset, flags):
    """``replace(preset=P)`` is the config ``resolve_config`` builds for P (before: only the
    preset's name changed, its values stayed the old preset's)."""
    replaced = preset_config(start).replace(preset=preset, **flags)
    assert replaced.to_dict() == resolve_config(None, preset=preset, **flags).to_dict()
    with pytest.raises(ValueError, match="unknown preset 'nope'"):
        preset_config(start).replace(preset="nope")


def test_numpy_numbers_are_numbers_in_a_config():
    config = resolve_config(outer_lr=np.float32(0.5), workers=np.int64(2), inner_steps=np.int32(3))
    assert (config.outer.lr, config.run.workers, config.inner.steps) == (0.5, 2, 3)
    assert type(config.outer.lr) is float and type(config.run.workers) is int


@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("file", "error: aggregator_options in {file}: method 'ties': density must be a finite"),
        ("flag", "error: --option: ties: density must lie in (0, 1], got 2.0"),
        ("method flag", "error: --density: ties: density must lie in (0, 1], got 2.0"),
        ("method flag 0", "error: --density: ties: density must lie in (0, 1], got 0.0"),
        ("both", "error: --option: iso-c: rank_aware applies to spectral='exact' only"),
        ("name", "error: --aggregator: unknown merge method 'tiesx'"),
    ],
)
def test_a_refused_aggregator_option_is_named_where_it_was_given(capsys, tmp_path, given, said):
    """``density = nan`` under a config file's [aggregator_options], ``--option density=2`` or
    ``--density 2`` (before: ``error: aggregator: ...``, naming neither the file nor the flag;
    then ``--option`` for ``--density``); options refused together are named ``--option``."""
    config = tmp_path / "run.toml"
    config.write_text('aggregator = "ties"\n[aggregator_options]\ndensity = nan\n')
    extra = {
        "file": [f"--config={config}"],
        "flag": ["--aggregator=ties", "--option", "density=2"],
        "method flag": ["--aggregator=ties", "--density", "2"],
        "method flag 0": ["--aggregator=ties", "--density", "0"],
        "both": ["--aggregator=iso-c", "--spectral", "ns", "--option", "rank_aware=true"],
        "name": ["--aggregator=tiesx"],
    }[given]
    code, err = train(capsys, tmp_path, *extra)
    assert code == 2 and err.startswith(said.format(file=config)), err


def test_a_yaml_error_says_where_without_quoting_the_file(capsys, tmp_path):
    """A ``!!python`` tag (refused: no code runs) in a train or merge config (before: PyYAML's
    message quoted the line, ``workers: !!python/object/apply:os.system ... ^``)."""
    text = 'workers: !!python/object/apply:os.system ["echo hi"]\n'
    config, line = refused_config(capsys, tmp_path, "evil.yaml", text)
    assert line == (
        f"error: config file {config} cannot be parsed: could not determine a constructor for "
        "the tag 'tag:yaml.org,2002:python/object/apply:os.system' at line 1, column 10"
    )
    merge = write(tmp_path, "evil.yml", text.replace("workers", "merge_method"))
    code, err, _ = run_cli(capsys, "merge", "--config", merge, "-o", tmp_path / "m.safetensors")
    line = assert_refused(code, err)
    assert line.endswith("os.system' at line 1, column 15)") and "echo" not in line, line
