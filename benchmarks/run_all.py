"""Run every benchmark in this folder, one after another (``make bench``)."""

import subprocess
import sys
from pathlib import Path

here = Path(__file__).resolve().parent
rc = 0
for script in ("bench_train.py", "bench_data.py", "bench_generate.py"):
    print(f"== {script}", flush=True)
    rc |= subprocess.run([sys.executable, str(here / script)]).returncode
sys.exit(rc)
