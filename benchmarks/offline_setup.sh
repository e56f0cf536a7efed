# Sourced on the CUDA machine, in the repository root: installs benchmarks/offline_bundle.sh's .whl/ once
# into /tmp/site and sets the environment nnrun's GPU tests and benchmarks run in.
if [ ! -f /tmp/site/.installed ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl &&
    tar xJf .whl/flashinfer.tar.xz -C /tmp/site && touch /tmp/site/.installed || return 1
fi
export PYTHONPATH=/tmp/site:$PWD:$PWD/tests
# FlashInfer compiles each kernel variant on first use: for the one GPU present only, on every core
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-9.0a} MAX_JOBS=${MAX_JOBS:-$(nproc)}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
