/* A program that forks after its first OpenCL calls, as a pre-fork server or Python's
 * multiprocessing does: the parent increments a buffer on the device step after step; at step
 * FORK_AT a child starts. CHILD `opencl`: it makes its own context and runs its own kernel,
 * then exits. CHILD `idle`: it never calls OpenCL, and lives until the parent ends it at the
 * end. Both check their results; the parent prints `step N checksum X`, and `verify ok`.
 * Usage: forks STEPS FORK_AT DEVICE SLEEP_MS [CHILD] */
#include <signal.h>
#include "common.h"
#include <sys/wait.h>
#include <unistd.h>

static const char *SRC = "__kernel void inc(__global uint *a, uint v) { a[get_global_id(0)] += v; }\n";
#define N 4096

static int child(int dev) {
    cl_device_id d;
    cl_context ctx;
    cl_command_queue q = open_queue(dev, &d, &ctx);
    cl_program p = build(ctx, d, SRC);
    cl_int err;
    cl_kernel k = clCreateKernel(p, "inc", &err);
    CHECK(err);
    uint32_t host[N];
    for (int i = 0; i < N; i++) host[i] = (uint32_t)i;
    cl_mem b = clCreateBuffer(ctx, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, sizeof host, host, &err);
    CHECK(err);
    uint32_t v = 7;
    CHECK(clSetKernelArg(k, 0, sizeof b, &b));
    CHECK(clSetKernelArg(k, 1, sizeof v, &v));
    size_t g = N;
    CHECK(clEnqueueNDRangeKernel(q, k, 1, NULL, &g, NULL, 0, NULL, NULL));
    CHECK(clEnqueueReadBuffer(q, b, CL_TRUE, 0, sizeof host, host, 0, NULL, NULL));
    for (int i = 0; i < N; i++)
        if (host[i] != (uint32_t)i + 7) return 1;
    printf("child ok\n");
    fflush(stdout);
    return 0;
}

int main(int argc, char **argv) {
    int steps = argc > 1 ? atoi(argv[1]) : 200;
    int fork_at = argc > 2 ? atoi(argv[2]) : 50;
    int dev = argc > 3 ? device_arg(argv[3]) : 0;
    int sleep = argc > 4 ? atoi(argv[4]) : 10;
    int idle = argc > 5 && !strcmp(argv[5], "idle");
    cl_device_id d;
    cl_context ctx;
    cl_command_queue q = open_queue(dev, &d, &ctx);
    cl_program p = build(ctx, d, SRC);
    cl_int err;
    cl_kernel k = clCreateKernel(p, "inc", &err);
    CHECK(err);
    static uint32_t host[N], want[N];
    cl_mem b = clCreateBuffer(ctx, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, sizeof host, host, &err);
    CHECK(err);
    CHECK(clSetKernelArg(k, 0, sizeof b, &b));
    pid_t kid = -1;
    for (int s = 0; s < steps; s++) {
        if (s == fork_at) {
            fflush(stdout);
            kid = fork();
            if (kid == 0) {
                if (idle) {
                    printf("child idle\n");
                    fflush(stdout);
                    for (;;) pause();
                }
                _exit(child(dev));
            }
        }
        uint32_t v = (uint32_t)s + 1;
        CHECK(clSetKernelArg(k, 1, sizeof v, &v));
        size_t g = N;
        CHECK(clEnqueueNDRangeKernel(q, k, 1, NULL, &g, NULL, 0, NULL, NULL));
        CHECK(clEnqueueReadBuffer(q, b, CL_TRUE, 0, sizeof host, host, 0, NULL, NULL));
        for (int i = 0; i < N; i++) want[i] += v;
        if (memcmp(host, want, sizeof host)) {
            fprintf(stderr, "step %d: device state differs from the host's\n", s);
            return 1;
        }
        printf("step %d checksum %016llx t %llu\n", s, (unsigned long long)fnv(host, sizeof host, 1469598103934665603ULL), (unsigned long long)now_ms());
        fflush(stdout);
        pause_ms(sleep);
    }
    int st = 0;
    if (idle && kid > 0) {
        kill(kid, SIGTERM);
        if (waitpid(kid, &st, 0) != kid || !WIFSIGNALED(st)) {
            fprintf(stderr, "the idle child did not end as told (status %d)\n", st);
            return 1;
        }
        printf("verify ok\n");
        return 0;
    }
    if (kid > 0 && (waitpid(kid, &st, 0) != kid || !WIFEXITED(st) || WEXITSTATUS(st) != 0)) {
        fprintf(stderr, "the child failed (status %d)\n", st);
        return 1;
    }
    printf("verify ok\n");
    return 0;
}
