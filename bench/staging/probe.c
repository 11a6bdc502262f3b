/* How fast can device memory reach host memory when the GPU has no room for a copy?
 * Measures the ways of getting pinned (page-locked) host memory and the copy bandwidth
 * into it, so that hiber's host staging is designed from numbers (issue: speed on a full
 * GPU). Built and run on the GPU machine against its cuda.h:
 *
 *   gcc -O2 -I/usr/local/cuda/include bench/staging/probe.c -o probe -ldl -lpthread
 *   ./probe [GIB] [THREADS]
 *
 * Prints one JSON object per line: {"what": ..., "seconds": ..., "GBps": ...}. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#include <cuda.h>

static CUresult (*p_init)(unsigned);
static CUresult (*p_dev_get)(CUdevice *, int);
static CUresult (*p_ctx_retain)(CUcontext *, CUdevice);
static CUresult (*p_ctx_set)(CUcontext);
static CUresult (*p_malloc)(CUdeviceptr *, size_t);
static CUresult (*p_memset)(CUdeviceptr, unsigned char, size_t);
static CUresult (*p_host_alloc)(void **, size_t, unsigned);
static CUresult (*p_free_host)(void *);
static CUresult (*p_register)(void *, size_t, unsigned);
static CUresult (*p_unregister)(void *);
static CUresult (*p_stream)(CUstream *, unsigned);
static CUresult (*p_dtoh)(void *, CUdeviceptr, size_t, CUstream);
static CUresult (*p_htod)(CUdeviceptr, const void *, size_t, CUstream);
static CUresult (*p_sync)(CUstream);

static CUcontext ctx;
static CUdeviceptr dev;
static size_t total;
static int nthreads;

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

#define CK(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { fprintf(stderr, "%s:%d %s -> %d\n", __FILE__, __LINE__, #x, (int)r_); exit(1); } } while (0)

static void report(const char *what, double s, size_t bytes) {
    printf("{\"what\": \"%s\", \"seconds\": %.3f, \"GBps\": %.2f, \"GiB\": %.1f, \"threads\": %d}\n", what, s, bytes / s / 1e9, bytes / (double)(1 << 30), nthreads);
    fflush(stdout);
}

/* Work split over threads: each takes slice [i*len/n, (i+1)*len/n). */
enum op { TOUCH, REGISTER, UNREGISTER, DTOH, HTOD };
struct job { enum op op; char *host; size_t off, len; CUresult r; };

static void *worker(void *arg) {
    struct job *j = arg;
    j->r = CUDA_SUCCESS;
    if (j->op == TOUCH) {
        for (size_t o = 0; o < j->len; o += 4096) j->host[j->off + o] = 1;
        return NULL;
    }
    p_ctx_set(ctx);
    if (j->op == REGISTER) { j->r = p_register(j->host + j->off, j->len, 0); return NULL; }
    if (j->op == UNREGISTER) { j->r = p_unregister(j->host + j->off); return NULL; }
    CUstream s;
    if ((j->r = p_stream(&s, CU_STREAM_NON_BLOCKING)) != CUDA_SUCCESS) return NULL;
    /* 64 MiB pieces, as hiber's chunks. */
    const size_t piece = 64ul << 20;
    for (size_t o = 0; o < j->len && j->r == CUDA_SUCCESS; o += piece) {
        size_t n = j->len - o < piece ? j->len - o : piece;
        if (j->op == DTOH) j->r = p_dtoh(j->host + j->off + o, dev + j->off + o, n, s);
        else j->r = p_htod(dev + j->off + o, j->host + j->off + o, n, s);
    }
    if (j->r == CUDA_SUCCESS) j->r = p_sync(s);
    return NULL;
}

static double parallel(enum op op, char *host, int n) {
    pthread_t t[64];
    struct job j[64];
    size_t slice = (total / n) & ~((2ul << 20) - 1);
    double t0 = now();
    for (int i = 0; i < n; i++) {
        j[i] = (struct job){ op, host, i * slice, i == n - 1 ? total - i * slice : slice, CUDA_SUCCESS };
        pthread_create(&t[i], NULL, worker, &j[i]);
    }
    for (int i = 0; i < n; i++) pthread_join(t[i], NULL);
    double s = now() - t0;
    for (int i = 0; i < n; i++) if (j[i].r != CUDA_SUCCESS) { fprintf(stderr, "op %d slice %d failed: %d\n", op, i, (int)j[i].r); return -1; }
    return s;
}

static char *anon(int huge) {
    size_t align = 2ul << 20;
    char *p = mmap(NULL, total + align, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) { perror("mmap"); exit(1); }
    p = (char *)(((unsigned long)p + align - 1) & ~(align - 1));
    if (huge && madvise(p, total, MADV_HUGEPAGE)) perror("madvise");
    return p;
}

static char *shmem(int huge) {
    int fd = memfd_create("probe", 0);
    if (fd < 0 || ftruncate(fd, total)) { perror("memfd"); exit(1); }
    char *p = mmap(NULL, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) { perror("mmap"); exit(1); }
    if (huge && madvise(p, total, MADV_HUGEPAGE)) perror("madvise shmem");
    close(fd);
    return p;
}

/* Pins `host` by the given way, then measures copies into it and out of it. */
static void pinned_case(const char *name, char *host, int touch_first, int register_threads) {
    char what[128];
    if (touch_first) {
        double s = parallel(TOUCH, host, nthreads);
        snprintf(what, sizeof what, "%s: touch (fault in)", name);
        report(what, s, total);
    }
    double s = register_threads > 1 ? parallel(REGISTER, host, register_threads) : (({ double t0 = now(); CK(p_register(host, total, 0)); now() - t0; }));
    snprintf(what, sizeof what, "%s: cuMemHostRegister x%d", name, register_threads);
    report(what, s, total);
    for (int n = 1; n <= nthreads; n *= 4) {
        int save = nthreads;
        s = parallel(DTOH, host, n);
        snprintf(what, sizeof what, "%s: DtoH, %d streams", name, n);
        nthreads = n; report(what, s, total); nthreads = save;
    }
    s = parallel(HTOD, host, nthreads);
    snprintf(what, sizeof what, "%s: HtoD, %d streams", name, nthreads);
    report(what, s, total);
    s = register_threads > 1 ? parallel(UNREGISTER, host, register_threads) : (({ double t0 = now(); CK(p_unregister(host)); now() - t0; }));
    snprintf(what, sizeof what, "%s: unregister", name);
    report(what, s, total);
    munmap(host, total);
}

static void show(const char *path) {
    char buf[256] = "";
    FILE *f = fopen(path, "r");
    if (f) { if (!fgets(buf, sizeof buf, f)) buf[0] = 0; fclose(f); }
    buf[strcspn(buf, "\n")] = 0;
    printf("{\"file\": \"%s\", \"value\": \"%s\"}\n", path, buf);
}

int main(int argc, char **argv) {
    total = (size_t)(argc > 1 ? atof(argv[1]) : 8) * (1ul << 30);
    nthreads = argc > 2 ? atoi(argv[2]) : 8;
    show("/sys/kernel/mm/transparent_hugepage/enabled");
    show("/sys/kernel/mm/transparent_hugepage/defrag");
    show("/sys/kernel/mm/transparent_hugepage/shmem_enabled");
    show("/proc/sys/vm/nr_hugepages");
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) { fprintf(stderr, "%s\n", dlerror()); return 1; }
#define L(v, n) if (!(*(void **)&v = dlsym(lib, n))) { fprintf(stderr, "no %s\n", n); return 1; }
    L(p_init, "cuInit"); L(p_dev_get, "cuDeviceGet"); L(p_ctx_retain, "cuDevicePrimaryCtxRetain"); L(p_ctx_set, "cuCtxSetCurrent");
    L(p_malloc, "cuMemAlloc_v2"); L(p_memset, "cuMemsetD8_v2"); L(p_host_alloc, "cuMemHostAlloc"); L(p_free_host, "cuMemFreeHost");
    L(p_register, "cuMemHostRegister_v2"); L(p_unregister, "cuMemHostUnregister"); L(p_stream, "cuStreamCreate");
    L(p_dtoh, "cuMemcpyDtoHAsync_v2"); L(p_htod, "cuMemcpyHtoDAsync_v2"); L(p_sync, "cuStreamSynchronize");
    CUdevice d;
    CK(p_init(0)); CK(p_dev_get(&d, 0)); CK(p_ctx_retain(&ctx, d)); CK(p_ctx_set(ctx));
    CK(p_malloc(&dev, total)); CK(p_memset(dev, 7, total));

    /* 1. cuMemHostAlloc: what hiber's pinned buffers use today. */
    double t0 = now();
    void *h;
    CK(p_host_alloc(&h, total, 0));
    report("cuMemHostAlloc", now() - t0, total);
    double s = parallel(DTOH, h, nthreads);
    report("cuMemHostAlloc: DtoH", s, total);
    t0 = now();
    CK(p_free_host(h));
    report("cuMemFreeHost", now() - t0, total);

    /* 2. Pageable memory, already faulted in: no pinning at all. */
    char *p = anon(0);
    s = parallel(TOUCH, p, nthreads);
    report("pageable: touch (fault in)", s, total);
    for (int n = 1; n <= nthreads; n *= 4) {
        int save = nthreads; s = parallel(DTOH, p, n); nthreads = n; report("pageable: DtoH", s, total); nthreads = save;
    }
    s = parallel(HTOD, p, nthreads);
    report("pageable: HtoD", s, total);
    munmap(p, total);

    /* 3. Registered anonymous memory: 4 KiB pages, huge pages; faulted in first or not;
     *    registered in one call or by several threads. */
    pinned_case("anon 4k, register unfaulted", anon(0), 0, 1);
    pinned_case("anon 4k, touched by threads", anon(0), 1, 1);
    pinned_case("anon 4k, touched, register by threads", anon(0), 1, nthreads);
    pinned_case("anon THP, touched by threads", anon(1), 1, 1);
    pinned_case("anon THP, touched, register by threads", anon(1), 1, nthreads);
    /* 4. Shared memory (a memfd: survives as a file if hiber would link it). */
    pinned_case("memfd, touched, register by threads", shmem(0), 1, nthreads);
    pinned_case("memfd THP advise, touched, register by threads", shmem(1), 1, nthreads);
    return 0;
}
