#!/usr/bin/env bash
# Builds llama.cpp's own `llama-bench`, the binary behind `specvox bench spec`'s llama.cpp row, from
# the llama.cpp that the pinned llama-cpp-python sdist vendors (the `llamacpp` extra's version in
# pyproject.toml), for this CPU's instructions (GGML_NATIVE). About 10 minutes on 2 cores.
#
#   bash bench/build_llama_bench.sh [DIR]      # or: make llama-bench
#
# DIR defaults to build/llama.cpp (ignored by git). The binary lands in
# DIR/llama_cpp_python-VERSION/vendor/llama.cpp/build/bin/llama-bench, where bench/spec.py looks
# for it; SPECVOX_LLAMA_BENCH=/path/to/llama-bench names another one.
set -euo pipefail

VERSION=0.3.36  # = pyproject.toml's llamacpp extra
DIR=${1:-build/llama.cpp}
PYTHON=${PYTHON:-.venv/bin/python}
JOBS=${JOBS:-$(nproc)}

mkdir -p "$DIR"
SDIST="$DIR/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
    "$PYTHON" -m pip download --quiet --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d "$DIR"
fi
SRC="$DIR/llama_cpp_python-$VERSION"
[ -d "$SRC" ] || tar xzf "$SDIST" -C "$DIR"
cd "$SRC/vendor/llama.cpp"
cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"$JOBS" --target llama-bench
echo "built $(pwd)/build/bin/llama-bench"
