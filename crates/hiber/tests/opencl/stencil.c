/* An iterative integer stencil on one device: two buffers swapped by kernel arguments each
 * step, each step's kernel waiting on the previous step's event (kept across steps), and a
 * host reference computed beside it. Prints `step N checksum X t MS dev NAME`, then
 * `verify ok` when the device's state equals the host's after the last step.
 * Usage: stencil STEPS N DEVICE SLEEP_MS [map|svm]
 *   map: keeps one more buffer mapped (clEnqueueMapBuffer) the whole run;
 *   svm: allocates and frees shared virtual memory once (clSVMAlloc);
 *   binary: runs its kernel from a program made from the device's binary of it;
 *   lean: keeps no host copy of the buffers (a job whose memory is its OpenCL buffers):
 *         fills and reads them in LEAN_CHUNK pieces, prints the same checksums, and
 *         checks nothing itself (compare its checksums with an uninterrupted run's). */
#include "common.h"

static const char *SRC =
    "__kernel void stencil_step(__global const uint *a, __global uint *b, uint n, uint it, ulong salt) {\n"
    "  uint i = get_global_id(0);\n"
    "  uint l = a[(i + n - 1) % n], c = a[i], r = a[(i + 1) % n];\n"
    "  b[i] = ((l * 3u + c * 5u + r * 7u + it) ^ (c >> 3)) + (uint)(salt >> 40);\n"
    "}\n";

/* SALT: an 8-byte argument whose value is no valid address (the layer must not take it for
 * a handle and read through it). */
static uint64_t salt_of(uint32_t it) { return 0xdeadbeef00000000ULL + ((uint64_t)it << 40); }

static void host_step(const uint32_t *a, uint32_t *b, uint32_t n, uint32_t it) {
    for (uint32_t i = 0; i < n; i++) {
        uint32_t l = a[(i + n - 1) % n], c = a[i], r = a[(i + 1) % n];
        b[i] = ((l * 3u + c * 5u + r * 7u + it) ^ (c >> 3)) + (uint32_t)(salt_of(it) >> 40);
    }
}

#define LEAN_CHUNK (16u << 20)

/* The lean mode's checksum of B (N words): read back piece by piece into STAGE. */
static uint64_t lean_checksum(cl_command_queue q, cl_mem b, uint32_t n, uint32_t *stage, cl_event *after) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (size_t off = 0; off < (size_t)n * 4; off += LEAN_CHUNK) {
        size_t len = (size_t)n * 4 - off < LEAN_CHUNK ? (size_t)n * 4 - off : LEAN_CHUNK;
        CHECK(clEnqueueReadBuffer(q, b, CL_TRUE, off, len, stage, after ? 1 : 0, after, NULL));
        after = NULL;
        h = fnv(stage, len, h);
    }
    return h;
}

int main(int argc, char **argv) {
    int steps = argc > 1 ? atoi(argv[1]) : 100;
    uint32_t n = argc > 2 ? (uint32_t)atoi(argv[2]) : 65536;
    int dev = argc > 3 ? device_arg(argv[3]) : 0;
    int sleep = argc > 4 ? atoi(argv[4]) : 20;
    cl_device_id d;
    cl_context ctx;
    cl_command_queue q = open_queue(dev, &d, &ctx);
    cl_int err;
    cl_program prog = build(ctx, d, SRC);
    if (argc > 5 && strcmp(argv[5], "binary") == 0) {
        size_t len = 0;
        CHECK(clGetProgramInfo(prog, CL_PROGRAM_BINARY_SIZES, sizeof len, &len, NULL));
        unsigned char *bin = malloc(len);
        CHECK(clGetProgramInfo(prog, CL_PROGRAM_BINARIES, sizeof bin, &bin, NULL));
        CHECK(clReleaseProgram(prog));
        const unsigned char *b = bin;
        cl_int status;
        prog = clCreateProgramWithBinary(ctx, 1, &d, &len, &b, &status, &err);
        CHECK(err);
        CHECK(clBuildProgram(prog, 1, &d, "", NULL, NULL));
        free(bin);
    }
    cl_kernel k = clCreateKernel(prog, "stencil_step", &err);
    CHECK(err);
    CHECK(clReleaseProgram(prog)); /* the kernel keeps it */
    int lean = argc > 5 && strcmp(argv[5], "lean") == 0;
    uint32_t *host = NULL, *ref = NULL, *tmp = NULL, *stage = NULL;
    cl_mem buf[2];
    if (lean) {
        stage = malloc(LEAN_CHUNK);
        buf[0] = clCreateBuffer(ctx, CL_MEM_READ_WRITE, (size_t)n * 4, NULL, &err);
        CHECK(err);
        for (size_t off = 0; off < (size_t)n * 4; off += LEAN_CHUNK) {
            size_t len = (size_t)n * 4 - off < LEAN_CHUNK ? (size_t)n * 4 - off : LEAN_CHUNK;
            for (size_t j = 0; j < len / 4; j++) stage[j] = (uint32_t)(off / 4 + j) * 2654435761u;
            CHECK(clEnqueueWriteBuffer(q, buf[0], CL_TRUE, off, len, stage, 0, NULL, NULL));
        }
    } else {
        host = malloc(n * 4), ref = malloc(n * 4), tmp = malloc(n * 4);
        for (uint32_t i = 0; i < n; i++) ref[i] = i * 2654435761u;
        buf[0] = clCreateBuffer(ctx, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, n * 4, ref, &err);
        CHECK(err);
    }
    buf[1] = clCreateBuffer(ctx, CL_MEM_READ_WRITE, n * 4, NULL, &err);
    CHECK(err);
    if (argc > 5 && strcmp(argv[5], "map") == 0) {
        cl_mem m = clCreateBuffer(ctx, CL_MEM_READ_WRITE, 4096, NULL, &err);
        CHECK(err);
        void *p = clEnqueueMapBuffer(q, m, CL_TRUE, CL_MAP_WRITE, 0, 4096, 0, NULL, NULL, &err);
        CHECK(err);
        memset(p, 1, 4096);
    }
    if (argc > 5 && strcmp(argv[5], "svm") == 0) {
        void *p = clSVMAlloc(ctx, CL_MEM_READ_WRITE, 4096, 0);
        if (p) clSVMFree(ctx, p);
    }
    cl_event prev = NULL;
    char name[256];
    for (int s = 1; s <= steps; s++) {
        uint32_t it = (uint32_t)s;
        CHECK(clSetKernelArg(k, 0, sizeof(cl_mem), &buf[(s + 1) % 2]));
        CHECK(clSetKernelArg(k, 1, sizeof(cl_mem), &buf[s % 2]));
        CHECK(clSetKernelArg(k, 2, sizeof n, &n));
        CHECK(clSetKernelArg(k, 3, sizeof it, &it));
        cl_ulong salt = salt_of(it);
        CHECK(clSetKernelArg(k, 4, sizeof salt, &salt));
        size_t g = n;
        cl_event ev;
        CHECK(clEnqueueNDRangeKernel(q, k, 1, NULL, &g, NULL, prev ? 1 : 0, prev ? &prev : NULL, &ev));
        uint64_t sum;
        if (lean) {
            sum = lean_checksum(q, buf[s % 2], n, stage, &ev);
        } else {
            CHECK(clEnqueueReadBuffer(q, buf[s % 2], CL_TRUE, 0, n * 4, host, 1, &ev, NULL));
            host_step(ref, tmp, n, it);
            memcpy(ref, tmp, n * 4);
            sum = fnv(host, n * 4, 0xcbf29ce484222325ULL);
        }
        if (prev) CHECK(clReleaseEvent(prev));
        prev = ev;
        queue_device_name(q, name, sizeof name);
        printf("step %d checksum %016llx t %llu dev %s\n", s, (unsigned long long)sum, (unsigned long long)now_ms(), name);
        fflush(stdout);
        if (!lean && memcmp(host, ref, n * 4) != 0) {
            printf("verify failed at step %d\n", s);
            return 1;
        }
        pause_ms(sleep);
    }
    cl_int st;
    CHECK(clGetEventInfo(prev, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof st, &st, NULL));
    if (lean)
        printf("verify ok (lean: no host reference, last event status %d)\n", st);
    else
        printf("verify ok (last event status %d)\n", st);
    return 0;
}
