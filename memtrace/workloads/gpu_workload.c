/* Allocates GPU memory of every kind through the CUDA driver API, loaded with dlopen as
 * frameworks do, in a known pattern (a failing call included), starting 200 ms after
 * cuInit; then writes what it did as JSON, for the tests to compare with memtrace.
 * Usage: gpu_workload LIBCUDA MANIFEST (GPU_WORKLOAD_DELAY_MS overrides the 200 ms;
 * with GPU_WORKLOAD_WAIT_STDIN set, it says "waiting" after cuInit and waits for a line
 * on stdin, so a tracer can attach to it running, the driver already loaded) */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUhandle;
typedef struct {
    int type;
    int requestedHandleTypes;
    struct {
        int type;
        int id;
    } location;
    void *win32HandleMetaData;
    unsigned char allocFlags[8];
} CUmemAllocationProp;

static CUresult (*cuInit)(unsigned);
static CUresult (*cuMemAlloc_v2)(CUdeviceptr *, size_t);
static CUresult (*cuMemAllocPitch_v2)(CUdeviceptr *, size_t *, size_t, size_t, unsigned);
static CUresult (*cuMemAllocManaged)(CUdeviceptr *, size_t, unsigned);
static CUresult (*cuMemAllocAsync)(CUdeviceptr *, size_t, void *);
static CUresult (*cuMemAllocFromPoolAsync)(CUdeviceptr *, size_t, void *, void *);
static CUresult (*cuMemAllocHost_v2)(void **, size_t);
static CUresult (*cuMemHostAlloc)(void **, size_t, unsigned);
static CUresult (*cuMemCreate)(CUhandle *, size_t, const CUmemAllocationProp *, unsigned long long);
static CUresult (*cuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
static CUresult (*cuMemMap)(CUdeviceptr, size_t, size_t, CUhandle, unsigned long long);
static CUresult (*cuMemFree_v2)(CUdeviceptr);
static CUresult (*cuMemFreeAsync)(CUdeviceptr, void *);
static CUresult (*cuMemFreeHost)(void *);
static CUresult (*cuMemRelease)(CUhandle);
static CUresult (*cuMemAddressFree)(CUdeviceptr, size_t);
static CUresult (*cuMemUnmap)(CUdeviceptr, size_t);

/* What was done, per domain: gpu (memory) and gpu_va (address ranges). */
struct counts {
    unsigned long allocs, frees, bytes_req, bytes_alloc, live_allocs, live_bytes_req, failed, failed_bytes_req;
};
static struct counts gpu, va;

static void check(CUresult r, const char *what) {
    if (r != 0) {
        fprintf(stderr, "%s failed: %d\n", what, r);
        exit(1);
    }
}

static void allocated(struct counts *c, size_t req, size_t alloc) {
    c->allocs++;
    c->bytes_req += req;
    c->bytes_alloc += alloc;
    c->live_allocs++;
    c->live_bytes_req += req;
}

static void freed(struct counts *c, size_t req) {
    c->frees++;
    c->live_allocs--;
    c->live_bytes_req -= req;
}

__attribute__((noinline)) void gpu_device(void) {
    CUdeviceptr p[3];
    for (int i = 0; i < 3; i++) {
        check(cuMemAlloc_v2(&p[i], 1 << 20), "cuMemAlloc_v2");
        allocated(&gpu, 1 << 20, 1 << 20);
    }
    for (int i = 0; i < 2; i++) {
        check(cuMemFree_v2(p[i]), "cuMemFree_v2");
        freed(&gpu, 1 << 20);
    }
}

__attribute__((noinline)) void gpu_pitched(void) {
    CUdeviceptr p;
    size_t pitch = 0;
    check(cuMemAllocPitch_v2(&p, &pitch, 1000, 64, 4), "cuMemAllocPitch_v2");
    allocated(&gpu, 1000 * 64, pitch * 64);
    check(cuMemFree_v2(p), "cuMemFree_v2");
    freed(&gpu, 1000 * 64);
}

__attribute__((noinline)) void gpu_managed(void) {
    CUdeviceptr p[2];
    for (int i = 0; i < 2; i++) {
        check(cuMemAllocManaged(&p[i], 4096, 1), "cuMemAllocManaged");
        allocated(&gpu, 4096, 4096);
    }
    check(cuMemFree_v2(p[0]), "cuMemFree_v2");
    freed(&gpu, 4096);
}

__attribute__((noinline)) void gpu_async(void) {
    CUdeviceptr p[2];
    for (int i = 0; i < 2; i++) {
        check(cuMemAllocAsync(&p[i], 8192, 0), "cuMemAllocAsync");
        allocated(&gpu, 8192, 8192);
    }
    for (int i = 0; i < 2; i++) {
        check(cuMemFreeAsync(p[i], 0), "cuMemFreeAsync");
        freed(&gpu, 8192);
    }
}

__attribute__((noinline)) void gpu_pool(void) {
    CUdeviceptr p;
    check(cuMemAllocFromPoolAsync(&p, 16384, (void *)1, 0), "cuMemAllocFromPoolAsync");
    allocated(&gpu, 16384, 16384); /* left live */
}

__attribute__((noinline)) void gpu_host(void) {
    void *a, *b;
    check(cuMemAllocHost_v2(&a, 4096), "cuMemAllocHost_v2");
    allocated(&gpu, 4096, 4096);
    check(cuMemHostAlloc(&b, 12288, 0), "cuMemHostAlloc");
    allocated(&gpu, 12288, 12288);
    check(cuMemFreeHost(a), "cuMemFreeHost");
    freed(&gpu, 4096);
}

__attribute__((noinline)) void gpu_virtual(void) {
    const size_t chunk = 2 << 20;
    CUmemAllocationProp prop = {0};
    prop.type = 1;
    prop.location.type = 1; /* a device */
    prop.location.id = 1; /* the second device: the report names it */
    CUhandle h[2];
    for (int i = 0; i < 2; i++) {
        check(cuMemCreate(&h[i], chunk, &prop, 0), "cuMemCreate");
        allocated(&gpu, chunk, chunk);
    }
    CUdeviceptr base;
    check(cuMemAddressReserve(&base, 4 * chunk, 0, 0, 0), "cuMemAddressReserve");
    allocated(&va, 4 * chunk, 4 * chunk);
    for (int i = 0; i < 2; i++) {
        check(cuMemMap(base + i * chunk, chunk, 0, h[i], 0), "cuMemMap");
        allocated(&va, chunk, chunk);
    }
    check(cuMemUnmap(base + chunk, chunk), "cuMemUnmap");
    freed(&va, chunk);
    check(cuMemRelease(h[1]), "cuMemRelease");
    freed(&gpu, chunk);
}

/* Asks for more than the device has: the call fails, nothing is allocated. */
__attribute__((noinline)) void gpu_out_of_memory(void) {
    CUdeviceptr p;
    if (cuMemAlloc_v2(&p, 1ULL << 50) == 0) {
        fprintf(stderr, "the huge allocation succeeded\n");
        exit(1);
    }
    gpu.failed++;
    gpu.failed_bytes_req += 1ULL << 50;
}

static void *sym(void *lib, const char *name) {
    void *f = dlsym(lib, name);
    if (!f) {
        fprintf(stderr, "%s: %s\n", name, dlerror());
        exit(1);
    }
    return f;
}

static void write_counts(FILE *f, const char *name, const struct counts *c, const char *sep) {
    fprintf(f,
            "\"%s\": {\"allocs\": %lu, \"frees\": %lu, \"bytes_req\": %lu, \"bytes_alloc\": %lu, "
            "\"live_allocs\": %lu, \"live_bytes_req\": %lu, \"failed\": %lu, \"failed_bytes_req\": %lu}%s\n",
            name, c->allocs, c->frees, c->bytes_req, c->bytes_alloc, c->live_allocs, c->live_bytes_req, c->failed,
            c->failed_bytes_req, sep);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s LIBCUDA MANIFEST\n", argv[0]);
        return 2;
    }
    void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        fprintf(stderr, "dlopen: %s\n", dlerror());
        return 1;
    }
    cuInit = sym(lib, "cuInit");
    cuMemAlloc_v2 = sym(lib, "cuMemAlloc_v2");
    cuMemAllocPitch_v2 = sym(lib, "cuMemAllocPitch_v2");
    cuMemAllocManaged = sym(lib, "cuMemAllocManaged");
    cuMemAllocAsync = sym(lib, "cuMemAllocAsync");
    cuMemAllocFromPoolAsync = sym(lib, "cuMemAllocFromPoolAsync");
    cuMemAllocHost_v2 = sym(lib, "cuMemAllocHost_v2");
    cuMemHostAlloc = sym(lib, "cuMemHostAlloc");
    cuMemCreate = sym(lib, "cuMemCreate");
    cuMemAddressReserve = sym(lib, "cuMemAddressReserve");
    cuMemMap = sym(lib, "cuMemMap");
    cuMemFree_v2 = sym(lib, "cuMemFree_v2");
    cuMemFreeAsync = sym(lib, "cuMemFreeAsync");
    cuMemFreeHost = sym(lib, "cuMemFreeHost");
    cuMemRelease = sym(lib, "cuMemRelease");
    cuMemAddressFree = sym(lib, "cuMemAddressFree");
    cuMemUnmap = sym(lib, "cuMemUnmap");
    check(cuInit(0), "cuInit");
    if (getenv("GPU_WORKLOAD_WAIT_STDIN")) {
        char line[16];
        printf("waiting\n");
        fflush(stdout);
        if (!fgets(line, sizeof line, stdin))
            return 1;
    }
    const char *delay = getenv("GPU_WORKLOAD_DELAY_MS");
    if (delay) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        fprintf(stderr, "gpu_workload: cuInit returned at %lld ns\n", (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec);
    }
    usleep((delay ? atoi(delay) : 200) * 1000);
    gpu_device();
    gpu_pitched();
    gpu_managed();
    gpu_async();
    gpu_pool();
    gpu_host();
    gpu_virtual();
    gpu_out_of_memory();
    FILE *f = fopen(argv[2], "w");
    if (!f)
        return 1;
    fprintf(f, "{\n");
    write_counts(f, "gpu", &gpu, ",");
    write_counts(f, "gpu_va", &va, "");
    fprintf(f, "}\n");
    fclose(f);
    return 0;
}
