#!/usr/bin/env bash
# Build (or find the cached) llama-server from the llama.cpp tree vendored in the
# llama-cpp-python sdist. CPU only, server target only. The binary and the
# vocab/template files the tests need are cached by version, so only the first
# run pays the ~7 minute compile.
#
# Prints the cache directory on stdout. Override with:
#   LLAMA_CPP_PYTHON_VERSION (default 0.3.36)
#   FUSION_GRAPH_CACHE       (default ~/.cache/fusion-graph)
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
CACHE_ROOT="${FUSION_GRAPH_CACHE:-$HOME/.cache/fusion-graph}"
DEST="$CACHE_ROOT/llama-server-$VERSION"
PY="${PYTHON:-python3}"

if [[ -x "$DEST/bin/llama-server" && -d "$DEST/models" ]]; then
  echo "$DEST"
  exit 0
fi

mkdir -p "$CACHE_ROOT"
WORK="$(mktemp -d "$CACHE_ROOT/build.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT

echo "fetching llama-cpp-python==$VERSION sdist" >&2
"$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$WORK" >&2
tar -xzf "$WORK"/llama_cpp_python-"$VERSION".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp"

echo "building llama-server (CPU, $(nproc) jobs); this takes several minutes once" >&2
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release \
  -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DBUILD_SHARED_LIBS=OFF \
  -DGGML_NATIVE=OFF >&2
cmake --build "$WORK/build" --target llama-server -j "$(nproc)" >&2

STAGE="$WORK/stage"
mkdir -p "$STAGE/bin" "$STAGE/models/templates"
cp "$WORK/build/bin/llama-server" "$STAGE/bin/"
cp "$SRC"/models/ggml-vocab-*.gguf "$STAGE/models/"
cp "$SRC"/models/templates/*.jinja "$STAGE/models/templates/" 2>/dev/null || true
rm -rf "$DEST"
mv "$STAGE" "$DEST"
echo "$DEST"
