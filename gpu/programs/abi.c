/* Prints the layout of the CUDA structs hiber declares (crate hiber-cuda-sys) as this
 * machine's cuda.h defines them, in the format of `hiber workload cuda-abi`; the suite
 * diffs the two. */
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
    printf("CUmemAllocationProp size %zu\n", sizeof(CUmemAllocationProp));
    printf("CUmemAllocationProp.location %zu\n", offsetof(CUmemAllocationProp, location));
    printf("CUmemAllocationProp.win32HandleMetaData %zu\n", offsetof(CUmemAllocationProp, win32HandleMetaData));
    printf("CUmemAllocationProp.allocFlags %zu\n", offsetof(CUmemAllocationProp, allocFlags));
    printf("CUmemAccessDesc size %zu\n", sizeof(CUmemAccessDesc));
    printf("CUmemAccessDesc.flags %zu\n", offsetof(CUmemAccessDesc, flags));
    printf("CUmemLocation size %zu\n", sizeof(CUmemLocation));
    printf("CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR %d\n", (int)CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    printf("CU_MEM_LOCATION_TYPE_DEVICE %d\n", (int)CU_MEM_LOCATION_TYPE_DEVICE);
    printf("CU_MEM_ACCESS_FLAGS_PROT_READWRITE %d\n", (int)CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
    printf("CUipcMemHandle size %zu\n", sizeof(CUipcMemHandle));
    printf("CUipcEventHandle size %zu\n", sizeof(CUipcEventHandle));
    printf("CU_EVENT_DISABLE_TIMING %d\n", (int)CU_EVENT_DISABLE_TIMING);
    printf("CU_EVENT_INTERPROCESS %d\n", (int)CU_EVENT_INTERPROCESS);
    return 0;
}
