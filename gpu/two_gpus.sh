#!/usr/bin/env bash
# Every two-GPU scenario of the suite in one call on a two-GPU machine: group p alone first
# (its scenarios check each GPU's memory), then groups a (every NCCL job) and b (the rest)
# at the same time, each a suite of its own. Timings of a and b are then those of a loaded
# machine. No two NCCL jobs share the GPUs at once: with the network-transport scenarios in
# group b (until 2026-11-25), FSDP's round trip and one of them failed together in two
# loaded runs, beside Xid 109 (CTX SWITCH TIMEOUT) on both GPUs, and passed apart.
# Results: $OUT/{p,a,b}/results.md.
# Usage (from the repository root, with .carry/ from scripts/gpu-carry.sh): bash gpu/two_gpus.sh
# SUITE_GROUPS=p or SUITE_GROUPS=a,b runs only those groups (the whole script is longer than one device
# call may run).
set -u
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/hiber-gpu-out}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
mkdir -p "$out/p" "$out/a" "$out/b"
p=gpu_map_onto_the_other_gpu_agent,gpu_map_onto_the_other_gpu_no_agent,gpu_swap_two_jobs_agent,gpu_swap_two_jobs_no_agent
# JAX sharded over both GPUs (#41, item 8): XLA preallocates 75% of each GPU, so it runs alone.
p=$p,agent_jax_sharded_two_gpus
# The same image restored with the GPUs swapped: known to fail (docs/user/gpu-status.md).
p=$p,agent_jax_sharded_swapped_gpus
a=nccl_ddp_refused_cleanly_no_agent,nccl_ddp_leave_running_and_restored_twice,nccl_fsdp_leave_running_and_restored_twice
a=$a,nccl_allreduce_leave_running_and_restored_twice,nccl_ddp_stop_and_restore
a=$a,nccl_rank_killed_during_checkpoint_fails_the_other,nccl_rank_and_hiber_killed_recover_fails_the_other
# The socket-transport ranks one per GPU, the shape of two hosts.
a=$a,nccl_socket_ranks_failed_cut_trains_on,nccl_socket_ranks_in_one_job_leave_running
# #38: NCCL and Open MPI with CUDA across two network-namespace hosts, a GPU each.
a=$a,nccl_netns_hosts_coordinated_cut_restored_swapped,mpi_cuda_ranks_on_two_netns_hosts_cut_and_restored
b=gpu_one_process_on_both_gpus_agent,gpu_one_process_on_both_gpus_no_agent,gpu_one_process_on_both_gpus_in_place_agent
b=$b,gpu_one_process_on_both_gpus_in_place_no_agent,gpu_two_gpus_without_peer_access_in_place_no_agent
b=$b,gpu_cuda_visible_devices_1_agent,gpu_cuda_visible_devices_1_no_agent
# An NVML monitor (reads both GPUs) beside a training process.
b=$b,agent_nvml_monitor_beside_training
suite() { # GROUP ONLY [VAR=VALUE...]
    local g=$1 only=$2
    shift 2
    env OUT="$out/$g" SUITE_STATE="/tmp/hiber-gpu-state-$g" SUITE_BUILD="/tmp/hiber-gpu-build-$g" SUITE_ONLY="$only" "$@" \
        timeout "${SUITE_TIMEOUT:-900}" python3 gpu/suite.py >"$out/$g/suite.log" 2>&1
}
want() { [[ ",${SUITE_GROUPS:-p,a,b}," == *",$1,"* ]]; }
want p && suite p "$p"
want a && suite a "$a" SUITE_XHOST_SPREAD=1 SUITE_XHOST_FAIL_AT=quiesced,captured &
want b && suite b "$b" &
wait
rm -f "$out"/*/results.json
grep -h "^\[\|passed,\|hiber commit" "$out"/*/suite.log | cut -c1-400
dmesg 2>/dev/null | grep -i "xid" | tail -20 >"$out/xid.txt"
