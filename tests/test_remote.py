"""Remote token files and run directories against real servers on 127.0.0.1: moto's S3 server and
an HTTP server answering range requests (tests/remote_servers.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from olmax import io
from olmax.checkpoint.load import load_params, restore_train_state
from olmax.checkpoint.store import Checkpointer
from olmax.data import DataError
from olmax.data.dataset import TokenDataset
from olmax.data.loader import DataLoader
from olmax.recipes import get_recipe
from olmax.train.loop import train
from olmax.verify.resume import read_metrics
from remote_servers import RangeServer, S3Server
from trainlib import small_overrides, write_corpus

# End-to-end runs in child processes: the integration tier (`make test-integration`).
pytestmark = pytest.mark.integration

STEPS = 4


@pytest.fixture(autouse=True)
def _fast_retries_and_private_staging(tmp_path, monkeypatch):
    monkeypatch.setenv("OLMAX_IO_BACKOFF", "0.01")
    monkeypatch.setenv("OLMAX_STAGING_DIR", str(tmp_path / "staging"))


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("remote_corpus")
    write_corpus(root)
    (root / "mix.txt").write_text("# label,path relative to the mix file\na,part-000.npy\nb,part-001.npy\n")
    return root


@pytest.fixture(scope="module")
def local_paths(corpus_dir) -> list[str]:
    return [str(corpus_dir / "part-000.npy"), str(corpus_dir / "part-001.npy")]


@pytest.fixture(scope="module")
def s3(corpus_dir):
    with S3Server() as server:
        for name in ("part-000.npy", "part-001.npy", "mix.txt"):
            server.upload(corpus_dir / name, f"data/{name}")
        yield server


@pytest.fixture
def http(corpus_dir):
    with RangeServer(corpus_dir) as server:
        yield server


@pytest.fixture(scope="module")
def reference(local_paths, tmp_path_factory):
    """The uninterrupted run on the local files."""
    run = tmp_path_factory.mktemp("local_run")
    return train(get_recipe("tiny", small_overrides(local_paths, f"train.steps={STEPS}")), run, progress=False)


def _cfg(paths, *extra):
    return get_recipe("tiny", small_overrides(paths, f"train.steps={STEPS}", *extra))


# --------------------------------------------------------------------------- data


def test_remote_files_have_the_local_fingerprint_and_instances(s3, http, local_paths):
    local = TokenDataset.from_config(_cfg(local_paths))
    s3_ds = TokenDataset.from_config(_cfg(["s3://olmax-test/data/mix.txt"]))
    http_ds = TokenDataset.from_config(_cfg([f"{http.url}/part-000.npy", f"{http.url}/part-001.npy"]))
    ids = np.arange(len(local))
    for ds in (s3_ds, http_ds):
        assert ds.fingerprint == local.fingerprint and len(ds) == len(local)
        np.testing.assert_array_equal(ds.read(ids), local.read(ids))
    assert [f.label for f in s3_ds.files] == ["a", "b"]  # mix labels survive, relative paths resolved


def test_heldout_paths_read_remote_files_like_local_ones(http, s3, local_paths):
    from olmax.eval.heldout import heldout_windows
    want = heldout_windows(local_paths, "uint16", 16, 20)
    np.testing.assert_array_equal(heldout_windows(["s3://olmax-test/data/mix.txt"], "uint16", 16, 20), want)
    np.testing.assert_array_equal(heldout_windows([f"{http.url}/part-000.npy"], "uint16", 16, 20), want)
    assert sum(http.served.values()) == 20 * 16 * 2  # the 20 windows, not the file


def test_each_process_reads_only_its_share_by_range_requests(http, local_paths):
    urls = [f"{http.url}/part-000.npy", f"{http.url}/part-001.npy"]
    cfg = _cfg(urls)
    L, item = cfg.data.sequence_length, 2
    for r in range(2):
        http.served.clear()
        http.requests.clear()
        loader = DataLoader(cfg, process_index=r, process_count=2, validate="none")
        ref = DataLoader(_cfg(local_paths), process_index=r, process_count=2, validate="none")
        expected = set()
        for step in range(STEPS):
            got, want = loader.batch(step), ref.batch(step)
            np.testing.assert_array_equal(got["input_ids"], want["input_ids"])
            for i in loader.source.ids(step):
                f = next(f for f in loader.dataset.files if f.start <= i < f.start + f.instances)
                a = (int(i) - f.start) * L * item
                expected.add((f"/{f.path.rsplit('/', 1)[1]}", f"bytes={a}-{a + L * item - 1}"))
        # Exactly this process's instances (half of each global batch), one range request each.
        gets = [(p, rng) for m, p, rng in http.requests if m == "GET"]
        assert set(gets) == expected and len(expected) == STEPS * cfg.train.global_batch_size // 2
        assert sum(http.served.values()) == len(gets) * L * item


def test_local_cache_dir_serves_a_second_read_without_requests(http, tmp_path):
    url = f"{http.url}/part-000.npy"
    a = io.RemoteArray(url, "uint16", io.size(url), cache_dir=str(tmp_path / "cache"), block_bytes=1024)
    first = a[100:700]
    served = sum(http.served.values())
    assert served == 2048  # the two 1 KiB blocks that hold tokens 100..699
    b = io.RemoteArray(url, "uint16", io.size(url), cache_dir=str(tmp_path / "cache"), block_bytes=1024)
    np.testing.assert_array_equal(b[100:700], first)
    assert sum(http.served.values()) == served


def test_missing_object_is_an_error_naming_the_url(s3, http):
    with pytest.raises(DataError, match="s3://olmax-test/data/nope.npy: no such object"):
        TokenDataset.from_config(_cfg(["s3://olmax-test/data/part-000.npy", "s3://olmax-test/data/nope.npy"]))
    with pytest.raises(DataError, match=f"{http.url}/nope.txt: no such object"):
        TokenDataset.from_config(_cfg([f"{http.url}/nope.txt"]))


def test_forbidden_object_is_an_error_naming_the_url(http):
    http.deny.add("/part-001.npy")
    with pytest.raises(DataError, match=f"{http.url}/part-001.npy: access denied \\(HTTP 403\\)"):
        TokenDataset.from_config(_cfg([f"{http.url}/part-000.npy", f"{http.url}/part-001.npy"]))


def test_size_not_a_multiple_of_the_dtype_names_the_url(s3, tmp_path):
    odd = tmp_path / "odd.npy"
    odd.write_bytes(b"\x01\x00" * 100 + b"\x01")
    url = s3.upload(odd, "data/odd.npy")
    with pytest.raises(DataError, match=f"{url}: size 201 bytes is not a multiple of 2"):
        TokenDataset.from_config(_cfg([url]))


def test_a_missing_remote_file_fails_the_cli_before_training(s3, tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-m", "olmax.cli", "train", "tiny", "--run-dir", str(tmp_path / "run"),
                        *[a for o in small_overrides(["s3://olmax-test/data/gone.npy"]) for a in ("--set", o)]],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 2, r.stderr
    assert "s3://olmax-test/data/gone.npy: no such object" in r.stderr
    # Nothing trained: no metrics, no checkpoint (Orbax may have created the empty folder).
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert not any((tmp_path / "run" / "checkpoints").glob("*"))


# --------------------------------------------------------------------------- training


def test_transient_503s_are_retried_and_the_losses_do_not_change(http, reference):
    urls = [f"{http.url}/part-000.npy", f"{http.url}/part-001.npy"]
    for path in ("/part-000.npy", "/part-001.npy"):
        http.faults[path] = [503, 502, 503]
    res = train(_cfg(urls), Path(os.environ["OLMAX_STAGING_DIR"]).parent / "run", progress=False)
    assert res.losses == reference.losses  # bitwise
    assert all(not q for q in http.faults.values())  # every injected fault was met (and retried)


def test_remote_data_and_run_dir_resume_bitwise(s3, reference, tmp_path, monkeypatch):
    run = "s3://olmax-test/runs/a"
    cfg = _cfg(["s3://olmax-test/data/part-000.npy", "s3://olmax-test/data/part-001.npy"])
    first = train(cfg, run, progress=False, max_steps_this_run=2)
    assert first.stopped_early and first.run_dir == run
    assert Checkpointer(run, cfg.checkpoint, read_only=True).all_steps() == [2]
    keys = s3.keys("runs/a/")
    for name in ("config.yaml", "run_info.json", "metrics.jsonl", "checkpoints/2/_OLMAX_COMMITTED"):
        assert f"runs/a/{name}" in keys, name
    # A new machine: an empty staging folder; everything comes back from the bucket.
    monkeypatch.setenv("OLMAX_STAGING_DIR", str(tmp_path / "other_machine"))
    second = train(cfg, run, progress=False)
    assert second.start_step == 2 and second.end_step == STEPS
    assert {**first.losses, **second.losses} == reference.losses  # bitwise
    remote_metrics = [json.loads(l) for l in io.read_text(f"{run}/metrics.jsonl").splitlines()]
    local_metrics = read_metrics(Path(reference.run_dir))
    assert [m["train/CE loss"] for m in remote_metrics] == [local_metrics[s]["train/CE loss"]
                                                            for s in range(1, STEPS + 1)]
    # keep_last=2 on the remote too (the tiny recipe keeps the last 2).
    assert Checkpointer(run, cfg.checkpoint, read_only=True).all_steps() == [2, 4]

    # Tools take remote checkpoints (RUN or RUN/checkpoints/N) like local ones.
    remote_params, _ = load_params(f"{run}/checkpoints/4")
    local_params, _ = load_params(Path(reference.run_dir) / "checkpoints" / "4")
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((np.asarray(a) == np.asarray(b)).all()),
                                     remote_params, local_params))
    assert restore_train_state(run)[3]["step"] == 4

    # An upload of checkpoint 9 cut short (some files, no commit marker) is never the newest.
    client = s3.client()
    for key in [k for k in s3.keys("runs/a/checkpoints/4/") if not k.endswith("_OLMAX_COMMITTED")][:3]:
        client.copy_object(Bucket=s3.BUCKET, Key=key.replace("/4/", "/9/"),
                           CopySource={"Bucket": s3.BUCKET, "Key": key})
    assert any(k.startswith("runs/a/checkpoints/9/") for k in s3.keys("runs/a/"))
    ck = Checkpointer(run, cfg.checkpoint)
    assert ck.all_steps() == [2, 4] and ck.latest_step() == 4
    ck.close()
    assert Checkpointer.read_meta(run)["step"] == 4
    # Nor is a staged local copy whose upload never committed: it is dropped.
    staged = next((tmp_path / "other_machine").iterdir()) / "checkpoints"
    shutil.copytree(staged / "4", staged / "9")
    Checkpointer(run, cfg.checkpoint).close()
    assert not (staged / "9").exists() and (staged / "4").exists()


def test_http_run_directories_are_refused(http):
    with pytest.raises(ValueError, match="must be s3:// or gs://"):
        train(_cfg([f"{http.url}/part-000.npy"]), f"{http.url}/run", progress=False)
