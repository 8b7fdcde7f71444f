/* A stand-in for the CUDA driver (libcuda.so.1) with the same entry points and
 * signatures as the real one, for tests on machines without a GPU: it hands out fake
 * device addresses, handles and pitches, and fails requests above FAKE_CUDA_LIMIT bytes
 * with CUDA_ERROR_OUT_OF_MEMORY. Nothing is dereferenced. */
#include <stddef.h>
#include <stdint.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef void *CUstream;
typedef void *CUmemoryPool;
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

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define FAKE_CUDA_LIMIT (1ULL << 40)

static volatile int initialized;
static CUdeviceptr next_device = 0x7f0000000000ULL;
static CUdeviceptr next_host = 0x7e0000000000ULL;
static CUdeviceptr next_va = 0x7d0000000000ULL;
static CUmemGenericAllocationHandle next_handle = 0x1000;
/* Calls seen, per entry point: keeps the bodies distinct so none is folded into another. */
volatile unsigned long calls[32];

static CUdeviceptr take(CUdeviceptr *next, size_t bytes) {
    CUdeviceptr p = *next;
    *next += (bytes + 0x1fffff) & ~0x1fffffULL;
    return p;
}

static CUresult device_alloc(int which, CUdeviceptr *dptr, size_t bytes) {
    calls[which]++;
    if (!initialized)
        return CUDA_ERROR_NOT_INITIALIZED;
    if (!dptr || bytes == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (bytes > FAKE_CUDA_LIMIT)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *dptr = take(&next_device, bytes);
    return CUDA_SUCCESS;
}

CUresult cuInit(unsigned int flags) {
    calls[0]++;
    initialized = flags == 0;
    return initialized ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) { return device_alloc(1, dptr, bytesize); }

CUresult cuMemAllocPitch_v2(CUdeviceptr *dptr, size_t *pitch, size_t width, size_t height, unsigned int elem) {
    calls[2]++;
    if (!pitch || elem == 0)
        return CUDA_ERROR_INVALID_VALUE;
    size_t p = (width + 511) & ~(size_t)511;
    CUresult r = device_alloc(2, dptr, p * height);
    if (r == CUDA_SUCCESS)
        *pitch = p;
    return r;
}

CUresult cuMemAllocManaged(CUdeviceptr *dptr, size_t bytesize, unsigned int flags) {
    (void)flags;
    return device_alloc(3, dptr, bytesize);
}

CUresult cuMemAllocAsync(CUdeviceptr *dptr, size_t bytesize, CUstream stream) {
    (void)stream;
    return device_alloc(4, dptr, bytesize);
}

CUresult cuMemAllocFromPoolAsync(CUdeviceptr *dptr, size_t bytesize, CUmemoryPool pool, CUstream stream) {
    (void)stream;
    if (!pool)
        return CUDA_ERROR_INVALID_VALUE;
    return device_alloc(5, dptr, bytesize);
}

static CUresult host_alloc(int which, void **pp, size_t bytesize) {
    calls[which]++;
    if (!pp || bytesize == 0)
        return CUDA_ERROR_INVALID_VALUE;
    *pp = (void *)(uintptr_t)take(&next_host, bytesize);
    return CUDA_SUCCESS;
}

CUresult cuMemAllocHost_v2(void **pp, size_t bytesize) { return host_alloc(6, pp, bytesize); }

CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int flags) {
    (void)flags;
    return host_alloc(7, pp, bytesize);
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const CUmemAllocationProp *prop,
                     unsigned long long flags) {
    calls[8]++;
    if (!handle || !prop || flags != 0 || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    if (size > FAKE_CUDA_LIMIT)
        return CUDA_ERROR_OUT_OF_MEMORY;
    *handle = next_handle++;
    return CUDA_SUCCESS;
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
    calls[9]++;
    (void)alignment;
    (void)addr;
    if (!ptr || flags != 0 || size == 0)
        return CUDA_ERROR_INVALID_VALUE;
    *ptr = take(&next_va, size);
    return CUDA_SUCCESS;
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
    calls[10]++;
    return ptr && size && handle && !offset && !flags ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemFree_v2(CUdeviceptr dptr) {
    calls[11]++;
    return dptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemFreeAsync(CUdeviceptr dptr, CUstream stream) {
    calls[12]++;
    (void)stream;
    return dptr ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemFreeHost(void *p) {
    calls[13]++;
    return p ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    calls[14]++;
    return handle ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    calls[15]++;
    return ptr && size ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    calls[16]++;
    return ptr && size ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}
