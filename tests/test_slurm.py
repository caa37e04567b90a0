"""A real single-node Slurm (Debian's slurm-wlm and munge, daemons started here on 127.0.0.1)
accepts the script of `olmax launch slurm` and runs a 2-process CPU job to completion, through
one requeue after a training process is killed.

Slow (two 2-process trainings) and needs root plus `apt-get install slurm-wlm munge`; run it with
`make test-slurm` (skipped where Slurm is not installed).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from olmax.launch import latest_checkpoint
from olmax.recipes import get_recipe
from olmax.train.loop import train
from olmax.verify.resume import read_metrics
from trainlib import small_overrides

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    not all(shutil.which(b) for b in ("slurmctld", "slurmd", "munged", "sbatch")) or os.geteuid() != 0,
    reason="needs root and Debian's slurm-wlm + munge (apt-get install slurm-wlm munge)")]

STEPS = 6


def _port() -> int:
    import portpicker
    return portpicker.pick_unused_port()


@pytest.fixture
def slurm(tmp_path):
    """munged, slurmctld and slurmd on this host, private to the test; stopped by their pids."""
    d = tmp_path / "slurm"
    (d / "state").mkdir(parents=True)
    (d / "spool").mkdir()
    host = socket.gethostname()
    conf = d / "slurm.conf"
    conf.write_text(f"""ClusterName=olmaxtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={_port()}
SlurmdPort={_port()}
AuthType=auth/munge
AuthInfo=socket={d}/munge.sock
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/ctld.pid
SlurmdPidFile={d}/d.pid
SlurmctldLogFile={d}/ctld.log
SlurmdLogFile={d}/d.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobRequeue=1
SlurmUser=root
SlurmdUser=root
NodeName={host} NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
    key = d / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    subprocess.run(["munged", "--force", f"--socket={d}/munge.sock", f"--key-file={key}", f"--pid-file={d}/munged.pid",
                    f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"], check=True, env=env)
    subprocess.run(["slurmctld", "-f", str(conf), "-i"], check=True, env=env)
    subprocess.run(["slurmd", "-f", str(conf)], check=True, env=env)
    try:
        for _ in range(100):
            r = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, env=env)
            if r.stdout.strip() == "idle":
                break
            time.sleep(0.2)
        else:
            pytest.fail(f"slurm did not come up: {r.stdout} {r.stderr}")
        yield env
    finally:
        subprocess.run(["scancel", "--user", str(os.geteuid()), "--full"], env=env, capture_output=True)
        for _ in range(50):  # let slurmd end the job's processes before it stops itself
            r = subprocess.run(["squeue", "-h"], capture_output=True, text=True, env=env)
            if not r.stdout.strip():
                break
            time.sleep(0.2)
        for name in ("d.pid", "ctld.pid", "munged.pid"):
            try:
                os.kill(int((d / name).read_text()), signal.SIGTERM)
            except (OSError, ValueError):
                pass
        time.sleep(1)


def _argv0(pid: str) -> str | None:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except OSError:
        return None


def _job_state(env, job: str) -> str:
    r = subprocess.run(["scontrol", "show", "job", job, "-o"], capture_output=True, text=True, env=env)
    return next((w.split("=", 1)[1] for w in r.stdout.split() if w.startswith("JobState=")), "?")


def test_slurm_runs_the_generated_script_through_a_requeue(slurm, tmp_path, corpus):
    run, logs = tmp_path / "run", tmp_path / "logs"
    # OLMo 3's lr, as in test_multiprocess: the tiny recipe's 3e-3 amplifies reduction-order bits.
    ov = small_overrides(corpus, f"train.steps={STEPS}", "optim.lr=3e-4")
    sets = [a for o in ov for a in ("--set", o)]
    env = {**slurm, "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, "-m", "olmax.cli", "launch", "slurm", "tiny", "--nodes", "1",
                        "--tasks-per-node", "2", "--gpus-per-node", "0", "--backoff", "1", "--run-dir", str(run),
                        "--log-dir", str(logs), *sets], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    job = json.loads(r.stdout)["job_id"]
    # Kill one of the two training processes after the first checkpoint: srun takes the other
    # down, the script sees progress and requeues the job, which resumes and finishes.
    deadline = time.time() + 900
    while (latest_checkpoint(str(run)) or 0) < 2:
        assert time.time() < deadline and _job_state(env, job) in ("PENDING", "RUNNING", "CONFIGURING"), \
            (logs / f"slurm-{job}.out").read_text() if (logs / f"slurm-{job}.out").exists() else "no log"
        time.sleep(0.2)
    found = subprocess.run(["pgrep", "-f", f"olmax.cli train tiny --run-dir {run} "], capture_output=True,
                           text=True).stdout.split()
    pids = [p for p in found if _argv0(p) == sys.executable]  # the trainers, not srun
    assert len(pids) == 2, found
    os.kill(int(pids[0]), signal.SIGKILL)
    while _job_state(env, job) != "COMPLETED":
        state = _job_state(env, job)
        assert time.time() < deadline and state not in ("FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), state
        time.sleep(0.5)
    out = (logs / f"slurm-{job}.out").read_text()
    assert "requeueing job" in out and "(restart 1)" in out and f"done, checkpoint {STEPS}" in out, out
    # Two processes over a resume equal one uninterrupted process (README: within 1e-5 across device counts).
    ref = train(get_recipe("tiny", ov), tmp_path / "ref", progress=False)
    got = read_metrics(run)
    assert sorted(got) == list(range(1, STEPS + 1))
    for s in range(1, STEPS + 1):
        assert got[s]["train/CE loss"] == pytest.approx(ref.losses[s], abs=1e-5)
    info = json.loads((run / "run_info.json").read_text())
    assert info["processes"] == 2
