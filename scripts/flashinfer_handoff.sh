#!/usr/bin/env bash
# FlashInfer's fused-MoE build (fused_moe_90, scripts/flashinfer_aot_build.sh) begun on a machine
# without a GPU and finished on the GPU machine, for a build too long for either alone: 2 cores
# here take most of a day, and a GPU machine is held 30 minutes. `pack` takes the objects ninja
# has finished here (those in its log; one it is still writing is left out), the generated
# sources, and the commands of the rest and of the link, as ninja would run them; `finish`, on
# the GPU machine, runs those commands on all its cores, links, and keeps the module
# (scripts/flashinfer_module.sh) and puts it where FlashInfer loads it, as AOT= does. The
# commands name this machine's paths (FlashInfer's site, CUDA_HOME, tvm-ffi, the workspace);
# finish makes each exist there as a link to its counterpart, so they run unchanged.
#   WS=DIR bash scripts/flashinfer_handoff.sh pack OUTDIR       (WS as flashinfer_aot_build.sh's)
#   [JOBS=N] bash scripts/flashinfer_handoff.sh finish OUTDIR SITE KEEPDIR  (SITE: FlashInfer's site there)
set -u
# A package's folder, found without importing it (FlashInfer's import is slow and wants a GPU).
package_dir() {
  python3 -c "import importlib.util as u; print(u.find_spec('$1').submodule_search_locations[0])"
}
case ${1:-} in
  pack)
    out=$2
    ws=${WS:-/tmp/flashinfer-aot}
    dir=$(find "$ws"/.cache/flashinfer -type d -path '*cached_ops/fused_moe_90' | head -1)
    [ -n "$dir" ] || { echo "no fused_moe_90 build in $ws"; exit 1; }
    so=$dir/fused_moe_90.so
    mkdir -p "$out"
    # Finished objects: those ninja logged (it logs an edge once its command has succeeded).
    awk 'NR > 1 { print $4 }' "$dir/.ninja_log" | sort -u | while read -r o; do
      [ -e "$o" ] && echo "$o"; done > "$out/done.txt"
    ninja -C "$dir" -t commands "$so" > "$out/all.sh" || exit 1
    # The rest, longest first (by their kind's mean time in ninja's log here; a kind not built
    # yet first of all), so that the last of the compiles running side by side there is short.
    grep -vF -f <(sed 's/^/-o /' "$out/done.txt") "$out/all.sh" | grep -v -- "-o $so\$" |
      awk 'function kind(p) { sub(/.*\//, "", p); gsub(/_group[0-9]+/, "", p); return p }
        NR == FNR { if (FNR > 1) { k = kind($4); t[k] += $2 - $1; n[k]++ }; next }
        { match($0, /-o [^ ]+/); k = kind(substr($0, RSTART + 3, RLENGTH - 3))
          printf "%d\t%s\n", (k in n) ? t[k] / n[k] : 1e9, $0 }' "$dir/.ninja_log" - |
      sort -s -t "$(printf '\t')" -k1,1nr | cut -f2- > "$out/rest.sh"
    tail -1 "$out/all.sh" > "$out/link.sh"
    grep -q -- "-o $so\$" "$out/link.sh" || { echo "ninja's last command is not the link"; exit 1; }
    site=$(dirname "$(package_dir flashinfer)")
    tvm=$(package_dir tvm_ffi)
    printf 'site=%s\ncuda=%s\ntvm=%s\nws=%s\ndir=%s\n' "$site" "$CUDA_HOME" "$tvm" "$ws" "$dir" > "$out/paths"
    gen=$(dirname "$(dirname "$dir")")/generated
    tar -cf - -T "$out/done.txt" "$gen" 2> /dev/null | xz -T0 -6 > "$out/objects.tar.xz"
    rm "$out/all.sh"
    echo "handoff: $(wc -l < "$out/done.txt") objects built, $(wc -l < "$out/rest.sh") to build," \
      "$(du -h "$out/objects.tar.xz" | cut -f1) as xz" ;;
  finish)
    in=$2 there=$3 keep=$4
    # shellcheck disable=SC1091
    . "$in/paths"
    cuda_there=${CUDA_HOME:-$(python3 -c "from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME)")}
    for pair in "$site:$there" "$cuda:$cuda_there" "$tvm:$(package_dir tvm_ffi)"; do
      from=${pair%%:*} to=${pair#*:}
      [ "$from" = "$to" ] || [ -e "$from" ] || { mkdir -p "$(dirname "$from")" && ln -s "$to" "$from"; }
    done
    xz -dc "$in/objects.tar.xz" | tar -xf - -C / || exit 1
    mkdir -p "$dir/rest"
    split -l 1 -d -a 3 "$in/rest.sh" "$dir/rest/unit."
    cp "$in/link.sh" "$dir/rest/link.sh"  # the handoff folder may be gone by the time it links
    start=$(date +%s)
    echo "finishing: $(wc -l < "$in/rest.sh") units, ${JOBS:-$(nproc)} at a time" >&2
    find "$dir/rest" -name 'unit.*' | sort | xargs -r -P "${JOBS:-$(nproc)}" -n 1 nice -n 5 bash -e || exit 1
    bash -e "$dir/rest/link.sh" || exit 1
    echo "compiled and linked in $(( $(date +%s) - start )) s" >&2
    FLASHINFER_WORKSPACE_BASE=$ws bash "$(dirname "$0")/flashinfer_module.sh" keep "$keep" >&2 &&
      bash "$(dirname "$0")/flashinfer_module.sh" restore "$keep" "$there" >&2 ;;
  *) echo "usage: flashinfer_handoff.sh pack OUTDIR | finish OUTDIR SITE KEEPDIR"; exit 2 ;;
esac
