#!/usr/bin/env bash
# Bundle this machine's `ip` and `tc` (iproute2) with their libraries into .netbin/, for a
# machine that has root and `unshare` but no iproute2 and no package mirror (the lent GPU
# machines): carry .netbin there and put it first on PATH before bench/network.py.
#
#   bash bench/netbin.sh            # here; then, there: PATH=$PWD/.netbin:$PATH python bench/network.py ...
#
# The libraries come from this machine (Debian 12, glibc 2.36): the other machine's glibc must
# be as new. Each tool runs through a wrapper that sets LD_LIBRARY_PATH for itself only.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=.netbin
rm -rf "$out"; mkdir -p "$out/bin" "$out/lib"
for tool in ip tc; do
    path=$(command -v "$tool" || true)
    [[ -n $path ]] || { echo "netbin.sh: no $tool here (apt-get install iproute2)" >&2; exit 2; }
    cp "$path" "$out/bin/"
    # every library it needs but glibc's own
    ldd "$path" | awk '/=> \// {print $3}' | grep -v -E '/lib(c|m|pthread|dl|rt)\.so' \
        | xargs -r -I{} cp -L {} "$out/lib/"
    printf '#!/bin/sh\nd=$(dirname "$(readlink -f "$0")")\nLD_LIBRARY_PATH="$d/lib" exec "$d/bin/%s" "$@"\n' "$tool" > "$out/$tool"
    chmod +x "$out/$tool"
done
"$out/tc" -V
echo "netbin.sh: $(du -sh "$out" | cut -f1) in $out"
