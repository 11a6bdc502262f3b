/* Several kernels on two queues of one context: queue A updates the data, queue B reduces
 * the second half of it (a sub-buffer) in work-groups with __local scratch, then sums the
 * partial results; B waits on A's event and on a user event set once at the start.
 * Prints `step N checksum X t MS dev NAME`, then `verify ok` when every step's sum equals
 * the host's. Usage: reduce STEPS N DEVICE SLEEP_MS */
#include "common.h"

#define WG 64

static const char *SRC =
    "__kernel void update(__global uint *d, uint it) {\n"
    "  uint i = get_global_id(0);\n"
    "  d[i] = d[i] * 1664525u + 1013904223u + (it ^ i);\n"
    "}\n"
    "__kernel void partial(__global const uint *d, __local uint *s, __global uint *out) {\n"
    "  uint l = get_local_id(0);\n"
    "  s[l] = d[get_global_id(0)];\n"
    "  barrier(CLK_LOCAL_MEM_FENCE);\n"
    "  for (uint k = get_local_size(0) / 2; k > 0; k /= 2) {\n"
    "    if (l < k) s[l] += s[l + k];\n"
    "    barrier(CLK_LOCAL_MEM_FENCE);\n"
    "  }\n"
    "  if (l == 0) out[get_group_id(0)] = s[0];\n"
    "}\n"
    "__kernel void total(__global const uint *p, uint n, __global uint *out) {\n"
    "  uint t = 0;\n"
    "  for (uint i = 0; i < n; i++) t += p[i] * (i + 1);\n"
    "  out[0] = t;\n"
    "}\n";

int main(int argc, char **argv) {
    int steps = argc > 1 ? atoi(argv[1]) : 100;
    uint32_t n = argc > 2 ? (uint32_t)atoi(argv[2]) : 65536;
    int dev = argc > 3 ? device_arg(argv[3]) : 0;
    int sleep = argc > 4 ? atoi(argv[4]) : 20;
    n = (n + 2 * WG - 1) / (2 * WG) * (2 * WG);
    uint32_t half = n / 2, groups = half / WG;
    cl_platform_id platform;
    cl_device_id d = pick_device(dev, &platform);
    cl_int err;
    cl_context ctx = clCreateContext(NULL, 1, &d, NULL, NULL, &err);
    CHECK(err);
    cl_command_queue qa = clCreateCommandQueueWithProperties(ctx, d, NULL, &err);
    CHECK(err);
    cl_command_queue qb = clCreateCommandQueueWithProperties(ctx, d, NULL, &err);
    CHECK(err);
    cl_program prog = build(ctx, d, SRC);
    cl_kernel kernels[3];
    cl_uint nk = 0;
    CHECK(clCreateKernelsInProgram(prog, 3, kernels, &nk));
    cl_kernel mix = NULL, partial = NULL, total = NULL;
    for (cl_uint i = 0; i < nk; i++) {
        char name[64];
        CHECK(clGetKernelInfo(kernels[i], CL_KERNEL_FUNCTION_NAME, sizeof name, name, NULL));
        if (!strcmp(name, "update")) mix = kernels[i];
        if (!strcmp(name, "partial")) partial = kernels[i];
        if (!strcmp(name, "total")) total = kernels[i];
    }
    if (!mix || !partial || !total) {
        fprintf(stderr, "kernels missing (%u made)\n", nk);
        return 2;
    }
    uint32_t *ref = malloc(n * 4);
    for (uint32_t i = 0; i < n; i++) ref[i] = i ^ 0x5bd1e995u;
    cl_mem data = clCreateBuffer(ctx, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, n * 4, ref, &err);
    CHECK(err);
    cl_buffer_region region = {half * 4, half * 4};
    cl_mem upper = clCreateSubBuffer(data, CL_MEM_READ_ONLY, CL_BUFFER_CREATE_TYPE_REGION, &region, &err);
    CHECK(err);
    cl_mem partials = clCreateBuffer(ctx, CL_MEM_READ_WRITE, groups * 4, NULL, &err);
    CHECK(err);
    cl_mem out = clCreateBuffer(ctx, CL_MEM_READ_WRITE, 4, NULL, &err);
    CHECK(err);
    cl_event go = clCreateUserEvent(ctx, &err);
    CHECK(err);
    CHECK(clSetUserEventStatus(go, CL_COMPLETE));
    CHECK(clSetKernelArg(mix, 0, sizeof data, &data));
    CHECK(clSetKernelArg(partial, 0, sizeof upper, &upper));
    CHECK(clSetKernelArg(partial, 1, WG * 4, NULL));
    CHECK(clSetKernelArg(partial, 2, sizeof partials, &partials));
    CHECK(clSetKernelArg(total, 0, sizeof partials, &partials));
    CHECK(clSetKernelArg(total, 1, sizeof groups, &groups));
    CHECK(clSetKernelArg(total, 2, sizeof out, &out));
    uint64_t chain = 0xcbf29ce484222325ULL;
    char name[256];
    for (int s = 1; s <= steps; s++) {
        uint32_t it = (uint32_t)s;
        CHECK(clSetKernelArg(mix, 1, sizeof it, &it));
        size_t g = n, gh = half, l = WG, one = 1;
        cl_event mixed;
        CHECK(clEnqueueNDRangeKernel(qa, mix, 1, NULL, &g, NULL, 1, &go, &mixed));
        CHECK(clFlush(qa));
        CHECK(clEnqueueNDRangeKernel(qb, partial, 1, NULL, &gh, &l, 1, &mixed, NULL));
        CHECK(clEnqueueNDRangeKernel(qb, total, 1, NULL, &one, NULL, 0, NULL, NULL));
        uint32_t sum = 0;
        CHECK(clEnqueueReadBuffer(qb, out, CL_TRUE, 0, 4, &sum, 0, NULL, NULL));
        CHECK(clReleaseEvent(mixed));
        for (uint32_t i = 0; i < n; i++) ref[i] = ref[i] * 1664525u + 1013904223u + (it ^ i);
        uint32_t want = 0;
        for (uint32_t gi = 0; gi < groups; gi++) {
            uint32_t p = 0;
            for (uint32_t k = 0; k < WG; k++) p += ref[half + gi * WG + k];
            want += p * (gi + 1);
        }
        chain = fnv(&sum, 4, chain);
        queue_device_name(qb, name, sizeof name);
        printf("step %d checksum %016llx t %llu dev %s\n", s, (unsigned long long)chain, (unsigned long long)now_ms(), name);
        fflush(stdout);
        if (sum != want) {
            printf("verify failed at step %d: %u, host says %u\n", s, sum, want);
            return 1;
        }
        pause_ms(sleep);
    }
    printf("verify ok\n");
    return 0;
}
