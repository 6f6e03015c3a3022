"""One rank of the distributed tests (tests/test_distributed.py starts it as RANK of
WORLD_SIZE): joins the gloo group once, then trains each job of the JSON file argv[1] in turn
through the Trainer, so one process group serves several runs.

A job: {"spec": path, "set": {dotted field: value}, "out": dir, "until": step or null,
"resume": dir or null}."""
from __future__ import annotations

import json
import sys

import torch

from titanc.runtime.train.distributed import init_from_env, shutdown
from titanc.runtime.train.trainer import Trainer
from titanc.model.spec import load_spec


def main(path: str) -> None:
    torch.set_num_threads(1)
    jobs = json.loads(open(path).read())
    dist = None
    for job in jobs:
        spec = load_spec(job["spec"], job["set"])
        dist = dist or init_from_env(spec)
        Trainer(spec, job["out"], until=job.get("until"), resume=job.get("resume"),
                progress=False, log=lambda _: None, dist=dist).run()
    shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
