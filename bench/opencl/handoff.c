/* Why the proxy's launch loop is slower on NVIDIA (#36): launch.c's loop, but the OpenCL
 * calls are made by a second thread that takes them from a ring the first thread fills, as
 * the proxy's post thread takes posted calls from the application. No hiber code is in it:
 * if this is as slow as the proxy, handing calls to another thread costs the driver that
 * much; if it is as fast as launch.c, the cost is in the proxy's own code.
 * Prints `rep R us_per_call X` as launch.c does.
 * Usage: handoff REPS ROUNDS DEVICE MODE (MODE: direct, or handoff) */
#include <pthread.h>
#include <stdatomic.h>

#include "../../crates/hiber/tests/opencl/common.h"

static const char *SRC = "__kernel void inc(__global uint *a, uint v) { a[get_global_id(0)] += v; }\n";

enum { SETARG = 1, LAUNCH = 2, WRITE = 3, STOP = 4 };
#define RING 65536
static struct {
    uint32_t kind, value;
} ring[RING];
static _Atomic uint64_t head, done;
static cl_command_queue q;
static cl_kernel k;
static cl_mem b;
static uint32_t host[1024];

static void run_one(uint32_t kind, uint32_t v) {
    size_t g = 64;
    switch (kind) {
    case SETARG:
        CHECK(clSetKernelArg(k, 1, sizeof v, &v));
        break;
    case LAUNCH:
        CHECK(clEnqueueNDRangeKernel(q, k, 1, NULL, &g, NULL, 0, NULL, NULL));
        break;
    case WRITE:
        CHECK(clEnqueueWriteBuffer(q, b, CL_FALSE, 0, 256, host, 0, NULL, NULL));
        break;
    }
}

/* The post thread: spins for the next entry, runs it, counts it done. */
static void *consumer(void *arg) {
    (void)arg;
    uint64_t next = 0;
    for (;;) {
        while (atomic_load_explicit(&head, memory_order_acquire) == next)
            __builtin_ia32_pause();
        uint32_t kind = ring[next % RING].kind, v = ring[next % RING].value;
        if (kind == STOP)
            return NULL;
        run_one(kind, v);
        next++;
        atomic_store_explicit(&done, next, memory_order_release);
    }
}

static void post(uint32_t kind, uint32_t v) {
    uint64_t h = atomic_load_explicit(&head, memory_order_relaxed);
    while (h - atomic_load_explicit(&done, memory_order_acquire) >= RING - 1)
        __builtin_ia32_pause();
    ring[h % RING].kind = kind;
    ring[h % RING].value = v;
    atomic_store_explicit(&head, h + 1, memory_order_release);
}

/* A call that waits: every post before it done, then made here (as a proxy's call thread). */
static void read_after_posts(void) {
    uint64_t h = atomic_load_explicit(&head, memory_order_relaxed);
    while (atomic_load_explicit(&done, memory_order_acquire) < h)
        __builtin_ia32_pause();
    CHECK(clEnqueueReadBuffer(q, b, CL_TRUE, 0, 4096, host, 0, NULL, NULL));
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 5;
    int rounds = argc > 2 ? atoi(argv[2]) : 20000;
    int dev = argc > 3 ? device_arg(argv[3]) : 0;
    int handoff = argc > 4 && strcmp(argv[4], "handoff") == 0;
    cl_platform_id platform;
    cl_device_id d = pick_device(dev, &platform);
    cl_int err;
    cl_context ctx = clCreateContext(NULL, 1, &d, NULL, NULL, &err);
    CHECK(err);
    q = clCreateCommandQueueWithProperties(ctx, d, NULL, &err);
    CHECK(err);
    cl_program p = build(ctx, d, SRC);
    k = clCreateKernel(p, "inc", &err);
    CHECK(err);
    b = clCreateBuffer(ctx, CL_MEM_READ_WRITE, 4096, NULL, &err);
    CHECK(err);
    CHECK(clEnqueueWriteBuffer(q, b, CL_TRUE, 0, sizeof host, host, 0, NULL, NULL));
    CHECK(clSetKernelArg(k, 0, sizeof b, &b));
    pthread_t t;
    if (handoff && pthread_create(&t, NULL, consumer, NULL) != 0) {
        fprintf(stderr, "cannot start the post thread\n");
        return 1;
    }
    for (int r = 0; r < reps; r++) {
        struct timespec a, z;
        clock_gettime(CLOCK_MONOTONIC, &a);
        long calls = 0;
        for (int i = 0; i < rounds; i++) {
            if (handoff) {
                post(SETARG, (uint32_t)i);
                post(LAUNCH, 0);
            } else {
                run_one(SETARG, (uint32_t)i);
                run_one(LAUNCH, 0);
            }
            calls += 2;
            if (i % 100 == 99) {
                if (handoff) {
                    post(WRITE, 0);
                    read_after_posts();
                } else {
                    run_one(WRITE, 0);
                    CHECK(clEnqueueReadBuffer(q, b, CL_TRUE, 0, 4096, host, 0, NULL, NULL));
                }
                calls += 2;
            }
        }
        if (handoff)
            read_after_posts();
        CHECK(clFinish(q));
        clock_gettime(CLOCK_MONOTONIC, &z);
        double us = ((z.tv_sec - a.tv_sec) * 1e6 + (z.tv_nsec - a.tv_nsec) / 1e3) / (double)calls;
        printf("rep %d us_per_call %.4f mode %s\n", r, us, handoff ? "handoff" : "direct");
        fflush(stdout);
    }
    if (handoff) {
        post(STOP, 0);
        pthread_join(t, NULL);
    }
    return 0;
}
