/* A process that uses OpenCL only to list the platforms and devices (as hwloc's OpenCL plugin
 * does inside some launchers' daemons), then runs on without OpenCL: it prints
 * `alive N` every SLEEP_MS, and at the end lists them again and says `listed again P D`.
 * Usage: discover COUNT SLEEP_MS */
#include "common.h"
#include <unistd.h>

static void count(cl_uint *np, cl_uint *nd) {
    cl_platform_id ps[8];
    CHECK(clGetPlatformIDs(8, ps, np));
    *nd = 0;
    for (cl_uint i = 0; i < *np && i < 8; i++) {
        cl_uint n = 0;
        CHECK(clGetDeviceIDs(ps[i], CL_DEVICE_TYPE_ALL, 0, NULL, &n));
        *nd += n;
    }
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 100;
    int ms = argc > 2 ? atoi(argv[2]) : 50;
    cl_uint np, nd;
    count(&np, &nd);
    printf("listed %u %u\n", np, nd);
    fflush(stdout);
    for (int i = 0; i < n; i++) {
        printf("alive %d\n", i);
        fflush(stdout);
        usleep(ms * 1000);
    }
    cl_uint np2, nd2;
    count(&np2, &nd2);
    printf("listed again %u %u\n", np2, nd2);
    return np2 == np && nd2 == nd ? 0 : 1;
}
