#!/usr/bin/env bash
# FlashInfer's built fused-MoE module (fused_moe_90 on Hopper: a build of tens of minutes) carried
# to another machine as what FlashInfer calls an AOT artifact: a module under its package's
# data/aot/<name>/, which it loads instead of building (flashinfer/jit/env.py get_aot_artifacts).
#   keep DIR          the module built under ${FLASHINFER_WORKSPACE_BASE:-$HOME}/.cache/flashinfer,
#                     as xz chunks of at most 15 MiB (what one $OUT file of the GPU machine holds)
#                     and SHA256SUMS, into DIR
#   restore DIR SITE  those chunks as SITE/flashinfer/data/aot/<name>/<name>.so, after its checksum
set -u
case ${1:-} in
  keep)
    dir=$2
    [ -e "$dir/SHA256SUMS" ] && exit 0
    so=$(find "${FLASHINFER_WORKSPACE_BASE:-$HOME}"/.cache/flashinfer \
      -path '*cached_ops/fused_moe_9*/fused_moe_9*.so' | head -1)
    [ -n "$so" ] || { echo "no fused-MoE module built"; exit 1; }
    mkdir -p "$dir"
    xz -T0 -6 -c "$so" | split -b 15M -d - "$dir/$(basename "$so").xz."
    (cd "$dir" && sha256sum "$so" ./*.xz.* > SHA256SUMS)
    echo "the module kept: $(du -h "$so" | cut -f1), $(du -ch "$dir"/*.xz.* | tail -1 | cut -f1) as xz" ;;
  restore)
    dir=$2 site=$3
    [ -e "$dir/SHA256SUMS" ] || { echo "no kept module in $dir"; exit 1; }
    name=$(basename "$(ls "$dir"/*.so.xz.* | head -1)" | sed 's/\.so\.xz\..*//')
    dest="$site/flashinfer/data/aot/$name/$name.so"
    [ -e "$dest" ] && exit 0
    mkdir -p "$(dirname "$dest")"
    cat "$dir/$name".so.xz.* | xz -d > "$dest"
    if ! echo "$(head -1 "$dir/SHA256SUMS" | cut -d' ' -f1)  $dest" | sha256sum -c --quiet; then
      rm -f "$dest"; echo "the kept module's checksum differs"; exit 1
    fi
    echo "FlashInfer's $name from $dir: in place, FlashInfer loads it instead of building" ;;
  *) echo "usage: flashinfer_module.sh keep DIR | restore DIR SITE"; exit 2 ;;
esac
