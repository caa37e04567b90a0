"""Child processes of ``olmax verify olmo-core --ranks N``: one OLMo-core rank, or olmax on N devices.

``python -m olmax.verify._worker SPEC.json``; SPEC holds the run's recipe (steps, seed, overrides),
the token files, the folders and, for OLMo-core, this process's rank. The trace is written as JSON
next to SPEC (``<SPEC stem>.trace.json``). The parent (``noise_floor.run_olmo_core_ranks`` /
``run_olmax_devices``) launches and merges.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

from olmax.verify import olmo_core as oc


def main(spec_path: str) -> int:
    spec_file = Path(spec_path)
    spec = json.loads(spec_file.read_text())
    cfg = oc.parity_config(spec["steps"], spec["seed"], spec["overrides"])
    out = Path(spec["out"])
    if spec["side"] == "olmo_core":
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        rank, world = spec["rank"], spec["world"]
        # What torchrun sets on one node (OLMo-core's HSDP reads the node layout from them).
        os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                           "LOCAL_WORLD_SIZE": str(world)})
        dist.init_process_group("gloo", init_method=f"file://{spec['store']}", world_size=world, rank=rank)
        try:
            trace = oc.run_olmo_core(cfg, spec["paths"], Path(spec["work"]),  # shared, as on one node
                                     spec["hf_dir"], world_size=world)
        finally:
            dist.destroy_process_group()
    else:
        trace = oc.run_olmax(oc.olmax_config(cfg, out, spec["paths"], spec["hf_dir"], spec["olmax_overrides"]),
                             Path(spec["work"]))
    spec_file.with_suffix(".trace.json").write_text(json.dumps(dataclasses.asdict(trace)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
