#!/usr/bin/env bash
# Validation-mode pipeline runs in parallel on one lent GPU (exploration for issue 15; never in CI): each
# configuration x seed is its own process (the small denoiser leaves the GPU mostly idle, so 9 share it), the
# classifiers on the CPU. Lean protocol (accuracy + release-only). Logs: $OUT/sweep-TAG-sSEED.log.
#   SWEEP_S=420 bash bench/gpu_sweep.sh
source bench/gpu_env.sh
common="--mode validation --preset cpu-eps10-nodpsgd --threads 2 --lean --device cuda"
t0=$(date +%s)
for s in 0 1 2; do
    timeout "${SWEEP_S:-420}" python3 bench/eval_protocol.py $common --seeds $s --out /tmp/sw-base$s \
        >"$OUT/sweep-base-s$s.log" 2>&1 &
    timeout "${SWEEP_S:-420}" python3 bench/frequency_kernels_pipeline.py --map patch7s3:32 -- $common --seeds $s \
        --tag p7s3 --set frequency.features=2048 --out /tmp/sw-p7s3-$s >"$OUT/sweep-p7s3-s$s.log" 2>&1 &
    timeout "${SWEEP_S:-420}" python3 bench/frequency_kernels_pipeline.py --map mix7s3:32 -- $common --seeds $s \
        --tag m7s3 --set frequency.features=2548 --out /tmp/sw-m7s3-$s >"$OUT/sweep-m7s3-s$s.log" 2>&1 &
done
wait
echo "sweep done in $(( $(date +%s) - t0 )) s"
grep -h '^{' "$OUT"/sweep-*.log
grep -h -i "error\|Traceback" "$OUT"/sweep-*.log | sort | uniq -c | head
