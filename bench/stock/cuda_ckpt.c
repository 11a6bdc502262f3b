/* The stock path's driver client: the CUDA checkpoint API as NVIDIA documents it, with no
 * hiber code. Built on the GPU machine against its cuda.h.
 *
 *   cuda_ckpt PID ACTION...     ACTION: lock | checkpoint | restore | unlock | state
 *
 * Runs the actions in order on PID (lock with a 10 s timeout, as CRIU's CUDA plugin does)
 * and prints each one's time. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <cuda.h>

static double now(void) {
    struct timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: %s PID ACTION...\n", argv[0]); return 2; }
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) { fprintf(stderr, "%s\n", dlerror()); return 1; }
    CUresult (*init)(unsigned) = dlsym(lib, "cuInit");
    CUresult (*lock)(int, CUcheckpointLockArgs *) = dlsym(lib, "cuCheckpointProcessLock");
    CUresult (*ckpt)(int, CUcheckpointCheckpointArgs *) = dlsym(lib, "cuCheckpointProcessCheckpoint");
    CUresult (*rest)(int, CUcheckpointRestoreArgs *) = dlsym(lib, "cuCheckpointProcessRestore");
    CUresult (*unlock)(int, CUcheckpointUnlockArgs *) = dlsym(lib, "cuCheckpointProcessUnlock");
    CUresult (*state)(int, CUprocessState *) = dlsym(lib, "cuCheckpointProcessGetState");
    if (!init || !lock || !ckpt || !rest || !unlock || !state) { fprintf(stderr, "no checkpoint API\n"); return 1; }
    if (init(0) != CUDA_SUCCESS) { fprintf(stderr, "cuInit failed\n"); return 1; }
    int pid = atoi(argv[1]);
    for (int i = 2; i < argc; i++) {
        double t = now();
        CUresult r;
        if (!strcmp(argv[i], "lock")) { CUcheckpointLockArgs a; memset(&a, 0, sizeof a); a.timeoutMs = 10000; r = lock(pid, &a); }
        else if (!strcmp(argv[i], "checkpoint")) { CUcheckpointCheckpointArgs a; memset(&a, 0, sizeof a); r = ckpt(pid, &a); }
        else if (!strcmp(argv[i], "restore")) { CUcheckpointRestoreArgs a; memset(&a, 0, sizeof a); r = rest(pid, &a); }
        else if (!strcmp(argv[i], "unlock")) { CUcheckpointUnlockArgs a; memset(&a, 0, sizeof a); r = unlock(pid, &a); }
        else if (!strcmp(argv[i], "state")) { CUprocessState s; r = state(pid, &s); printf("state %d\n", (int)s); }
        else { fprintf(stderr, "unknown action %s\n", argv[i]); return 2; }
        if (r != CUDA_SUCCESS) { fprintf(stderr, "%s of %d failed: %d\n", argv[i], pid, (int)r); return 1; }
        printf("%s %.3f\n", argv[i], now() - t);
    }
    return 0;
}
