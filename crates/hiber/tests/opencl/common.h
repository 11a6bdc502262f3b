/* Shared by the OpenCL test programs: device choice, error checks, the progress line. */
#define CL_TARGET_OPENCL_VERSION 300
#include <CL/cl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHECK(x)                                                                 \
    do {                                                                         \
        cl_int e_ = (x);                                                         \
        if (e_ != CL_SUCCESS) {                                                  \
            fprintf(stderr, "%s:%d: %s = %d\n", __FILE__, __LINE__, #x, e_);     \
            exit(2);                                                             \
        }                                                                        \
    } while (0)

static inline uint64_t now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static inline uint64_t fnv(const void *p, size_t n, uint64_t h) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ULL;
    return h;
}

/* DEVICE arguments: an index, or gpu/cpu. */
static inline int device_arg(const char *s) {
    if (!strcmp(s, "gpu")) return -1;
    if (!strcmp(s, "cpu")) return -2;
    return atoi(s);
}

/* Device DEV (an index over all platforms' devices, in order; or -1 for the first GPU,
 * -2 for the first CPU) and its platform. */
static inline cl_device_id pick_device(int dev, cl_platform_id *platform) {
    cl_platform_id ps[8];
    cl_uint np = 0;
    CHECK(clGetPlatformIDs(8, ps, &np));
    int k = 0;
    for (cl_uint p = 0; p < np; p++) {
        cl_device_id ds[8];
        cl_uint nd = 0;
        if (clGetDeviceIDs(ps[p], CL_DEVICE_TYPE_ALL, 8, ds, &nd) != CL_SUCCESS) continue;
        for (cl_uint d = 0; d < nd; d++, k++) {
            cl_device_type t = 0;
            clGetDeviceInfo(ds[d], CL_DEVICE_TYPE, sizeof t, &t, NULL);
            if (k == dev || (dev == -1 && (t & CL_DEVICE_TYPE_GPU)) || (dev == -2 && (t & CL_DEVICE_TYPE_CPU))) {
                *platform = ps[p];
                return ds[d];
            }
        }
    }
    fprintf(stderr, "no device %d\n", dev);
    exit(2);
}

/* The name of the device a queue runs on now (after a move, the new one). */
static inline void queue_device_name(cl_command_queue q, char *out, size_t n) {
    cl_device_id d;
    CHECK(clGetCommandQueueInfo(q, CL_QUEUE_DEVICE, sizeof d, &d, NULL));
    CHECK(clGetDeviceInfo(d, CL_DEVICE_NAME, n, out, NULL));
    for (char *c = out; *c; c++)
        if (*c == ' ') *c = '_';
}

/* Device DEV (as pick_device), a context on its platform, and an in-order queue on it. */
static inline cl_command_queue open_queue(int dev, cl_device_id *d, cl_context *ctx) {
    cl_platform_id platform;
    *d = pick_device(dev, &platform);
    cl_int err;
    cl_context_properties props[] = {CL_CONTEXT_PLATFORM, (cl_context_properties)platform, 0};
    *ctx = clCreateContext(props, 1, d, NULL, NULL, &err);
    CHECK(err);
    cl_command_queue q = clCreateCommandQueueWithProperties(*ctx, *d, NULL, &err);
    CHECK(err);
    return q;
}

static inline cl_program build(cl_context ctx, cl_device_id dev, const char *src) {
    cl_int err;
    cl_program p = clCreateProgramWithSource(ctx, 1, &src, NULL, &err);
    CHECK(err);
    if (clBuildProgram(p, 1, &dev, "", NULL, NULL) != CL_SUCCESS) {
        char log[4096] = "";
        clGetProgramBuildInfo(p, dev, CL_PROGRAM_BUILD_LOG, sizeof log, log, NULL);
        fprintf(stderr, "build failed: %s\n", log);
        exit(2);
    }
    return p;
}

static inline void pause_ms(int ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}
