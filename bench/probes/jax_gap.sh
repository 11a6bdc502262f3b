#!/usr/bin/env bash
# #41, item 8: does a JAX process on two GPUs die while its device state is checkpointed and
# its threads run? hiber's driver checkpoint comes before CRIU freezes the tree, and with
# --leave-running CRIU lets the tree run before the driver restores it. Each gap is widened
# to 4 s (HIBER_PAUSE_AT/HIBER_PAUSE_MS), and a stopping checkpoint (no second gap) is
# restored; JAX's default client on both GPUs (no NCCL) is the control. Prints, per case,
# whether the process lived, the kernel's segfault lines with the thread's name, and the
# checkpoint's last lines. Runs on the GPU machine with .carry/ (scripts/gpu-carry.sh).
set -u
cd "$(dirname "$0")/../.."
export HIBER_STATE=/tmp/jg-state HIBER_CRIU=$PWD/.carry/bin/criu PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
export XLA_FLAGS="--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0"
H=$PWD/.carry/bin/hiber
log() { echo "[$(cut -d' ' -f1 /proc/uptime)] $*"; }
start() { # NAME PROGRAM [VAR=VALUE...]
    local name=$1 prog=$2
    shift 2
    env "$@" "$H" run --name "$name" -- python3 "$prog" --steps 100000 --interval-ms 10 >/dev/null
    for _ in $(seq 1 1200); do grep -q "^step 40 " "$HIBER_STATE/jobs/$name/stdout.log" 2>/dev/null && break; sleep 0.1; done
    pid=$(pgrep -f "$prog" | while read -r p; do [ "$(cat /proc/$p/comm)" = python3 ] && echo "$p"; done | tail -n1)
    log "$name pid $pid at $(grep -c '^step' "$HIBER_STATE/jobs/$name/stdout.log") steps"
    for t in /proc/$pid/task/*; do printf '%s %s\n' "$(basename "$t")" "$(cat "$t/comm")"; done >"/tmp/jg-$name-threads.txt"
    awk '{print $2}' "/tmp/jg-$name-threads.txt" | sort | uniq -c | sort -rn | tr '\n' ';'
    echo
}
report() { # NAME
    local name=$1
    if kill -0 "$pid" 2>/dev/null; then log "$name: process $pid alive"; else log "$name: process $pid GONE"; fi
    local before after
    before=$(grep -c '^step' "$HIBER_STATE/jobs/$name/stdout.log")
    sleep 2
    after=$(grep -c '^step' "$HIBER_STATE/jobs/$name/stdout.log")
    log "$name: steps $before -> $after in 2 s"
    dmesg | grep -i -E "segfault|NVRM|Xid" | tail -n 8
    for tid in $(dmesg | grep -i segfault | sed -n 's/.*\[\([0-9]*\)\]: segfault.*/\1/p'); do
        grep "^$tid " "/tmp/jg-$name-threads.txt" || echo "$tid (no thread of that id before the checkpoint)"
    done
    tail -n 3 "$HIBER_STATE/jobs/$name/stderr.log" 2>/dev/null
    "$H" rm -f "$name" >/dev/null 2>&1
    dmesg -C 2>/dev/null
}
checkpoint() { # NAME [ARGS...] (env from the caller)
    local name=$1
    shift
    log "$name: checkpoint $*"
    timeout 150 "$H" checkpoint "$name" "$@" 2>&1 | tail -n 4
    log "$name: checkpoint rc ${PIPESTATUS[0]}"
}
dmesg -C 2>/dev/null
rm -rf /tmp/jg-img-*

echo "== A: JAX sharded, --leave-running, 4 s after the driver's checkpoint before CRIU"
start ja gpu/programs/jax_sharded.py HIBER_NCCL_DLSYM=1
HIBER_PAUSE_AT=captured HIBER_PAUSE_MS=4000 checkpoint ja --leave-running --out /tmp/jg-img-a
report ja

echo "== B: JAX sharded, --leave-running, 4 s after CRIU's dump before the driver's restore"
start jb gpu/programs/jax_sharded.py HIBER_NCCL_DLSYM=1
HIBER_PAUSE_AT=dumped HIBER_PAUSE_MS=4000 checkpoint jb --leave-running --out /tmp/jg-img-b
report jb

echo "== C: JAX sharded, stopping checkpoint, then restore"
start jc gpu/programs/jax_sharded.py HIBER_NCCL_DLSYM=1
checkpoint jc --out /tmp/jg-img-c
log "jc: restore"
timeout 150 "$H" restore /tmp/jg-img-c --name jc 2>&1 | tail -n 4
sleep 3
pid=$(pgrep -f jax_sharded.py | tail -n1)
report jc

echo "== D: control, JAX's default client on both GPUs (no NCCL), 4 s after the driver's checkpoint"
start jd gpu/programs/jax_train.py
HIBER_PAUSE_AT=captured HIBER_PAUSE_MS=4000 checkpoint jd --leave-running --out /tmp/jg-img-d
report jd
rm -rf /tmp/jg-img-* "$HIBER_STATE"
