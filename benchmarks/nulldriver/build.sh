#!/usr/bin/env bash
# Builds the null CUDA driver (see nulldriver.c) into benchmarks/nulldriver/build/.
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p build
# the lookup table of cuGetProcAddress: every function defined with S(...)
grep -oE "^S\((cu[A-Za-z0-9_]+)" nulldriver.c | sed 's/S(//' | sort -u \
    | grep -v "^cuGetProcAddress\|^cuGetExportTable" \
    | awk 'BEGIN{print "static const struct { const char *name; void *fn; } TABLE[] = {"}
           {print "  {\"" $1 "\", (void *)" $1 "},"} END{print "};"}' > build/table.h
gcc -shared -fPIC -O2 -fvisibility=hidden nulldriver.c -o build/libcuda.so.1
ln -sf libcuda.so.1 build/libcuda.so
echo "built $(pwd)/build/libcuda.so.1"
