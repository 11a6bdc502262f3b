/* The cost of an OpenCL call whose answer the application waits for: clGetEventStatus-like
 * queries (clGetEventInfo of a completed user event's status) in a loop. Through the inline
 * layer that is a lookup and a call into the platform; through the proxy, a round trip to
 * the proxy process. Prints one line per repetition: `rep R us_per_call X`.
 * Usage: roundtrip REPS CALLS DEVICE (DEVICE: index, gpu or cpu) */
#include "../../crates/hiber/tests/opencl/common.h"

int main(int argc, char **argv) {
    int reps = argc > 1 ? atoi(argv[1]) : 5;
    long calls = argc > 2 ? atol(argv[2]) : 100000;
    int dev = argc > 3 ? device_arg(argv[3]) : 0;
    cl_platform_id platform;
    cl_device_id d = pick_device(dev, &platform);
    cl_int err;
    cl_context ctx = clCreateContext(NULL, 1, &d, NULL, NULL, &err);
    CHECK(err);
    cl_event e = clCreateUserEvent(ctx, &err);
    CHECK(err);
    CHECK(clSetUserEventStatus(e, CL_COMPLETE));
    for (int r = 0; r < reps; r++) {
        struct timespec a, z;
        clock_gettime(CLOCK_MONOTONIC, &a);
        for (long i = 0; i < calls; i++) {
            cl_int status = -1;
            CHECK(clGetEventInfo(e, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof status, &status, NULL));
            if (status != CL_COMPLETE) {
                fprintf(stderr, "event status %d\n", status);
                return 1;
            }
        }
        clock_gettime(CLOCK_MONOTONIC, &z);
        double us = ((z.tv_sec - a.tv_sec) * 1e6 + (z.tv_nsec - a.tv_nsec) / 1e3) / (double)calls;
        printf("rep %d us_per_call %.4f\n", r, us);
        fflush(stdout);
    }
    return 0;
}
