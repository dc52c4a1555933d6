#!/usr/bin/env bash
# `make demo`: merge the bundled tiny checkpoints with every method, then train IsoLoCo against
# DiLoCo with R = 8 simulated workers on the embedded corpus (the Python standard library's own
# sources) and print both validation losses. A few minutes on a laptop CPU.
# Usage: bash examples/demo.sh [OUT_DIR]   (default: demo-out)
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
out="${1:-demo-out}"
tokens="${MLOCO_DEMO_TOKENS:-1000000}"

bash examples/merge_demo.sh "$out/merges"

for preset in diloco isoloco; do
    echo "training $preset: nano model, 8 workers, 30 inner steps, $tokens tokens"
    mloco train --preset "$preset" --model nano --workers 8 --inner-steps 30 \
        --global-batch 32 --seq-len 128 --tokens "$tokens" --out "$out/$preset" --force --quiet
done

python - "$out" <<'PY'
import json
import sys
from pathlib import Path

for preset in ("diloco", "isoloco"):
    lines = (Path(sys.argv[1]) / preset / "metrics.jsonl").read_text().splitlines()
    final = json.loads(lines[-1])
    print(f"{preset:8s} final validation loss: {final['val_loss']:.4f}")
PY
