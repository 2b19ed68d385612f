"""Where the runs of a comparison or a stage train (`--launcher`).

- `local` (the default): this machine. One run at a time in this process, or `jobs` at once on each device in worker
  processes, each worker pinned to its GPU (CUDA_VISIBLE_DEVICES) for good: on the CPU, `jobs` processes; on CUDA,
  `jobs` per visible GPU.
- `slurm`: a SLURM cluster through submitit, the runs submitted as one job array, each job with its GPUs, time and
  partition; a job that SLURM preempts or times out is requeued and resumes from its checkpoint.

Whoever launches it, a run trains in its folder of the comparison (`run_task` with resume), so a run already finished
is never launched again, a killed one resumes from its newest checkpoint, and the archive reads the same files.
Each result.json records its device and how it was launched (`launch`).
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import shutil
import signal
import sys
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..training.trackers import check_report_to
from .runs import run_task

LAUNCHERS = ("local", "slurm")
SUBMITIT_PIP = "pip install 'tapelm[cluster]' (or: pip install submitit)"


@dataclass(frozen=True)
class RunOptions:
    """How every run trains, whichever launcher runs it; none of it is part of a run's identity. `data_workers`:
    batch-making processes of the whole machine, split between the runs a local launcher trains at once."""

    progress: bool = True
    compile_layers: bool = False
    data_workers: int = 0
    report_to: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.data_workers, bool) or not isinstance(self.data_workers, int) or self.data_workers < 0:
            raise ValueError(f"--data-workers={self.data_workers!r} is not allowed; give a number of processes >= 0")
        object.__setattr__(self, "report_to", check_report_to(self.report_to))


@dataclass(frozen=True)
class Job:
    """One run to launch: the resolved run, its folder and the command recorded with it."""

    run: Any
    run_dir: Path
    command: str


@dataclass
class Outcome:
    """A launched run that ended: its place in the jobs given to `launch`, its result, or the error that ended it."""

    index: int
    result: dict[str, Any] | None = None
    error: BaseException | None = None


def run_one(
    job: Job, options: RunOptions, launch: dict[str, Any] | None = None, threads: int | None = None
) -> dict[str, Any] | None:
    """Train and evaluate one run (in this process, or in a worker with `threads` torch threads); its result."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    run, started = job.run, time.time()
    result = run_task(
        run,
        job.run_dir,
        resume=True,
        progress=options.progress,
        command=job.command,
        compile_layers=options.compile_layers,
        data_workers=options.data_workers,
        report_to=options.report_to,
        launch=launch,
    )
    if result is not None:
        print(
            f"    {run.spec.pe} / seed {run.spec.seed} done in {time.time() - started:.0f} s: {result['metric']} "
            f"in-distribution {result['summary']['in_distribution']:.4f}, all {result['summary']['all']:.4f}",
            flush=True,
        )
    return result


def die_with_parent(parent: int) -> None:
    """In a worker: end when the process that started it ends (killed or not), instead of training on as an
    orphan; the unfinished run resumes from its checkpoint next time. Linux only (prctl); elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent ended before the request took effect
            os._exit(1)


def visible_devices() -> list[str]:
    """The devices a local launcher pins runs to: the visible GPUs as CUDA_VISIBLE_DEVICES names them (their
    indices when it is unset), or ["cpu"] where there is none."""
    import torch

    if not torch.cuda.is_available():
        return ["cpu"]
    named = [name.strip() for name in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if name.strip()]
    return named[: torch.cuda.device_count()] if named else [str(i) for i in range(torch.cuda.device_count())]


def device_slots(devices: list[str], per_device: int) -> list[str]:
    """The device of each concurrent worker: every device `per_device` times, round robin, so that fewer runs than
    workers still spread over every device."""
    return [device for _ in range(per_device) for device in devices]


def shared_data_workers(total: int, concurrent: int) -> int:
    """Each run's share of `total` data workers when `concurrent` runs train at once (at least one where any were
    asked for)."""
    return 0 if total == 0 else max(1, total // concurrent)


_WORKER_DEVICE: str | None = None  # the device this worker process is pinned to (`_start_worker`)


def pin(device: str, position: int) -> None:
    """Make this process compute on GPU `device` (its name in the parent's CUDA_VISIBLE_DEVICES, `position` in the
    parent's list): the only GPU it sees, where CUDA has not started in the process yet; else (an import asked CUDA
    for its devices first, which fixes what the process sees) its current device. Nothing for "cpu"."""
    if device == "cpu":
        return
    os.environ["CUDA_VISIBLE_DEVICES"] = device
    import torch

    if torch.cuda.device_count() > 1:
        torch.cuda.set_device(position)


def _start_worker(parent: int, devices, threads: int) -> None:
    """A local worker's start: die with the parent, take a device for good (`pin`), use `threads` torch threads."""
    global _WORKER_DEVICE
    die_with_parent(parent)
    _WORKER_DEVICE, position = devices.get()
    pin(_WORKER_DEVICE, position)
    import torch

    torch.set_num_threads(threads)


def _run_pinned(job: Job, options: RunOptions, launch: dict[str, Any]) -> dict[str, Any] | None:
    return run_one(job, options, {**launch, "device_slot": _WORKER_DEVICE})


class Launcher(ABC):
    """Where runs train: a `session` starts runs and hands back their outcomes as they end, with at most `slots`
    training at once (None: no limit, the cluster queues them)."""

    name: str
    slots: int | None

    @abstractmethod
    def session(self, options: RunOptions) -> Session:
        """A session that trains runs with `options`; a context manager that waits for started runs as it ends."""

    def launch(self, jobs: list[Job], options: RunOptions) -> Iterator[Outcome]:
        """Train `jobs`, all started at once (as many training as there are slots), yielding each outcome as it
        ends."""
        if not jobs:
            return
        with self.session(options) as session:
            session.start(jobs)
            for _ in jobs:
                yield session.landed()


class Session(ABC):
    """Runs started and not yet handed back; `start` numbers them in order (an Outcome's `index`) across calls."""

    def __init__(self) -> None:
        self.started = 0

    def start(self, jobs: list[Job]) -> list[int]:
        """Start `jobs` (queued while every slot is busy); their numbers."""
        keys = list(range(self.started, self.started + len(jobs)))
        self.started += len(jobs)
        self._start(list(zip(keys, jobs)))
        return keys

    @abstractmethod
    def _start(self, keyed: list[tuple[int, Job]]) -> None:
        """Start each (number, job)."""

    @abstractmethod
    def landed(self) -> Outcome:
        """The outcome of the next started run to end (waiting for it)."""

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exception: Any) -> None:  # noqa: B027 (a session without resources to free)
        pass


class _InProcess(Session):
    """One slot on this process's own device: each run trains here, in order, when an outcome is asked for."""

    def __init__(self, options: RunOptions) -> None:
        super().__init__()
        self.options, self.queued = options, deque()

    def _start(self, keyed: list[tuple[int, Job]]) -> None:
        self.queued.extend(keyed)

    def landed(self) -> Outcome:
        key, job = self.queued.popleft()
        try:
            return Outcome(key, run_one(job, self.options, {"launcher": "local", "runs_per_device": 1}))
        except Exception as error:  # noqa: BLE001 (the caller decides whether one failure stops the rest)
            return Outcome(key, error=error)


class _Workers(Session):
    """`per_device` worker processes on each of `devices`, each pinned to its device for good (`_start_worker`);
    a run goes to the next free worker."""

    def __init__(self, devices: list[str], per_device: int, options: RunOptions) -> None:
        import torch

        super().__init__()
        context = multiprocessing.get_context("spawn")
        slots = device_slots(devices, per_device)
        queue = context.Queue()
        for device in slots:  # a worker takes the next one as it starts, so fewer runs still spread over devices
            queue.put((device, devices.index(device)))
        self.options = replace(
            options, progress=False, data_workers=shared_data_workers(options.data_workers, len(slots))
        )
        self.launch = {"launcher": "local", "runs_per_device": per_device}
        self.pool = ProcessPoolExecutor(
            len(slots),
            mp_context=context,
            initializer=_start_worker,
            initargs=(os.getpid(), queue, torch.get_num_threads()),
        )
        self.futures: dict[Any, int] = {}

    def _start(self, keyed: list[tuple[int, Job]]) -> None:
        for key, job in keyed:
            self.futures[self.pool.submit(_run_pinned, job, self.options, self.launch)] = key

    def landed(self) -> Outcome:
        done, _ = wait(self.futures, return_when=FIRST_COMPLETED)
        future = min(done, key=self.futures.get)
        key, error = self.futures.pop(future), future.exception()
        return Outcome(key, None if error else future.result(), error)

    def __exit__(self, *exception: Any) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)  # runs not started stay undone; started ones finish


class LocalLauncher(Launcher):
    """Runs on this machine: `jobs` at once on each of `devices` (default `visible_devices()`), in pinned worker
    processes; one run at a time in this process where that makes one slot on the process's own device."""

    name = "local"

    def __init__(self, jobs: int = 1, devices: list[str] | None = None) -> None:
        if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
            raise ValueError(f"--jobs={jobs!r} is not allowed; it must be a positive integer (runs at once per device)")
        if devices is not None and (not devices or len(set(devices)) != len(devices)):
            raise ValueError(f"devices={devices!r} is not allowed; give distinct device names")
        self.jobs, self.pinned = jobs, devices is not None
        self.devices = list(devices) if devices is not None else visible_devices()
        self.slots = jobs * len(self.devices)

    def session(self, options: RunOptions) -> Session:
        if self.slots == 1 and not self.pinned:
            return _InProcess(options)
        return _Workers(self.devices, self.jobs, options)


class SubmittedRun:
    """A run as a submitit job with the submitting process's torch threads (as a local worker has them: a CPU run's
    numbers depend on them): it trains (resuming from its folder's checkpoint); when SLURM preempts it or its time
    runs out, submitit calls `checkpoint`, which requeues the same call, so the run resumes from its newest
    checkpoint (`submitit.helpers.Checkpointable`'s protocol)."""

    def __call__(self, job: Job, options: RunOptions, threads: int) -> dict[str, Any] | None:
        import submitit

        environment = submitit.JobEnvironment()
        return run_one(
            job, options, {"launcher": "slurm", "job_id": environment.job_id, "hostname": environment.hostname}, threads
        )

    def checkpoint(self, *args: Any, **kwargs: Any):
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, *args, **kwargs)


class SlurmLauncher(Launcher):
    """Runs on a SLURM cluster through submitit: one job array, each job `gpus_per_run` GPUs (1, or 0 on CPU
    nodes), `cpus_per_run` CPUs, `time_minutes` and `partition`; submitit's files (scripts, logs, pickled results) in
    `folder`. `cluster`: "slurm", or "local" for submitit's local executor (tests: the same submission, as processes
    on this machine)."""

    name = "slurm"
    slots = None  # every run that may start is submitted at once

    def __init__(
        self,
        folder: str | Path,
        partition: str | None = None,
        time_minutes: int = 60,
        gpus_per_run: int = 1,
        cpus_per_run: int | None = None,
        cluster: str = "slurm",
        poll_seconds: float = 10.0,
    ) -> None:
        try:
            import submitit  # noqa: F401
        except ImportError:
            raise ValueError(
                f"--launcher slurm needs the submitit package, which is not installed: {SUBMITIT_PIP}"
            ) from None
        for name, value, low in (
            ("--slurm-time", time_minutes, 1),
            ("--slurm-cpus-per-run", 1 if cpus_per_run is None else cpus_per_run, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{name}={value!r} is not allowed; it must be an integer >= {low}")
        if gpus_per_run not in (0, 1) or isinstance(gpus_per_run, bool):
            raise ValueError(
                f"--slurm-gpus-per-run={gpus_per_run!r} is not allowed; give 1 (a run trains on one GPU: "
                "on several its batches, and so its result, would change) or 0 (CPU nodes)"
            )
        if cluster not in ("slurm", "local"):
            raise ValueError(f"cluster={cluster!r} is not allowed; choose slurm or local")
        if cluster == "slurm" and shutil.which("sbatch") is None:
            raise ValueError(
                "--launcher slurm submits with SLURM's sbatch, which this machine does not have; run the "
                "command on the cluster's login node"
            )
        self.folder, self.partition, self.time_minutes = Path(folder), partition, time_minutes
        self.gpus_per_run, self.cpus_per_run, self.cluster = gpus_per_run, cpus_per_run, cluster
        self.poll_seconds = poll_seconds

    def executor(self):
        """submitit's executor with this launcher's per-run resources."""
        import submitit

        executor = submitit.AutoExecutor(folder=self.folder / "%j", cluster=self.cluster)
        parameters: dict[str, Any] = {
            "name": "tapelm",
            "timeout_min": self.time_minutes,
            "nodes": 1,
            "tasks_per_node": 1,
            "gpus_per_node": self.gpus_per_run,
        }
        if self.cpus_per_run is not None:
            parameters["cpus_per_task"] = self.cpus_per_run
        if self.partition is not None:
            parameters["slurm_partition"] = self.partition
        executor.update_parameters(**parameters)
        return executor

    def submit(self, jobs: list[Job], options: RunOptions) -> list:
        """Submit `jobs` as one job array; the submitit jobs, in order."""
        import torch

        executor = self.executor()
        quiet = replace(options, progress=False)
        with executor.batch():
            submitted = [executor.submit(SubmittedRun(), job, quiet, torch.get_num_threads()) for job in jobs]
        for job, handle in zip(jobs, submitted):
            print(
                f"    submitted {job.run.spec.pe} / seed {job.run.spec.seed} as job {handle.job_id} "
                f"(log: {handle.paths.stdout})",
                flush=True,
            )
        return submitted

    def session(self, options: RunOptions) -> Session:
        return _Submitted(self, options)


class _Submitted(Session):
    """Runs submitted to SLURM, each `start` one job array; an outcome as its job lands (polled)."""

    def __init__(self, launcher: SlurmLauncher, options: RunOptions) -> None:
        super().__init__()
        self.launcher, self.options, self.running = launcher, options, {}

    def _start(self, keyed: list[tuple[int, Job]]) -> None:
        if keyed:
            handles = self.launcher.submit([job for _, job in keyed], self.options)
            self.running.update(zip(handles, keyed))

    def landed(self) -> Outcome:
        while not (done := [handle for handle in self.running if handle.done()]):
            time.sleep(self.launcher.poll_seconds)
        handle = done[0]
        key, job = self.running.pop(handle)
        try:
            outcome = Outcome(key, handle.result())
        except Exception as error:  # noqa: BLE001 (a failed, killed or cancelled job)
            outcome = Outcome(key, error=error)
        print(
            f"    {job.run.spec.pe} / seed {job.run.spec.seed}: job {handle.job_id} "
            + (
                "finished"
                if outcome.error is None
                else f"failed ({type(outcome.error).__name__}; log: {handle.paths.stderr})"
            ),
            flush=True,
        )
        return outcome


def make_launcher(
    name: str,
    jobs: int = 1,
    folder: str | Path = "runs/slurm",
    partition: str | None = None,
    time_minutes: int | None = None,
    gpus_per_run: int | None = None,
    cpus_per_run: int | None = None,
) -> Launcher:
    """The launcher `--launcher name` asks for, with its options; ValueError, before anything starts, for an unknown
    launcher or an option of the other one."""
    if name not in LAUNCHERS:
        raise ValueError(f"--launcher {name!r} is not allowed; choose from: {', '.join(LAUNCHERS)}")
    slurm = {
        "--slurm-partition": partition,
        "--slurm-time": time_minutes,
        "--slurm-gpus-per-run": gpus_per_run,
        "--slurm-cpus-per-run": cpus_per_run,
    }
    if name == "local":
        given = [flag for flag, value in slurm.items() if value is not None]
        if given:
            raise ValueError(f"{given[0]} is an option of --launcher slurm; add --launcher slurm or leave it out")
        return LocalLauncher(jobs)
    if jobs != 1:
        raise ValueError(
            "--jobs is an option of --launcher local; on SLURM every run is a job of its own, with one GPU"
        )
    return SlurmLauncher(
        folder,
        partition,
        60 if time_minutes is None else time_minutes,
        1 if gpus_per_run is None else gpus_per_run,
        cpus_per_run,
    )


__all__ = [
    "LAUNCHERS",
    "Job",
    "Launcher",
    "LocalLauncher",
    "Outcome",
    "RunOptions",
    "Session",
    "SlurmLauncher",
    "SubmittedRun",
    "device_slots",
    "die_with_parent",
    "make_launcher",
    "pin",
    "run_one",
    "shared_data_workers",
    "visible_devices",
]
