/* Can hiber find which chunks of device memory changed since the parent image without
 * moving the unchanged ones over PCIe? Measures fingerprinting device memory on the GPU
 * against copying it to host memory, and checks that the fingerprints find exactly the
 * chunks that changed (issue: speed on a full GPU, incremental images). Built and run on
 * the GPU machine:
 *
 *   nvcc -O3 -o fingerprint bench/staging/fingerprint.cu && ./fingerprint [GIB]
 *
 * The fingerprint of a 2 MiB block (the VMM granularity, so every allocation hiber moves is
 * a whole number of blocks): 256 threads, thread t folding words t, t+256, ... of the block
 * into two 64-bit lanes with xxHash64's round (acc = rotl(acc + w * P2, 31) * P1, from two
 * seeds) and xxHash64's avalanche: 512 words, 4 KiB, per 2 MiB. hiber would hash those on
 * the CPU (blake3) into one fingerprint per chunk and compare with the parent's. The host
 * reference below must give the same words; it is what a port to PTX is checked against.
 *
 * Prints one JSON object per line. */
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <cuda_runtime.h>

#define CHECK(x)                                                                              \
    do {                                                                                      \
        cudaError_t e = (x);                                                                  \
        if (e != cudaSuccess) {                                                               \
            fprintf(stderr, "%s failed: %s (line %d)\n", #x, cudaGetErrorString(e), __LINE__); \
            exit(1);                                                                          \
        }                                                                                     \
    } while (0)

// Macros, so that host and device code use the same constants without question.
#define P1 0x9E3779B185EBCA87ULL
#define P2 0xC2B2AE3D27D4EB4FULL
#define P3 0x165667B19E3779F9ULL
#define SEED1 0x6869626572000001ULL
#define SEED2 0x6869626572000002ULL
#define THREADS 256
#define BLOCK ((size_t)2 << 20)
#define WORDS (BLOCK / 8)

__host__ __device__ static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
__host__ __device__ static inline uint64_t round_(uint64_t acc, uint64_t w) { return rotl(acc + w * P2, 31) * P1; }
__host__ __device__ static inline uint64_t avalanche(uint64_t h) {
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    h ^= h >> 32;
    return h;
}

__global__ void fingerprint(const uint64_t *data, uint64_t *out) {
    const uint64_t *block = data + (size_t)blockIdx.x * WORDS;
    uint64_t a = SEED1, b = SEED2;
    for (size_t i = threadIdx.x; i < WORDS; i += THREADS) {
        uint64_t w = block[i];
        a = round_(a, w);
        b = round_(b, w ^ P3);
    }
    size_t o = ((size_t)blockIdx.x * THREADS + threadIdx.x) * 2;
    out[o] = avalanche(a);
    out[o + 1] = avalanche(b);
}

__global__ void fill(uint64_t *data, size_t n, uint64_t seed) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        uint64_t z = seed ^ (i * 0x2545F4914F6CDD1DULL);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
        data[i] = z ^ (z >> 31);
    }
}

/* The same fingerprint of one block, on the host. */
static void host_fingerprint(const uint64_t *block, uint64_t *out) {
    for (int t = 0; t < THREADS; t++) {
        uint64_t a = SEED1, b = SEED2;
        for (size_t i = t; i < WORDS; i += THREADS) {
            a = round_(a, block[i]);
            b = round_(b, block[i] ^ P3);
        }
        out[2 * t] = avalanche(a);
        out[2 * t + 1] = avalanche(b);
    }
}

static double elapsed(cudaEvent_t a, cudaEvent_t b) {
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    return ms / 1000.0;
}

int main(int argc, char **argv) {
    size_t gib = argc > 1 ? strtoull(argv[1], 0, 10) : 8;
    size_t bytes = gib << 30, blocks = bytes / BLOCK, words = bytes / 8;
    size_t out_words = blocks * THREADS * 2;
    uint64_t *data, *parent, *fp, *fp_parent;
    CHECK(cudaMalloc(&data, bytes));
    CHECK(cudaMalloc(&parent, bytes));
    CHECK(cudaMalloc(&fp, out_words * 8));
    CHECK(cudaMalloc(&fp_parent, out_words * 8));
    fill<<<1024, 256>>>(data, words, 42);
    CHECK(cudaDeviceSynchronize());
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));

    // Fingerprinting: the best of five passes over the whole buffer.
    double best = 1e9;
    for (int rep = 0; rep < 5; rep++) {
        CHECK(cudaEventRecord(e0));
        fingerprint<<<blocks, THREADS>>>(data, fp);
        CHECK(cudaEventRecord(e1));
        CHECK(cudaEventSynchronize(e1));
        CHECK(cudaGetLastError());
        double s = elapsed(e0, e1);
        best = s < best ? s : best;
    }
    printf("{\"what\": \"fingerprint on the GPU\", \"gib\": %zu, \"seconds\": %.5f, \"GBps\": %.1f, \"fingerprint_bytes\": %zu}\n", gib, best, bytes / best / 1e9, out_words * 8);

    // The fingerprints to host memory (what the CPU would hash and compare).
    std::vector<uint64_t> host_fp(out_words), host_fp_parent(out_words);
    CHECK(cudaEventRecord(e0));
    CHECK(cudaMemcpy(host_fp.data(), fp, out_words * 8, cudaMemcpyDeviceToHost));
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    printf("{\"what\": \"fingerprints to host\", \"seconds\": %.5f}\n", elapsed(e0, e1));

    // Against copying the data itself to pinned host memory, 1 GiB at a time.
    size_t piece = (size_t)1 << 30;
    void *pinned;
    CHECK(cudaMallocHost(&pinned, piece));
    CHECK(cudaEventRecord(e0));
    for (size_t off = 0; off < bytes; off += piece) CHECK(cudaMemcpy(pinned, (char *)data + off, piece, cudaMemcpyDeviceToHost));
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    double copy = elapsed(e0, e1);
    printf("{\"what\": \"copy to pinned host memory\", \"gib\": %zu, \"seconds\": %.5f, \"GBps\": %.1f}\n", gib, copy, bytes / copy / 1e9);

    // The host reference agrees with the GPU on a few blocks.
    std::vector<uint64_t> block(WORDS), ref(THREADS * 2);
    size_t mismatched = 0;
    for (size_t k : {(size_t)0, blocks / 2, blocks - 1}) {
        CHECK(cudaMemcpy(block.data(), (char *)data + k * BLOCK, BLOCK, cudaMemcpyDeviceToHost));
        host_fingerprint(block.data(), ref.data());
        mismatched += memcmp(ref.data(), &host_fp[k * THREADS * 2], THREADS * 16) != 0;
    }
    printf("{\"what\": \"host reference\", \"blocks_checked\": 3, \"mismatched\": %zu}\n", mismatched);

    // Change detection: the parent is a copy; 1% of the blocks get one bit flipped, at a
    // random word; the fingerprints must differ in exactly those blocks.
    CHECK(cudaMemcpy(parent, data, bytes, cudaMemcpyDeviceToDevice));
    srand(7);
    std::vector<char> changed(blocks, 0);
    size_t want = blocks / 100 + 1;
    for (size_t n = 0; n < want;) {
        size_t k = (size_t)rand() % blocks;
        if (changed[k]) continue;
        changed[k] = 1;
        n++;
        size_t w = k * WORDS + (size_t)rand() % WORDS;
        uint64_t v;
        CHECK(cudaMemcpy(&v, data + w, 8, cudaMemcpyDeviceToHost));
        v ^= 1ULL << (rand() % 64);
        CHECK(cudaMemcpy(data + w, &v, 8, cudaMemcpyHostToDevice));
    }
    fingerprint<<<blocks, THREADS>>>(data, fp);
    fingerprint<<<blocks, THREADS>>>(parent, fp_parent);
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(host_fp.data(), fp, out_words * 8, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(host_fp_parent.data(), fp_parent, out_words * 8, cudaMemcpyDeviceToHost));
    size_t found = 0, wrong = 0;
    for (size_t k = 0; k < blocks; k++) {
        bool differs = memcmp(&host_fp[k * THREADS * 2], &host_fp_parent[k * THREADS * 2], THREADS * 16) != 0;
        found += differs && changed[k];
        wrong += differs != (bool)changed[k];
    }
    printf("{\"what\": \"change detection\", \"blocks\": %zu, \"changed\": %zu, \"found\": %zu, \"wrong\": %zu}\n", blocks, want, found, wrong);
    return mismatched || wrong ? 1 : 0;
}
