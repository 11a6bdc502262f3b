/* Inference-shaped: a large read-only weights buffer written once, and a small state vector
 * that every step updates from it (each step reads a different weight per element), with a
 * host reference beside it. Prints `step N checksum X t MS dev NAME`, then `verify ok` when
 * the device's state equals the host's after the last step.
 * Usage: weights STEPS WEIGHTS_MIB DEVICE SLEEP_MS [small]
 *   small: weights of small integers (they compress, as quantized weights do) */
#include "common.h"

#define STATE 4096

static const char *SRC =
    "__kernel void infer(__global const uint *w, uint nw, __global const uint *a, __global uint *b, uint it) {\n"
    "  uint i = get_global_id(0);\n"
    "  uint x = w[(i * 2654435761u + it * 40503u) % nw];\n"
    "  b[i] = (a[i] * 1664525u + x) ^ (a[(i + 1) % get_global_size(0)] >> 5) ^ it;\n"
    "}\n";

static void host_step(const uint32_t *w, uint32_t nw, const uint32_t *a, uint32_t *b, uint32_t it) {
    for (uint32_t i = 0; i < STATE; i++) {
        uint32_t x = w[(i * 2654435761u + it * 40503u) % nw];
        b[i] = (a[i] * 1664525u + x) ^ (a[(i + 1) % STATE] >> 5) ^ it;
    }
}

int main(int argc, char **argv) {
    int steps = argc > 1 ? atoi(argv[1]) : 100;
    uint32_t mib = argc > 2 ? (uint32_t)atoi(argv[2]) : 96;
    int dev = argc > 3 ? device_arg(argv[3]) : 0;
    int sleep = argc > 4 ? atoi(argv[4]) : 20;
    uint32_t nw = mib * (1u << 20) / 4;
    cl_device_id d;
    cl_context ctx;
    cl_command_queue q = open_queue(dev, &d, &ctx);
    cl_int err;
    cl_program prog = build(ctx, d, SRC);
    cl_kernel k = clCreateKernel(prog, "infer", &err);
    CHECK(err);
    uint32_t *w = malloc((size_t)nw * 4), *ref = malloc(STATE * 4), *tmp = malloc(STATE * 4), *host = malloc(STATE * 4);
    int small = argc > 5 && strcmp(argv[5], "small") == 0;
    for (uint32_t i = 0; i < nw; i++) w[i] = small ? (i * 2246822519u) >> 28 : i * 2246822519u + 374761393u;
    for (uint32_t i = 0; i < STATE; i++) ref[i] = i;
    cl_mem wbuf = clCreateBuffer(ctx, CL_MEM_READ_ONLY | CL_MEM_COPY_HOST_PTR, (size_t)nw * 4, w, &err);
    CHECK(err);
    cl_mem s[2];
    s[0] = clCreateBuffer(ctx, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, STATE * 4, ref, &err);
    CHECK(err);
    s[1] = clCreateBuffer(ctx, CL_MEM_READ_WRITE, STATE * 4, NULL, &err);
    CHECK(err);
    char name[256];
    for (int step = 1; step <= steps; step++) {
        uint32_t it = (uint32_t)step;
        CHECK(clSetKernelArg(k, 0, sizeof(cl_mem), &wbuf));
        CHECK(clSetKernelArg(k, 1, sizeof nw, &nw));
        CHECK(clSetKernelArg(k, 2, sizeof(cl_mem), &s[(step + 1) % 2]));
        CHECK(clSetKernelArg(k, 3, sizeof(cl_mem), &s[step % 2]));
        CHECK(clSetKernelArg(k, 4, sizeof it, &it));
        size_t g = STATE;
        CHECK(clEnqueueNDRangeKernel(q, k, 1, NULL, &g, NULL, 0, NULL, NULL));
        CHECK(clEnqueueReadBuffer(q, s[step % 2], CL_TRUE, 0, STATE * 4, host, 0, NULL, NULL));
        host_step(w, nw, ref, tmp, it);
        memcpy(ref, tmp, STATE * 4);
        queue_device_name(q, name, sizeof name);
        printf("step %d checksum %016llx t %llu dev %s\n", step, (unsigned long long)fnv(host, STATE * 4, 0xcbf29ce484222325ULL), (unsigned long long)now_ms(), name);
        fflush(stdout);
        if (memcmp(host, ref, STATE * 4) != 0) {
            printf("verify failed at step %d\n", step);
            return 1;
        }
        pause_ms(sleep);
    }
    printf("verify ok\n");
    return 0;
}
