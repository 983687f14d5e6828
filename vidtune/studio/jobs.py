"""The studio's queue of `vidtune` processes: one runs at a time (one GPU), the rest wait in order.

A job is one of vidtune's own commands with arguments the studio checked (`Command`); it runs as
`python -m vidtune ...` in the root, its output in a log file under `.vidtune-studio/logs`. Stopping sends SIGINT, as
Ctrl-C does: a training run saves a checkpoint after its current step, then exits (130); resuming is
`vidtune train <run>/config.yaml checkpoint.resume=latest`, as the command line resumes. Each process has its own
session, so a Ctrl-C in the studio's terminal reaches the studio alone, which then sends each run one SIGINT (a
second would stop it without its checkpoint).
"""

from __future__ import annotations

import itertools
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from vidtune.errors import VidtuneError

COMMANDS = ("train", "sample", "export", "caption")
STUDIO_FOLDER = ".vidtune-studio"
POLL_SECONDS = 0.5


@dataclass(frozen=True)
class Command:
    """`vidtune <name> <args...>`; `run`: the run folder it works on (for the run page), if any."""

    name: str
    args: tuple[str, ...]
    title: str
    run: Path | None = None

    def __post_init__(self) -> None:
        if self.name not in COMMANDS:
            raise VidtuneError(f"{self.name!r} is not a command the studio runs (it runs: {', '.join(COMMANDS)}).")
        if any(not isinstance(arg, str) or "\x00" in arg for arg in self.args):
            raise VidtuneError("A command's arguments must be text without NUL characters.")

    def argv(self) -> list[str]:
        return [sys.executable, "-m", "vidtune", self.name, *self.args]


@dataclass
class Job:
    number: int
    command: Command
    log: Path
    state: str = "queued"  # queued, running, stopping, finished, stopped, failed, cancelled
    exit_code: int | None = None
    started: float | None = None
    ended: float | None = None
    process: subprocess.Popen | None = field(default=None, repr=False)

    def to_json(self) -> dict:
        return {"id": self.number, "command": self.command.name, "title": self.command.title,
                "args": list(self.command.args), "state": self.state, "exit_code": self.exit_code,
                "run": str(self.command.run) if self.command.run else None, "log": self.log.name,
                "message": self.message()}

    def message(self) -> str | None:
        """Why a failed job failed, as vidtune said it: its last `error:` message (what the command line shows),
        else the last lines of its log; None for a job that did not fail."""
        if self.state != "failed":
            return None
        tail = "\n" + self.tail(8000)
        marker = tail.rfind("\nerror: ")
        if marker >= 0:
            return tail[marker + len("\nerror: "):].strip()
        lines = tail.strip().splitlines()[-5:]
        return "\n".join(lines) if lines else f"It exited with code {self.exit_code} and wrote nothing to its log."

    def tail(self, characters: int = 4000) -> str:
        try:
            with self.log.open("rb") as handle:
                handle.seek(0, 2)
                size = handle.tell()
                handle.seek(max(size - characters, 0))
                return handle.read().decode("utf-8", errors="replace")
        except OSError:
            return ""


class JobQueue:
    """Jobs in order; a worker thread starts the next when none is running."""

    def __init__(self, root: Path, environment: dict[str, str] | None = None) -> None:
        self.root = root
        self.logs = root / STUDIO_FOLDER / "logs"
        self.environment = environment
        self.jobs: list[Job] = []
        self._numbers = itertools.count(1)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._worker = threading.Thread(target=self._work, name="vidtune-studio-jobs", daemon=True)
        self._worker.start()

    def add(self, command: Command) -> Job:
        self.logs.mkdir(parents=True, exist_ok=True)
        with self._lock:
            number = next(self._numbers)
            stamp = time.strftime("%Y%m%d-%H%M%S")
            job = Job(number, command, self.logs / f"{stamp}-{number:04d}-{command.name}.log")
            self.jobs.append(job)
        self._wake.set()
        return job

    def get(self, number: int) -> Job:
        for job in self.jobs:
            if job.number == number:
                return job
        raise VidtuneError(f"There is no job {number}.")

    def for_run(self, run: Path) -> list[Job]:
        return [job for job in self.jobs if job.command.run == run]

    def active_for(self, run: Path) -> Job | None:
        return next((job for job in self.jobs if job.command.run == run and job.command.name == "train"
                     and job.state in ("queued", "running", "stopping")), None)

    def latest_for(self, run: Path) -> Job | None:
        """The newest training job of `run`, whatever its state."""
        return next((job for job in reversed(self.jobs) if job.command.run == run and job.command.name == "train"),
                    None)

    def stop(self, number: int) -> Job:
        """A queued job is cancelled; a running one gets SIGINT (a training run: checkpoint, then exit)."""
        with self._lock:
            job = self.get(number)
            if job.state == "queued":
                job.state = "cancelled"
            elif job.state == "running" and job.process is not None:
                job.state = "stopping"
                job.process.send_signal(signal.SIGINT)
        return job

    def close(self, wait: float = 60.0) -> None:
        """Stop what runs (with its checkpoint) and the worker; queued jobs are cancelled."""
        self._closed = True
        for job in list(self.jobs):
            if job.state in ("queued", "running"):
                self.stop(job.number)
        self._wake.set()
        self._worker.join(timeout=wait)

    def _next(self) -> Job | None:
        with self._lock:
            if any(job.state in ("running", "stopping") for job in self.jobs):
                return None
            return next((job for job in self.jobs if job.state == "queued"), None)

    def _work(self) -> None:
        while True:
            job = None if self._closed else self._next()
            if job is None:
                running = next((j for j in self.jobs if j.state in ("running", "stopping")), None)
                if running is None and self._closed:
                    return
                if running is not None:
                    self._reap(running)
                self._wake.wait(POLL_SECONDS)
                self._wake.clear()
                continue
            self._start(job)

    def _start(self, job: Job) -> None:
        with self._lock:
            handle = job.log.open("ab")
            try:
                job.process = subprocess.Popen(job.command.argv(), cwd=self.root, stdout=handle,
                                               stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               env=self.environment, start_new_session=True)
            except OSError as error:
                handle.write(f"could not start: {error}\n".encode())
                job.state, job.exit_code = "failed", None
                return
            finally:
                handle.close()
            job.state, job.started = "running", time.time()

    def _reap(self, job: Job) -> None:
        process = job.process
        if process is None or process.poll() is None:
            return
        with self._lock:
            job.exit_code = process.returncode
            job.ended = time.time()
            if process.returncode == 0:
                job.state = "finished"
            elif process.returncode in (130, 143, -signal.SIGINT):
                job.state = "stopped"
            else:
                job.state = "failed"
