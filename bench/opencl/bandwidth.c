/* Bulk transfers: a blocking clEnqueueWriteBuffer of MIB MiB from ordinary (malloc'd,
 * pageable) host memory, then a blocking clEnqueueReadBuffer of it back, REPS times. Prints
 * one line per repetition: `rep R us_per_call X` (X: the microseconds of one transfer, the
 * mean of the write's and the read's) and `gbs R write W read R` (GB/s); checks every
 * read's bytes against what was written. At the end it releases the context, moves the
 * bytes once more through its queue and buffer, releases them, and says `context
 * destroyed` once the context's destructor callback ran (nothing kept it alive).
 * Usage: bandwidth REPS MIB DEVICE (DEVICE: index, gpu or cpu) */
#include "../../crates/hiber/tests/opencl/common.h"
#include <string.h>
#include <time.h>

static volatile int destroyed;

static void CL_CALLBACK on_destroyed(cl_context c, void *data) {
    (void)c;
    (void)data;
    destroyed = 1;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 5;
    size_t mib = argc > 2 ? (size_t)atol(argv[2]) : 1024;
    int dev = argc > 3 ? device_arg(argv[3]) : 0;
    size_t n = mib << 20;
    cl_device_id d;
    cl_context ctx;
    cl_command_queue q = open_queue(dev, &d, &ctx);
    cl_int err;
    cl_mem b = clCreateBuffer(ctx, CL_MEM_READ_WRITE, n, NULL, &err);
    CHECK(err);
    unsigned char *src = malloc(n), *dst = malloc(n);
    if (!src || !dst) {
        fprintf(stderr, "out of host memory\n");
        return 1;
    }
    for (size_t i = 0; i < n; i++)
        src[i] = (unsigned char)(i * 131 + (i >> 20));
    memset(dst, 0, n);
    for (int r = 0; r < reps; r++) {
        src[r] ^= 0xff; /* each repetition moves different bytes */
        double t0 = now_s();
        CHECK(clEnqueueWriteBuffer(q, b, CL_TRUE, 0, n, src, 0, NULL, NULL));
        double t1 = now_s();
        CHECK(clEnqueueReadBuffer(q, b, CL_TRUE, 0, n, dst, 0, NULL, NULL));
        double t2 = now_s();
        if (memcmp(src, dst, n) != 0) {
            fprintf(stderr, "rep %d: the bytes read back differ from those written\n", r);
            return 1;
        }
        printf("rep %d us_per_call %.1f\n", r, (t2 - t0) / 2 * 1e6);
        printf("gbs %d write %.2f read %.2f\n", r, n / (t1 - t0) / 1e9, n / (t2 - t1) / 1e9);
        fflush(stdout);
    }
    /* The context released first, as a program may while its queue and buffer still
     * work: one more transfer through them, then they go too, and the context with them. */
    CHECK(clSetContextDestructorCallback(ctx, on_destroyed, NULL));
    CHECK(clReleaseContext(ctx));
    CHECK(clEnqueueWriteBuffer(q, b, CL_TRUE, 0, n, src, 0, NULL, NULL));
    CHECK(clEnqueueReadBuffer(q, b, CL_TRUE, 0, n, dst, 0, NULL, NULL));
    if (memcmp(src, dst, n) != 0) {
        fprintf(stderr, "after the context's release: the bytes read back differ\n");
        return 1;
    }
    CHECK(clReleaseMemObject(b));
    CHECK(clReleaseCommandQueue(q));
    for (int i = 0; i < 500 && !destroyed; i++)
        pause_ms(10);
    printf(destroyed ? "context destroyed\n" : "context still alive\n");
    return destroyed ? 0 : 1;
}
