#!/usr/bin/env bash
# Which threads of a JAX process on two GPUs die in libcuda when the driver checkpoints it
# (#41, item 8): their names and where they wait before the checkpoint, matched with the
# kernel's segfault lines after it. Runs on the GPU machine with .carry/ (scripts/gpu-carry.sh).
set -u
cd "$(dirname "$0")/../.."
export HIBER_STATE=/tmp/jt-state HIBER_CRIU=$PWD/.carry/bin/criu PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export XLA_FLAGS="--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0"
H=.carry/bin/hiber
$H run --name jt -- python3 gpu/programs/jax_sharded.py --steps 3000 --interval-ms 10 >/dev/null
for _ in $(seq 1 600); do grep -q "^step 40 " $HIBER_STATE/jobs/jt/stdout.log 2>/dev/null && break; sleep 0.1; done
pid=$(python3 -c "import json;print(json.load(open('$HIBER_STATE/jobs/jt/job.json'))['pid'])")
echo "pid $pid"
for t in /proc/$pid/task/*; do printf '%s %s %s %s\n' "$(basename $t)" "$(cat $t/comm)" "$(cat $t/wchan 2>/dev/null)" "$(awk '{print $3}' $t/stat)"; done | sort -k2 > /tmp/jt-threads.txt
awk '{print $2}' /tmp/jt-threads.txt | sort | uniq -c | sort -rn | head -30
dmesg -C 2>/dev/null
$H checkpoint jt --leave-running --out /tmp/jt-img 2>&1 | tail -3
sleep 1
dmesg | grep -i segfault | tail -4
for tid in $(dmesg | grep -i segfault | sed -n 's/.*python3\[\([0-9]*\)\].*/\1/p'); do grep "^$tid " /tmp/jt-threads.txt || echo "$tid (not seen before)"; done
$H rm -f jt >/dev/null 2>&1
