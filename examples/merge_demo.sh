#!/usr/bin/env bash
# Merge the bundled tiny Llama fine-tunes with every method, then load one result with
# transformers (model and tokenizer). Run from anywhere:
#     bash examples/merge_demo.sh [OUT_DIR]   (default: demo-out)
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"  # mloco and python of `make install`, as demo.sh does
out="${1:-demo-out}"
tiny=examples/tiny
models="$tiny/ft1 $tiny/ft2 $tiny/ft3"
mkdir -p "$out"

mloco methods
for method in mean ta ties dare breadcrumbs tsv iso-c iso-cts; do
    mloco merge $models --base "$tiny/base" --method "$method" -o "$out/$method" --force --quiet
    echo "merged with $method -> $out/$method"
done
mloco merge $models --base "$tiny/base" --method iso-c --spectral ns --scale 0.8 \
    --dtype bfloat16 -o "$out/iso-c-ns-bf16.safetensors" --force

echo "a bad input is one line and exit code 2:"
if mloco merge $models --method ties -o "$out/never-written"; then exit 1; fi
test ! -e "$out/never-written"

python - "$out/ties" <<'PY'
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging

logging.disable_progress_bar()
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
logits = model(tokenizer("def merge(models):", return_tensors="pt").input_ids).logits
print(f"loaded {sys.argv[1]}: logits {tuple(logits.shape)}, finite: {bool(logits.isfinite().all())}")
PY
