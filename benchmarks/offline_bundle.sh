#!/usr/bin/env bash
# Packages for a CUDA machine with no network whose Python 3.12 already has torch (and numpy, safetensors,
# tokenizers, huggingface-hub, ...): transformers, nnsight, FlashInfer and the server's packages as
# manylinux wheels in .whl/, FlashInfer trimmed to the kernels nnrun compiles (its sources for MoE,
# Blackwell, sampling and other kernels dropped: 426 MB unpacked -> a 14 MB xz) so the bundle stays
# under 45 MB. Run where pip can reach an index; then `source benchmarks/offline_setup.sh` there.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "$@"
}
# the versions pyproject.toml pins, and the ones the dev extra resolves to here
download transformers==5.23.0 nnsight==0.8.1 apache-tvm-ffi==0.1.15.post2 greenlet pydantic pydantic_core \
  annotated-types typing-inspection websocket-client zstandard regex fastapi starlette uvicorn httptools \
  opentelemetry-api
flashinfer=$(mktemp -d)
download --dest "$flashinfer" flashinfer-python==0.7.2.post1 2>/dev/null || \
  python3 -m pip download -q --no-deps -d "$flashinfer" flashinfer-python==0.7.2.post1
(
  cd "$flashinfer" && unzip -q ./flashinfer_python-*.whl && rm ./*.whl
  cd flashinfer/data/csrc
  for d in */; do case $d in generated/ | nv_internal/) ;; *) rm -rf "$d" ;; esac; done
  rm -f cake_* alphamoe* blackwell*
)
tar cf - -C "$flashinfer" flashinfer "$(basename "$(ls -d "$flashinfer"/flashinfer_python-*.dist-info)")" |
  xz -T0 -6 >.whl/flashinfer.tar.xz
rm -rf "$flashinfer"
du -sh .whl
