/* Image objects and a sampler: a 3x3 integer blur of an RGBA8 image, ping-ponged between
 * two images through kernel arguments, read back each step. Prints
 * `step N checksum X t MS dev NAME`, then `verify ok` when the device's image equals the
 * host's. Usage: image STEPS SIDE DEVICE SLEEP_MS */
#define CL_USE_DEPRECATED_OPENCL_1_2_APIS
#include "common.h"

static const char *SRC =
    "__kernel void blur(__read_only image2d_t src, __write_only image2d_t dst, sampler_t s, uint it) {\n"
    "  int2 p = (int2)(get_global_id(0), get_global_id(1));\n"
    "  uint4 t = (uint4)(it);\n"
    "  for (int dy = -1; dy <= 1; dy++)\n"
    "    for (int dx = -1; dx <= 1; dx++) t += read_imageui(src, s, p + (int2)(dx, dy));\n"
    "  write_imageui(dst, p, t & 255u);\n"
    "}\n";

static int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

int main(int argc, char **argv) {
    int steps = argc > 1 ? atoi(argv[1]) : 100;
    int side = argc > 2 ? atoi(argv[2]) : 128;
    int dev = argc > 3 ? device_arg(argv[3]) : 0;
    int sleep = argc > 4 ? atoi(argv[4]) : 20;
    cl_platform_id platform;
    cl_device_id d = pick_device(dev, &platform);
    cl_int err;
    cl_context ctx = clCreateContext(NULL, 1, &d, NULL, NULL, &err);
    CHECK(err);
    cl_command_queue q = clCreateCommandQueue(ctx, d, 0, &err);
    CHECK(err);
    cl_program prog = build(ctx, d, SRC);
    cl_kernel k = clCreateKernel(prog, "blur", &err);
    CHECK(err);
    cl_sampler smp = clCreateSampler(ctx, CL_FALSE, CL_ADDRESS_CLAMP_TO_EDGE, CL_FILTER_NEAREST, &err);
    CHECK(err);
    size_t bytes = (size_t)side * side * 4;
    unsigned char *ref = malloc(bytes), *tmp = malloc(bytes), *host = malloc(bytes);
    for (size_t i = 0; i < bytes; i++) ref[i] = (unsigned char)(i * 7 + (i >> 9));
    cl_image_format fmt = {CL_RGBA, CL_UNSIGNED_INT8};
    cl_image_desc desc;
    memset(&desc, 0, sizeof desc);
    desc.image_type = CL_MEM_OBJECT_IMAGE2D;
    desc.image_width = side;
    desc.image_height = side;
    cl_mem img[2];
    img[0] = clCreateImage(ctx, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, &fmt, &desc, ref, &err);
    CHECK(err);
    img[1] = clCreateImage(ctx, CL_MEM_READ_WRITE, &fmt, &desc, NULL, &err);
    CHECK(err);
    CHECK(clSetKernelArg(k, 2, sizeof smp, &smp));
    size_t origin[3] = {0, 0, 0}, region[3] = {(size_t)side, (size_t)side, 1};
    char name[256];
    for (int s = 1; s <= steps; s++) {
        uint32_t it = (uint32_t)s;
        CHECK(clSetKernelArg(k, 0, sizeof(cl_mem), &img[(s + 1) % 2]));
        CHECK(clSetKernelArg(k, 1, sizeof(cl_mem), &img[s % 2]));
        CHECK(clSetKernelArg(k, 3, sizeof it, &it));
        size_t g[2] = {(size_t)side, (size_t)side};
        CHECK(clEnqueueNDRangeKernel(q, k, 2, NULL, g, NULL, 0, NULL, NULL));
        CHECK(clEnqueueReadImage(q, img[s % 2], CL_TRUE, origin, region, 0, 0, host, 0, NULL, NULL));
        for (int y = 0; y < side; y++)
            for (int x = 0; x < side; x++)
                for (int c = 0; c < 4; c++) {
                    unsigned t = it;
                    for (int dy = -1; dy <= 1; dy++)
                        for (int dx = -1; dx <= 1; dx++)
                            t += ref[((size_t)clampi(y + dy, 0, side - 1) * side + clampi(x + dx, 0, side - 1)) * 4 + c];
                    tmp[((size_t)y * side + x) * 4 + c] = (unsigned char)(t & 255u);
                }
        memcpy(ref, tmp, bytes);
        queue_device_name(q, name, sizeof name);
        printf("step %d checksum %016llx t %llu dev %s\n", s, (unsigned long long)fnv(host, bytes, 0xcbf29ce484222325ULL), (unsigned long long)now_ms(), name);
        fflush(stdout);
        if (memcmp(host, ref, bytes) != 0) {
            printf("verify failed at step %d\n", s);
            return 1;
        }
        pause_ms(sleep);
    }
    printf("verify ok\n");
    return 0;
}
