// A CUDA C++ test program for hiber's GPU suite, built with nvcc defaults (static cudart).
//
// It holds --mib MiB of device memory whose every word follows a known chain (the same
// chain as hiber's built-in GPU workload), advances it each step, prints a running
// checksum of a sample, and at the end recomputes every word on the device and reports
// `verify ok` or `verify FAILED`.
//
//   counter [--mib N] [--steps S] [--interval-ms I] [--fork] [--spin-at STEP --spin-ms MS]
//           [--reserve-mib R]  (R MiB more, zeroed and never touched: an allocator's pool)
//           [--static-mib W]   (W MiB more, written once and never changed: a model's weights)
//   counter --hog-free-mib N    (holds all but N MiB of device memory until killed)
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <ctime>
#include <unistd.h>
#include <sys/wait.h>
#include <cuda_runtime.h>

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
    printf("cuda error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); fflush(stdout); exit(2); } } while (0)

__host__ __device__ static inline uint64_t mix(uint64_t z) {
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

__global__ void k_init(uint64_t *buf, uint64_t n, uint64_t seed) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
        buf[i] = mix(seed ^ (i * 0x2545F4914F6CDD1DULL));
}

__global__ void k_step(uint64_t *buf, uint64_t n, uint64_t step) {
    uint64_t k = step * 0x9E3779B97F4A7C15ULL;
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
        buf[i] = mix(buf[i] ^ k ^ i);
}

__global__ void k_verify(const uint64_t *buf, uint64_t n, uint64_t seed, uint64_t steps, unsigned long long *bad) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x) {
        uint64_t v = mix(seed ^ (i * 0x2545F4914F6CDD1DULL));
        for (uint64_t s = 0; s < steps; s++) v = mix(v ^ (s * 0x9E3779B97F4A7C15ULL) ^ i);
        if (v != buf[i]) atomicAdd(bad, 1ULL);
    }
}

// Keeps the GPU busy for `ms` milliseconds: work a driver lock must wait for.
__global__ void k_spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}

static unsigned long long now_ms() {
    timespec ts; clock_gettime(CLOCK_REALTIME, &ts);
    return (unsigned long long)ts.tv_sec * 1000ULL + ts.tv_nsec / 1000000ULL;
}

static uint64_t reserve_mib = 0, static_mib = 0;

static int run(const char *who, uint64_t mib, uint64_t steps, unsigned interval_ms, uint64_t seed, long spin_at, long spin_ms) {
    uint64_t n = mib * 1024 * 1024 / 8, sample_n = 8192;
    uint64_t *buf; unsigned long long *bad;
    CHECK(cudaMalloc(&buf, n * 8));
    CHECK(cudaMalloc(&bad, 8));
    if (reserve_mib) {
        void *pool;
        CHECK(cudaMalloc(&pool, reserve_mib << 20));
        CHECK(cudaMemset(pool, 0, reserve_mib << 20));
    }
    uint64_t *weights = 0;
    if (static_mib) {
        CHECK(cudaMalloc(&weights, static_mib << 20));
        k_init<<<1024, 256>>>(weights, (static_mib << 20) / 8, seed ^ 0x5eed);
    }
    k_init<<<1024, 256>>>(buf, n, seed);
    CHECK(cudaDeviceSynchronize());
    uint64_t *sample = (uint64_t *)malloc(sample_n * 8);
    uint64_t checksum = seed;
    printf("%sstart counter mib %llu steps %llu pid %d\n", who, (unsigned long long)mib, (unsigned long long)steps, getpid());
    fflush(stdout);
    for (uint64_t step = 0; step < steps; step++) {
        if ((long)step == spin_at) {
            int khz; CHECK(cudaDeviceGetAttribute(&khz, cudaDevAttrClockRate, 0));
            printf("%sspin %ld ms\n", who, spin_ms); fflush(stdout);
            k_spin<<<1, 1>>>((long long)khz * spin_ms);
        }
        k_step<<<1024, 256>>>(buf, n, step);
        uint64_t off = mix(step) % (n - sample_n);
        CHECK(cudaMemcpy(sample, buf + off, sample_n * 8, cudaMemcpyDeviceToHost));
        uint64_t c = mix(checksum ^ step);
        for (uint64_t i = 0; i < sample_n; i++) c = mix(c ^ sample[i]);
        checksum = c;
        printf("%sstep %llu checksum %016llx t %llu\n", who, (unsigned long long)step, (unsigned long long)checksum, now_ms());
        fflush(stdout);
        usleep(interval_ms * 1000);
    }
    CHECK(cudaMemset(bad, 0, 8));
    k_verify<<<1024, 256>>>(buf, n, seed, steps, bad);
    // The weights too: written once, they must still hold their first values (an
    // incremental image shares them with its parent rather than writing them).
    if (static_mib) k_verify<<<1024, 256>>>(weights, (static_mib << 20) / 8, seed ^ 0x5eed, 0, bad);
    unsigned long long bad_words = 0;
    CHECK(cudaMemcpy(&bad_words, bad, 8, cudaMemcpyDeviceToHost));
    printf("%s%s bad_words %llu of %llu\n", who, bad_words == 0 ? "verify ok" : "verify FAILED", bad_words, (unsigned long long)(n + (static_mib << 20) / 8));
    fflush(stdout);
    return bad_words == 0 ? 0 : 1;
}

int main(int argc, char **argv) {
    uint64_t mib = 1024, steps = 200; unsigned interval = 20; int fork_child = 0;
    long spin_at = -1, spin_ms = 0, hog_free = -1; int device = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--mib") && i + 1 < argc) mib = strtoull(argv[++i], 0, 10);
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = strtoull(argv[++i], 0, 10);
        else if (!strcmp(argv[i], "--interval-ms") && i + 1 < argc) interval = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--fork")) fork_child = 1;
        else if (!strcmp(argv[i], "--spin-at") && i + 1 < argc) spin_at = atol(argv[++i]);
        else if (!strcmp(argv[i], "--spin-ms") && i + 1 < argc) spin_ms = atol(argv[++i]);
        else if (!strcmp(argv[i], "--hog-free-mib") && i + 1 < argc) hog_free = atol(argv[++i]);
        else if (!strcmp(argv[i], "--device") && i + 1 < argc) device = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reserve-mib") && i + 1 < argc) reserve_mib = strtoull(argv[++i], 0, 10);
        else if (!strcmp(argv[i], "--static-mib") && i + 1 < argc) static_mib = strtoull(argv[++i], 0, 10);
        else { fprintf(stderr, "unknown argument %s\n", argv[i]); return 2; }
    }
    // --device picks the GPU (default 0) before any other CUDA call; with --fork, each
    // process sets it itself, after the fork.
    if (!fork_child) CHECK(cudaSetDevice(device));
    if (hog_free >= 0) {
        size_t free_b, total_b; CHECK(cudaMemGetInfo(&free_b, &total_b));
        size_t want = free_b - (size_t)hog_free * 1024 * 1024;
        void *p; CHECK(cudaMalloc(&p, want));
        printf("hogging %zu MiB\n", want >> 20); fflush(stdout);
        for (;;) pause();
    }
    if (fork_child) {
        // Two GPU processes in one job: the child is forked before either touches CUDA.
        pid_t child = fork();
        if (child == 0) return run("child ", mib / 2, steps, interval, 7, -1, 0);
        int rc = run("", mib / 2, steps, interval, 1, spin_at, spin_ms);
        int st = 0; waitpid(child, &st, 0);
        int child_ok = WIFEXITED(st) && WEXITSTATUS(st) == 0;
        printf("%s both processes\n", rc == 0 && child_ok ? "verify ok" : "verify FAILED");
        return rc == 0 && child_ok ? 0 : 1;
    }
    return run("", mib, steps, interval, 1, spin_at, spin_ms);
}
