"""Task runs: a model built from a task and a preset, trained by `tapelm.training.loop.train` on the task's
seeded batches,
then evaluated over lengths (`tapelm train`).

A run directory holds, besides what `train` writes: run.json (the run's identity: task, options, encoding, seed,
preset, model config, settings and their hash), the task's tokenizer (tokenizer.json and tokenizer_config.json, written
with run.json and copied into model/, so that `AutoTokenizer` loads either folder; everything after training reuses
it, a BPE is never retrained), eval.json / eval.png and result.json (written last: the run is done).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import shlex
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import TapeConfig
from ..layout import HostLayout
from ..modeling import TapeForCausalLM
from ..positional import encoding_class, encodings_in
from ..training import trackers
from ..training.accelerator import make_accelerator
from ..training.atomic import write_json_atomically
from ..training.checkpoints import CheckpointError, check_run_dir
from ..training.devices import describe_device
from ..training.launchers import shared_data_workers
from ..training.loop import LoopOptions, TrainResult, check_minutes, train
from ..training.saved_models import load_saved_model
from ..training.settings import TrainSettings
from ..training.trackers import check_report_to
from ..variants import AT_EVALUATION, check_row, resolve_variant, trained_row
from .evaluate import EVAL_SEED, VALIDATION_SEED, evaluate_model, plot_evaluation, seeded_torch_rng
from .presets import DEFAULT_PRESET, PRESETS, Preset, get_preset
from .tasks import TASKS, Task, get_task, has_saved_tokenizer, is_saved_in, save_tokenizer

RUN_FILE = "run.json"
RESULT_FILE = "result.json"
# What a finished run's result consists of, without its model or checkpoints (what the comparisons' archive keeps).
RESULT_FILES = (RESULT_FILE, "eval.json", "metrics.jsonl")


@dataclass(frozen=True)
class RunSpec:
    """What identifies a run: task (+ options over the preset's), encoding, seed, preset and overrides."""

    task: str
    pe: str
    seed: int = 0
    preset: str = DEFAULT_PRESET
    task_options: dict[str, Any] = field(default_factory=dict)
    model_options: dict[str, Any] = field(default_factory=dict)
    train_options: dict[str, Any] = field(default_factory=dict)
    eval_n: int | None = None
    eval_batch_size: int | None = None
    match_params: bool = False


@dataclass
class ResolvedRun:
    """A spec made concrete and validated: the task object, model config, training settings, identity and hash."""

    spec: RunSpec
    preset: Preset
    task: Task
    task_options: dict[str, Any]
    config: TapeConfig
    settings: TrainSettings
    identity: dict[str, Any]
    settings_hash: str
    parameters: int

    def build_model(self) -> TapeForCausalLM:
        torch.manual_seed(self.spec.seed)
        return TapeForCausalLM(self.config)

    def load_model(self, run_dir: Path | None = None) -> TapeForCausalLM:
        directory = Path(run_dir or self.run_dir) / "model"
        if not (directory / "config.json").is_file():
            raise ValueError(
                f"run '{directory.parent}' has no trained model yet (no {directory}/config.json); "
                "finish it with `tapelm train ... --resume`"
            )
        return load_saved_model(directory, TapeForCausalLM)

    run_dir: Path | None = None


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=list))


def _hash(payload: Any) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:10]


def model_config(task: Task, pe: str, preset: Preset, options: dict[str, Any]) -> TapeConfig:
    """The model of a run: the preset's sizes, the task's vocabulary and position tables covering the longest
    evaluation length (learned positions beyond the training lengths stay untrained: the honest baseline), RandPE
    positions drawn from [0, longest evaluation length)."""
    check_row(pe)
    pe_type, variant_options = resolve_variant(pe)
    longest = max(task.max_eval_length, task.train_length)
    kwargs: dict[str, Any] = dict(
        vocab_size=task.tokenizer.vocab_size,
        pad_token_id=task.tokenizer.pad_id,
        max_position_embeddings=longest,
        randpe_max_position=longest,
        pe_type=pe_type,
    )
    kwargs.update(preset.model.as_config_kwargs())
    kwargs.update(variant_options)
    kwargs.update(options)
    return TapeConfig(**kwargs)


def count_parameters(config: TapeConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in TapeForCausalLM(config).parameters())


def matched_intermediate(config: TapeConfig, target: int) -> int:
    """The smallest intermediate_size at which `config`'s model has at least `target` parameters."""
    base = count_parameters(config)
    per_unit = 3 * config.hidden_size * config.num_hidden_layers  # gate, up and down projections
    extra = max(0, -(-(target - base) // per_unit))
    return config.intermediate_size + extra


def check_model_options(options: dict[str, Any]) -> None:
    """ValueError naming a key that is not a TapeConfig field (a typo would otherwise train the preset's value)."""
    known = [name for name in inspect.signature(TapeConfig.__init__).parameters if name not in ("self", "kwargs")]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"unknown model option '{unknown[0]}'; choose from the TapeConfig fields: {', '.join(known)}")


def _recipe(spec: RunSpec) -> tuple[Preset, dict[str, Any], TrainSettings]:
    """The validated preset (with the spec's evaluation sizes), task options and training settings of `spec`."""
    if spec.task not in TASKS:
        raise ValueError(f"unknown task '{spec.task}'; choose one of: {', '.join(TASKS)}")
    check_row(spec.pe)
    if spec.pe in AT_EVALUATION:
        raise ValueError(
            f"row '{spec.pe}' is not trained: it evaluates {trained_row(spec.pe)}'s trained models under a RoPE "
            f"scaling; name it in `tapelm compare`, beside {trained_row(spec.pe)}"
        )
    if spec.preset not in PRESETS:
        raise ValueError(f"unknown preset '{spec.preset}'; choose one of: {', '.join(PRESETS)}")
    if not isinstance(spec.seed, int) or spec.seed < 0:
        raise ValueError(f"seed={spec.seed!r} is not allowed; it must be a non-negative integer")
    preset = get_preset(spec.preset, spec.task)
    task_options = {**preset.task_options, **spec.task_options}
    settings = TrainSettings.from_dict({**preset.train.to_dict(), **spec.train_options, "seed": spec.seed})
    for name in ("eval_n", "eval_batch_size"):
        value = getattr(spec, name)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name}={value!r} is not allowed; it must be a positive integer")
    if spec.eval_n is not None or spec.eval_batch_size is not None:
        preset = replace(
            preset, eval_n=spec.eval_n or preset.eval_n, eval_batch_size=spec.eval_batch_size or preset.eval_batch_size
        )
    return preset, task_options, settings


def _settings_hash(spec: RunSpec, preset: Preset, task_options: dict[str, Any], settings: TrainSettings) -> str:
    """What runs of one comparison share (all but the encoding, the seed and the model they make of it), hashed."""
    return _hash(
        _jsonable(
            {
                "task": spec.task,
                "task_options": task_options,
                "preset": spec.preset,
                "train": {k: v for k, v in settings.to_dict().items() if k != "seed"},
                "eval": {"n": preset.eval_n, "batch_size": preset.eval_batch_size},
                "match_params": spec.match_params,
                "model_options": spec.model_options,
                "model_size": preset.model.as_config_kwargs(),  # a preset's new size is a new comparison
            }
        )
    )


def recipe_lr(spec: RunSpec) -> float:
    """The peak learning rate `spec` trains at (its override, else its preset's), without building the task."""
    return _recipe(spec)[2].lr


def settings_hash(spec: RunSpec) -> str:
    """`resolve(spec).settings_hash`, without building the task (nor training its tokenizer)."""
    return _settings_hash(spec, *_recipe(spec))


def resolve(spec: RunSpec, tokenizer_dir: str | Path | None = None) -> ResolvedRun:
    """Validate everything about a run before any work or any write; ValueError naming the problem.
    `tokenizer_dir`: a folder with the tokenizer saved by a run (its own, or another of its comparison); a task that
    learns its tokenizer (text with BPE) uses that one instead of training one."""
    preset, task_options, settings = _recipe(spec)
    task = get_task(spec.task, tokenizer_dir, **task_options)
    longest = max(task.eval_conditions(), key=lambda c: c["length"])
    next(iter(task.eval_batches(longest, 0, preset.eval_n, preset.eval_batch_size)))  # the task's own checks, now
    model_options = dict(spec.model_options)
    check_model_options(model_options)
    try:
        config = model_config(task, spec.pe, preset, model_options)
        if spec.match_params and spec.pe != "tape":
            tape = model_config(task, "tape", preset, model_options)
            model_options["intermediate_size"] = matched_intermediate(config, count_parameters(tape))
            config = model_config(task, spec.pe, preset, model_options)
    except TypeError as error:
        raise ValueError(f"bad model option: {error}") from None
    identity = _jsonable(
        {
            "task": spec.task,
            "task_options": task_options,
            "pe": spec.pe,
            "seed": spec.seed,
            "preset": spec.preset,
            "model": {k: v for k, v in config.to_dict().items() if k not in ("transformers_version",)},
            "train": settings.to_dict(),
            "eval": {"n": preset.eval_n, "batch_size": preset.eval_batch_size},
            "match_params": spec.match_params,
        }
    )
    return ResolvedRun(
        spec=spec,
        preset=preset,
        task=task,
        task_options=task_options,
        config=config,
        settings=settings,
        identity=identity,
        settings_hash=_settings_hash(spec, preset, task_options, settings),
        parameters=count_parameters(config),
    )


def _new_config_defaults(saved_model: dict[str, Any]) -> dict[str, Any]:
    """The defaults of the TapeConfig fields added after a run was written: such a run reads as having them."""
    defaults = _jsonable(TapeConfig().to_dict())
    return {key: value for key, value in defaults.items() if key not in saved_model and key != "transformers_version"}


def identity_differences(saved: dict[str, Any], run: ResolvedRun) -> list[str]:
    """The keys of a saved run identity (run.json's or result.json's) that differ from `run`'s; a TapeConfig field
    added since the run was written counts as its default."""
    if "model" in saved:
        saved = {**saved, "model": {**_new_config_defaults(saved["model"]), **saved["model"]}}
    return sorted(k for k in set(saved) | set(run.identity) if saved.get(k) != run.identity.get(k))


POSITION_LIMITS = ("max_position_embeddings", "randpe_max_position")
"""The config fields a run sizes to its task's longest evaluation length."""


def reads_position_limit(config: TapeConfig) -> bool:
    """Whether `config`'s model depends on its `POSITION_LIMITS`: an encoding of its layers says so
    (`reads_position_limit`), or its RoPE scaling may read them (any `rope_type` but the default)."""
    scaled = config.rope_parameters.get("rope_type", "default") != "default"
    return scaled or any(encoding_class(pe).reads_position_limit for pe in encodings_in(config))


def training_identity(identity: dict[str, Any]) -> dict[str, Any]:
    """What shapes a run's training, from its recorded identity (run.json's, result.json's): all of it but its
    evaluation (test-set size, the task's `evaluation_options`) and, where the model does not read them
    (`reads_position_limit`), the `POSITION_LIMITS` the longest evaluation length sizes. Runs with equal training
    identities, on one tokenizer, train the same model (tests/test_reuse.py)."""
    model = {**_new_config_defaults(identity["model"]), **identity["model"]}
    if not reads_position_limit(TapeConfig.from_dict(model)):
        model = {key: value for key, value in model.items() if key not in POSITION_LIMITS}
    evaluation_only = TASKS[identity["task"]].evaluation_options
    options = {key: value for key, value in identity["task_options"].items() if key not in evaluation_only}
    kept = {key: value for key, value in identity.items() if key != "eval"}
    return {**kept, "task_options": options, "model": model}


def training_fingerprint(result: dict[str, Any]) -> str:
    """A finished run's training, as its result records it (identity, first and last losses and evaluation
    summary), hashed: what a row evaluated from its model records, so that a model trained again since is noticed."""
    return _hash({key: result.get(key) for key in ("identity", "first_loss", "final_loss", "summary")})


def _check_identity(run: ResolvedRun, run_dir: Path) -> None:
    path = run_dir / RUN_FILE
    if not path.exists():
        return
    try:
        saved = json.loads(path.read_text())["identity"]
    except (json.JSONDecodeError, KeyError):
        raise CheckpointError(f"run directory '{run_dir}' has an unreadable {RUN_FILE}") from None
    changed = identity_differences(saved, run)
    if changed:
        raise CheckpointError(
            f"run directory '{run_dir}' belongs to another configuration (different "
            f"{', '.join(changed)}); choose another run directory"
        )


def batch_stream(task: Task, seed: int, batch_size: int):
    """index -> one training micro-batch as model keyword arguments, with its padding known on the host
    (`host_layout`); a pure function of (seed, index)."""

    def make(index: int) -> dict[str, Any]:
        batch = task.train_batch(np.random.default_rng([seed, index]), batch_size)
        inputs = {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask}
        return {**inputs, "labels": batch.labels, "host_layout": HostLayout.of(**inputs)}

    return make


def _environment() -> dict[str, Any]:
    from ..training.provenance import environment

    return environment()


@dataclass(frozen=True)
class RunOptions:
    """How a run trains, none of it part of its identity (like threads). `progress`: progress bars;
    `compile_layers`: train with torch.compile'd decoder layers (`compile_for_training`); `data_workers`: processes
    that make the batches ahead (`train`; a launcher splits them between the runs it trains at once); `report_to`:
    experiment trackers to log to (`trackers`); `compile_step`: compile the whole model's training forward instead
    (`tapelm.training.step.compile_for_steps`; None: the preset's choice); `checkpoint_minutes`: also checkpoint
    every that many minutes of training (`train`; 0: only the settings' `checkpoint_every`; None: the preset's
    choice), so that a run stopped by a deadline or a preemption loses at most that much when it resumes;
    `compile_backend`: the torch.compile backend of `compile_layers` and `compile_step` (dynamo's "aot_eager" traces
    the forward and backward as inductor does, without generating code: for a machine without a C++ compiler, and
    for the tests)."""

    progress: bool = True
    compile_layers: bool = False
    data_workers: int = 0
    report_to: tuple[str, ...] = ()
    compile_step: bool | None = None
    checkpoint_minutes: float | None = None
    compile_backend: str = "inductor"

    def __post_init__(self) -> None:
        if self.checkpoint_minutes is not None:
            check_minutes(self.checkpoint_minutes)
        if isinstance(self.data_workers, bool) or not isinstance(self.data_workers, int) or self.data_workers < 0:
            raise ValueError(f"data_workers={self.data_workers!r}: give a number of processes >= 0")
        if self.compile_layers and self.compile_step:
            raise ValueError("compile_layers=True and compile_step=True compile the same forward two ways; choose one")
        backends = torch._dynamo.list_backends(exclude_tags=())
        if self.compile_backend not in backends:
            raise ValueError(f"compile_backend={self.compile_backend!r} is not a torch.compile backend: {backends}")
        object.__setattr__(self, "report_to", check_report_to(self.report_to))

    def with_preset(self, preset: Preset) -> RunOptions:
        """These options with `preset`'s choices where they leave them to it (None)."""
        compile_step = self.compile_step
        if compile_step is None:
            compile_step = preset.compile_step and not self.compile_layers
        minutes = preset.checkpoint_minutes if self.checkpoint_minutes is None else self.checkpoint_minutes
        return replace(self, compile_step=compile_step, checkpoint_minutes=minutes)

    def in_workers(self, concurrent: int | None) -> RunOptions:
        """These options for a run among `concurrent` trained at once in worker processes (None: each on a machine
        of its own): no progress bars, a share of the data workers."""
        workers = self.data_workers if concurrent is None else shared_data_workers(self.data_workers, concurrent)
        return replace(self, progress=False, data_workers=workers)


def run_task(
    spec: RunSpec | ResolvedRun,
    run_dir: str | Path,
    options: RunOptions | None = None,
    resume: bool = False,
    stop_after: int | None = None,
    command: str | None = None,
    launch: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """Train and evaluate one run in `run_dir` as `options` say (default `RunOptions()`); returns the result (also
    written to result.json), or None when stopped early by `stop_after`. With resume, a finished run returns its
    cached result. `launch`: how the run was launched (`launchers`), recorded in result.json with its device; like
    the options, not part of the run's identity."""
    run = spec if isinstance(spec, ResolvedRun) else resolve(spec)
    options = (options or RunOptions()).with_preset(run.preset)
    run_dir = Path(run_dir)
    _check_identity(run, run_dir)
    if resume and (run_dir / RESULT_FILE).exists():
        return json.loads((run_dir / RESULT_FILE).read_text())
    check_run_dir(run_dir, run.settings, resume)  # raises before anything is written
    _check_tokenizer(run, run_dir)
    # The Accelerator comes first: a bare PartialState created before it would settle the process group on its own
    # (on CPU without ACCELERATE_USE_CPU it silently becomes a single process); a broken group is refused here.
    state = make_accelerator(run.settings, options.report_to, run_dir)
    _prepare_run_dir(run, run_dir, state, command or _train_command(run.spec, options))
    model = run.build_model()
    if options.compile_layers:
        compile_for_training(model, options.compile_backend)
    started = time.time()
    trained = _train_run(run, model, run_dir, state, options, resume, stop_after)
    if trained.start_step + len(trained.losses) < run.settings.steps or not state.is_main_process:
        return None
    save_tokenizer(run.task.tokenizer, run_dir / "model")
    eval_started = time.time()
    evaluation = eager(evaluate_model)(
        model, run.task, run.preset.eval_n, run.preset.eval_batch_size, progress=options.progress
    )
    write_evaluation(run, run_dir, evaluation)
    result = _result_record(
        run,
        run_dir,
        options,
        trained,
        evaluation,
        started=started,
        eval_started=eval_started,
        device=state.device,
        launch=launch,
    )
    write_json_atomically(run_dir / RESULT_FILE, result)
    return result


def run_record(run: ResolvedRun) -> dict[str, Any]:
    """What run.json and result.json open with: the run's identity, settings hash and parameter count."""
    return {"identity": run.identity, "settings_hash": run.settings_hash, "parameters": run.parameters}


def _train_command(spec: RunSpec, options: RunOptions) -> str:
    """The `tapelm train` command line of `spec` trained as `options` (with the preset's choices) say."""
    return shlex.join(
        [
            "tapelm",
            "train",
            "--task",
            spec.task,
            "--pe",
            spec.pe,
            "--seed",
            str(spec.seed),
            *option_flags(spec, options.compile_layers, options.compile_step),
        ]
    )


def _prepare_run_dir(run: ResolvedRun, run_dir: Path, state, command: str) -> None:
    """run.json with `command` (unless there is one) and the task's tokenizer, written by the main process while the
    others wait."""
    if state.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        if not (run_dir / RUN_FILE).exists():
            write_json_atomically(run_dir / RUN_FILE, {**run_record(run), "command": command})
        if not has_saved_tokenizer(run_dir):
            save_tokenizer(run.task.tokenizer, run_dir)
    state.wait_for_everyone()


def _train_run(
    run: ResolvedRun,
    model: TapeForCausalLM,
    run_dir: Path,
    state,
    options: RunOptions,
    resume: bool,
    stop_after: int | None,
) -> TrainResult:
    """`train` on the run's batches, with the quick evaluation every `eval_every` steps, logged to the trackers."""
    stream = batch_stream(run.task, run.spec.seed, run.settings.batch_size)
    evaluate_fn = eager(_quick_evaluation(run)) if run.settings.eval_every else None
    loop = LoopOptions(
        progress=options.progress,
        stop_after=stop_after,
        evaluate_last=False,  # the full evaluation follows: the last step's
        data_workers=options.data_workers,
        compile_step=options.compile_step,
        compile_backend=options.compile_backend,
        checkpoint_minutes=options.checkpoint_minutes,
    )
    trackers.start(
        state, f"{run.spec.task}-{run.spec.pe}-seed{run.spec.seed}-{run.settings_hash}", run.settings_hash, run.identity
    )
    try:
        return train(
            model,
            stream,
            run.settings,
            run_dir,
            evaluate_fn=evaluate_fn,
            resume=resume,
            accelerator=state,
            options=loop,
        )
    finally:
        trackers.finish(state)


def _result_record(
    run: ResolvedRun,
    run_dir: Path,
    options: RunOptions,
    trained: TrainResult,
    evaluation: dict[str, Any],
    *,
    started: float,
    eval_started: float,
    device: torch.device,
    launch: dict[str, Any] | None,
) -> dict[str, Any]:
    """result.json: the run's record, its evaluation, first and last logged losses, this session's training, the
    seconds since the session (`started`) and its evaluation (`eval_started`) began, and how and where it ran."""
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    losses = [m["loss"] for m in metrics if "loss" in m]
    return {
        **run_record(run),
        "task": run.spec.task,
        "pe": run.spec.pe,
        "seed": run.spec.seed,
        "preset": run.spec.preset,
        **{key: evaluation.get(key) for key in EVALUATION_FIELDS},
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        "train_seconds_this_session": trained.seconds,
        "resumed_from_step": trained.start_step,
        "train_seconds_before_this_session": trained.earlier_seconds,
        "eval_seconds": time.time() - eval_started,
        "session_seconds": time.time() - started,
        "world_size": trained.world_size,
        "tokens_this_session": trained.tokens,
        "compiled_layers": options.compile_backend if options.compile_layers else False,
        "compiled_step": options.compile_backend if options.compile_step else False,
        "data": run.task.data_record(),
        "device": describe_device(device),
        "launch": launch or {"launcher": "in-process"},
        "environment": _environment(),
    }


def _check_tokenizer(run: ResolvedRun, run_dir: Path) -> None:
    """CheckpointError when `run_dir` saved another tokenizer than the run's, or holds a run started before runs
    saved their tokenizer whose task learns one (finishing it with a tokenizer trained now could change its ids)."""
    if has_saved_tokenizer(run_dir):
        if not is_saved_in(run.task.tokenizer, run_dir):
            raise CheckpointError(
                f"run directory '{run_dir}' saved another tokenizer than this run's; resolve the "
                "run with the directory's tokenizer (`resolve(spec, run_dir)`)"
            )
    elif (run_dir / RUN_FILE).exists() and type(run.task).tokenizer_is_trained(run.task_options):
        raise CheckpointError(
            f"run directory '{run_dir}' was started before runs saved their tokenizer, and its "
            "task learns one from the corpus; start the run in a new directory"
        )


def compile_for_training(model: TapeForCausalLM, backend: str = "inductor") -> None:
    """torch.compile every decoder layer (`compile_layers`) with `backend` for the training steps. The compiler's
    caches are reset first: dynamo keeps at most eight compiled versions of a layer's code per process and then
    silently runs it eagerly, which a process training one model after another would reach."""
    torch.compiler.reset()
    model.compile_layers(backend=backend)


def eager(function):
    """`function` with every torch.compile directive ignored while it runs: evaluation decodes token by token with
    a cache, shapes a training-compiled layer would recompile for at a cost no evaluation earns back."""
    return torch.compiler.set_stance("force_eager")(function)


EVALUATION_FIELDS = ("metric", "summary", "mean", "token_accuracy_summary")


def write_evaluation(run: ResolvedRun, run_dir: Path, evaluation: dict[str, Any]) -> None:
    """eval.json and eval.png of a run; a finished run's result.json takes the new numbers too when the evaluation
    is the run's own (its test-set size and seed), so that a comparison reads one evaluation, not two."""
    write_json_atomically(run_dir / "eval.json", evaluation)
    plot_evaluation(evaluation, run_dir / "eval.png", f"{run.spec.task} / {run.spec.pe} / seed {run.spec.seed}")
    result_path = run_dir / RESULT_FILE
    if result_path.exists() and (evaluation["n"], evaluation["seed"]) == (run.preset.eval_n, EVAL_SEED):
        result = json.loads(result_path.read_text())
        result.update({key: evaluation.get(key) for key in EVALUATION_FIELDS})
        write_json_atomically(result_path, result)


def _quick_evaluation(run: ResolvedRun):
    """In-training evaluation: the in-distribution conditions only, few examples (the full grid runs at the end),
    and, for encodings that carry a positional state (TAPE), its norm entering each layer (`state_norms`)."""
    conditions = [c for c in run.task.eval_conditions() if run.task.in_distribution(c)]
    n = max(1, min(run.preset.eval_n, 16))

    def evaluate(model, step):
        device = next(model.parameters()).device

        def logits_fn(ids, mask):
            return model(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False).logits

        with seeded_torch_rng(VALIDATION_SEED, device):
            values = [
                run.task.evaluate_condition(logits_fn, c, VALIDATION_SEED, n, run.preset.eval_batch_size)[0]
                for c in conditions
            ]
        record = {f"in_distribution_{run.task.metric_name}": float(np.mean(values))}
        batch = next(run.task.eval_batches(conditions[-1], VALIDATION_SEED, n, run.preset.eval_batch_size))
        norms = state_norms(model, batch.input_ids.to(device), batch.attention_mask.to(device))
        if norms:
            record["state_norm"] = norms
        return record

    return evaluate


@torch.no_grad()
def state_norms(model: TapeForCausalLM, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[float]:
    """The mean norm (over real tokens and KV heads) of the positional state entering each decoder layer and leaving
    the last, relative to the initial state's (so 1.0 at layer 0, whatever the state's layout); empty for encodings
    without a state."""
    norms: list[float] = []
    real = attention_mask.bool()

    def record(state):
        if isinstance(state, torch.Tensor):
            per_token = state.float().flatten(3).norm(dim=-1).mean(1)  # (B, N): mean over heads
            norms.append(float(per_token[real].mean()))

    hooks = [layer.register_forward_pre_hook(lambda module, args: record(args[1])) for layer in model.model.layers]
    hooks.append(model.model.layers[-1].register_forward_hook(lambda module, args, out: record(out[1])))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return [norm / norms[0] for norm in norms]


def load_run(run_dir: str | Path) -> ResolvedRun:
    """The resolved run recorded in `run_dir/run.json`, with the tokenizer the run saved."""
    run_dir = Path(run_dir)
    path = run_dir / RUN_FILE
    if not path.is_file():
        raise ValueError(f"'{run_dir}' is not a tapelm run directory (no {RUN_FILE})")
    try:
        identity = json.loads(path.read_text())["identity"]
    except (json.JSONDecodeError, KeyError):
        raise ValueError(f"'{path}' is unreadable") from None
    saved = has_saved_tokenizer(run_dir)
    task = TASKS.get(identity["task"])
    if not saved and task is not None and task.tokenizer_is_trained(identity["task_options"]):
        raise ValueError(
            f"run '{run_dir}' has no saved tokenizer (tokenizer.json): it was trained before runs saved "
            "theirs, and a tokenizer trained now from this machine's corpus may give other token ids"
        )
    run = run_from_identity(identity, run_dir if saved else None)
    run.run_dir = run_dir
    return run


def run_from_identity(identity: dict[str, Any], tokenizer_dir: str | Path | None = None) -> ResolvedRun:
    """The resolved run a recorded identity (run.json's, result.json's) describes: its task, recipe and model as
    recorded, whatever the presets say today."""
    preset = get_preset(identity["preset"], identity["task"])
    run = resolve(
        RunSpec(
            task=identity["task"],
            pe=identity["pe"],
            seed=identity["seed"],
            preset=identity["preset"],
            task_options=identity["task_options"],
            train_options=identity["train"],
            eval_n=identity["eval"]["n"],
            eval_batch_size=identity["eval"]["batch_size"],
        ),
        tokenizer_dir,
    )
    run.config = TapeConfig.from_dict(identity["model"])
    run.preset = replace(preset, eval_n=identity["eval"]["n"], eval_batch_size=identity["eval"]["batch_size"])
    return run


def option_flags(spec: RunSpec, compile_layers: bool = False, compile_step: bool = False) -> list[str]:
    """The command-line flags that reproduce `spec`'s preset, options and overrides (not task, encoding, seed), and
    --compile / --compile-step when the run is trained with compiled layers / a compiled step (`tapelm train`'s)."""
    flags = [] if spec.preset == DEFAULT_PRESET else ["--preset", spec.preset]
    for flag, options in (("--task-option", spec.task_options), ("--model-option", spec.model_options)):
        for key, value in options.items():
            text = (
                ",".join(map(str, value))
                if isinstance(value, (list, tuple))
                else (json.dumps(value) if isinstance(value, bool) or value is None else str(value))
            )
            flags += [flag, f"{key}={text}"]
    for key, value in spec.train_options.items():
        if key == "grad_checkpointing":
            flags += ["--grad-checkpointing"] if value else []
        elif key != "seed":
            flags += [f"--{key.replace('_', '-')}", str(value)]
    for key in ("eval_n", "eval_batch_size"):
        if getattr(spec, key) is not None:
            flags += [f"--{key.replace('_', '-')}", str(getattr(spec, key))]
    return (
        flags
        + (["--match-params"] if spec.match_params else [])
        + (["--compile"] if compile_layers else [])
        + (["--compile-step"] if compile_step else [])
    )


__all__ = [
    "RunSpec",
    "ResolvedRun",
    "resolve",
    "settings_hash",
    "run_task",
    "load_run",
    "run_from_identity",
    "batch_stream",
    "model_config",
    "matched_intermediate",
    "count_parameters",
    "option_flags",
    "recipe_lr",
    "identity_differences",
    "reads_position_limit",
    "run_record",
    "training_fingerprint",
    "training_identity",
    "POSITION_LIMITS",
    "RESULT_FILE",
    "RESULT_FILES",
]
