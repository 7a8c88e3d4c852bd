#!/usr/bin/env bash
# Splits a model file into parts that fit the 64 MiB a GPU-machine run may carry (../shared/gpu/README.md),
# under the git-ignored .dev/<name>-<k>/part, with its sha256 beside the first part. Example, Gemma 3 270M
# (253 MB: five runs within 30 s of each other, each carrying one part and appending it there):
#
#   bash bench/gpu_stage_model.sh models/gemma-3-270m-q4_k_m.gguf g3
#   run 1 (carry .dev/g3-1): cat .dev/g3-1/part > /tmp/g3.gguf
#   run k (carry .dev/g3-k): cat .dev/g3-k/part >> /tmp/g3.gguf
#   last: sha256sum -c over .dev/g3-1/sha256, then mkdir -p models && cp /tmp/g3.gguf models/<file>
set -euo pipefail
model=${1:?model file}; name=${2:?short name}
part_mib=${PART_MIB:-60}; part_bytes=$((part_mib * 1024 * 1024))
cd "$(git rev-parse --show-toplevel)"
[ -f "$model" ] || { echo "gpu_stage_model.sh: no file $model" >&2; exit 2; }
mkdir -p .git/info; grep -qx '/.dev/' .git/info/exclude 2>/dev/null || echo '/.dev/' >> .git/info/exclude
rm -rf .dev/"$name"-*
size=$(stat -c %s "$model"); k=0
while [ $((k * part_bytes)) -lt "$size" ]; do
  k=$((k + 1)); mkdir -p .dev/"$name-$k"
  dd if="$model" of=.dev/"$name-$k"/part bs=1048576 skip=$(((k - 1) * part_mib)) count="$part_mib" status=none
done
echo "$(sha256sum "$model" | cut -d' ' -f1)  /tmp/$name.gguf" > .dev/"$name"-1/sha256
echo "staged $model in $k parts: .dev/$name-1 .. .dev/$name-$k"
