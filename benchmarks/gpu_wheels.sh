#!/usr/bin/env bash
# The packages the GPU check needs that the lent GPU machines' image lacks, as wheels in .whl/ (ignored
# by git), for its Python (3.12, x86-64). The image has torch, peft, transformers, safetensors,
# tokenizers, huggingface-hub, jinja2 and numpy; it lacks these, or has other versions:
#   lightning-fabric, litdata (and what it imports: boto3, botocore, s3transfer, jmespath, obstore),
#   torchao, jsonargparse (docstring-parser, typeshed-client);
#   and for the check against LitGPT (gpu_check.py's moe_step_litgpt): litgpt 0.5.13, lightning,
#   torchmetrics, lightning-utilities.
# Versions from constraints.txt where it names them, else this machine's venv.
#
#   bash benchmarks/gpu_wheels.sh                      # here, once (about 27 MiB)
#   # there, carrying .whl:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/*.whl
#   timeout 540 python3 benchmarks/gpu_check.py --out $OUT/gpu_check.json
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
pinned() { grep -E "^$1==" constraints.txt | cut -d' ' -f1; }
installed() { echo "$1==$(.venv/bin/python -m pip show "$1" | awk '/^Version/{print $2}')"; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  "$(pinned lightning-fabric)" "$(pinned litdata)" "$(pinned torchao)" "$(pinned jsonargparse)" \
  "$(pinned docstring-parser)" "$(pinned typeshed-client)" \
  "$(installed boto3)" "$(installed botocore)" "$(installed s3transfer)" "$(installed jmespath)" "$(installed obstore)" \
  "litgpt==0.5.13" "lightning==$(pinned lightning-fabric | cut -d= -f3)" "torchmetrics==1.9.0" "$(installed lightning-utilities)"
du -sh .whl
