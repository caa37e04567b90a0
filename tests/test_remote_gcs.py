"""``gs://`` token files, mix files and run directories against a GCS server on 127.0.0.1
(tests/remote_servers.py: ``GcsServer``, the JSON API subset ``google-cloud-storage`` uses), the
same coverage as tests/test_remote.py gives ``s3://``; and ``OLMAX_IO_RETRIES`` checks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from olmax import io
from olmax.checkpoint.store import Checkpointer
from olmax.data import DataError
from olmax.data.dataset import TokenDataset
from olmax.recipes import get_recipe
from olmax.train.loop import train
from olmax.verify.resume import read_metrics
from remote_servers import GcsServer
from trainlib import small_overrides

# End-to-end runs in child processes: the integration tier (`make test-integration`).
pytestmark = pytest.mark.integration

STEPS = 4
TOKENS_PER_FILE = 1 << 20
DATA = "gs://olmax-test/data"


@pytest.fixture(autouse=True)
def _fast_retries_and_private_staging(tmp_path, monkeypatch):
    monkeypatch.setenv("OLMAX_IO_BACKOFF", "0.01")
    monkeypatch.delenv("OLMAX_IO_RETRIES", raising=False)
    monkeypatch.setenv("OLMAX_STAGING_DIR", str(tmp_path / "staging"))


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    """Two 2 MiB token files: big next to what a run of STEPS steps reads (1 KiB of instances,
    plus the construction-time vocabulary check's 8 windows of 32 KiB per file)."""
    root = tmp_path_factory.mktemp("gcs_corpus")
    rng = np.random.default_rng(0)
    for i in range(2):
        rng.integers(0, 256, TOKENS_PER_FILE).astype("<u2").tofile(root / f"part-00{i}.npy")
    (root / "mix.txt").write_text("# label,path relative to the mix file\na,part-000.npy\nb,part-001.npy\n")
    return root


@pytest.fixture(scope="module")
def local_paths(corpus_dir) -> list[str]:
    return [str(corpus_dir / "part-000.npy"), str(corpus_dir / "part-001.npy")]


@pytest.fixture(scope="module")
def gcs_server(corpus_dir):
    with GcsServer() as server:
        for name in ("part-000.npy", "part-001.npy", "mix.txt"):
            server.upload(corpus_dir / name, f"data/{name}")
        yield server


@pytest.fixture
def gcs(gcs_server):
    """The module's server with a clean slate of counters, faults and refusals for each test."""
    gcs_server.served.clear()
    gcs_server.requests.clear()
    gcs_server.faults.clear()
    gcs_server.deny.clear()
    os.environ["OLMAX_GCS_ENDPOINT"] = gcs_server.url  # a test may have removed it
    return gcs_server


@pytest.fixture(scope="module")
def reference(local_paths, tmp_path_factory):
    """The uninterrupted run on the local files."""
    run = tmp_path_factory.mktemp("gcs_local_run")
    return train(get_recipe("tiny", small_overrides(local_paths, f"train.steps={STEPS}")), run, progress=False)


def _cfg(paths, *extra):
    return get_recipe("tiny", small_overrides(paths, f"train.steps={STEPS}", *extra))


def _token_bytes(server: GcsServer) -> int:
    return sum(n for name, n in server.served.items() if name.endswith(".npy"))


# --------------------------------------------------------------------------- data


def test_gs_files_have_the_local_fingerprint_and_instances(gcs, local_paths):
    local = TokenDataset.from_config(_cfg(local_paths))
    mix = TokenDataset.from_config(_cfg([f"{DATA}/mix.txt"]))
    direct = TokenDataset.from_config(_cfg(["gcs://olmax-test/data/part-000.npy", f"{DATA}/part-001.npy"]))
    ids = np.r_[0:40, len(local) - 40:len(local), np.random.default_rng(0).integers(0, len(local), 40)]
    for ds in (mix, direct):
        assert ds.fingerprint == local.fingerprint and len(ds) == len(local)
        np.testing.assert_array_equal(ds.read(ids), local.read(ids))
    assert [f.label for f in mix.files] == ["a", "b"]  # mix labels survive, relative paths resolved


def test_training_from_a_gs_mix_through_5xx_is_bitwise_and_fetches_only_its_instances(gcs, reference,
                                                                                       corpus_dir, tmp_path):
    cfg = _cfg([f"{DATA}/mix.txt"])
    for name in ("data/mix.txt", "data/part-000.npy", "data/part-001.npy"):
        gcs.faults[name] = [503, 502, 500]  # transient: retried (OLMAX_IO_RETRIES, default 6 attempts)
    res = train(cfg, tmp_path / "run", progress=False)
    assert res.losses == reference.losses  # bitwise
    assert all(not q for q in gcs.faults.values())  # every injected fault was met (and retried)
    L, item = cfg.data.sequence_length, 2
    corpus = 2 * TOKENS_PER_FILE * item
    # One range request per trained instance; the rest is the sampled vocabulary check.
    ranges = [rng for m, kind, name, rng in gcs.requests if kind == "media" and name.endswith(".npy")]
    assert ranges and all(rng and rng.startswith("bytes=") for rng in ranges)  # no whole-object read
    sizes = [int(b) - int(a) + 1 for a, b in (r[len("bytes="):].split("-") for r in ranges)]
    assert sizes.count(L * item) == STEPS * cfg.train.global_batch_size
    assert _token_bytes(gcs) < corpus // 6, (_token_bytes(gcs), corpus)


def test_local_cache_dir_serves_a_second_read_without_requests(gcs, tmp_path):
    url = f"{DATA}/part-000.npy"
    a = io.RemoteArray(url, "uint16", io.size(url), cache_dir=str(tmp_path / "cache"), block_bytes=1024)
    first = a[100:700]
    assert _token_bytes(gcs) == 2048  # the two 1 KiB blocks that hold tokens 100..699
    b = io.RemoteArray(url, "uint16", io.size(url), cache_dir=str(tmp_path / "cache"), block_bytes=1024)
    np.testing.assert_array_equal(b[100:700], first)
    assert _token_bytes(gcs) == 2048


def test_missing_gs_objects_and_buckets_are_errors_naming_the_url(gcs):
    with pytest.raises(DataError, match=f"{DATA}/nope.npy: no such object"):
        TokenDataset.from_config(_cfg([f"{DATA}/part-000.npy", f"{DATA}/nope.npy"]))
    with pytest.raises(DataError, match="gs://no-such-bucket/part-000.npy: no such object"):
        TokenDataset.from_config(_cfg(["gs://no-such-bucket/part-000.npy"]))
    with pytest.raises(DataError, match=f"mix file {DATA}/gone.txt: no such object"):
        TokenDataset.from_config(_cfg([f"{DATA}/gone.txt"]))


def test_refused_gs_object_is_an_error_naming_the_url(gcs):
    gcs.deny.add("data/part-001.npy")
    with pytest.raises(DataError, match=f"{DATA}/part-001.npy: access denied \\(HTTP 403\\).*application-default"):
        TokenDataset.from_config(_cfg([f"{DATA}/part-000.npy", f"{DATA}/part-001.npy"]))
    assert not any(k == "media" for _, k, _, _ in gcs.requests)  # refused at the size, nothing read


def test_size_not_a_multiple_of_the_dtype_names_the_gs_url(gcs, tmp_path):
    odd = tmp_path / "odd.npy"
    odd.write_bytes(b"\x01\x00" * 100 + b"\x01")
    url = gcs.upload(odd, "data/odd.npy")
    with pytest.raises(DataError, match=f"{url}: size 201 bytes is not a multiple of 2"):
        TokenDataset.from_config(_cfg([url]))


def test_gs_credentials_and_endpoint_errors_are_clear(gcs, monkeypatch):
    monkeypatch.setenv("OLMAX_GCS_ENDPOINT", "127.0.0.1:4443")
    with pytest.raises(io.RemoteError, match="OLMAX_GCS_ENDPOINT='127.0.0.1:4443': give the URL with its scheme"):
        io.size(f"{DATA}/part-000.npy")
    monkeypatch.delenv("OLMAX_GCS_ENDPOINT")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", "/nonexistent/olmax-test-key.json")
    with pytest.raises(io.RemoteError, match="gs://: no Google credentials.*application-default login"):
        io.size(f"{DATA}/part-000.npy")


# --------------------------------------------------------------------------- retries


def test_a_ranged_read_through_5xx_and_429_is_retried(gcs):
    want = io.read_range(f"{DATA}/part-001.npy", 64, 96)
    gcs.faults["data/part-001.npy"] = [503, 429, 504]
    assert io.read_range(f"{DATA}/part-001.npy", 64, 96) == want and not gcs.faults["data/part-001.npy"]


def test_gs_retries_stop_after_OLMAX_IO_RETRIES_attempts(gcs, monkeypatch):
    monkeypatch.setenv("OLMAX_IO_RETRIES", "2")
    gcs.faults["data/part-000.npy"] = [503] * 5
    with pytest.raises(io.RemoteError, match=f"{DATA}/part-000.npy: reading bytes 0..32 failed after 2 attempts"):
        io.read_range(f"{DATA}/part-000.npy", 0, 32)
    assert len(gcs.faults["data/part-000.npy"]) == 3  # exactly two requests were made
    monkeypatch.setenv("OLMAX_IO_RETRIES", "1")
    gcs.faults["data/part-000.npy"] = [503]
    with pytest.raises(io.RemoteError, match="failed after 1 attempts"):
        io.size(f"{DATA}/part-000.npy")


@pytest.mark.parametrize("value", ["0", "-1", "two", ""])
def test_OLMAX_IO_RETRIES_below_one_is_an_error_naming_the_variable(value, monkeypatch):
    monkeypatch.setenv("OLMAX_IO_RETRIES", value)
    calls = []
    with pytest.raises(io.RemoteError, match=f"OLMAX_IO_RETRIES={value!r}: must be a whole number of attempts, "
                                             "at least 1"):
        io.with_retries("gs://b/x", "reading it", lambda: calls.append(1))
    assert not calls  # nothing was tried
    # Through the data pipeline it reaches the user as a data error (exit 2 from the CLI).
    with pytest.raises(DataError, match="OLMAX_IO_RETRIES"):
        TokenDataset.from_config(_cfg([f"{DATA}/part-000.npy"]))


def test_OLMAX_IO_BACKOFF_must_be_a_non_negative_number(monkeypatch):
    for value in ("-0.5", "nan", "soon"):
        monkeypatch.setenv("OLMAX_IO_BACKOFF", value)
        with pytest.raises(io.RemoteError, match=f"OLMAX_IO_BACKOFF={value!r}: must be a number of seconds"):
            io.with_retries("gs://b/x", "reading it", lambda: 1)
    monkeypatch.setenv("OLMAX_IO_BACKOFF", "0")
    assert io.with_retries("gs://b/x", "reading it", lambda: 7) == 7


# --------------------------------------------------------------------------- run directories


def test_io_api_round_trips_on_gs(gcs, tmp_path):
    base = "gs://olmax-test/api"
    io.write_bytes(f"{base}/a.txt", b"hello")
    big = tmp_path / "big.bin"
    big.write_bytes(np.random.default_rng(0).bytes(9 << 20))  # over 8 MiB: a resumable upload
    io.put_file(big, f"{base}/sub/big.bin")
    assert io.read_text(f"{base}/a.txt") == "hello" and io.size(f"{base}/sub/big.bin") == 9 << 20
    io.get_file(f"{base}/sub/big.bin", tmp_path / "back" / "big.bin")
    assert (tmp_path / "back" / "big.bin").read_bytes() == big.read_bytes()  # full reads are crc32c-checked
    assert io.list_files(base) == {"a.txt": 5, "sub/big.bin": 9 << 20} and io.list_dirs(base) == ["sub"]
    assert io.exists(f"{base}/a.txt") and io.exists(f"{base}/sub") and not io.exists(f"{base}/nope")
    assert io.list_files(f"{base}/nothing") == {} and io.list_dirs(f"{base}/nothing") == []
    io.remove(f"{base}/sub")
    assert gcs.keys("api/") == ["api/a.txt"]


def test_gs_run_dir_killed_mid_upload_resumes_bitwise_from_a_fresh_cache(gcs, reference, tmp_path, monkeypatch):
    run = "gs://olmax-test/runs/k"
    overrides = small_overrides([f"{DATA}/part-000.npy", f"{DATA}/part-001.npy"], f"train.steps={STEPS}")
    # Machine 1: checkpoint 2 is committed, then the process is SIGKILLed while it uploads
    # checkpoint 4 (one file of it is up, the next one is parked by the server).
    gcs.hold_writes("runs/k/checkpoints/4/", after=1)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "OLMAX_STAGING_DIR": str(tmp_path / "machine1")}
    log = tmp_path / "machine1.log"
    with open(log, "w") as out:
        p = subprocess.Popen([sys.executable, "-m", "olmax.cli", "train", "tiny", "--run-dir", run, "--no-progress",
                              *[a for o in overrides for a in ("--set", o)]], env=env, stdout=out, stderr=out)
    try:
        deadline = time.time() + 400
        while not gcs.held.wait(0.2):
            assert p.poll() is None, f"the run ended before it was killed: {log.read_text()[-3000:]}"
            assert time.time() < deadline, f"checkpoint 4's upload never started: {log.read_text()[-3000:]}"
        p.send_signal(signal.SIGKILL)
        p.wait(60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        gcs.hold_writes("", after=1 << 30)  # the server stores everything again
        gcs.release.set()
    keys = gcs.keys("runs/k/")
    assert p.returncode == -signal.SIGKILL, log.read_text()[-3000:]
    for name in ("config.yaml", "run_info.json", "metrics.jsonl", "checkpoints/2/_OLMAX_COMMITTED"):
        assert f"runs/k/{name}" in keys, name
    assert any(k.startswith("runs/k/checkpoints/4/") for k in keys)  # an upload cut short ...
    assert "runs/k/checkpoints/4/_OLMAX_COMMITTED" not in keys  # ... and never committed
    cfg = _cfg([f"{DATA}/part-000.npy", f"{DATA}/part-001.npy"])
    assert Checkpointer(run, cfg.checkpoint, read_only=True).all_steps() == [2]

    # Machine 2: an empty local cache; everything comes back from the bucket.
    monkeypatch.setenv("OLMAX_STAGING_DIR", str(tmp_path / "machine2"))
    second = train(cfg, run, progress=False)
    assert second.start_step == 2 and second.end_step == STEPS
    assert second.losses == {s: v for s, v in reference.losses.items() if s > 2}  # bitwise
    remote_metrics = [json.loads(line) for line in io.read_text(f"{run}/metrics.jsonl").splitlines()]
    local_metrics = read_metrics(Path(reference.run_dir))
    assert [m["train/CE loss"] for m in remote_metrics] == [local_metrics[s]["train/CE loss"]
                                                            for s in range(1, STEPS + 1)]
    assert Checkpointer(run, cfg.checkpoint, read_only=True).all_steps() == [2, 4]
    assert Checkpointer.read_meta(run)["step"] == STEPS
