#!/usr/bin/env bash
# The GPU checks, as ONE command on a lent GPU machine (16 cores, one GPU; never in CI), run from the
# repository root with the project's missing wheels carried in .whl/ (bench/gpu_env.sh installs them):
#     bash bench/gpu_check.sh            # ~7.5 min wall, everything in $OUT (8 files at most)
#     GPU_CHECK_SMOKE=1 bash bench/gpu_check.sh   # the same command lines, toy scale, on the CPU
# Parts run AT ONCE, each under its own timeout, all ending within GPU_CHECK_S (default 440 s):
#   a. tests/e2e/test_cuda_path.py + tests/training/test_device.py (the CUDA path, the federated job on CUDA) -> pytest.log
#   b. bench/generality.py at 4,000 training images, derived job (`train --epsilon E --device cuda`), the
#      evaluation classifiers on cuda, rows in priority order (medical ε 10, digits ε 1, RGB ε 10, then the
#      rest), seeds 0-2, several cells at once; every finished cell is a line of generality.log (and rewrites
#      generality.json / generality.md), so a timeout loses only the unfinished cells. Each release cell also
#      gives the derived job's wall time (train_s) and per-stage seconds on the GPU, under the others' load.
#   c. timings: the derived job for the 4,000 digits (28 px, ε 1) on 2 CPU cores of the same machine (taskset,
#      --threads 2, --device cpu) and a short public pretraining (--quick) on the same 2 cores -> cpu2.log;
#      the public pretraining on the GPU (bench/pretraining.py --pretrain-only: population-B medical and
#      pen strokes, 10,000 public images, 4,000 steps each) -> pretrain.log.
#   The paper-mnist preset is not run: its DP-SGD alone (~1,800 steps of ~15.7 s on one H100) takes hours.
# GPU load every 15 s -> gpu_util.csv; the summary (environment first) -> summary.txt.
set -u
T0=$(date +%s); END=$(( T0 + ${GPU_CHECK_S:-440} ))  # the wheels' install counts too
SMOKE=${GPU_CHECK_SMOKE:-0}
PY=${PYTHON:-python3}
if [ "$SMOKE" = 1 ]; then
    OUT=${OUT:-/tmp/gpu-check-smoke-out}
fi
source bench/gpu_env.sh
export PYTHONPATH=${PYTHONPATH:-$PWD} PYTHONDONTWRITEBYTECODE=1 MPLBACKEND=Agg
WORK=/tmp/gpu-check
rm -rf "$WORK"; mkdir -p "$WORK" "$OUT"
left() { local s=$(( END - $(date +%s) - ${1:-0} )); [ "$s" -gt 5 ] && echo "$s" || echo 5; }

if [ "$SMOKE" = 1 ]; then  # toy sizes, the CPU, one row per kind
    DEV=cpu
    GEN=(--quick --kinds digits,medical,rgb --eps 10 --seeds 0 --methods ceiling,release --jobs 2 --threads 1
         --priority medical:10,digits:10,rgb:10)
    N_CPU2=300; SYN_CPU2=100; PRE_GPU=(--quick); PRE_CPU=(--quick); PIN01=(); PIN_GEN=(); PIN_TEST=()
else
    DEV=cuda
    GEN=(--sizes 4000 --eps 1,10 --seeds 0,1,2 --methods ceiling,release --job derived
         --jobs "${GEN_JOBS:-6}" --threads 2 --priority medical:10,digits:1,rgb:10,medical:1,digits:10,rgb:1)
    N_CPU2=4000; SYN_CPU2=10000; PRE_GPU=(); PRE_CPU=(--quick)
    PIN01=(); PIN_GEN=(); PIN_TEST=()
    if command -v taskset >/dev/null && [ "$(nproc)" -ge 16 ]; then
        PIN01=(taskset -c 0,1); PIN_GEN=(taskset -c 2-15); PIN_TEST=(taskset -c 12-15)
    fi
fi

{
    echo "gpu_check: smoke=$SMOKE device=$DEV nproc=$(nproc) start $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -3
    "$PY" -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available())"
    "$PY" -c "import flwr, opacus, cryptography, jsonschema, prv_accountant, pydicom, onnxruntime as o; \
print('flwr', flwr.__version__, 'opacus', opacus.__version__, 'onnxruntime', o.__version__)" 2>&1 | tail -1
} >"$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
if [ "$DEV" = cuda ]; then
    nvidia-smi --query-gpu=timestamp,utilization.gpu,memory.used --format=csv -l 15 \
        >"$OUT/gpu_util.csv" 2>&1 &
    SMI=$!
fi

# a. the CUDA tests (4 threads: they share the cores with part b)
( t=$(date +%s)
  OMP_NUM_THREADS=4 timeout -k 5 "$(left 10)" "${PIN_TEST[@]}" "$PY" -m pytest -q -p no:cacheprovider \
      tests/e2e/test_cuda_path.py tests/training/test_device.py >"$OUT/pytest.log" 2>&1
  echo "[a] pytest rc=$? in $(( $(date +%s) - t )) s" >>"$OUT/pytest.log" ) &
PA=$!

# b. the generality rows; the evaluator falls back to the CPU if a 1-epoch fit on $DEV fails (~10 s)
( t=$(date +%s); CDEV=$DEV
  timeout 90 "$PY" -c "import sys; from feta_release.data.procedural import generate
from feta_release.evaluation import train_classifier
train_classifier(generate('medical', 200, size=28), epochs=1, device=sys.argv[1])" "$DEV" \
      || { CDEV=cpu; echo "[b] the evaluator failed on $DEV: it trains on the CPU"; }
  timeout -k 5 "$(left 8)" "${PIN_GEN[@]}" "$PY" bench/generality.py "${GEN[@]}" --device "$DEV" \
      --classifier-device "$CDEV" --out "$OUT/generality" --work "$WORK/generality"
  echo "[b] generality rc=$? in $(( $(date +%s) - t )) s" ) >"$OUT/generality.log" 2>&1 &
PB=$!

# c1. the derived job for the digits on 2 CPU cores, then a short pretraining on the same 2 cores
( t=$(date +%s)
  "$PY" - "$N_CPU2" "$WORK/digits.npz" <<'EOF'
import sys
sys.path.insert(0, "bench")
from dpsgd_classifier import load_kind
from feta_release.data import save_npz
from feta_release.eval_protocol import protocol_splits
train, _ = protocol_splits(load_kind("embedded", int(sys.argv[1])), "test")
save_npz(train, sys.argv[2])
print(f"digits train split: {train.n} images {train.image_shape}")
EOF
  timeout -k 5 "$(left 60)" "${PIN01[@]}" "$PY" -m feta_release train --data "$WORK/digits.npz" --epsilon 1 \
      --out "$WORK/cpu2" --synthetic "$SYN_CPU2" --no-release --json --no-progress --threads 2 --device cpu \
      >"$WORK/cpu2.json" 2>&1
  rc=$?
  echo "[c] derived job, $N_CPU2 digits 28 px, eps 1, $SYN_CPU2 synthetic, 2 CPU cores: rc=$rc in" \
       "$(( $(date +%s) - t )) s"
  tail -c 1500 "$WORK/cpu2.json"; echo
  [ -f "$WORK/cpu2/job_summary.json" ] && "$PY" -c "import json, sys
print('stage_seconds', json.load(open(sys.argv[1])).get('timings'))" "$WORK/cpu2/job_summary.json"
  timeout -k 5 "$(left 8)" "${PIN01[@]}" "$PY" bench/pretraining.py --pretrain-only "${PRE_CPU[@]}" \
      --datasets medical --threads 2 --device cpu --out "$WORK/pretrain-cpu2" 2>&1 | tail -3
  echo "[c] 2-core pretraining rc=${PIPESTATUS[0]}" ) >"$OUT/cpu2.log" 2>&1 &
PC=$!

# c2. the public pretraining on the GPU (full size: 10,000 public images, 4,000 steps per dataset)
( t=$(date +%s)
  timeout -k 5 "$(left 8)" "${PIN_TEST[@]}" "$PY" bench/pretraining.py --pretrain-only "${PRE_GPU[@]}" \
      --datasets medical,digits --threads 2 --device "$DEV" --out "$WORK/pretrain-gpu"
  echo "[c] pretraining on $DEV rc=$? in $(( $(date +%s) - t )) s" ) >"$OUT/pretrain.log" 2>&1 &
PD=$!

wait "$PA" "$PB" "$PC" "$PD"
[ -n "${SMI:-}" ] && kill "$SMI" 2>/dev/null
{
    echo; echo "== summary after $(( $(date +%s) - T0 )) s"
    echo "-- a. CUDA tests"; grep -E "passed|failed|error|skipped|\[a\]" "$OUT/pytest.log" | tail -6
    echo "-- b. generality ($(grep -c '^{"cell"' "$OUT/generality.log") cells done)"
    tail -1 "$OUT/generality.log"
    [ -f "$OUT/generality.md" ] && cat "$OUT/generality.md"
    grep -h '^{"cell": "release' "$OUT/generality.log" | "$PY" -c "
import json, sys
for line in sys.stdin:
    r = json.loads(line); res = r['result']
    print(r['cell'], 'train_s', res.get('train_s'), 'cell_s', r['seconds'],
          res.get('stage_seconds', res.get('error')))"
    echo "-- c. timings"; grep -E "^\[c\]|stage_seconds|pretrained" "$OUT/cpu2.log" "$OUT/pretrain.log"
} >>"$OUT/summary.txt" 2>&1
sed -n '/^== summary/,$p' "$OUT/summary.txt"
