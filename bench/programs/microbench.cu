// The CUDA microbenchmark of the agent-overhead benchmark (bench/bench.py --overhead-reps),
// built with nvcc defaults (static cudart).
//
// What a preloaded library intercepting the CUDA API would slow down most: each block
// allocates and frees many small buffers (4 KiB to 1 MiB) and a few large ones (8 to
// 64 MiB), launches many tiny kernels and makes many small copies, then synchronizes.
// It prints the wall time of each block, and at the end checks on the host that every
// launch and copy did what it should.
//
//   microbench [--blocks B]
//
// Output: `start microbench blocks B pid P`, then `block N ms X` per block, then
// `verify ok` (or `verify FAILED ...`) and `done`.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <ctime>
#include <unistd.h>
#include <cuda_runtime.h>

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
    printf("cuda error %s at %s:%d\n", cudaGetErrorString(e), __FILE__, __LINE__); fflush(stdout); exit(2); } } while (0)

static const int SMALL_PER_BLOCK = 512;
static const int LAUNCHES_PER_BLOCK = 2000;
static const int COPIES_PER_BLOCK = 256;
static const size_t COPY_BYTES = 4096;

// Writes a word derived from `tag` at the start and the end of a fresh buffer.
__global__ void k_touch(uint32_t *buf, size_t words, uint32_t tag) {
    if (threadIdx.x == 0) {
        buf[0] = tag;
        buf[words - 1] = tag ^ 0xA5A5A5A5u;
    }
}

// One tiny kernel: adds `v` to one counter word.
__global__ void k_add(unsigned long long *counter, unsigned long long v) {
    if (threadIdx.x == 0) counter[0] += v;
}

// Adds the first word of a buffer just copied in to the second counter word.
__global__ void k_fold(const uint32_t *buf, unsigned long long *counter) {
    if (threadIdx.x == 0) counter[1] += buf[0];
}

static double now_s() {
    timespec ts; clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// xorshift64: the same sizes and orders in every run.
static uint64_t rng_state = 0x9E3779B97F4A7C15ULL;
static uint64_t rnd() {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

int main(int argc, char **argv) {
    int blocks = 40;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--blocks") && i + 1 < argc) blocks = atoi(argv[++i]);
        else { fprintf(stderr, "usage: microbench [--blocks B]\n"); return 2; }
    }
    printf("start microbench blocks %d pid %d\n", blocks, (int)getpid());
    fflush(stdout);

    unsigned long long *counter;
    CHECK(cudaMalloc(&counter, 2 * sizeof(unsigned long long)));
    CHECK(cudaMemset(counter, 0, 2 * sizeof(unsigned long long)));
    uint32_t *stage;
    CHECK(cudaMalloc(&stage, COPY_BYTES));
    uint32_t *host = (uint32_t *)malloc(COPY_BYTES);
    uint32_t back[64];
    void *small[SMALL_PER_BLOCK];
    size_t small_bytes[SMALL_PER_BLOCK];
    unsigned long long expect_add = 0, expect_fold = 0;
    int bad_reads = 0;

    for (int b = 0; b < blocks; b++) {
        double t0 = now_s();

        // Many small buffers, each touched by a kernel; every 8th round-trips a copy.
        for (int i = 0; i < SMALL_PER_BLOCK; i++) {
            small_bytes[i] = (size_t)4096 << (rnd() % 9);  // 4 KiB .. 1 MiB
            CHECK(cudaMalloc(&small[i], small_bytes[i]));
            uint32_t tag = (uint32_t)(b * SMALL_PER_BLOCK + i);
            k_touch<<<1, 32>>>((uint32_t *)small[i], small_bytes[i] / 4, tag);
            if (i % 8 == 0) {
                uint32_t got[1];
                CHECK(cudaMemcpy(got, small[i], sizeof(got), cudaMemcpyDeviceToHost));
                if (got[0] != tag) bad_reads++;
            }
        }
        // Freed in a shuffled order, as a real allocator's frees come.
        for (int i = SMALL_PER_BLOCK - 1; i > 0; i--) {
            int j = (int)(rnd() % (uint64_t)(i + 1));
            void *p = small[i]; small[i] = small[j]; small[j] = p;
        }
        for (int i = 0; i < SMALL_PER_BLOCK; i++) CHECK(cudaFree(small[i]));

        // A few large buffers: 8, 16, 32, 64 MiB, rotating.
        for (int i = 0; i < 4; i++) {
            size_t bytes = (size_t)8 << 20 << ((b + i) % 4);
            void *p;
            CHECK(cudaMalloc(&p, bytes));
            CHECK(cudaMemsetAsync(p, 0, bytes));
            k_touch<<<1, 32>>>((uint32_t *)p, bytes / 4, (uint32_t)i);
            CHECK(cudaFree(p));
        }

        // Many tiny launches.
        for (int i = 0; i < LAUNCHES_PER_BLOCK; i++) {
            unsigned long long v = (unsigned long long)(b + 1) * (i + 1);
            k_add<<<1, 32>>>(counter, v);
            expect_add += v;
        }
        CHECK(cudaGetLastError());

        // Many small copies: 4 KiB in, a kernel reads it, 256 B back.
        for (int i = 0; i < COPIES_PER_BLOCK; i++) {
            uint32_t word = (uint32_t)(rnd() & 0xffff);
            host[0] = word;
            CHECK(cudaMemcpy(stage, host, COPY_BYTES, cudaMemcpyHostToDevice));
            k_fold<<<1, 32>>>(stage, counter);
            expect_fold += word;
            CHECK(cudaMemcpy(back, stage, sizeof(back), cudaMemcpyDeviceToHost));
            if (back[0] != word) bad_reads++;
        }
        CHECK(cudaDeviceSynchronize());

        double t1 = now_s();
        printf("block %d ms %.3f\n", b, (t1 - t0) * 1e3);
        fflush(stdout);
    }

    unsigned long long got[2];
    CHECK(cudaMemcpy(got, counter, sizeof(got), cudaMemcpyDeviceToHost));
    bool ok = got[0] == expect_add && got[1] == expect_fold && bad_reads == 0;
    if (ok) {
        printf("verify ok\n");
    } else {
        printf("verify FAILED add %llu/%llu fold %llu/%llu bad_reads %d\n", got[0], expect_add, got[1], expect_fold, bad_reads);
    }
    printf("done\n");
    fflush(stdout);
    free(host);
    return ok ? 0 : 1;
}
