"""Resume-until-done on one machine: restart ``olmax train`` after a crash.

Rules (the published reproduction resubmitted failed jobs by hand; MaxText's launcher retries a
fixed 10 times with a fixed 300 s wait and no notion of progress):

- exit 0 with the final checkpoint written: done;
- exit 2 (olmax's status for bad input: a config error, a missing file): not retried, since
  the same input fails the same way;
- anything else (a crash, a kill, a stop by a signal the supervisor did not send): restart after
  ``backoff * 2**k`` seconds (capped at ``max_backoff``), where k counts the consecutive failures
  without progress. Progress is a newer committed checkpoint than before the attempt; it resets
  k. After ``max_restarts`` restarts in a row without progress the supervisor gives up and
  reports every attempt.

SIGTERM / SIGINT to the supervisor are forwarded to the child (which saves a checkpoint and
exits), and the supervisor stops without restarting.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from olmax import io
from olmax.launch import latest_checkpoint


@dataclasses.dataclass
class Attempt:
    attempt: int
    pid: int
    returncode: int
    checkpoint_before: int | None
    checkpoint_after: int | None
    seconds: float

    @property
    def progressed(self) -> bool:
        return self.checkpoint_after is not None and (self.checkpoint_before is None
                                                      or self.checkpoint_after > self.checkpoint_before)


@dataclasses.dataclass
class Report:
    ok: bool
    reason: str
    total_steps: int
    last_checkpoint: int | None
    restarts: int
    attempts: list[Attempt]

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for a, att in zip(d["attempts"], self.attempts):
            a["progressed"] = att.progressed
            a["signal"] = signal.Signals(-att.returncode).name if att.returncode < 0 else None
        return d

    def summary(self) -> str:
        lines = [f"olmax launch: {'done' if self.ok else 'gave up'}: {self.reason}"]
        for a in self.attempts:
            how = (f"killed by {signal.Signals(-a.returncode).name}" if a.returncode < 0
                   else f"exit {a.returncode}")
            lines.append(f"  attempt {a.attempt}: pid {a.pid}, {how} after {a.seconds:.1f} s, checkpoint "
                         f"{a.checkpoint_before} -> {a.checkpoint_after}" + (" (progress)" if a.progressed else ""))
        return "\n".join(lines)


def supervise(cmd: list[str], run_dir: str, total_steps: int, *, max_restarts: int = 3, backoff: float = 10.0,
              max_backoff: float = 600.0, status_file: str | None = None,
              progress: Callable[[str], int | None] = latest_checkpoint, log=sys.stderr) -> Report:
    attempts: list[Attempt] = []
    failures = 0          # consecutive failed attempts without progress
    delay = backoff
    stop = {"signal": None}
    child: subprocess.Popen | None = None

    def forward(signum, _frame):
        stop["signal"] = signum
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    old = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            before = progress(run_dir)
            if before is not None and before >= total_steps:
                return Report(True, f"the run is complete (checkpoint {before})", total_steps, before,
                              len(attempts) - 1 if attempts else 0, attempts)
            t0 = time.monotonic()
            child = subprocess.Popen(cmd)
            try:
                _status(status_file, {"pid": child.pid, "attempt": len(attempts) + 1, "checkpoint": before})
            except BaseException:  # no trainer runs on unsupervised once the launcher fails
                child.kill()
                child.wait()
                raise
            print(f"olmax launch: attempt {len(attempts) + 1}, pid {child.pid}, from checkpoint {before}",
                  file=log, flush=True)
            rc = child.wait()
            after = progress(run_dir)
            att = Attempt(len(attempts) + 1, child.pid, rc, before, after, time.monotonic() - t0)
            attempts.append(att)
            restarts = len(attempts) - 1
            if stop["signal"] is not None:
                return Report(False, f"stopped by {signal.Signals(stop['signal']).name} (forwarded to the "
                              "training process; run the same command to resume)", total_steps, after,
                              restarts, attempts)
            if rc == 0 and after is not None and after >= total_steps:
                return Report(True, f"trained to step {after}", total_steps, after, restarts, attempts)
            if rc == 2:
                return Report(False, "training exited with status 2 (bad input: a config error or a missing "
                              "file); not retried, the same input fails the same way", total_steps, after,
                              restarts, attempts)
            if att.progressed:
                failures, delay = 0, backoff
            failures += 0 if att.progressed else 1
            if failures > max_restarts:
                return Report(False, f"{failures} attempts in a row made no progress (no new checkpoint; "
                              f"--max-restarts {max_restarts}); last checkpoint {after}", total_steps, after,
                              restarts, attempts)
            print(f"olmax launch: attempt {att.attempt} ended with "
                  f"{'signal ' + signal.Signals(-rc).name if rc < 0 else 'exit ' + str(rc)} at checkpoint {after}; "
                  f"restarting in {delay:g} s", file=log, flush=True)
            if _sleep(delay, stop):
                return Report(False, f"stopped by {signal.Signals(stop['signal']).name}", total_steps, after,
                              restarts, attempts)
            delay = backoff if att.progressed else min(delay * 2, max_backoff)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _sleep(seconds: float, stop: dict) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if stop["signal"] is not None:
            return True
        time.sleep(min(0.1, max(end - time.monotonic(), 0)))
    return stop["signal"] is not None


def _status(path: str | None, values: dict) -> None:
    if path:
        io.write_local_atomically(path, json.dumps(values))
