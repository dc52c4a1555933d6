"""The file names of a training run folder, in one place (writers and readers both import them).

```
OUT/
  config.json          the resolved run configuration
  metrics.jsonl        one JSON event per line: round, eval, final
  checkpoints/         round-XXXXXX/ folders and the `latest` pointer
  final/               the trained model as a Hugging Face folder (after the last round)
```
A sweep (``mloco compare -o DIR``) holds one such folder per cell under ``DIR/runs/``.
"""

from __future__ import annotations

CONFIG = "config.json"
METRICS = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
LATEST = "latest"
FINAL = "final"
SWEEP_RUNS = "runs"
