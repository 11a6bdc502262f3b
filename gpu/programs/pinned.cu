// Mapped page-locked host memory that kernels read and write, as NCCL's network transport
// uses it (its FIFOs and flags live in such memory, allocated by the proxy thread when a
// communicator is made), for hiber's GPU suite.
//
// At start it allocates a long-lived mapped buffer (cudaHostAlloc, cudaHostAllocMapped).
// Each step it allocates a fresh one too, runs a kernel that waits for a flag the host sets
// in the fresh buffer after the launch (a kernel polling host memory, as NCCL's do for the
// proxy), then writes a chain of values into both buffers; the host checks every word,
// frees the fresh buffer, and prints `step N checksum X t MS`. A kernel that waits longer
// than a second for the flag fails the step. At the end it prints `verify ok`.
//
//   pinned [--steps S] [--interval-ms I] [--kib K]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <ctime>
#include <unistd.h>
#include <cuda_runtime.h>

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
    printf("cuda error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); fflush(stdout); exit(2); } } while (0)

__host__ __device__ static inline uint64_t mix(uint64_t z) {
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

// flag: the fresh buffer's first word, set by the host to step + 1; words 1.. the data.
__global__ void k_step(volatile uint64_t *fresh, uint64_t *lasting, uint64_t n, uint64_t step, long long cycles) {
    if (threadIdx.x == 0) {
        long long start = clock64();
        while (fresh[0] != step + 1) {
            if (clock64() - start > cycles) { fresh[1] = 0xdeadULL; return; }
        }
    }
    __syncthreads();
    if (fresh[1] == 0xdeadULL) return;
    for (uint64_t i = threadIdx.x; i < n; i += blockDim.x) {
        lasting[i] = mix(lasting[i] ^ step ^ i);
        fresh[2 + i] = lasting[i];
    }
}

static unsigned long long now_ms() {
    timespec ts; clock_gettime(CLOCK_REALTIME, &ts);
    return (unsigned long long)ts.tv_sec * 1000ULL + ts.tv_nsec / 1000000ULL;
}

int main(int argc, char **argv) {
    uint64_t steps = 300, kib = 256; unsigned interval = 20;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = strtoull(argv[++i], 0, 10);
        else if (!strcmp(argv[i], "--interval-ms") && i + 1 < argc) interval = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--kib") && i + 1 < argc) kib = strtoull(argv[++i], 0, 10);
        else { fprintf(stderr, "unknown argument %s\n", argv[i]); return 2; }
    }
    CHECK(cudaSetDevice(0));
    int khz; CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
    uint64_t n = kib * 1024 / 8;
    uint64_t *lasting, *lasting_d;
    CHECK(cudaHostAlloc(&lasting, n * 8, cudaHostAllocMapped));
    CHECK(cudaHostGetDevicePointer((void **)&lasting_d, lasting, 0));
    for (uint64_t i = 0; i < n; i++) lasting[i] = mix(i);
    uint64_t *want = (uint64_t *)malloc(n * 8);
    for (uint64_t i = 0; i < n; i++) want[i] = mix(i);
    uint64_t checksum = 0;
    printf("start pinned kib %llu steps %llu pid %d\n", (unsigned long long)kib, (unsigned long long)steps, getpid());
    fflush(stdout);
    for (uint64_t step = 0; step < steps; step++) {
        volatile uint64_t *fresh; uint64_t *fresh_d;
        CHECK(cudaHostAlloc((void **)&fresh, (n + 2) * 8, cudaHostAllocMapped));
        CHECK(cudaHostGetDevicePointer((void **)&fresh_d, (void *)fresh, 0));
        fresh[0] = 0; fresh[1] = 0;
        k_step<<<1, 256>>>(fresh_d, lasting_d, n, step, (long long)khz * 1000);
        CHECK(cudaGetLastError());
        usleep(1000);
        fresh[0] = step + 1;
        CHECK(cudaDeviceSynchronize());
        if (fresh[1] == 0xdeadULL) { printf("step %llu: the kernel never saw the host's flag\n", (unsigned long long)step); fflush(stdout); return 1; }
        uint64_t c = mix(checksum ^ step);
        for (uint64_t i = 0; i < n; i++) {
            want[i] = mix(want[i] ^ step ^ i);
            if (lasting[i] != want[i] || fresh[2 + i] != want[i]) {
                printf("step %llu: word %llu wrong\n", (unsigned long long)step, (unsigned long long)i); fflush(stdout); return 1;
            }
            c = mix(c ^ want[i]);
        }
        checksum = c;
        CHECK(cudaFreeHost((void *)fresh));
        printf("step %llu checksum %016llx t %llu\n", (unsigned long long)step, (unsigned long long)checksum, now_ms());
        fflush(stdout);
        usleep(interval * 1000);
    }
    printf("verify ok\n");
    fflush(stdout);
    return 0;
}
