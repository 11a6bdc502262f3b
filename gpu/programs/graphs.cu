// A CUDA C++ test program for hiber's GPU suite: every step is one launch of a CUDA graph.
//
// The same protocol as counter.cu (a `step N checksum X t MS` line per step, then `verify ok`
// or `verify FAILED` after recomputing every word on the device). Its --mib MiB of device
// memory are two cudaMalloc'd buffers, advanced by a graph captured once, before the first
// step, from two streams:
//
//   s0: fork ─► step(a) ──────────────► join ─► gather(a, b → sample) ─► advance(step counter)
//   s1:         └─► step(b, salted) ──┘
//
// A graph's kernel nodes keep the arguments they were captured with, device pointers
// included, so the step number lives in device memory and the last node advances it: a
// restored graph only works if every buffer is back at its address with its content.
//
//   graphs [--mib N] [--steps S] [--interval-ms I]
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <ctime>
#include <unistd.h>
#include <cuda_runtime.h>

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
    printf("cuda error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); fflush(stdout); exit(2); } } while (0)

// Buffer b's steps are salted, so that the two buffers never hold the same chain.
static const uint64_t SALT_B = 0x5BD1E9955BD1E995ULL;

__host__ __device__ static inline uint64_t mix(uint64_t z) {
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

__host__ __device__ static inline uint64_t step_key(uint64_t step, uint64_t salt) {
    return (step ^ salt) * 0x9E3779B97F4A7C15ULL;
}

__global__ void k_init(uint64_t *buf, uint64_t n, uint64_t seed) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
        buf[i] = mix(seed ^ (i * 0x2545F4914F6CDD1DULL));
}

__global__ void k_step(uint64_t *buf, uint64_t n, const uint64_t *step_p, uint64_t salt) {
    uint64_t k = step_key(*step_p, salt);
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
        buf[i] = mix(buf[i] ^ k ^ i);
}

// Copies the step's sample window of both buffers into `out`: a first, b after.
__global__ void k_gather(const uint64_t *a, const uint64_t *b, uint64_t n, uint64_t count, const uint64_t *step_p, uint64_t *out) {
    uint64_t off = mix(*step_p) % (n - count);
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < count; i += (uint64_t)gridDim.x * blockDim.x) {
        out[i] = a[off + i];
        out[count + i] = b[off + i];
    }
}

__global__ void k_advance(uint64_t *step_p) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *step_p += 1;
}

__global__ void k_verify(const uint64_t *buf, uint64_t n, uint64_t seed, uint64_t salt, uint64_t steps, unsigned long long *bad) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x) {
        uint64_t v = mix(seed ^ (i * 0x2545F4914F6CDD1DULL));
        for (uint64_t s = 0; s < steps; s++) v = mix(v ^ step_key(s, salt) ^ i);
        if (v != buf[i]) atomicAdd(bad, 1ULL);
    }
}

static unsigned long long now_ms() {
    timespec ts; clock_gettime(CLOCK_REALTIME, &ts);
    return (unsigned long long)ts.tv_sec * 1000ULL + ts.tv_nsec / 1000000ULL;
}

int main(int argc, char **argv) {
    uint64_t mib = 512, steps = 200; unsigned interval = 20;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--mib") && i + 1 < argc) mib = strtoull(argv[++i], 0, 10);
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = strtoull(argv[++i], 0, 10);
        else if (!strcmp(argv[i], "--interval-ms") && i + 1 < argc) interval = atoi(argv[++i]);
        else { fprintf(stderr, "unknown argument %s\n", argv[i]); return 2; }
    }
    if (mib < 1) { fprintf(stderr, "--mib must be at least 1\n"); return 2; }
    // Two buffers of n words each: half of --mib apiece.
    uint64_t n = mib * 1024 * 1024 / 16, sample_n = 8192;
    uint64_t *a, *b, *d_step, *d_sample; unsigned long long *bad;
    CHECK(cudaMalloc(&a, n * 8));
    CHECK(cudaMalloc(&b, n * 8));
    CHECK(cudaMalloc(&d_step, 8));
    CHECK(cudaMalloc(&d_sample, 2 * sample_n * 8));
    CHECK(cudaMalloc(&bad, 8));
    cudaStream_t s0, s1;
    CHECK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
    CHECK(cudaStreamCreateWithFlags(&s1, cudaStreamNonBlocking));
    k_init<<<1024, 256, 0, s0>>>(a, n, 1);
    k_init<<<1024, 256, 0, s0>>>(b, n, 2);
    CHECK(cudaGetLastError());
    CHECK(cudaMemsetAsync(d_step, 0, 8, s0));
    CHECK(cudaStreamSynchronize(s0));

    cudaEvent_t fork_ev, join_ev;
    CHECK(cudaEventCreateWithFlags(&fork_ev, cudaEventDisableTiming));
    CHECK(cudaEventCreateWithFlags(&join_ev, cudaEventDisableTiming));
    cudaGraph_t graph;
    CHECK(cudaStreamBeginCapture(s0, cudaStreamCaptureModeGlobal));
    CHECK(cudaEventRecord(fork_ev, s0));
    CHECK(cudaStreamWaitEvent(s1, fork_ev, 0));
    k_step<<<1024, 256, 0, s0>>>(a, n, d_step, 0);
    k_step<<<1024, 256, 0, s1>>>(b, n, d_step, SALT_B);
    CHECK(cudaEventRecord(join_ev, s1));
    CHECK(cudaStreamWaitEvent(s0, join_ev, 0));
    k_gather<<<64, 256, 0, s0>>>(a, b, n, sample_n, d_step, d_sample);
    k_advance<<<1, 1, 0, s0>>>(d_step);
    CHECK(cudaGetLastError());
    CHECK(cudaStreamEndCapture(s0, &graph));
    cudaGraphExec_t exec;
    CHECK(cudaGraphInstantiate(&exec, graph, 0));

    uint64_t *sample = (uint64_t *)malloc(2 * sample_n * 8);
    uint64_t checksum = 1;
    printf("start graphs mib %llu steps %llu pid %d\n", (unsigned long long)mib, (unsigned long long)steps, getpid());
    fflush(stdout);
    for (uint64_t step = 0; step < steps; step++) {
        // The graph reads the step number from d_step, which equals `step` here.
        CHECK(cudaGraphLaunch(exec, s0));
        CHECK(cudaMemcpyAsync(sample, d_sample, 2 * sample_n * 8, cudaMemcpyDeviceToHost, s0));
        CHECK(cudaStreamSynchronize(s0));
        uint64_t c = mix(checksum ^ step);
        for (uint64_t i = 0; i < 2 * sample_n; i++) c = mix(c ^ sample[i]);
        checksum = c;
        printf("step %llu checksum %016llx t %llu\n", (unsigned long long)step, (unsigned long long)checksum, now_ms());
        fflush(stdout);
        usleep(interval * 1000);
    }
    uint64_t device_steps = 0;
    CHECK(cudaMemcpy(&device_steps, d_step, 8, cudaMemcpyDeviceToHost));
    CHECK(cudaMemset(bad, 0, 8));
    k_verify<<<1024, 256>>>(a, n, 1, 0, steps, bad);
    k_verify<<<1024, 256>>>(b, n, 2, SALT_B, steps, bad);
    CHECK(cudaGetLastError());
    unsigned long long bad_words = 0;
    CHECK(cudaMemcpy(&bad_words, bad, 8, cudaMemcpyDeviceToHost));
    int ok = bad_words == 0 && device_steps == steps;
    printf("%s bad_words %llu of %llu device_steps %llu\n", ok ? "verify ok" : "verify FAILED", bad_words,
           (unsigned long long)(2 * n), (unsigned long long)device_steps);
    fflush(stdout);
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    return ok ? 0 : 1;
}
