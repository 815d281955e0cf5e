# Sourced by bench/gpu_check.sh and bench/gpu_sweep.sh on a lent GPU machine: $OUT for logs, and the project's
# wheels that the machine's image lacks (carried in .whl/; cryptography, jsonschema, prv-accountant, opacus, ...)
# installed beside its own torch, never over it.
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
