"""Coverage audit: simulate the loader for R processes x W workers and prove the split.

For one epoch it checks that (1) the workers of each process read every step once, in order;
(2) at every step the processes' shares together are exactly global batch k; (3) every instance
of the epoch is read exactly once, and nothing outside it is read; (4) the batches equal the
single-process run. The share function is injectable so a test can show that a double-sharded
loader (the bug of the published OLMo 3 reproduction) fails the audit (tests/data/test_audit.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from olmax.data import DataError
from olmax.data.order import GlobalOrder, ShareFn, process_share, worker_steps

_BLOCK_INSTANCES = 1 << 22  # steps are audited in blocks of about this many instances


@dataclass
class AuditResult:
    processes: int
    workers: int
    epoch: int
    steps: int
    global_batch_size: int
    instances: int            # instances in the dataset
    assigned: int             # instance reads over the epoch, all processes together
    dropped: int              # instances past the last whole batch (OLMo-core drops them too)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}

    def summary(self) -> str:
        head = (f"audit R={self.processes} W={self.workers} epoch {self.epoch}: {self.steps} steps x "
                f"{self.global_batch_size} instances, {self.assigned} reads of {self.instances} instances "
                f"({self.dropped} dropped as a partial batch)")
        if self.ok:
            return head + "\nOK: every instance of the epoch read exactly once; batches equal the single-process run"
        return head + "\nFAILED:\n" + "\n".join(f"  - {p}" for p in self.problems)


def _reassembled_steps(start: int, stop: int, workers: int) -> list[int]:
    """The order in which a process receives steps: Grain interleaves its workers round-robin."""
    per_worker = [list(worker_steps(start, stop, w, workers)) for w in range(max(workers, 1))]
    out = []
    for i in range(max((len(s) for s in per_worker), default=0)):
        out += [s[i] for s in per_worker if i < len(s)]
    return out


def audit(order: GlobalOrder, processes: int, workers: int, *, epoch: int = 1, share_fn: ShareFn = process_share,
          max_problems: int = 20) -> AuditResult:
    """Audit epoch ``epoch`` of ``order`` for ``processes`` x ``workers``; see the module docstring."""
    if processes < 1 or workers < 0:
        raise DataError(f"need processes >= 1 and workers >= 0, got {processes}, {workers}")
    B, nb = order.global_batch_size, order.batches_per_epoch
    if B % processes:
        raise DataError(f"train.global_batch_size={B} is not divisible by {processes} processes")
    start, stop = (epoch - 1) * nb, epoch * nb
    res = AuditResult(processes, workers, epoch, nb, B, order.num_instances, 0, order.num_instances - nb * B)
    problems = res.problems

    def problem(msg: str) -> None:
        if len(problems) < max_problems:
            problems.append(msg)

    # What the trainer's i-th batch is: the step the workers' interleaved stream delivers i-th.
    got = np.array(_reassembled_steps(start, stop, workers), dtype=np.int64)
    if not np.array_equal(got, np.arange(start, stop)):
        dup = len(got) - len(np.unique(got))
        problem(f"workers do not deliver each step once in order ({len(got)} deliveries of {nb} steps, "
                f"{dup} repeated)")
    counts = np.zeros(order.num_instances, dtype=np.uint16)
    block = max(1, _BLOCK_INSTANCES // B)
    for i0 in range(0, min(len(got), nb), block):
        steps = np.arange(start + i0, start + min(i0 + block, len(got), nb))
        delivered = got[i0:i0 + len(steps)]
        want = order.batches(steps)
        single = np.asarray(share_fn(order, steps, 0, 1))
        if not np.array_equal(single, want):
            problem(f"single-process batches differ from the global order in steps {steps[0]}..{steps[-1]}")
            single = want
        merged = np.zeros_like(want)
        for r in range(processes):
            share = np.asarray(share_fn(order, delivered, r, processes))
            if share.shape != (len(steps), B // processes):
                problem(f"process {r} reads {share.shape[1:]} instances per step, expected {B // processes}")
                continue
            merged[:, r::processes] = share
            np.add.at(counts, share.reshape(-1).astype(np.int64), 1)
            res.assigned += share.size
        same_set = (np.sort(merged, axis=1) == np.sort(want, axis=1)).all(axis=1)
        for k in steps[~same_set][:3]:
            problem(f"step {k}: the processes' shares together are not global batch {k}")
        differ = ~(merged == single).all(axis=1) & same_set
        for k in steps[differ][:3]:
            problem(f"step {k}: batch differs from the single-process run")
    in_epoch = np.zeros(order.num_instances, dtype=bool)
    in_epoch[np.asarray(order.epoch(epoch)).reshape(-1)] = True
    dup, missing, outside = (counts > 1) & in_epoch, (counts == 0) & in_epoch, (counts > 0) & ~in_epoch
    for n, what in ((dup.sum(), "read more than once"), (missing.sum(), "never read"),
                    (outside.sum(), "read although not in this epoch's batches")):
        if n:
            problem(f"{n} instances ({n / max(in_epoch.sum(), 1):.1%} of the epoch) {what}")
    return res

