/* Prints the layout of the CUDA checkpoint API's argument structs as this machine's cuda.h
 * defines them, in the format of `hiber workload cuda-abi`; the suite diffs the two. */
#include <stdio.h>
#include <stddef.h>
#include <cuda.h>

int main(void) {
    printf("CUcheckpointLockArgs size %zu\n", sizeof(CUcheckpointLockArgs));
    printf("CUcheckpointLockArgs.timeoutMs %zu\n", offsetof(CUcheckpointLockArgs, timeoutMs));
    printf("CUcheckpointCheckpointArgs size %zu\n", sizeof(CUcheckpointCheckpointArgs));
    printf("CUcheckpointRestoreArgs size %zu\n", sizeof(CUcheckpointRestoreArgs));
    printf("CUcheckpointRestoreArgs.gpuPairs %zu\n", offsetof(CUcheckpointRestoreArgs, gpuPairs));
    printf("CUcheckpointRestoreArgs.gpuPairsCount %zu\n", offsetof(CUcheckpointRestoreArgs, gpuPairsCount));
    printf("CUcheckpointGpuPair size %zu\n", sizeof(CUcheckpointGpuPair));
    printf("CUcheckpointGpuPair.newUuid %zu\n", offsetof(CUcheckpointGpuPair, newUuid));
    printf("CUcheckpointUnlockArgs size %zu\n", sizeof(CUcheckpointUnlockArgs));
    printf("CU_PROCESS_STATE_RUNNING %d\n", (int)CU_PROCESS_STATE_RUNNING);
    printf("CU_PROCESS_STATE_LOCKED %d\n", (int)CU_PROCESS_STATE_LOCKED);
    printf("CU_PROCESS_STATE_CHECKPOINTED %d\n", (int)CU_PROCESS_STATE_CHECKPOINTED);
    printf("CU_PROCESS_STATE_FAILED %d\n", (int)CU_PROCESS_STATE_FAILED);
    return 0;
}
