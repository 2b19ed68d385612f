"""Where runs train, whatever they are: a job is a picklable callable `job(options, launch)` returning its result,
where `options` (`LaunchOptions`) say how every job runs and `launch` records how this one was launched.

- `LocalLauncher`: this machine. One job at a time in this process, or `jobs` at once on each device in worker
  processes, each worker pinned to its GPU (CUDA_VISIBLE_DEVICES) for good: on the CPU, `jobs` processes; on CUDA,
  `jobs` per visible GPU.
- `SlurmLauncher`: a SLURM cluster through submitit, the jobs submitted as one job array, each with its GPUs, time and
  partition; a job that SLURM preempts or times out is requeued (jobs resume from their own checkpoints).

Progress lines (a job done, submitted, landed) go to the launcher's `log` callback (default: this module's logger).
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import shutil
import signal
import sys
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

SUBMITIT_PIP = "pip install 'tapelm[cluster]' (or: pip install submitit)"

logger = logging.getLogger(__name__)
Log = Callable[[str], None]


class LaunchOptions(Protocol):
    """How every job of a launch runs; `in_workers` gives them for a job among `concurrent` training at once in
    worker processes (None: each on a machine of its own), e.g. without progress bars."""

    def in_workers(self, concurrent: int | None) -> LaunchOptions: ...


class LaunchJob(Protocol):
    """One job: called (in this process, a worker or a cluster job) with the options and its launch record; named by
    `str(job)` in progress lines; `summary(result)` says its result in a few words."""

    def __call__(self, options: Any, launch: dict[str, Any]) -> Any: ...

    def summary(self, result: Any) -> str: ...


@dataclass
class Outcome:
    """A launched job that ended: its place in the jobs given to `launch`, its result, or the error that ended it."""

    index: int
    result: Any = None
    error: BaseException | None = None


def timed(job: LaunchJob, options: Any, launch: dict[str, Any], threads: int | None = None) -> tuple[Any, float]:
    """The job's result and its seconds (with `threads` torch threads when given: a CPU run's numbers depend on
    them)."""
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    started = time.time()
    return job(options, launch), time.time() - started


def die_with_parent(parent: int) -> None:
    """In a worker: end when the process that started it ends (killed or not), instead of training on as an
    orphan; the unfinished run resumes from its checkpoint next time. Linux only (prctl); elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent ended before the request took effect
            os._exit(1)


def visible_devices() -> list[str]:
    """The devices a local launcher pins jobs to: the visible GPUs as CUDA_VISIBLE_DEVICES names them (their
    indices when it is unset), or ["cpu"] where there is none."""
    import torch

    if not torch.cuda.is_available():
        return ["cpu"]
    named = [name.strip() for name in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if name.strip()]
    return named[: torch.cuda.device_count()] if named else [str(i) for i in range(torch.cuda.device_count())]


def device_slots(devices: list[str], per_device: int) -> list[str]:
    """The device of each concurrent worker: every device `per_device` times, round robin, so that fewer jobs than
    workers still spread over every device."""
    return [device for _ in range(per_device) for device in devices]


def shared_data_workers(total: int, concurrent: int) -> int:
    """Each job's share of `total` data workers when `concurrent` jobs train at once (at least one where any were
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


def _run_pinned(job: LaunchJob, options: Any, launch: dict[str, Any]) -> tuple[Any, float]:
    return timed(job, options, {**launch, "device_slot": _WORKER_DEVICE})


class Session(ABC):
    """Jobs started and not yet handed back; `start` numbers them in order (an Outcome's `index`) across calls."""

    def __init__(self, log: Log) -> None:
        self.started, self.log = 0, log

    def start(self, jobs: list[LaunchJob]) -> list[int]:
        """Start `jobs` (queued while every slot is busy); their numbers."""
        keys = list(range(self.started, self.started + len(jobs)))
        self.started += len(jobs)
        self._start(list(zip(keys, jobs)))
        return keys

    @abstractmethod
    def _start(self, keyed: list[tuple[int, LaunchJob]]) -> None:
        """Start each (number, job)."""

    @abstractmethod
    def landed(self) -> Outcome:
        """The outcome of the next started job to end (waiting for it)."""

    def _done(self, job: LaunchJob, result: Any, seconds: float) -> None:
        if result is not None:
            self.log(f"    {job} done in {seconds:.0f} s: {job.summary(result)}")

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exception: Any) -> None:  # noqa: B027 (overridden only by sessions that hold workers)
        """Free what the session holds: nothing here; a session with worker processes ends them."""


class Launcher(ABC):
    """Where jobs train: a `session` starts jobs and hands back their outcomes as they end, with at most `slots`
    training at once (None: no limit, the cluster queues them), at most `per_device` of them on one device. `log`
    takes its progress lines."""

    name: str
    slots: int | None
    per_device: int = 1
    log: Log

    @abstractmethod
    def session(self, options: LaunchOptions) -> Session:
        """A session that trains jobs with `options`; a context manager that waits for started jobs as it ends."""

    def launch(self, jobs: list[LaunchJob], options: LaunchOptions) -> Iterator[Outcome]:
        """Train `jobs`, all started at once (as many training as there are slots), yielding each outcome as it
        ends."""
        if not jobs:
            return
        with self.session(options) as session:
            session.start(jobs)
            for _ in jobs:
                yield session.landed()


class _InProcess(Session):
    """One slot on this process's own device: each job trains here, in order, when an outcome is asked for."""

    def __init__(self, options: LaunchOptions, log: Log) -> None:
        super().__init__(log)
        self.options, self.queued = options, deque()

    def _start(self, keyed: list[tuple[int, LaunchJob]]) -> None:
        self.queued.extend(keyed)

    def landed(self) -> Outcome:
        key, job = self.queued.popleft()
        try:
            result, seconds = timed(job, self.options, {"launcher": "local", "runs_per_device": 1})
        except Exception as error:  # noqa: BLE001 (the caller decides whether one failure stops the rest)
            return Outcome(key, error=error)
        self._done(job, result, seconds)
        return Outcome(key, result)


class _Workers(Session):
    """`per_device` worker processes on each of `devices`, each pinned to its device for good (`_start_worker`);
    a job goes to the next free worker."""

    def __init__(self, devices: list[str], per_device: int, options: LaunchOptions, log: Log) -> None:
        import torch

        super().__init__(log)
        context = multiprocessing.get_context("spawn")
        slots = device_slots(devices, per_device)
        queue = context.Queue()
        for device in slots:  # a worker takes the next one as it starts, so fewer jobs still spread over devices
            queue.put((device, devices.index(device)))
        self.options = options.in_workers(len(slots))
        self.launch = {"launcher": "local", "runs_per_device": per_device}
        self.pool = ProcessPoolExecutor(
            len(slots),
            mp_context=context,
            initializer=_start_worker,
            initargs=(os.getpid(), queue, torch.get_num_threads()),
        )
        self.futures: dict[Any, tuple[int, LaunchJob]] = {}

    def _start(self, keyed: list[tuple[int, LaunchJob]]) -> None:
        for key, job in keyed:
            self.futures[self.pool.submit(_run_pinned, job, self.options, self.launch)] = key, job

    def landed(self) -> Outcome:
        done, _ = wait(self.futures, return_when=FIRST_COMPLETED)
        future = min(done, key=lambda handle: self.futures[handle][0])
        (key, job), error = self.futures.pop(future), future.exception()
        if error is not None:
            return Outcome(key, error=error)
        result, seconds = future.result()
        self._done(job, result, seconds)
        return Outcome(key, result)

    def __exit__(self, *exception: Any) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)  # jobs not started stay undone; started ones finish


class LocalLauncher(Launcher):
    """Jobs on this machine: `jobs` at once on each of `devices` (default `visible_devices()`), in pinned worker
    processes; one job at a time in this process where that makes one slot on the process's own device."""

    name = "local"

    def __init__(self, jobs: int = 1, devices: list[str] | None = None, log: Log | None = None) -> None:
        if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
            raise ValueError(f"jobs={jobs!r}: give a whole number of at least 1 (runs at once per device)")
        if devices is not None and (not devices or len(set(devices)) != len(devices)):
            raise ValueError(f"devices={devices!r} is not allowed; give distinct device names")
        self.jobs, self.pinned, self.log = jobs, devices is not None, log or logger.info
        self.per_device = jobs
        self.devices = list(devices) if devices is not None else visible_devices()
        self.slots = jobs * len(self.devices)

    def session(self, options: LaunchOptions) -> Session:
        if self.slots == 1 and not self.pinned:
            return _InProcess(options, self.log)
        return _Workers(self.devices, self.jobs, options, self.log)


class SubmittedJob:
    """A job as a submitit job with the submitting process's torch threads (as a local worker has them): when SLURM
    preempts it or its time runs out, submitit calls `checkpoint`, which requeues the same call, so a job that
    resumes from its own checkpoints continues (`submitit.helpers.Checkpointable`'s protocol)."""

    def __call__(self, job: LaunchJob, options: Any, threads: int) -> Any:
        import submitit

        environment = submitit.JobEnvironment()
        launch = {"launcher": "slurm", "job_id": environment.job_id, "hostname": environment.hostname}
        return timed(job, options, launch, threads)[0]

    def checkpoint(self, *args: Any, **kwargs: Any):
        from submitit.helpers import DelayedSubmission

        return DelayedSubmission(self, *args, **kwargs)


class SlurmLauncher(Launcher):
    """Jobs on a SLURM cluster through submitit: one job array, each job `gpus_per_run` GPUs (1, or 0 on CPU
    nodes), `cpus_per_run` CPUs, `time_minutes` and `partition`; submitit's files (scripts, logs, pickled results) in
    `folder`. `cluster`: "slurm", or "local" for submitit's local executor (tests: the same submission, as processes
    on this machine)."""

    name = "slurm"
    slots = None  # every job that may start is submitted at once

    def __init__(
        self,
        folder: str | Path,
        partition: str | None = None,
        time_minutes: int = 60,
        gpus_per_run: int = 1,
        cpus_per_run: int | None = None,
        cluster: str = "slurm",
        poll_seconds: float = 10.0,
        log: Log | None = None,
    ) -> None:
        for name, value in (
            ("time_minutes", time_minutes),
            ("cpus_per_run", 1 if cpus_per_run is None else cpus_per_run),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r}: give a whole number of at least 1")
        if gpus_per_run not in (0, 1) or isinstance(gpus_per_run, bool):
            raise ValueError(
                f"gpus_per_run={gpus_per_run!r}: give 1 (a run trains on one GPU: on several its batches, and so "
                "its result, would change) or 0 (CPU nodes)"
            )
        if cluster not in ("slurm", "local"):
            raise ValueError(f"cluster={cluster!r} is not allowed; choose slurm or local")
        if cluster == "slurm" and shutil.which("sbatch") is None:
            raise ValueError(
                "SlurmLauncher submits with SLURM's sbatch, which this machine does not have; run the "
                "command on the cluster's login node"
            )
        try:
            import submitit  # noqa: F401
        except ImportError:
            raise ValueError(
                f"SlurmLauncher needs the submitit package, which is not installed: {SUBMITIT_PIP}"
            ) from None
        self.folder, self.partition, self.time_minutes = Path(folder), partition, time_minutes
        self.gpus_per_run, self.cpus_per_run, self.cluster = gpus_per_run, cpus_per_run, cluster
        self.poll_seconds, self.log = poll_seconds, log or logger.info

    def executor(self):
        """submitit's executor with this launcher's per-job resources."""
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

    def submit(self, jobs: list[LaunchJob], options: LaunchOptions) -> list:
        """Submit `jobs` as one job array; the submitit jobs, in order."""
        import torch

        executor = self.executor()
        quiet = options.in_workers(None)
        with executor.batch():
            submitted = [executor.submit(SubmittedJob(), job, quiet, torch.get_num_threads()) for job in jobs]
        for job, handle in zip(jobs, submitted):
            self.log(f"    submitted {job} as job {handle.job_id} (log: {handle.paths.stdout})")
        return submitted

    def session(self, options: LaunchOptions) -> Session:
        return _Submitted(self, options)


class _Submitted(Session):
    """Jobs submitted to SLURM, each `start` one job array; an outcome as its job lands (polled)."""

    def __init__(self, launcher: SlurmLauncher, options: LaunchOptions) -> None:
        super().__init__(launcher.log)
        self.launcher, self.options, self.running = launcher, options, {}

    def _start(self, keyed: list[tuple[int, LaunchJob]]) -> None:
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
        ended = (
            "finished"
            if outcome.error is None
            else f"failed ({type(outcome.error).__name__}; log: {handle.paths.stderr})"
        )
        self.log(f"    {job}: job {handle.job_id} {ended}")
        return outcome


__all__ = [
    "LaunchJob",
    "LaunchOptions",
    "Launcher",
    "LocalLauncher",
    "Outcome",
    "Session",
    "SlurmLauncher",
    "SubmittedJob",
    "device_slots",
    "die_with_parent",
    "pin",
    "shared_data_workers",
    "timed",
    "visible_devices",
]
