"""Audit: passes for every topology, and catches the published double-sharding bug."""

from __future__ import annotations

import numpy as np
import pytest

from olmax.data import DataError
from olmax.data.audit import audit
from olmax.data.order import GlobalOrder


@pytest.fixture(scope="module")
def order() -> GlobalOrder:
    return GlobalOrder(1003, 12, 34521)           # 83 batches per epoch, 7 instances dropped


@pytest.mark.parametrize("processes", [1, 2, 3, 4])
@pytest.mark.parametrize("workers", [0, 1, 2, 4])
def test_audit_passes(order: GlobalOrder, processes: int, workers: int) -> None:
    for epoch in (1, 2):
        res = audit(order, processes, workers, epoch=epoch)
        assert res.ok, res.problems
        assert (res.steps, res.assigned, res.dropped) == (83, 83 * 12, 7)


def double_sharded_share(order: GlobalOrder, steps: np.ndarray, r: int, R: int) -> np.ndarray:
    """The published bug: the sampler shards per host (columns r::R), then the loader is told to
    shard again and reads every R-th record of that host stream; its cursor runs R times too
    fast and wraps around, so the epoch becomes resampling with replacement."""
    lb = order.global_batch_size // R
    out = np.empty((len(steps), lb), dtype=np.uint32)
    for i, step in enumerate(np.asarray(steps)):
        epoch, row = order.locate(int(step))
        host_stream = np.asarray(order.epoch(epoch))[:, r::R].reshape(-1)
        sharded_again = host_stream[r::R]
        out[i] = sharded_again[(row * lb + np.arange(lb)) % len(sharded_again)]
    return out


@pytest.mark.parametrize("processes", [2, 3, 4])
def test_audit_catches_double_sharding(order: GlobalOrder, processes: int) -> None:
    res = audit(order, processes, 2, share_fn=double_sharded_share)
    assert not res.ok
    text = "\n".join(res.problems)
    assert "read more than once" in text and "never read" in text
    assert "the processes' shares together are not global batch" in text
    assert audit(order, 1, 2, share_fn=double_sharded_share).ok     # invisible on one host


def test_audit_catches_reordering_and_wrong_sizes(order: GlobalOrder) -> None:
    def reversed_share(o: GlobalOrder, steps: np.ndarray, r: int, R: int) -> np.ndarray:
        return o.batches(steps)[:, ::-1][:, r::R]          # right instances, wrong order
    res = audit(order, 2, 0, share_fn=reversed_share)
    assert not res.ok and any("differ" in p for p in res.problems)

    def short_share(o: GlobalOrder, steps: np.ndarray, r: int, R: int) -> np.ndarray:
        return o.batches(steps)[:, r::R][:, :-1]
    res = audit(order, 2, 1, share_fn=short_share)
    assert not res.ok and any("expected 6" in p for p in res.problems)
    with pytest.raises(DataError, match="not divisible by 5 processes"):
        audit(order, 5, 0)
    assert "OK" in audit(order, 3, 2).summary() and "FAILED" in res.summary()


def test_audit_catches_a_wrong_worker_split(order: GlobalOrder, monkeypatch: pytest.MonkeyPatch) -> None:
    import olmax.data.audit as audit_mod
    # Workers that ignore their index (each reads every step): steps repeat, the stream drifts.
    monkeypatch.setattr(audit_mod, "worker_steps", lambda start, stop, w, W: range(start, stop, max(W, 1)))
    assert audit(order, 2, 1).ok                 # one worker: nothing to get wrong
    res = audit(order, 2, 4)
    assert not res.ok and "do not deliver each step once" in res.problems[0]
    assert any("read more than once" in p for p in res.problems)
