/* An MPI job whose ranks compute on the GPU, for hiber's GPU suite (#38): tests/fixtures/
 * mpi_ring.c's ring (every step each rank passes its state to the next rank with
 * MPI_Sendrecv, and all ranks sum their states with MPI_Allreduce), with each rank's memory
 * on its GPU (rank r on GPU r mod the GPUs it sees). Every step a kernel folds one word of
 * the rank's device memory (a different one each step) into its state, which lives on the
 * device too, and changes that word; so the printed trajectory depends on every rank's
 * device memory and every message at every step. Rank 0 prints `step N checksum X t MS`.
 * At the end each rank checks its whole device memory against a copy it kept on the host,
 * changed the same way, and rank 0 prints `verify ok` when every rank agrees.
 * Usage: mpirun -np N mpi_cuda_ring STEPS PAUSE_MS MEM_MIB */
#include <cuda_runtime.h>
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

static uint64_t now_ms(void) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (uint64_t)t.tv_sec * 1000 + (uint64_t)t.tv_nsec / 1000000;
}

__host__ __device__ static uint64_t mix(uint64_t x, uint64_t s) {
    x ^= s * 0x9e3779b97f4a7c15ULL;
    x ^= x >> 31;
    x *= 0xbf58476d1ce4e5b9ULL;
    return x ^ (x >> 29);
}

__global__ void fill(uint64_t *mem, size_t words, uint64_t rank) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < words; i += (size_t)gridDim.x * blockDim.x)
        mem[i] = mix(rank * 0x100000000ULL + i, 7);
}

/* One step's device work: state = mix(state ^ got), then fold word `at` in and change it. */
__global__ void fold(uint64_t *mem, uint64_t *state, uint64_t got, size_t at, uint64_t step) {
    uint64_t s = mix(*state ^ got, step);
    s = mix(s ^ mem[at], step);
    mem[at] ^= s;
    *state = s;
}

#define CHECK(call)                                                                          \
    do {                                                                                     \
        cudaError_t e_ = (call);                                                             \
        if (e_ != cudaSuccess) {                                                             \
            fprintf(stderr, "rank %d: %s: %s\n", rank, #call, cudaGetErrorString(e_));       \
            MPI_Abort(MPI_COMM_WORLD, 2);                                                    \
        }                                                                                    \
    } while (0)

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    int steps = argc > 1 ? atoi(argv[1]) : 100;
    int pause = argc > 2 ? atoi(argv[2]) : 50;
    size_t words = (size_t)(argc > 3 ? atoi(argv[3]) : 256) * (1u << 20) / 8;
    int ndev = 0;
    CHECK(cudaGetDeviceCount(&ndev));
    CHECK(cudaSetDevice(rank % ndev));
    char uuid[64] = "?";
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, rank % ndev) == cudaSuccess) {
        const unsigned char *u = (const unsigned char *)prop.uuid.bytes;
        snprintf(uuid, sizeof uuid, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", u[0], u[1], u[2], u[3], u[4], u[5], u[6],
                 u[7], u[8], u[9], u[10], u[11], u[12], u[13], u[14], u[15]);
    }
    printf("start rank %d of %d pid %d gpu %d %s\n", rank, size, (int)getpid(), rank % ndev, uuid);
    fflush(stdout);
    uint64_t *mem = NULL, *dstate = NULL;
    CHECK(cudaMalloc(&mem, words * 8));
    CHECK(cudaMalloc(&dstate, 8));
    uint64_t *shadow = (uint64_t *)malloc(words * 8);
    if (!shadow) {
        fprintf(stderr, "rank %d: cannot allocate the host copy\n", rank);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    for (size_t i = 0; i < words; i++) shadow[i] = mix((uint64_t)rank * 0x100000000ULL + i, 7);
    fill<<<256, 256>>>(mem, words, (uint64_t)rank);
    uint64_t state = (uint64_t)rank + 1;
    CHECK(cudaMemcpy(dstate, &state, 8, cudaMemcpyHostToDevice));
    int next = (rank + 1) % size, prev = (rank + size - 1) % size;
    int done = 0;
    for (int s = 1; s <= steps; s++) {
        uint64_t got = 0, sum = 0;
        MPI_Sendrecv(&state, 1, MPI_UINT64_T, next, 0, &got, 1, MPI_UINT64_T, prev, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        size_t at = mix((uint64_t)s, (uint64_t)rank) % words;
        fold<<<1, 1>>>(mem, dstate, got, at, (uint64_t)s);
        CHECK(cudaMemcpy(&state, dstate, 8, cudaMemcpyDeviceToHost));
        shadow[at] ^= state;
        MPI_Allreduce(&state, &sum, 1, MPI_UINT64_T, MPI_SUM, MPI_COMM_WORLD);
        if (rank == 0) {
            printf("step %d checksum %016llx t %llu\n", s, (unsigned long long)sum, (unsigned long long)now_ms());
            fflush(stdout);
        }
        done = s;
        usleep((useconds_t)pause * 1000);
    }
    /* The whole device memory, against the host's copy. */
    uint64_t *back = (uint64_t *)malloc(words * 8);
    int intact = back != NULL;
    if (back) {
        CHECK(cudaMemcpy(back, mem, words * 8, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < words && intact; i++) intact = back[i] == shadow[i];
    }
    int lo = 0, hi = 0, all_intact = 0;
    MPI_Allreduce(&done, &lo, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    MPI_Allreduce(&done, &hi, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(&intact, &all_intact, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    int ok = lo == steps && hi == steps && all_intact;
    if (rank == 0) {
        if (ok)
            printf("verify ok ranks %d steps %d device memory intact\n", size, steps);
        else
            printf("verify failed: ranks ended at steps %d..%d of %d, device memory intact on all: %d\n", lo, hi, steps, all_intact);
        fflush(stdout);
    }
    MPI_Finalize();
    return ok ? 0 : 1;
}
