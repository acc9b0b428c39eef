#!/usr/bin/env bash
# FlashInfer's fused-MoE build (fused_moe_90, scripts/flashinfer_aot_build.sh) shared between
# machines, for a build too long for any one: 2 cores here take most of a day, and a GPU machine
# is held 30 minutes. `pack` takes the objects finished here (those in ninja's log, or marked
# done by `compile`; one still being written is neither), the generated sources, and the
# commands of the rest and of the link as ninja would run them. `compile` runs the rest's
# commands not done yet, JOBS at a time, marking each object done (`<object>.ok`) once its
# command has succeeded: on the GPU machine in the background while other GPU work runs,
# longest first, and here too (ORDER=reverse: shortest first, so the two meet in the middle).
# `collect` keeps the objects compiled there as xz chunks (for $OUT) and `merge` puts them back
# here. `finish` compiles what is left, links, and keeps the module (scripts/flashinfer_module.sh)
# and puts it where FlashInfer loads it, as AOT= does. The commands name this machine's paths
# (FlashInfer's site, CUDA_HOME, tvm-ffi, the workspace); elsewhere `compile` makes each exist
# as a link to its counterpart, so they run unchanged.
#   WS=DIR bash scripts/flashinfer_handoff.sh pack HANDOFF      (WS as flashinfer_aot_build.sh's)
#   [JOBS=N] [ORDER=reverse] bash scripts/flashinfer_handoff.sh compile HANDOFF SITE
#   bash scripts/flashinfer_handoff.sh collect HANDOFF OUTDIR | merge DIR
#   [JOBS=N] bash scripts/flashinfer_handoff.sh finish HANDOFF SITE KEEPDIR
# (SITE: the folder FlashInfer is installed in on the machine running the command.)
set -u
# A package's folder, found without importing it (FlashInfer's import is slow and wants a GPU).
package_dir() {
  python3 -c "import importlib.util as u; print(u.find_spec('$1').submodule_search_locations[0])"
}
# This machine made to run the handoff's commands: its paths linked to their counterparts here,
# the finished objects and generated sources in place (once).
set_up() {
  # shellcheck disable=SC1091
  . "$1/paths"
  local cuda_here pair from to
  cuda_here=${CUDA_HOME:-$(python3 -c "from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME)")}
  for pair in "$site:$2" "$cuda:$cuda_here" "$tvm:$(package_dir tvm_ffi)"; do
    from=${pair%%:*} to=${pair#*:}
    [ "$from" = "$to" ] || [ -e "$from" ] || { mkdir -p "$(dirname "$from")" && ln -s "$to" "$from"; }
  done
  [ -d "$dir/rest" ] || xz -dc "$1/objects.tar.xz" | tar -xf - -C /
}
case ${1:-} in
  pack)
    out=$2
    ws=${WS:-/tmp/flashinfer-aot}
    dir=$(find "$ws"/.cache/flashinfer -type d -path '*cached_ops/fused_moe_90' | head -1)
    [ -n "$dir" ] || { echo "no fused_moe_90 build in $ws"; exit 1; }
    so=$dir/fused_moe_90.so
    mkdir -p "$out"
    # Finished objects: those ninja logged (it logs an edge once its command has succeeded) and
    # those `compile` marked.
    { awk 'NR > 1 { print $4 }' "$dir/.ninja_log" 2> /dev/null
      find "$dir" -name '*.o.ok' | sed 's/\.ok$//'; } | sort -u | while read -r o; do
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
  compile)
    in=$2 there=$3
    set_up "$in" "$there" || exit 1
    units=$dir/rest
    times=$dir/times.$(hostname).txt  # each unit's start, end and object, as it ends
    if [ ! -d "$units" ]; then
      mkdir -p "$units.part"
      i=0
      while read -r line; do
        o=$(grep -oE -- '-o [^ ]+' <<< "$line" | tail -1 | cut -c4-)
        printf '[ -e %s.ok ] && exit 0\nstart=$(date +%%s.%%N)\n%s\necho "$start $(date +%%s.%%N) %s" >> %s\ntouch %s.ok\n' \
          "$o" "$line" "$o" "$times" "$o" > "$units.part/$(printf %03d $i)"
        i=$((i + 1))
      done < "$in/rest.sh"
      cp "$in/link.sh" "$units.part/link.sh"  # the handoff folder may be gone by the time it links
      mv "$units.part" "$units"
    fi
    start=$(date +%s)
    echo "compiling: $(ls "$units" | grep -vc link) units less those done, ${JOBS:-$(nproc)} at a time" >&2
    find "$units" -name '[0-9]*' | sort ${ORDER:+-r} |
      xargs -r -P "${JOBS:-$(nproc)}" -n 1 nice -n "${NICE:-5}" bash -e || exit 1
    echo "compiled in $(( $(date +%s) - start )) s" >&2 ;;
  collect)
    # shellcheck disable=SC1091
    . "$2/paths"
    mkdir -p "$3"
    find "$dir" -name '*.o.ok' | sed 's/\.ok$//' | while read -r o; do echo "$o" "$o.ok"; done |
      tr ' ' '\n' | cat - <(ls "$dir"/times.*.txt 2> /dev/null) | tar -cf - -T - 2> /dev/null |
      xz -T0 -6 | split -b 15M -d - "$3/built.tar.xz."
    echo "collected $(find "$dir" -name '*.o.ok' | wc -l) objects: $(du -ch "$3"/built.tar.xz.* | tail -1 | cut -f1)" ;;
  merge)
    cat "$2"/built.tar.xz.* | xz -dc | tar -xf - -C / && echo "merged $(ls "$2"/built.tar.xz.* | wc -l) chunks" ;;
  finish)
    in=$2 there=$3 keep=$4
    bash "$0" compile "$in" "$there" || exit 1
    # shellcheck disable=SC1091
    . "$in/paths"
    bash -e "$dir/rest/link.sh" || exit 1
    FLASHINFER_WORKSPACE_BASE=$ws bash "$(dirname "$0")/flashinfer_module.sh" keep "$keep" >&2 &&
      bash "$(dirname "$0")/flashinfer_module.sh" restore "$keep" "$there" >&2 ;;
  *) echo "usage: flashinfer_handoff.sh pack|compile|collect|merge|finish ..."; exit 2 ;;
esac
