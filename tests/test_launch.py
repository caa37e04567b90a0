"""``olmax launch``: the local supervisor with real training children killed by SIGKILL, the Slurm
script (generated, and run by bash against stub srun/scontrol), the TPU commands."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from signal import SIGKILL

import pytest

from olmax.launch import latest_checkpoint
from olmax.recipes import get_recipe
from olmax.train.loop import train
from olmax.verify.resume import read_metrics
from trainlib import small_overrides

# End-to-end runs in child processes: the integration tier (`make test-integration`).
pytestmark = pytest.mark.integration

STEPS = 8
# Timing-dependent columns differ between any two runs.
VOLATILE = ("throughput/device/TPS", "throughput/MFU", "throughput/device/TFLOPs")


def _sets(paths, *extra):
    return [a for o in small_overrides(paths, f"train.steps={STEPS}", *extra) for a in ("--set", o)]


def _launch(args, tmp_path, **kw):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.Popen([sys.executable, "-m", "olmax.cli", "launch", "local", "tiny", *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, **kw)


def _read_status(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def test_a_run_that_never_progresses_stops_after_n_restarts(tmp_path, corpus):
    status = tmp_path / "status.json"
    proc = _launch(["--run-dir", str(tmp_path / "run"), "--max-restarts", "2", "--backoff", "0.05",
                    "--status-file", str(status), "--json", *_sets(corpus)], tmp_path)
    killed: set[int] = set()

    def killer():  # every child dies at once, before it can write a checkpoint
        while proc.poll() is None:
            st = _read_status(status)
            if st and st["pid"] not in killed:
                try:
                    os.kill(st["pid"], signal.SIGKILL)
                except ProcessLookupError:
                    pass
                killed.add(st["pid"])
            time.sleep(0.01)

    out, err = _communicate_while(proc, killer, timeout=600)
    assert proc.returncode == 1, err
    report = json.loads(out)
    assert not report["ok"] and "3 attempts in a row made no progress" in report["reason"]
    assert [a["signal"] for a in report["attempts"]] == ["SIGKILL"] * 3 and report["restarts"] == 2
    assert "gave up" in err and "--max-restarts 2" in err
    assert latest_checkpoint(str(tmp_path / "run")) is None


def _communicate_while(proc: subprocess.Popen, killer, timeout: float) -> tuple[str, str]:
    """The launcher's output, with ``killer`` running beside it in a thread."""
    t = threading.Thread(target=killer)
    t.start()
    out, err = proc.communicate(timeout=timeout)
    t.join()
    return out, err


def test_bad_input_is_not_retried(tmp_path):
    proc = _launch(["--run-dir", str(tmp_path / "run"), "--backoff", "0.05", "--json",
                    *_sets([str(tmp_path / "missing.npy")])], tmp_path)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 2, err
    report = json.loads(out)
    assert len(report["attempts"]) == 1 and "status 2" in report["reason"]
    assert "missing.npy" in err


@pytest.mark.slow  # four training processes (about 1-2 minutes on 2 cores)
def test_children_killed_at_random_points_finish_with_the_uninterrupted_metrics(tmp_path, corpus):
    ref = train(get_recipe("tiny", small_overrides(corpus, f"train.steps={STEPS}")), tmp_path / "ref", progress=False)
    assert ref.end_step == STEPS
    run, status = tmp_path / "run", tmp_path / "status.json"
    proc = _launch(["--run-dir", str(run), "--max-restarts", "2", "--backoff", "0.05", "--status-file", str(status),
                    "--json", *_sets(corpus)], tmp_path)
    rng = random.Random(1234)
    kills = []

    def kill(pid: int) -> None:
        try:
            os.kill(pid, SIGKILL)
            kills.append(pid)
        except ProcessLookupError:
            pass

    def killer():
        # Kill 1: the first child, a random moment after a randomly chosen checkpoint appeared.
        k1 = rng.choice([2, 4])
        while proc.poll() is None and (latest_checkpoint(str(run)) or 0) < k1:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.05))
        kill(_read_status(status)["pid"])
        # Kill 2: the restarted child, at a random point of its start-up (import, restore, compile).
        while proc.poll() is None and (_read_status(status) or {}).get("attempt") != 2:
            time.sleep(0.01)
        time.sleep(rng.uniform(0.5, 3.0))
        kill(_read_status(status)["pid"])

    out, err = _communicate_while(proc, killer, timeout=900)
    assert proc.returncode == 0, err
    report = json.loads(out)
    assert report["ok"] and report["last_checkpoint"] == STEPS
    sigs = [a["signal"] for a in report["attempts"]]
    assert sigs.count("SIGKILL") == len(kills) == 2 and sigs[-1] is None
    # The children report progress into the launcher's log (no terminal: plain lines), to the end.
    assert f"step {STEPS}/{STEPS} (100.0%)" in err, err[-2000:]
    a, b = read_metrics(tmp_path / "ref"), read_metrics(run)
    assert sorted(a) == sorted(b) == list(range(1, STEPS + 1))
    for step in a:
        for k in a[step]:
            if k not in VOLATILE:
                assert b[step][k] == a[step][k], (step, k)


# --------------------------------------------------------------------------- Slurm and TPU


def test_slurm_dry_run_prints_a_requeueing_sbatch_script(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-m", "olmax.cli", "launch", "slurm", "tiny", "--nodes", "4",
                        "--gpus-per-node", "8", "--partition", "h100", "--time", "48:00:00", "--run-dir",
                        "s3://bucket/runs/x", "--log-dir", str(tmp_path / "logs"), "--dry-run"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    s = r.stdout
    for line in ("#SBATCH --nodes=4", "#SBATCH --gpus-per-node=8", "#SBATCH --partition=h100",
                 "#SBATCH --time=48:00:00", "#SBATCH --requeue", "#SBATCH --signal=B:TERM@120",
                 "#SBATCH --ntasks-per-node=1"):
        assert line in s.splitlines(), line
    assert "srun --kill-on-bad-exit=1" in s and "train tiny --run-dir s3://bucket/runs/x" in s
    assert 'scontrol requeue "$SLURM_JOB_ID"' in s and "TOTAL_STEPS=500" in s
    assert not (tmp_path / "logs").exists()  # a dry run writes nothing


def test_slurm_script_requeues_on_a_crash_and_gives_up_without_progress(tmp_path):
    """Run the generated script with bash against stub srun/scontrol (a real Slurm is in the
    slow test): a crash without progress requeues with a doubled backoff; past --max-restarts it
    gives up; a finished run exits 0."""
    from olmax.launch.slurm import sbatch_script
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "srun").write_text("#!/bin/bash\nshift\nexec \"$@\"\n")  # drop --kill-on-bad-exit
    (bin_ / "scontrol").write_text(f"#!/bin/bash\necho \"$@\" >> {tmp_path}/scontrol.log\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    run = tmp_path / "run"
    train_cmd = ["bash", "-c", f"mkdir -p {run}/checkpoints/$STEP_TO_WRITE; exit $TRAIN_RC"]
    script = sbatch_script(train_cmd, run_dir=str(run), total_steps=4, nodes=1, gpus_per_node=0, job_name="t",
                           log_dir=str(tmp_path), max_restarts=1, backoff=5, python=sys.executable)
    (tmp_path / "job.sh").write_text(script)
    env = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "SLURM_JOB_ID": "77", "SLURM_JOB_NODELIST": "n1"}

    def job(step: int, rc: int) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(tmp_path / "job.sh")], env={**env, "STEP_TO_WRITE": str(step),
                              "TRAIN_RC": str(rc)}, capture_output=True, text=True, timeout=300)

    def log() -> list[str]:
        p = tmp_path / "scontrol.log"
        return p.read_text().splitlines() if p.exists() else []

    r = job(2, 137)  # progress to checkpoint 2, then a crash: requeue after the base backoff
    assert r.returncode == 0 and log() == ["requeue 77", "update JobId=77 StartTime=now+5"], r.stdout + r.stderr
    r = job(2, 137)  # no progress: requeue, the next backoff doubles
    assert (log()[-1] == "update JobId=77 StartTime=now+5"
            and "FAILS=1; DELAY=10" in (tmp_path / "olmax-launch-77.state").read_text())
    r = job(2, 137)  # a second failure in a row without progress: past --max-restarts 1
    assert r.returncode == 1 and "gave up" in r.stdout and len(log()) == 4
    r = job(4, 0)
    assert r.returncode == 0 and "done, checkpoint 4" in r.stdout and len(log()) == 4


def test_tpu_prints_the_host_command_and_a_jobset(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-m", "olmax.cli", "launch", "tpu", "olmo3_7b_stage1", "--run-dir",
                        "gs://bucket/runs/s1", "--tpu-name", "v5p-64", "--hosts", "8", "--topology", "4x4x4"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    s = r.stdout
    assert "OLMAX_DISTRIBUTED=auto python3 -m olmax.cli train olmo3_7b_stage1 --run-dir gs://bucket/runs/s1" in s
    assert "gcloud compute tpus tpu-vm ssh v5p-64" in s and "--worker=all" in s
    assert "kind: JobSet" in s and "parallelism: 8" in s and "cloud.google.com/gke-tpu-topology: 4x4x4" in s
    import yaml
    manifest = yaml.safe_load(s[s.index("# Generated by `olmax launch tpu`"):])
    job = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["completions"] == 8 and manifest["spec"]["failurePolicy"]["maxRestarts"] == 3
    assert job["template"]["spec"]["containers"][0]["command"][:4] == ["python3", "-m", "olmax.cli", "train"]
    # v5p 4x4x4 is a v5p-128, where the sweep chose the stage-1 step's remat and micro-batch: the
    # run takes them, said once with why; the user's --set lines come after them.
    host = next(ln for ln in s.splitlines() if ln.startswith("OLMAX_DISTRIBUTED="))
    assert host.endswith("--set model.remat=save_proj --set train.max_micro_batch_size=2"), host
    from olmax.recipes.slices import slice_choice
    why = slice_choice("olmo3_7b_stage1", "v5p-128").why  # names the measurement's result file
    assert "# olmo3_7b_stage1 on v5p-128 runs with --set model.remat=save_proj" in s
    assert "benchmarks/results/compile-sweep-" in why and why.split("(")[1].split(")")[0] in s


def test_a_slice_takes_its_measured_choice_before_the_users_settings():
    """``slices.CHOICES``: applied where a recipe meets the slice it was measured on (``olmax
    compile --topology``, ``olmax launch tpu``), before the user's --set lines, and nowhere else."""
    from olmax.compile import parse_topology
    from olmax.launch.tpu import slice_name
    from olmax.recipes import get_recipe
    assert parse_topology("v5p:4x4x4").slice_name == "v5p-128" == parse_topology("v5p-128").slice_name
    assert parse_topology("tpu7x-128").slice_name == "tpu7x-128" and parse_topology("v5p-128", 2).slice_name is None
    assert slice_name("tpu-v5p-slice", "4x4x4", 1) == "v5p-128" and slice_name("tpu-v6e-slice", "16x16", 1) == "v6e-256"
    assert slice_name("tpu-v5p-slice", "4x4x4", 2) is None and slice_name("some-gpu", "4x4x4", 1) is None
    assert get_recipe("olmo3_7b_stage1").model.remat == "full"                       # the recipe as written
    chosen = get_recipe("olmo3_7b_stage1", slice_name="v5p-128")
    assert chosen.model.remat == "save_proj" and chosen.train.max_micro_batch_size == 2
    assert get_recipe("olmo3_7b_stage1", slice_name="v5p-256").model.remat == "save_proj"
    assert get_recipe("olmo3_7b_stage1", slice_name="v5p-512").model.remat == "full"  # not measured there
    assert get_recipe("olmo3_7b_stage2", slice_name="v5p-128").model.remat == "save_proj"
    assert get_recipe("olmo3_7b_stage3", slice_name="v5p-128").model.remat == "full"  # a choice is the recipe's own
    mine = get_recipe("olmo3_7b_stage1", ["model.remat=minimal"], slice_name="v5p-128")
    assert mine.model.remat == "minimal" and mine.train.max_micro_batch_size == 2      # the user's line wins
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-m", "olmax.cli", "launch", "tpu", "olmo3_7b_stage1", "--run-dir", "gs://b/r",
                        "--hosts", "16", "--topology", "4x4x4", "--set", "model.remat=full"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    host = next(ln for ln in r.stdout.splitlines() if ln.startswith("OLMAX_DISTRIBUTED="))
    assert host.endswith("--set model.remat=save_proj --set train.max_micro_batch_size=2 --set model.remat=full")


def test_every_slice_choice_names_a_recipe_a_slice_and_its_measurement():
    """Each ``slices.CHOICES`` entry is a known recipe on a slice ``olmax compile`` can parse, its
    lines change the recipe (a stale line would fail to apply or change nothing) and its reason
    points at a result file that exists."""
    import re
    from pathlib import Path

    from olmax.compile import parse_topology
    from olmax.recipes import RECIPES, get_recipe
    from olmax.recipes.slices import CHOICES
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    for (recipe, name), choice in CHOICES.items():
        assert recipe in RECIPES and parse_topology(name).slice_name == name, (recipe, name)
        assert get_recipe(recipe, slice_name=name) != get_recipe(recipe), (recipe, name)
        files = re.findall(r"benchmarks/results/([\w.-]+\.md)", choice.why)
        assert files and all((results / f).is_file() for f in files), (recipe, name, choice.why)


def test_a_recipe_sharing_its_twins_programs_takes_its_twins_choice():
    """``slices.SAME_PROGRAMS``: the Instruct SFT and DPO recipes take the Think ones' measured
    choices, which holds only while the two differ in nothing that shapes a compiled program (the
    learning rate, the schedule's length, the number of steps); a new difference fails here."""
    import dataclasses

    from olmax.recipes import get_recipe
    from olmax.recipes.slices import CHOICES, SAME_PROGRAMS, slice_choice

    def fields(obj, prefix=""):
        if not dataclasses.is_dataclass(obj):
            return {prefix[:-1]: obj}
        return {k: v for f in dataclasses.fields(obj)
                for k, v in fields(getattr(obj, f.name), prefix + f.name + ".").items()}

    runtime_only = {"name", "optim.lr", "optim.schedule.warmup", "train.steps"}
    assert SAME_PROGRAMS
    for recipe, twin in SAME_PROGRAMS.items():
        mine, theirs = fields(get_recipe(recipe)), fields(get_recipe(twin))
        assert {k for k in mine if mine[k] != theirs[k]} <= runtime_only, (recipe, twin)
        slices = [name for (r, name) in CHOICES if r == twin]
        assert slices, twin
        for name in slices:
            choice = slice_choice(recipe, name)
            assert choice.overrides == CHOICES[twin, name].overrides and choice.why.startswith(f"as {twin}")
            assert get_recipe(recipe, slice_name=name).model == get_recipe(twin, slice_name=name).model
    assert slice_choice("olmo3_7b_instruct_rl", "v5p-256") is None


def test_tpu_num_slices_sets_the_runs_slice_axis(tmp_path):
    """`--num-slices N` puts mesh.slice=N into the command every host runs (the run checks it against
    its devices' slices, as `olmax compile --slices N` compiled it); a conflicting mesh.slice is refused."""
    from olmax.config import ConfigError
    from olmax.launch.tpu import slice_overrides
    assert slice_overrides(1, 1) == [] and slice_overrides(1, 4) == ["mesh.slice=4"]
    assert slice_overrides(4, 4) == [] and slice_overrides(-1, 4) == []
    for mesh_slice, n in ((3, 2), (2, 1)):
        with pytest.raises(ConfigError, match=f"mesh.slice={mesh_slice} conflicts with --num-slices {n}"):
            slice_overrides(mesh_slice, n)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}

    def tpu(*args):
        return subprocess.run([sys.executable, "-m", "olmax.cli", "launch", "tpu", "tiny", "--run-dir", "gs://b/r",
                               "--hosts", "2", *args], capture_output=True, text=True, env=env, timeout=300)

    r = tpu("--num-slices", "2")
    assert r.returncode == 0, r.stderr
    import yaml
    manifest = yaml.safe_load(r.stdout[r.stdout.index("# Generated by `olmax launch tpu`"):])
    job = manifest["spec"]["replicatedJobs"][0]
    assert job["replicas"] == 2
    assert job["template"]["spec"]["template"]["spec"]["containers"][0]["command"][-2:] == ["--set", "mesh.slice=2"]
    assert "--set mesh.slice=2" in next(ln for ln in r.stdout.splitlines() if ln.startswith("OLMAX_DISTRIBUTED="))
    r = tpu("--num-slices", "2", "--set", "mesh.slice=2")  # said twice, passed once
    assert r.returncode == 0 and r.stdout.count("mesh.slice=2") == 3  # host command, gcloud line, manifest
    r = tpu("--num-slices", "2", "--set", "mesh.slice=3")
    assert r.returncode == 2 and "mesh.slice=3 conflicts with --num-slices 2" in r.stderr and not r.stdout
