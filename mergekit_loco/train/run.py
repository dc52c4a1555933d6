"""A training run's state and its setup: tokenizer, model, data, workers, the DiLoCo driver,
the run folder, checkpoints and resume. :func:`mergekit_loco.train.loop.train` drives it."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from mergekit_loco.console import print_line
from mergekit_loco.io import open_checkpoint
from mergekit_loco.io.atomic import write_atomically
from mergekit_loco.io.lock import FolderLock
from mergekit_loco.io.yaml_config import bounded
from mergekit_loco.methods import METHODS
from mergekit_loco.run_layout import CONFIG, METRICS
from mergekit_loco.train.checkpoint import (
    SHARED,
    STATE,
    Checkpoint,
    CheckpointCorrupt,
    data_bounds,
    load_checkpoint,
    read_state,
    reading,
    restore_rng_state,
    rng_file,
    rng_state,
    save_checkpoint,
    worker_file,
)
from mergekit_loco.train.config import TrainConfig
from mergekit_loco.train.config_sections import flag_name
from mergekit_loco.train.data import (
    BatchStream,
    NotEnoughData,
    PreparedData,
    prepare_data,
    worker_slice,
)
from mergekit_loco.train.diloco import DiLoCo, check_compression_has_ranks
from mergekit_loco.train.guards import check_data_left
from mergekit_loco.train.model import (
    build_model,
    check_pretrained,
    check_seq_len,
    check_weights_fit,
    checkpoint_vocab,
    count_parameters,
    finite_weights,
    load_pretrained,
    model_config,
    parameter_checksum,
)
from mergekit_loco.train.run_folder import (
    MetricsLog,
    check_output,
    claim_output,
    hold_output,
    resume_point,
)
from mergekit_loco.train.tokenizer import (
    TOKENIZER_FILES,
    as_saved_beside,
    load_tokenizer,
    tokenizer_for_model,
)
from mergekit_loco.train.workers import InnerOptimizer, Worker, WorkerGroup


@dataclass
class Run:
    """Everything a run holds. DiLoCo mode: ``driver`` (the global parameters, the outer
    optimizer) and each worker's own inner optimizer; data-parallel mode: ``dp_optimizer``."""

    config: TrainConfig
    group: WorkerGroup
    model: torch.nn.Module
    tokenizer: PreTrainedTokenizerBase
    data: PreparedData
    workers: list[Worker]
    driver: DiLoCo | None
    dp_optimizer: InnerOptimizer | None
    rounds: int
    start_round: int = 0
    completed: int = 0
    round_number: int = 0
    train_loss: float | None = None
    last_saved: tuple[int, Path | None] = (0, None)
    metrics: MetricsLog | None = None
    seconds: dict[str, float] = field(default_factory=lambda: {"round": 0.0, "outer": 0.0})
    #: ``time.perf_counter()`` when this invocation started; wall seconds of earlier ones
    started: float = field(default_factory=time.perf_counter)
    seconds_before: float = 0.0
    #: processes that wrote the checkpoint this run resumed from (None: not resumed)
    resumed_world_size: int | None = None
    #: training-token bounds of the budget's segments (:func:`budget_bounds`)
    data_bounds: list[int] = field(default_factory=list)

    @property
    def wall_seconds(self) -> float:
        """Wall seconds of the run so far, over every invocation (resumes add up)."""
        return self.seconds_before + time.perf_counter() - self.started

    @property
    def out(self) -> Path:
        return Path(self.config.run.out)

    @property
    def distributed(self) -> bool:
        return self.group.distributed

    @property
    def global_params(self) -> dict[str, torch.Tensor]:
        """theta: the driver's global parameters, or (dp) the one model's."""
        if self.driver is not None:
            return self.driver.global_params
        return {name: p.detach() for name, p in self.model.named_parameters()}

    def shared_state(self) -> dict:
        """What every process shares besides theta: the driver's counters and outer optimizer,
        or (dp) the one inner optimizer."""
        if self.driver is None:
            return self.dp_optimizer.state_dict()
        state = self.driver.state_dict()
        del state["global_params"]
        return state

    def save(self, completed: int) -> Path:
        state = Checkpoint(
            round=completed,
            config=self.config.to_dict(),
            global_params=self.global_params,
            shared=self.shared_state(),
            workers={w.index: worker_state(w) for w in self.workers},
            rng=rng_state(),
            data=self.data.source,
            seconds=self.wall_seconds,
            data_bounds=self.data_bounds,
        )
        path = save_checkpoint(self.out, state, self.group, self.config.checkpoint.keep)
        self.last_saved = (completed, path)
        return path

    def save_unless_saved(self, completed: int) -> None:
        if self.last_saved[0] != completed:
            self.save(completed)

    def restore(self, path: Path) -> None:
        """Load this process's part of the checkpoint at ``path``."""
        saved = load_checkpoint(path, [w.index for w in self.workers], self.group.rank)
        if saved.round > self.rounds:
            raise CheckpointCorrupt(
                f"checkpoint file {path / STATE} says round {saved.round}, beyond this run's "
                f"{self.rounds} rounds"
            )
        check_same_shapes(path, saved.global_params, self.global_params)
        if saved.data and saved.data != self.data.source:
            raise ValueError(
                f"checkpoint {path}: the run trained on other data than --data "
                f"{self.config.data.source!r} holds now (its documents, their sizes or times, or "
                "the tokenizer changed: a qwen2-type run begun before mloco trained with the "
                "tokenizer its final/ reloads to, 2026-12-02, used another); resume with the "
                "data it started on, or start over"
            )
        with reading(path / SHARED):  # a damaged file's error names it (never a bare KeyError)
            if self.driver is not None:
                shared = driver_state(saved.shared, self.driver)
                self.driver.load_state_dict({**shared, "global_params": saved.global_params})
                for group in self.driver.outer_optimizer.param_groups:  # the config's, not saved
                    group.update(outer_settings(self.config))
            else:
                with torch.no_grad():
                    for name, tensor in self.global_params.items():
                        tensor.copy_(saved.global_params[name])
                self.dp_optimizer.load_state_dict(saved.shared)
        for worker in self.workers:
            with reading(path / worker_file(worker.index)):
                worker.stream.load_state_dict(saved.workers[worker.index]["data"])
                if worker.inner is not None:
                    worker.inner.load_state_dict(saved.workers[worker.index]["inner"])
                    if self.group.device.type != "cpu":
                        worker.inner.to("cpu")
        with reading(path / rng_file(self.group.rank)):
            restore_rng_state(saved.rng)
        self.start_round = self.completed = saved.round
        self.last_saved = (saved.round, path)
        self.seconds_before = saved.seconds
        self.resumed_world_size = saved.world_size


def check_same_shapes(
    path: Path, saved: dict[str, torch.Tensor], params: dict[str, torch.Tensor]
) -> None:
    """Refuse (ValueError) a checkpoint whose global tensors are not the model's, by name and
    shape: a model that changed though ``--model`` did not (the config.json it names edited,
    ``--init`` of another architecture, another vocabulary) cannot load its state."""
    names = [*params, *(name for name in saved if name not in params)]
    differ = [
        name
        for name in names
        if name not in saved or name not in params or saved[name].shape != params[name].shape
    ]
    if not differ:
        return
    first = differ[0]
    there, here = (list(t[first].shape) if first in t else "absent" for t in (saved, params))
    raise ValueError(
        f"checkpoint {path} holds another model than this run builds ({len(differ)} of "
        f"{len(names)} tensors differ; {first}: {there} there, {here} here); the model "
        "(--model and its config.json, --init, the vocabulary: --tokenizer, --vocab-size) cannot "
        "change on resume, even with --allow-config-change: resume with the run's, or start a "
        "new run in another --out"
    )


def driver_state(shared: dict, driver: DiLoCo) -> dict:
    """A checkpoint's outer state as :meth:`DiLoCo.load_state_dict` takes it. Checkpoints written
    before the driver hold the OuterOptimizer's ``{steps_taken, momentum_buffers by name}``: the
    same SGD state, the buffers indexed by the position of their parameter in the driver."""
    if "momentum_buffers" not in shared:
        return shared
    buffers = shared["momentum_buffers"]
    state = {
        i: {"momentum_buffer": buffers[n]} for i, n in enumerate(driver.params) if n in buffers
    }
    param_groups = driver.outer_optimizer.state_dict()["param_groups"]
    return {
        "local_steps": 0,
        "outer_steps": int(shared["steps_taken"]),
        "pending": [],
        "outer": {"state": state, "param_groups": param_groups},
    }


def worker_state(worker: Worker) -> dict:
    return {
        "data": worker.stream.state_dict(),
        "inner": worker.inner.state_dict() if worker.inner is not None else None,
    }


def start_run(
    config: TrainConfig, group: WorkerGroup, lock: FolderLock, started: float | None = None
) -> Run:
    """Build (or resume) the run ``config`` describes. Every check that needs no training runs
    before ``out`` is touched, so a run that cannot start leaves it as it found it (a resumed
    one leaves the lock file). ``lock``: ``out``'s, taken before a checkpoint is read or ``out``
    is changed, and held by the caller until the run ends. ``started``: the
    ``time.perf_counter()`` its wall time counts from (default: now)."""
    out = Path(config.run.out)
    check_same_options(config, group)
    check_compression_has_ranks(config.outer.compression, None)  # torchrun's group, if any
    check_output(out, config)
    resume_from = None
    if config.checkpoint.resume:
        hold_output(lock, group)  # another process may still be writing the checkpoints
        resume_from = resume_point(out, config)
    check_init(config)
    torch.manual_seed(config.run.seed)
    tokenizer = main_process_first(group, lambda: find_tokenizer(config))
    model = load_model(config, tokenizer).to(group.device).train()
    check_seq_len(model.config, config.data.seq_len, config.model.init or config.model.name)
    tokenizer = as_saved_beside(tokenizer, model.config)  # what final/ will reload to
    if config.model.init is not None and model.config.vocab_size > len(tokenizer) and group.is_main:
        print_line(
            f"note: --init {config.model.init} has {model.config.vocab_size} vocabulary rows and "
            f"the tokenizer {len(tokenizer)}: the rows above are never used; if the checkpoint "
            "was trained with another tokenizer, pass --tokenizer it"
        )
    config.check_budget(count_parameters(model))
    rounds = config.total_rounds(count_parameters(model))
    bounds = budget_bounds(config, resume_from, count_parameters(model), rounds)
    steps = rounds * config.inner.steps
    diloco = config.run.mode == "diloco"
    dp_optimizer = None if diloco else InnerOptimizer(model, config, steps)
    data = main_process_first(group, lambda: load_data(config, tokenizer, rounds))
    group.check_identical(token_checksum(data), "the tokens of --data")
    workers = [
        Worker(
            index,
            BatchStream(
                worker_slice(data.train, index, config.run.workers, bounds), config.data.seq_len
            ),
            InnerOptimizer(model, config, steps) if diloco else None,
        )
        for index in group.worker_ids
    ]
    driver = make_driver(config, model, [w.inner for w in workers]) if diloco else None
    run = Run(config, group, model, tokenizer, data, workers, driver, dp_optimizer, rounds)
    run.data_bounds = bounds
    if started is not None:
        run.started = started
    if resume_from is not None:
        run.restore(resume_from)
    check_data_left(workers, config, rounds - run.start_round)
    group.check_identical(parameter_checksum(run.global_params), "global parameters")
    claim_output(out, config, group, lock)
    run.metrics = MetricsLog(out / METRICS, group.is_main, run.start_round, rounds)
    run.train_loss = run.metrics.resumed_train_loss
    if group.is_main:
        write_atomically(out / CONFIG, json.dumps(config.to_dict(), indent=2) + "\n")
    return run


def budget_bounds(
    config: TrainConfig, checkpoint: Path | None, parameter_count: int, rounds: int
) -> list[int]:
    """The run's training-token bounds (:func:`~mergekit_loco.train.data.worker_slice`):
    ``[rounds x tokens a round]``; on resume the checkpoint's, with the new budget appended when
    it grew (the training stream of a larger budget starts with that of the smaller one). A
    budget that shrank is refused: each worker's slice would move under its saved position."""
    total = rounds * config.tokens_per_round()
    if checkpoint is None:
        return [total]
    with reading(checkpoint / STATE):
        state = read_state(checkpoint)
        saved = TrainConfig.from_dict(state["config"])
        saved_total = saved.total_rounds(parameter_count) * saved.tokens_per_round()
    bounds = data_bounds(state, saved_total)
    if total < bounds[-1]:
        raise ValueError(
            f"{checkpoint}: the run's budget is {bounds[-1]:,} training tokens and this resume "
            f"gives {total:,}; a budget may grow on resume, not shrink (each worker's data "
            "slice would move under its saved position): to stop earlier, resume with the "
            "run's budget and --stop-after ROUNDS"
        )
    return bounds if total == bounds[-1] else [*bounds, total]


#: Options that may differ between processes: where each writes or reads its files (the
#: contents of --data, --tokenizer and --init are compared instead).
PER_PROCESS_OPTIONS = frozenset({"out", "quiet", "data", "tokenizer", "init"})


def check_same_options(config: TrainConfig, group: WorkerGroup) -> None:
    """Refuse, on every process and before any other collective, options that differ between
    the processes of a torchrun launch: they would train on other settings silently, or call
    their collectives at other points (one rank's validation loss read as another's checkpoint
    path). Raises ValueError naming the option and the two values."""
    if not group.distributed:
        return
    options = {**config.to_dict(), "resume": config.checkpoint.resume,
               "force": config.checkpoint.force}  # fmt: skip
    mine = {key: value for key, value in options.items() if key not in PER_PROCESS_OPTIONS}
    everyone = group.gather(mine)
    for rank, theirs in enumerate(everyone):
        for key in sorted(set(everyone[0]) | set(theirs)):
            if theirs.get(key) != everyone[0].get(key):
                raise ValueError(
                    f"{flag_name(key)} differs between processes (rank 0: "
                    f"{bounded(everyone[0].get(key))}, rank {rank}: {bounded(theirs.get(key))}); "
                    "start every process with the same options"
                )


def token_checksum(data: PreparedData) -> str:
    """sha256 of the train and validation token ids (what every process must train on)."""
    digest = hashlib.sha256()
    for tokens in (data.train, data.val):
        digest.update(tokens.contiguous().numpy())
    return digest.hexdigest()


def make_driver(config: TrainConfig, model: torch.nn.Module, inner: list[InnerOptimizer]) -> DiLoCo:
    """DiLoCo with ``config``'s aggregator and torch SGD / Nesterov as the outer optimizer (the
    driver checks at once that the aggregator can merge R deltas of the model's shapes).
    DARE's masks follow the run seed."""
    options = dict(config.outer.aggregator_options)
    if "seed" in METHODS[config.outer.aggregator].parameter_names():
        options.setdefault("seed", config.run.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    outer = torch.optim.SGD(params, **outer_settings(config))
    return DiLoCo(
        model, inner, outer, aggregator=config.outer.aggregator, sync_every=config.inner.steps,
        aggregator_options=options, compression=config.outer.compression,
    )  # fmt: skip


def outer_settings(config: TrainConfig) -> dict:
    """The outer SGD's hyperparameters: ``lr``, ``momentum``, ``nesterov``."""
    return {
        "lr": config.outer.lr,
        "momentum": config.outer.momentum,
        "nesterov": config.outer.nesterov,
    }


def main_process_first(group: WorkerGroup, load):
    """``load()`` on rank 0, then on the others (they find rank 0's cache files)."""
    if group.is_main:
        result = load()
    group.barrier()
    if not group.is_main:
        result = load()
    return result


def find_tokenizer(config: TrainConfig) -> PreTrainedTokenizerBase:
    """``--tokenizer``, else the tokenizer beside the ``--init`` weights (:func:`init_folder`,
    named by its path), else a BPE trained on the data (unnamed)."""
    path = config.data.tokenizer
    folder = init_folder(config.model.init) if config.model.init is not None else None
    if path is None and folder is not None:
        if any((folder / name).is_file() for name in TOKENIZER_FILES):
            path = str(folder)
    if path is not None:
        tokenizer = load_tokenizer(path)
        tokenizer.name_or_path = str(path)
        return tokenizer
    spec = str(folder) if folder is not None and (folder / "config.json").is_file() else None
    model = model_config(spec or config.model.name, config.data.vocab_size)
    tokenizer = tokenizer_for_model(config.data.source, config.data.vocab_size, model)
    tokenizer.name_or_path = ""
    return tokenizer


def init_folder(init: str | Path) -> Path:
    """The folder of the ``--init`` weights, where their config.json and tokenizer may lie: the
    folder given, or a weights file's folder (``CheckpointReader.config_dir``, which ``mloco
    eval`` and ``load_pretrained`` read too)."""
    with open_checkpoint(init) as reader:
        return reader.config_dir


def check_init(config: TrainConfig) -> None:
    """Refuse an ``--init`` checkpoint the model cannot load before the tokenizer and the data
    are prepared: the config.json beside the weights against them, weights alone against
    ``--model`` (:func:`~mergekit_loco.train.model.check_weights_fit`)."""
    if config.model.init is None:
        return
    init = Path(config.model.init)
    if (init_folder(init) / "config.json").is_file():
        check_pretrained(init, "--init")
        return
    with open_checkpoint(init) as reader:
        check_weights_fit(reader, init, config.model.name, "--init")


def load_model(config: TrainConfig, tokenizer: PreTrainedTokenizerBase) -> torch.nn.Module:
    """A fresh seeded model of ``config.model.name``, or the ``config.model.init`` checkpoint
    (weights with config.json beside them, a folder or a file in it, or weights that fit the
    model, their vocabulary rows included), in float32."""
    vocab = len(tokenizer)
    if config.model.init is None:
        spec = model_config(
            config.model.name, vocab, tokenizer.bos_token_id, tokenizer.eos_token_id
        )
        return build_model(spec, config.run.seed)
    init = Path(config.model.init)
    if (init_folder(init) / "config.json").is_file():
        model = load_pretrained(init, "--init")  # config checked against the weights first
    else:
        with open_checkpoint(init) as reader:
            check_weights_fit(reader, init, config.model.name, "--init")
            rows = checkpoint_vocab(reader, config.model.name)
            spec = model_config(config.model.name, rows, tokenizer.bos_token_id,
                                tokenizer.eos_token_id)  # fmt: skip
            model = build_model(spec, config.run.seed)
            weights = finite_weights(reader, init, "--init")
            model.load_state_dict(weights, strict=False)  # checked; tied copies may be absent
    if model.config.vocab_size < vocab:
        raise ValueError(
            f"init checkpoint {init} has a vocabulary of {model.config.vocab_size}, smaller than "
            f"the tokenizer's {vocab}; pass --tokenizer the tokenizer it was trained with"
        )
    return model.to(torch.float32)


def load_data(config: TrainConfig, tokenizer: PreTrainedTokenizerBase, rounds: int) -> PreparedData:
    """Train tokens for ``rounds`` rounds (R equal shards), ``val_tokens`` held out, in
    ``tokenizer``'s ids."""
    train_tokens = rounds * config.tokens_per_round()
    try:
        return prepare_data(
            config.data.source,
            tokenizer=tokenizer,
            max_train_tokens=train_tokens,
            val_tokens=config.data.val_tokens,
            vocab_size=config.data.vocab_size,
            seed=config.run.seed,
            val_seed=config.data.val_seed,
        )
    except NotEnoughData as error:
        if error.part == "validation":
            raise ValueError(f"{error}; lower --val-tokens or give more data") from None
        smaller = (
            "--global-batch, --seq-len or --inner-steps (one round needs more than there is)"
            if rounds == 1
            else "the token budget (--tokens or --chinchilla)"
        )
        raise ValueError(
            f"{error} (the run needs {train_tokens:,} training tokens: {rounds} rounds x "
            f"{config.tokens_per_round():,}); lower {smaller} or --val-tokens, or give more data"
        ) from None
