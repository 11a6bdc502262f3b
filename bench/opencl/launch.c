/* A launch-heavy OpenCL microbenchmark: many small kernels and small transfers, the
 * pattern where a layer in front of every call costs the most. Each round enqueues ROUNDS
 * tiny kernels, a 4 KiB write and a 4 KiB read, then finishes the queue; prints one line
 * per repetition: `rep R us_per_call X` (X: wall time divided by calls made).
 * Usage: launch REPS ROUNDS DEVICE [thread] (DEVICE: index, gpu or cpu; thread: the loop runs
 * on a thread other than the one that made the context, queue and kernel, as a proxy's
 * thread that runs the posted calls does) */
#include <pthread.h>

#include "../../crates/hiber/tests/opencl/common.h"

static const char *SRC = "__kernel void inc(__global uint *a, uint v) { a[get_global_id(0)] += v; }\n";

struct loop {
    int reps, rounds;
    cl_command_queue q;
    cl_kernel k;
    cl_mem b;
    uint32_t *host;
};

static void *run_loop(void *arg) {
    struct loop *l = arg;
    int reps = l->reps, rounds = l->rounds;
    cl_command_queue q = l->q;
    cl_kernel k = l->k;
    cl_mem b = l->b;
    uint32_t *host = l->host;
    for (int r = 0; r < reps; r++) {
        uint64_t t0 = now_ms();
        struct timespec a, z;
        clock_gettime(CLOCK_MONOTONIC, &a);
        long calls = 0;
        for (int i = 0; i < rounds; i++) {
            uint32_t v = (uint32_t)i;
            CHECK(clSetKernelArg(k, 1, sizeof v, &v));
            size_t g = 64;
            CHECK(clEnqueueNDRangeKernel(q, k, 1, NULL, &g, NULL, 0, NULL, NULL));
            calls += 2;
            if (i % 100 == 99) {
                CHECK(clEnqueueWriteBuffer(q, b, CL_FALSE, 0, 256, host, 0, NULL, NULL));
                CHECK(clEnqueueReadBuffer(q, b, CL_TRUE, 0, 4096, host, 0, NULL, NULL));
                calls += 2;
            }
        }
        CHECK(clFinish(q));
        clock_gettime(CLOCK_MONOTONIC, &z);
        double us = ((z.tv_sec - a.tv_sec) * 1e6 + (z.tv_nsec - a.tv_nsec) / 1e3) / (double)calls;
        printf("rep %d us_per_call %.4f t %llu\n", r, us, (unsigned long long)t0);
        fflush(stdout);
    }
    return NULL;
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 5;
    int rounds = argc > 2 ? atoi(argv[2]) : 20000;
    int dev = argc > 3 ? device_arg(argv[3]) : 0;
    cl_platform_id platform;
    cl_device_id d = pick_device(dev, &platform);
    cl_int err;
    cl_context ctx = clCreateContext(NULL, 1, &d, NULL, NULL, &err);
    CHECK(err);
    cl_command_queue q = clCreateCommandQueueWithProperties(ctx, d, NULL, &err);
    CHECK(err);
    cl_program p = build(ctx, d, SRC);
    cl_kernel k = clCreateKernel(p, "inc", &err);
    CHECK(err);
    cl_mem b = clCreateBuffer(ctx, CL_MEM_READ_WRITE, 4096, NULL, &err);
    CHECK(err);
    uint32_t host[1024] = {0};
    CHECK(clEnqueueWriteBuffer(q, b, CL_TRUE, 0, sizeof host, host, 0, NULL, NULL));
    CHECK(clSetKernelArg(k, 0, sizeof b, &b));
    struct loop l = {reps, rounds, q, k, b, host};
    if (argc > 4 && strcmp(argv[4], "thread") == 0) {
        pthread_t t;
        if (pthread_create(&t, NULL, run_loop, &l) != 0 || pthread_join(t, NULL) != 0) {
            fprintf(stderr, "cannot run the loop on a thread\n");
            return 1;
        }
    } else {
        run_loop(&l);
    }
    return 0;
}
