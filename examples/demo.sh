#!/usr/bin/env bash
# `make demo`: merge the bundled tiny checkpoints with every method, then train DiLoCo and
# IsoLoCo (R = 8 simulated workers) on the embedded corpus (the Python standard library's own
# sources) and print both validation losses. About 3 minutes on 2 idle CPU cores.
# Usage: bash examples/demo.sh [OUT_DIR]   (default: demo-out)
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
out="${1:-demo-out}"
tokens="${MLOCO_DEMO_TOKENS:-400000}"
val_tokens=16384

cat <<INTRO
mergekit_loco demo: usually about 3 minutes on 2 idle CPU cores (5 on a busy machine).
  1. merge examples/tiny (a tiny Llama and three fine-tunes) with all 8 merge methods  ~20 s
  2. train DiLoCo, then IsoLoCo (Iso-C as the aggregator): the nano Llama (1.8M parameters),
     8 simulated workers x 10 inner steps per round, $tokens tokens each   ~1 min each;
     the first run trains a tokenizer on the corpus and tokenizes it (about 2 s on
     one core), the second reuses both
  3. print both validation losses and the folders the trained models are in
Everything goes to $out/. Progress is shown as it runs.

INTRO

echo "== 1. merging"
bash examples/merge_demo.sh "$out/merges"

for preset in diloco isoloco; do
    echo
    echo "== 2. training $preset"
    mloco train --preset "$preset" --model nano --workers 8 --inner-steps 10 \
        --global-batch 32 --seq-len 128 --tokens "$tokens" --val-tokens "$val_tokens" --out "$out/$preset" --force
done

echo
echo "== 3. results"
python - "$out" "$val_tokens" <<'PY'
import json
import sys
from pathlib import Path

for preset in ("diloco", "isoloco"):
    run = Path(sys.argv[1]) / preset
    final = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    print(f"{preset:8s} final validation loss {final['val_loss']:.4f}   model: {run / 'final'}")
print("load one: transformers.AutoModelForCausalLM.from_pretrained(FOLDER), or score it with")
# the run's own held-out tokens: more would score tokens it trained on
print(f"          mloco eval {Path(sys.argv[1]) / 'isoloco' / 'final'} --data stdlib "
      f"--tokens {sys.argv[2]}")
PY
