#!/usr/bin/env bash
# #41, item 8: a CUDA process hiber stopped for the driver's checkpoint is resumed in place
# (--leave-running, or an undo): which order the driver takes. HIBER_PROBE_RESUME picks
# restore and unlock with only the restore thread running ("alone"), the restore alone then
# the unlock running ("restore-alone"), or both running ("running"). Each case runs the
# counter program with the agent and checkpoints it --leave-running under a timeout, then
# checks that it computes on; on a hang it prints hiber's and the process's threads.
# Then JAX sharded over both GPUs with the given modes. Runs on the GPU machine with .carry/.
set -u
cd "$(dirname "$0")/../.."
export HIBER_STATE=/tmp/rp-state HIBER_CRIU=$PWD/.carry/bin/criu PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 HIBER_LOG=debug
H=$PWD/.carry/bin/hiber
nvcc -O2 -o /tmp/rp-counter gpu/programs/counter.cu || exit 1
steps() { grep -c '^step' "$HIBER_STATE/jobs/$1/stdout.log"; }
threads() { # PID
    for t in /proc/$1/task/*; do echo "  $(basename "$t") $(cat "$t/comm") $(awk '{print $3}' "$t/stat") $(cat "$t/wchan")"; done | sort -k3 | uniq -c -f2 | head -20
}
case_run() { # NAME MODE PROGRAM ARGS...
    local name=$1 mode=$2
    shift 2
    echo "== $name: HIBER_PROBE_RESUME=$mode"
    "$H" run --name "$name" -- "$@" >/dev/null
    for _ in $(seq 1 1200); do [ "$(steps "$name" 2>/dev/null || echo 0)" -ge 40 ] && break; sleep 0.1; done
    local pid
    pid=$(python3 -c "import json;print(json.load(open('$HIBER_STATE/jobs/$name/job.json'))['pid'])")
    HIBER_PROBE_RESUME=$mode timeout 60 "$H" checkpoint "$name" --leave-running --out "/tmp/rp-img-$name" >"/tmp/rp-$name.log" 2>&1 &
    local ck=$!
    for _ in $(seq 1 400); do kill -0 $ck 2>/dev/null || break; sleep 0.1; done
    if kill -0 $ck 2>/dev/null; then
        echo "  HUNG after 40 s; hiber:"
        for h in $(pgrep -f "hiber checkpoint $name"); do for t in /proc/$h/task/*; do echo "  hiber $(basename "$t") $(cat "$t/wchan") $(head -c 300 "$t/stack" | tr '\n' '|')"; done; done
        echo "  process $pid $(cat /proc/$pid/comm):"
        threads "$pid"
    fi
    wait $ck
    echo "  checkpoint rc $?"
    grep -E "driver|error|failed|checkpointed" "/tmp/rp-$name.log" | sed 's/\x1b\[[0-9;]*m//g' | tail -n 12 | cut -c1-240
    local a b
    a=$(steps "$name"); sleep 2; b=$(steps "$name")
    echo "  steps $a -> $b in 2 s; state $(awk '{print $3}' /proc/$pid/stat 2>/dev/null || echo gone)"
    dmesg | grep -i -E "segfault|Xid" | tail -n 3
    "$H" rm -f "$name" >/dev/null 2>&1
    rm -rf "/tmp/rp-img-$name"
    dmesg -C 2>/dev/null
}
dmesg -C 2>/dev/null
for mode in alone restore-alone running; do
    case_run "c-$mode" "$mode" /tmp/rp-counter --mib 1024 --steps 100000 --interval-ms 10
done
export XLA_FLAGS="--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0"
for mode in ${JAX_MODES:-restore-alone alone}; do
    case_run "j-$mode" "$mode" python3 gpu/programs/jax_sharded.py --steps 100000 --interval-ms 10
done
rm -rf "$HIBER_STATE"
