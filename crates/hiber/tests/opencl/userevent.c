/* A queue whose work waits on a user event is released while the work is still waiting (the
 * platform may finish the queue in the release), and another thread sets the event a little
 * later; meanwhile the main thread waits on another queue. Every call returns, and the
 * work ran: prints `verify ok`.
 * Usage: userevent DEVICE (PoCL's basic device runs queued work only when asked to finish: use
 * pthread) */
#include "common.h"
#include <pthread.h>

static cl_event user;

static void *setter(void *arg) {
    (void)arg;
    pause_ms(300);
    CHECK(clSetUserEventStatus(user, CL_COMPLETE));
    return NULL;
}

int main(int argc, char **argv) {
    int dev = argc > 1 ? device_arg(argv[1]) : 0;
    cl_device_id d;
    cl_context ctx;
    cl_command_queue q = open_queue(dev, &d, &ctx);
    cl_int err;
    cl_command_queue q2 = clCreateCommandQueueWithProperties(ctx, d, NULL, &err);
    CHECK(err);
    user = clCreateUserEvent(ctx, &err);
    CHECK(err);
    uint32_t one = 1, got = 0;
    cl_mem b = clCreateBuffer(ctx, CL_MEM_READ_WRITE, sizeof one, NULL, &err);
    CHECK(err);
    CHECK(clEnqueueWriteBuffer(q2, b, CL_TRUE, 0, sizeof got, &got, 0, NULL, NULL));
    /* Work that waits on the user event, then the queue let go while it waits. */
    cl_event done;
    CHECK(clEnqueueFillBuffer(q, b, &one, sizeof one, 0, sizeof one, 1, &user, &done));
    CHECK(clFlush(q));
    pthread_t t;
    pthread_create(&t, NULL, setter, NULL);
    CHECK(clReleaseCommandQueue(q));
    CHECK(clFinish(q2));
    pthread_join(t, NULL);
    /* The fill ran on the released queue: wait for it (nothing else orders it before the read). */
    CHECK(clWaitForEvents(1, &done));
    CHECK(clReleaseEvent(done));
    CHECK(clEnqueueReadBuffer(q2, b, CL_TRUE, 0, sizeof got, &got, 0, NULL, NULL));
    if (got != 1) {
        fprintf(stderr, "the work that waited on the user event did not run: %u\n", got);
        return 1;
    }
    printf("verify ok\n");
    return 0;
}
