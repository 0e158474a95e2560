#!/usr/bin/env bash
# The kit's device calls, rehearsed here on CPU as the device runs them (tests/test_gpu_kit.py runs this):
# each call gets a fresh copy of what the device tool sends (tree_bytes.sh) plus that call's carried paths, and
# runs the same run.sh stage with the same PYTHONPATH scheme and the carried wheels installed by pip --no-index
# --no-deps --target (wheels.txt's pins, for this Python: the device's are cp312), under the image's view
# (view/sitecustomize.py: only image.txt's and wheels.txt's packages import). CPU, tiny shapes, short budgets
# (run.sh's knobs); the real pair's parts are prepare.sh's (run first unless $KIT_CARRY holds them). Each
# call's payload (tree, cp312 wheels, its part) must fit the device's 64 MiB.
#   bash bench/gpu/rehearse.sh [WORKDIR]     outputs in WORKDIR/out-{first,second,third,fourth,joins}
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRY=$(realpath -m "${KIT_CARRY:-.carry}")
WORK=$(realpath -m "${1:-$(mktemp -d)}")
mkdir -p "$WORK"
[ -d "$CARRY/p2" ] || KIT_CARRY=$CARRY bash bench/gpu/prepare.sh

tag=$(python3 -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
WHL=${KIT_WHEELS_HERE:-$HOME/.cache/specbatch/kit-wheels/$tag-$(sha256sum bench/gpu/wheels.txt | cut -c1-12)}
if [ ! -f "$WHL/.complete" ]; then  # the same pins for this Python, once
  rm -rf "$WHL" && mkdir -p "$WHL"
  python3 -m pip download -q --no-deps --only-binary=:all: -d "$WHL" $(sed 's/#.*//' bench/gpu/wheels.txt)
  touch "$WHL/.complete"
fi

# budgets are caps against a hang on a busy 2-core machine, not estimates (the rehearsal takes ~2-3 min)
export KIT_DEVICE=cpu KIT_TMP=$WORK/machine KIT_VIEW=$WORK/tree/bench/gpu/view KIT_VIEW_LOG=$WORK/refused.txt \
  KIT_BIG=${KIT_BIG:-tiny} KIT_SMALL=${KIT_SMALL:-tiny} KIT_BATCHES=${KIT_BATCHES:-1,8} KIT_MAX_NEW=${KIT_MAX_NEW:-4} \
  KIT_PROMPT_LEN=${KIT_PROMPT_LEN:-8} KIT_STEP_S=${KIT_STEP_S:-180} KIT_TEST_S=${KIT_TEST_S:-240} \
  KIT_SMALL_S=${KIT_SMALL_S:-180} KIT_POLICY_S=${KIT_POLICY_S:-300} KIT_EQUAL_S=${KIT_EQUAL_S:-300} \
  KIT_EQUAL_ARGS=${KIT_EQUAL_ARGS:-"--batches 2 --methods none,generator --prompts 2 --max-new 4 --budget 8"} \
  KIT_TEST_K=${KIT_TEST_K:-"lean_forward_matches or mismatched_pair or row_processing_equals or random123 or allocated_length or plain_rounds_queue or different_rounds"} \
  KIT_POLICY_ARGS=${KIT_POLICY_ARGS:-"--batches 1 --policies fixed --ks 2 --prompts 1 --max-new 4 --repeats 1"} \
  KIT_PROFILE_S=${KIT_PROFILE_S:-300} KIT_PROFILE_ARGS=${KIT_PROFILE_ARGS:-"--batch 1 --max-new 4 --top 5"} \
  KIT_GEMV_S=${KIT_GEMV_S:-300} KIT_GEMV_ARGS=${KIT_GEMV_ARGS:-"--shapes tiny --rows 1,3 --calls 2"} \
  KIT_SHAPE_S=${KIT_SHAPE_S:-300} KIT_SHAPE_ARGS=${KIT_SHAPE_ARGS:-"--shapes tiny --batches 1,2 --ks 2 --max-new 8 --prompt-len 8"} \
  KIT_JOINS_S=${KIT_JOINS_S:-120} KIT_JOINS_BATCH=${KIT_JOINS_BATCH:-2} KIT_LOOKUP_S=${KIT_LOOKUP_S:-300} \
  KIT_LOOKUP_ARGS=${KIT_LOOKUP_ARGS:-"--batches 2 --n 2 --max-new 6 --repeats 1 --settings trees:k=2:s=1 --dtype float32"} \
  KIT_PREFIX_S=${KIT_PREFIX_S:-300} KIT_PREFIX_ARGS=${KIT_PREFIX_ARGS:-"--methods none --batches 2 --rows 2 --max-new 4 --repeats 1"}
rm -rf "$KIT_TMP"
rc=0
for i in 0 1 2 3 4; do
  stage=$(echo first second third fourth joins | cut -d' ' -f$((i + 1)))
  tree=$WORK/tree
  rm -rf "$tree" "$WORK/out-$stage" && mkdir -p "$tree/.carry" "$WORK/out-$stage"
  part=$(ls -d "$CARRY/p$i" 2>/dev/null || true)  # the fourth and joins calls carry no model part
  payload=$(( $(bash bench/gpu/tree_bytes.sh "$tree") + $(du -cb "$CARRY/whl" $part | tail -1 | cut -f1) ))
  echo "# call $stage: carries $payload bytes (the device takes 67108864)"
  [ "$payload" -le $(( 64 * 1024 * 1024 )) ] || { echo "# call $stage: over 64 MiB"; rc=1; }
  cp -r "$WHL" "$tree/.carry/whl" && { [ -z "$part" ] || cp -r "$part" "$tree/.carry/"; }
  t0=$SECONDS
  OUT=$WORK/out-$stage bash "$tree/bench/gpu/run.sh" "$stage" || rc=$?
  echo "# call $stage: done after $((SECONDS - t0)) s"
done
exit $rc
