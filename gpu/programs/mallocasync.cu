// A CUDA C++ test program for hiber's GPU suite: device state in stream-ordered memory.
//
// The same protocol as counter.cu (a `step N checksum X t MS` line per step, then `verify ok`
// or `verify FAILED` after recomputing every word on the device), but every byte of device
// memory comes from stream-ordered allocation, which the agent does not serve and leaves to
// the driver path:
//   - half of --mib from cudaMallocAsync, out of the device's default pool, whose release
//     threshold is raised to keep everything it reserves;
//   - half from cudaMallocFromPoolAsync, out of a pool of its own whose release threshold is
//     --threshold-mib;
//   - each step reads its sample through a scratch buffer allocated and freed on the stream
//     from that pool, so the pool grows and trims around every synchronisation.
//
//   mallocasync [--mib N] [--steps S] [--interval-ms I] [--threshold-mib T]
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

__global__ void k_init(uint64_t *buf, uint64_t n, uint64_t seed) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
        buf[i] = mix(seed ^ (i * 0x2545F4914F6CDD1DULL));
}

__global__ void k_step(uint64_t *buf, uint64_t n, uint64_t step) {
    uint64_t k = step * 0x9E3779B97F4A7C15ULL;
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
        buf[i] = mix(buf[i] ^ k ^ i);
}

// Copies the step's sample window of both buffers into one scratch buffer: a first, b after.
__global__ void k_gather(const uint64_t *a, const uint64_t *b, uint64_t off, uint64_t count, uint64_t *out) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < count; i += (uint64_t)gridDim.x * blockDim.x) {
        out[i] = a[off + i];
        out[count + i] = b[off + i];
    }
}

__global__ void k_verify(const uint64_t *buf, uint64_t n, uint64_t seed, uint64_t steps, unsigned long long *bad) {
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x) {
        uint64_t v = mix(seed ^ (i * 0x2545F4914F6CDD1DULL));
        for (uint64_t s = 0; s < steps; s++) v = mix(v ^ (s * 0x9E3779B97F4A7C15ULL) ^ i);
        if (v != buf[i]) atomicAdd(bad, 1ULL);
    }
}

static unsigned long long now_ms() {
    timespec ts; clock_gettime(CLOCK_REALTIME, &ts);
    return (unsigned long long)ts.tv_sec * 1000ULL + ts.tv_nsec / 1000000ULL;
}

int main(int argc, char **argv) {
    uint64_t mib = 1024, steps = 200, threshold_mib = 64; unsigned interval = 20;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--mib") && i + 1 < argc) mib = strtoull(argv[++i], 0, 10);
        else if (!strcmp(argv[i], "--steps") && i + 1 < argc) steps = strtoull(argv[++i], 0, 10);
        else if (!strcmp(argv[i], "--interval-ms") && i + 1 < argc) interval = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threshold-mib") && i + 1 < argc) threshold_mib = strtoull(argv[++i], 0, 10);
        else { fprintf(stderr, "unknown argument %s\n", argv[i]); return 2; }
    }
    if (mib < 1) { fprintf(stderr, "--mib must be at least 1\n"); return 2; }
    const int dev = 0;
    CHECK(cudaSetDevice(dev));
    int pools = 0;
    CHECK(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, dev));
    if (!pools) { printf("cuda error memory pools not supported on device %d\n", dev); fflush(stdout); return 2; }

    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    // The default pool keeps all it reserves (no trimming at synchronisation)...
    cudaMemPool_t def_pool;
    CHECK(cudaDeviceGetDefaultMemPool(&def_pool, dev));
    uint64_t keep_all = UINT64_MAX;
    CHECK(cudaMemPoolSetAttribute(def_pool, cudaMemPoolAttrReleaseThreshold, &keep_all));
    // ...while our own pool gives back to the driver what it holds beyond the threshold.
    cudaMemPoolProps props;
    memset(&props, 0, sizeof props);
    props.allocType = cudaMemAllocationTypePinned;
    props.handleTypes = cudaMemHandleTypeNone;
    props.location.type = cudaMemLocationTypeDevice;
    props.location.id = dev;
    cudaMemPool_t pool;
    CHECK(cudaMemPoolCreate(&pool, &props));
    uint64_t threshold = threshold_mib << 20;
    CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));

    // Two buffers of n words each: half of --mib apiece.
    uint64_t n = mib * 1024 * 1024 / 16, sample_n = 8192;
    uint64_t *a, *b; unsigned long long *bad;
    CHECK(cudaMallocAsync((void **)&a, n * 8, s));
    CHECK(cudaMallocFromPoolAsync((void **)&b, n * 8, pool, s));
    CHECK(cudaMallocAsync((void **)&bad, 8, s));
    k_init<<<1024, 256, 0, s>>>(a, n, 1);
    k_init<<<1024, 256, 0, s>>>(b, n, 2);
    CHECK(cudaGetLastError());
    CHECK(cudaStreamSynchronize(s));
    uint64_t *sample = (uint64_t *)malloc(2 * sample_n * 8);
    uint64_t checksum = 1;
    printf("start mallocasync mib %llu steps %llu threshold_mib %llu pid %d\n", (unsigned long long)mib,
           (unsigned long long)steps, (unsigned long long)threshold_mib, getpid());
    fflush(stdout);
    for (uint64_t step = 0; step < steps; step++) {
        k_step<<<1024, 256, 0, s>>>(a, n, step);
        k_step<<<1024, 256, 0, s>>>(b, n, step);
        uint64_t off = mix(step) % (n - sample_n);
        uint64_t *scratch;
        CHECK(cudaMallocFromPoolAsync((void **)&scratch, 2 * sample_n * 8, pool, s));
        k_gather<<<64, 256, 0, s>>>(a, b, off, sample_n, scratch);
        CHECK(cudaGetLastError());
        CHECK(cudaMemcpyAsync(sample, scratch, 2 * sample_n * 8, cudaMemcpyDeviceToHost, s));
        CHECK(cudaFreeAsync(scratch, s));
        CHECK(cudaStreamSynchronize(s));
        uint64_t c = mix(checksum ^ step);
        for (uint64_t i = 0; i < 2 * sample_n; i++) c = mix(c ^ sample[i]);
        checksum = c;
        printf("step %llu checksum %016llx t %llu\n", (unsigned long long)step, (unsigned long long)checksum, now_ms());
        fflush(stdout);
        usleep(interval * 1000);
    }
    CHECK(cudaMemsetAsync(bad, 0, 8, s));
    k_verify<<<1024, 256, 0, s>>>(a, n, 1, steps, bad);
    k_verify<<<1024, 256, 0, s>>>(b, n, 2, steps, bad);
    CHECK(cudaGetLastError());
    unsigned long long bad_words = 0;
    CHECK(cudaMemcpyAsync(&bad_words, bad, 8, cudaMemcpyDeviceToHost, s));
    CHECK(cudaStreamSynchronize(s));
    printf("%s bad_words %llu of %llu\n", bad_words == 0 ? "verify ok" : "verify FAILED", bad_words, (unsigned long long)(2 * n));
    fflush(stdout);
    CHECK(cudaFreeAsync(a, s));
    CHECK(cudaFreeAsync(b, s));
    CHECK(cudaFreeAsync(bad, s));
    CHECK(cudaStreamSynchronize(s));
    CHECK(cudaMemPoolDestroy(pool));
    return bad_words == 0 ? 0 : 1;
}
