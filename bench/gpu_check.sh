#!/usr/bin/env bash
# The GPU checks, as ONE command on a lent GPU machine (never in CI; the device tool runs it from the
# repository root with the project's missing wheels carried in .whl/, see docs/evaluation.md "GPU"):
#   1. tests/e2e/test_cuda_path.py + tests/training/test_device.py: a whole `train --device cuda` job, DP-SGD and the sampler on
#      CUDA against the CPU;
#   2. bench/bench_dpsgd.py on cuda with the paper-mnist preset's model, K = 32 and physical batch 64;
#   3. the cpu-eps10-nodpsgd preset end to end with --device cuda (wall time against the CPU's ~15 min).
# Logs land in $OUT (or ./gpu-out).
source bench/gpu_env.sh
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, sys; print(sys.version.split()[0], torch.__version__, torch.cuda.is_available())" | tee -a "$OUT/gpu.txt"
t0=$(date +%s)
timeout "${PYTEST_S:-240}" python3 -m pytest -q -p no:cacheprovider tests/e2e/test_cuda_path.py tests/training/test_device.py \
    >"$OUT/pytest.log" 2>&1; echo "pytest rc=$? in $(( $(date +%s) - t0 )) s"; tail -25 "$OUT/pytest.log"
t0=$(date +%s)
timeout "${BENCH_S:-180}" python3 bench/bench_dpsgd.py --device cuda --preset paper-mnist --batch "${BENCH_B:-512}" \
    --k 32 --physical 64 --methods nonprivate,hooks --rounds 3 --steps 1 --threads 8 >"$OUT/bench_dpsgd.log" 2>&1
echo "bench rc=$? in $(( $(date +%s) - t0 )) s"; cat "$OUT/bench_dpsgd.log" | tail -8
t0=$(date +%s)
timeout "${TRAIN_S:-200}" python3 -m feta_release train --preset cpu-eps10-nodpsgd --device cuda --threads 8 \
    --out /tmp/eps10-cuda --no-progress >"$OUT/train_eps10.log" 2>&1
echo "train cpu-eps10-nodpsgd --device cuda rc=$? in $(( $(date +%s) - t0 )) s"; tail -4 "$OUT/train_eps10.log"
cp /tmp/eps10-cuda/samples.png "$OUT/eps10-cuda-samples.png" 2>/dev/null || true
