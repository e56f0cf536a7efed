"""A client process for the serve tests: run workloads against a server, torch.save what they return.

`python run_client.py '{"url": ..., "api_key": ..., "workloads": [...], "out": path}'`. A workload
that raises is recorded as {"error": (type name, message)} instead of failing the process.
"""

from __future__ import annotations

import json
import sys

import torch
from workloads import WORKLOADS

import nnrun


def main() -> int:
    spec = json.loads(sys.argv[1])
    model = nnrun.LanguageModel("tiny-facts", serve=spec["url"], api_key=spec["api_key"])
    results = {}
    for name in spec["workloads"]:
        try:
            results[name] = WORKLOADS[name](model)
        except Exception as error:  # recorded: the test decides whether it was expected
            results[name] = {"error": (type(error).__name__, str(error))}
    torch.save(results, spec["out"])
    model.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
