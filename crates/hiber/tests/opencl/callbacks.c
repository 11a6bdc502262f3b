/* Event callbacks across a checkpoint. A user event gets a callback at the start and is set
 * only at step SET (after the test has checkpointed and restored the program): its
 * callback must run then, once. Every step's kernel event also gets a callback, which
 * counts: at the end the count must equal the steps, each callback having run exactly once
 * whether or not a checkpoint fell between its command and its call. The callbacks call
 * OpenCL themselves (as StarPU's do): the user event's releases the reference the program
 * took for it, and a step's asks its event's status.
 * Prints `step N checksum X t MS dev NAME`, then `verify ok`.
 * Usage: callbacks STEPS SET DEVICE SLEEP_MS */
#include "common.h"
#include <stdatomic.h>
#include <unistd.h>

static const char *SRC =
    "__kernel void bump(__global uint *a, uint it) { uint i = get_global_id(0); a[i] = a[i] * 3u + it + i; }\n";

static atomic_int user_calls, step_calls;
static atomic_int user_status = 1;

static atomic_int bad_status;

static void CL_CALLBACK on_user(cl_event e, cl_int status, void *data) {
    if (data != (void *)&user_calls) abort();
    if (clReleaseEvent(e) != CL_SUCCESS) atomic_fetch_add(&bad_status, 1);
    atomic_store(&user_status, status);
    atomic_fetch_add(&user_calls, 1);
}

static void CL_CALLBACK on_step(cl_event e, cl_int status, void *data) {
    (void)data;
    cl_int st = -1;
    if (clGetEventInfo(e, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof st, &st, NULL) != CL_SUCCESS || st != CL_COMPLETE) atomic_fetch_add(&bad_status, 1);
    if (status == CL_COMPLETE) atomic_fetch_add(&step_calls, 1);
}

int main(int argc, char **argv) {
    int steps = argc > 1 ? atoi(argv[1]) : 100;
    int set_at = argc > 2 ? atoi(argv[2]) : 50;
    int dev = argc > 3 ? device_arg(argv[3]) : 0;
    int sleep = argc > 4 ? atoi(argv[4]) : 20;
    enum { N = 1024 };
    cl_device_id d;
    cl_context ctx;
    cl_command_queue q = open_queue(dev, &d, &ctx);
    cl_int err;
    cl_program prog = build(ctx, d, SRC);
    cl_kernel k = clCreateKernel(prog, "bump", &err);
    CHECK(err);
    uint32_t host[N], ref[N];
    for (uint32_t i = 0; i < N; i++) ref[i] = i;
    cl_mem buf = clCreateBuffer(ctx, CL_MEM_READ_WRITE | CL_MEM_COPY_HOST_PTR, sizeof ref, ref, &err);
    CHECK(err);
    cl_event user = clCreateUserEvent(ctx, &err);
    CHECK(err);
    CHECK(clRetainEvent(user)); /* the callback's, released there */
    CHECK(clSetEventCallback(user, CL_COMPLETE, on_user, &user_calls));
    char name[256];
    for (int s = 1; s <= steps; s++) {
        uint32_t it = (uint32_t)s;
        CHECK(clSetKernelArg(k, 0, sizeof buf, &buf));
        CHECK(clSetKernelArg(k, 1, sizeof it, &it));
        size_t g = N;
        cl_event ev;
        CHECK(clEnqueueNDRangeKernel(q, k, 1, NULL, &g, NULL, 0, NULL, &ev));
        CHECK(clSetEventCallback(ev, CL_COMPLETE, on_step, NULL));
        CHECK(clEnqueueReadBuffer(q, buf, CL_TRUE, 0, sizeof host, host, 0, NULL, NULL));
        CHECK(clReleaseEvent(ev));
        for (uint32_t i = 0; i < N; i++) ref[i] = ref[i] * 3u + it + i;
        if (memcmp(host, ref, sizeof ref) != 0) {
            printf("verify failed at step %d\n", s);
            return 1;
        }
        if (s == set_at) {
            if (atomic_load(&user_calls) != 0) {
                printf("verify failed: the user event's callback ran before the event was set\n");
                return 1;
            }
            CHECK(clSetUserEventStatus(user, CL_COMPLETE));
            for (int w = 0; w < 200 && atomic_load(&user_calls) == 0; w++) usleep(5000);
            if (atomic_load(&user_calls) != 1 || atomic_load(&user_status) != CL_COMPLETE) {
                printf("verify failed: the user event's callback ran %d times (status %d)\n", atomic_load(&user_calls), atomic_load(&user_status));
                return 1;
            }
        }
        queue_device_name(q, name, sizeof name);
        printf("step %d checksum %016llx t %llu dev %s\n", s, (unsigned long long)fnv(host, sizeof host, 0xcbf29ce484222325ULL), (unsigned long long)now_ms(), name);
        fflush(stdout);
        pause_ms(sleep);
    }
    CHECK(clFinish(q));
    for (int w = 0; w < 200 && atomic_load(&step_calls) < steps; w++) usleep(5000);
    usleep(50000);
    if (atomic_load(&step_calls) != steps || atomic_load(&user_calls) != 1 || atomic_load(&bad_status) != 0) {
        printf("verify failed: %d step callbacks for %d steps, %d user callbacks, %d OpenCL calls failed in callbacks\n", atomic_load(&step_calls), steps,
               atomic_load(&user_calls), atomic_load(&bad_status));
        return 1;
    }
    printf("verify ok\n");
    return 0;
}
