/*
 * The bundled deterministic workload memtrace's demo, tests and benchmarks trace.
 *
 * Default mode ("exercise"): every thread calls every entry point of the malloc family from
 * its own noinline function (so each is a distinct call site), frees all but a known number
 * of blocks, and measures malloc_usable_size itself. With --manifest FILE it writes what it
 * did, per allocating function, as JSON; tests compare memtrace's figures with it exactly.
 *
 * Other modes: --loop N (N malloc+free pairs of 32 bytes, or --loop-bytes B; prints ns/pair:
 * the overhead benchmark),
 * --kernel-loop N (N pipe()+close() pairs: kernel allocations on behalf of the task),
 * --kernel-sites N (N pipe()+close() pairs, from pipe_site_a and pipe_site_b in turn),
 * --cycle N (N rounds of four malloc sites called in turn, cycle_site_a to _d: 24, 40, 56
 * and 72 bytes, freed at each round's end),
 * --wrapped N (N rounds of malloc(48) through one wrapper, wl_xmalloc, called from
 * wl_wrapped_a and wl_wrapped_b in turn, each block freed at once),
 * --dlopen LIB N (load the allocator library LIB with dlopen, wait 3 s (--dlopen-wait-ms), then make N
 * allocations with its malloc, through dlsym: a second allocator memtrace must find;
 * with --dlopen-prefix P, its P##malloc, and each block is freed with its P##free),
 * --custom N (N allocations from a tiny allocator of its own, mt_malloc/mt_free: what
 * `record --symbol-prefix mt_` must find in the executable),
 * --stacks (allocations whose stacks test an unwinder: one in a signal handler, one in a
 * qsort comparator called back from libc, one 100 and one 300 calls deep),
 * --fork-children N (fork N children that each make 10 malloc(77) from wl_child_alloc at once
 * and exit: a tracer must see a child from its first instruction),
 * --peak (memory over time with a known peak, one thread; with --manifest FILE it writes
 * each site's figures, its bytes live at the peak and the peak's moment: see wl_peak_run),
 * --reserve BYTES (reserve BYTES of address space with mmap(PROT_NONE) from wl_reserve, as the
 * CUDA driver and allocators do, and map 1 MiB read-write from wl_map_rw; both stay mapped),
 * --remap N (N rounds of mappings changed by mremap, each unmapped in the end, so nothing
 * stays live: wl_remap_map maps two pages; wl_remap_grow moves its first to a mapping of 16
 * pages (the second page is in the way); wl_remap_shrink cuts that to two pages where it is;
 * wl_remap_copy duplicates it elsewhere with MREMAP_DONTUNMAP, which keeps the original;
 * wl_remap_view grows a read-only view of the program's file from one page to four, which
 * is not memory allocated; wl_remap_reserve grows a PROT_NONE reservation from two pages
 * to sixteen, which stays reserved address space),
 * --sleep-ms MS (pause before starting), --wait-stdin (start once a line is read from
 * stdin), so a recorder can attach with --pid first.
 * --steady-leak (a service that leaks, for `memtrace serve`): a startup burst kept live
 * (wl_startup: 8 blocks of 200000 bytes), then one step every --step-ms MS (default 50) of
 * --leak-per-step K blocks of --leak-block BYTES (default 8 of 65536) never freed
 * (wl_steady_leak) and short-lived churn (wl_churn: 32 blocks of 1000 bytes, freed at
 * once); it prints one JSON line once the startup burst is done and, after --leak-steps N
 * steps (0, the default: forever), one with what it leaked, then waits for a line or EOF
 * on stdin before exiting. Blocks are touched only in their first bytes: leaking costs
 * little resident memory.
 *
 * build.rs builds it twice: with frame pointers (alloc_workload) and without
 * (alloc_workload_nofp, -fomit-frame-pointer), so stack walks can be compared.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define NOINLINE __attribute__((noinline))
/* Neither inlined nor cloned nor otherwise changed by interprocedural passes, so the
 * function keeps its name and its frame in every stack. */
#define NOIPA __attribute__((noipa))

enum site {
    S_MALLOC,
    S_MALLOC_LARGE,
    S_CALLOC,
    S_REALLOC,
    S_REALLOCARRAY,
    S_POSIX_MEMALIGN,
    S_ALIGNED_ALLOC,
    S_MEMALIGN,
    S_VALLOC,
    S_PVALLOC,
    S_MMAP,
    S_LEAK,
    S_COUNT
};

static const char *site_names[S_COUNT] = {
    "wl_malloc",       "wl_malloc_large", "wl_calloc",        "wl_realloc",
    "wl_reallocarray", "wl_posix_memalign", "wl_aligned_alloc", "wl_memalign",
    "wl_valloc",       "wl_pvalloc",      "wl_mmap",          "wl_leak",
};

struct figures {
    unsigned long allocs, frees, bytes_req, bytes_alloc, live_allocs, live_bytes_req;
};

static struct figures totals[S_COUNT];
static pthread_mutex_t totals_lock = PTHREAD_MUTEX_INITIALIZER;

/* Per-thread tally, merged under the lock when the thread ends. */
struct tally {
    struct figures f[S_COUNT];
};

static volatile uintptr_t sink;

/* Entry points the allocator in use does not provide (jemalloc has no pvalloc): glibc's
 * would serve them from its own heap and the allocator's free would then crash on the block.
 * Those sites are skipped (0 in the manifest). reallocarray is called under every allocator:
 * where the allocator has none (jemalloc, tcmalloc), glibc's hands the call on to the realloc
 * the program uses (a tail call through its PLT), and the block is that allocator's. */
static int has_pvalloc = 1;

static void *object_of(const char *name) {
    Dl_info info;
    void *f = dlsym(RTLD_DEFAULT, name);
    if (!f || !dladdr(f, &info))
        return NULL;
    return info.dli_fbase;
}

static void check_entry_points(void) {
    void *malloc_object = object_of("malloc");
    has_pvalloc = object_of("pvalloc") == malloc_object;
}

static void touch(void *p, size_t n) {
    if (n)
        memset(p, 0xa5, n < 64 ? n : 64);
    sink ^= (uintptr_t)p;
}

static void count_alloc(struct tally *t, enum site s, void *p, size_t req) {
    t->f[s].allocs++;
    t->f[s].bytes_req += req;
    t->f[s].bytes_alloc += malloc_usable_size(p);
    t->f[s].live_allocs++;
    t->f[s].live_bytes_req += req;
}

static void count_free(struct tally *t, enum site s, size_t req) {
    t->f[s].frees++;
    t->f[s].live_allocs--;
    t->f[s].live_bytes_req -= req;
}

NOINLINE static void *wl_malloc(struct tally *t, size_t n) {
    void *p = malloc(n);
    count_alloc(t, S_MALLOC, p, n);
    touch(p, n);
    return p;
}

NOINLINE static void *wl_malloc_large(struct tally *t, size_t n) {
    void *p = malloc(n); /* above the mmap threshold: an mmapped chunk */
    count_alloc(t, S_MALLOC_LARGE, p, n);
    touch(p, n);
    return p;
}

NOINLINE static void *wl_calloc(struct tally *t, size_t nmemb, size_t size) {
    void *p = calloc(nmemb, size);
    count_alloc(t, S_CALLOC, p, nmemb * size);
    touch(p, nmemb * size);
    return p;
}

/* realloc(NULL, a) allocates; realloc(p, b) frees p and allocates; realloc(q, 0) frees. */
NOINLINE static void wl_realloc(struct tally *t, size_t a, size_t b) {
    void *p = realloc(NULL, a);
    count_alloc(t, S_REALLOC, p, a);
    touch(p, a);
    void *q = realloc(p, b);
    count_free(t, S_REALLOC, a);
    count_alloc(t, S_REALLOC, q, b);
    touch(q, b);
    void *r = realloc(q, 0);
    count_free(t, S_REALLOC, b);
    if (r) { /* mimalloc returns a fresh minimal block (glibc, jemalloc, tcmalloc: NULL) */
        count_alloc(t, S_REALLOC, r, 0);
        free(r);
        count_free(t, S_REALLOC, 0);
    }
}

NOINLINE static void *wl_reallocarray(struct tally *t, size_t n1, size_t n2, size_t size) {
    void *p = reallocarray(NULL, n1, size);
    count_alloc(t, S_REALLOCARRAY, p, n1 * size);
    touch(p, n1 * size);
    void *q = reallocarray(p, n2, size);
    count_free(t, S_REALLOCARRAY, n1 * size);
    count_alloc(t, S_REALLOCARRAY, q, n2 * size);
    touch(q, n2 * size);
    return q;
}

NOINLINE static void *wl_posix_memalign(struct tally *t, size_t align, size_t n) {
    void *p = NULL;
    if (posix_memalign(&p, align, n) != 0)
        abort();
    count_alloc(t, S_POSIX_MEMALIGN, p, n);
    touch(p, n);
    return p;
}

NOINLINE static void *wl_aligned_alloc(struct tally *t, size_t align, size_t n) {
    void *p = aligned_alloc(align, n);
    count_alloc(t, S_ALIGNED_ALLOC, p, n);
    touch(p, n);
    return p;
}

NOINLINE static void *wl_memalign(struct tally *t, size_t align, size_t n) {
    void *p = memalign(align, n);
    count_alloc(t, S_MEMALIGN, p, n);
    touch(p, n);
    return p;
}

NOINLINE static void *wl_valloc(struct tally *t, size_t n) {
    void *p = valloc(n);
    count_alloc(t, S_VALLOC, p, n);
    touch(p, n);
    return p;
}

NOINLINE static void *wl_pvalloc(struct tally *t, size_t n) {
    void *p = pvalloc(n);
    /* pvalloc rounds the request up to whole pages; the request is still n. */
    count_alloc(t, S_PVALLOC, p, n);
    touch(p, n);
    return p;
}

NOINLINE static void *wl_mmap(struct tally *t, size_t n) {
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        abort();
    t->f[S_MMAP].allocs++;
    t->f[S_MMAP].bytes_req += n;
    t->f[S_MMAP].bytes_alloc += (n + 4095) & ~(size_t)4095;
    t->f[S_MMAP].live_allocs++;
    t->f[S_MMAP].live_bytes_req += n;
    touch(p, n);
    return p;
}

#ifndef MREMAP_DONTUNMAP
#define MREMAP_DONTUNMAP 4
#endif
#define PAGE 4096

NOIPA static char *wl_remap_map(void) {
    char *p = mmap(NULL, 2 * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED)
        abort();
    p[0] = 1;
    return p;
}

NOIPA static char *wl_remap_grow(char *p) {
    char *q = mremap(p, PAGE, 16 * PAGE, MREMAP_MAYMOVE);
    if (q == MAP_FAILED || q == p)
        abort(); /* p's second page is still mapped: growing in place cannot be */
    return q;
}

NOIPA static char *wl_remap_shrink(char *q) {
    char *r = mremap(q, 16 * PAGE, 2 * PAGE, 0);
    if (r != q)
        abort();
    return r;
}

NOIPA static char *wl_remap_copy(char *r) {
    char *c = mremap(r, 2 * PAGE, 2 * PAGE, MREMAP_MAYMOVE | MREMAP_DONTUNMAP);
    if (c == MAP_FAILED || c == r)
        abort();
    return c;
}

NOIPA static void wl_remap_view(int fd) {
    char *v = mmap(NULL, PAGE, PROT_READ, MAP_PRIVATE, fd, 0);
    if (v == MAP_FAILED)
        abort();
    char *w = mremap(v, PAGE, 4 * PAGE, MREMAP_MAYMOVE);
    if (w == MAP_FAILED || munmap(w, 4 * PAGE))
        abort();
}

NOIPA static void wl_remap_reserve(void) {
    char *v = mmap(NULL, 2 * PAGE, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (v == MAP_FAILED)
        abort();
    char *w = mremap(v, 2 * PAGE, 16 * PAGE, MREMAP_MAYMOVE);
    if (w == MAP_FAILED || munmap(w, 16 * PAGE))
        abort();
}

static void wl_remap(long rounds) {
    int fd = open("/proc/self/exe", O_RDONLY);
    if (fd < 0)
        abort();
    for (long i = 0; i < rounds; i++) {
        char *p = wl_remap_map();
        char *r = wl_remap_shrink(wl_remap_grow(p));
        char *c = wl_remap_copy(r);
        if (munmap(p + PAGE, PAGE) || munmap(r, 2 * PAGE) || munmap(c, 2 * PAGE))
            abort();
        wl_remap_view(fd);
        wl_remap_reserve();
    }
    close(fd);
}

NOINLINE static void *wl_leak(struct tally *t, size_t n) {
    void *p = malloc(n);
    count_alloc(t, S_LEAK, p, n);
    touch(p, n);
    return p;
}

/* Calls that must not count as allocations or frees. */
NOINLINE static void wl_not_allocations(void) {
    static volatile size_t huge = SIZE_MAX; /* volatile: keep the compiler from judging */
    free(NULL);
    void *p = malloc(huge); /* fails */
    sink ^= (uintptr_t)p;
    p = calloc(huge / 2, 4); /* overflows, fails */
    sink ^= (uintptr_t)p;
    void *q = NULL;
    if (posix_memalign(&q, 3, 64) != EINVAL) /* bad alignment, fails */
        abort();
}

struct thread_arg {
    int iterations;
    int leaks;
};

static pthread_barrier_t start_barrier;

static void merge(const struct tally *t) {
    pthread_mutex_lock(&totals_lock);
    for (int s = 0; s < S_COUNT; s++) {
        totals[s].allocs += t->f[s].allocs;
        totals[s].frees += t->f[s].frees;
        totals[s].bytes_req += t->f[s].bytes_req;
        totals[s].bytes_alloc += t->f[s].bytes_alloc;
        totals[s].live_allocs += t->f[s].live_allocs;
        totals[s].live_bytes_req += t->f[s].live_bytes_req;
    }
    pthread_mutex_unlock(&totals_lock);
}

/* Sizes vary with the iteration so fragmentation is not uniform. */
static void *exercise(void *argp) {
    const struct thread_arg *arg = argp;
    struct tally *t = calloc(1, sizeof *t); /* not a wl_ site: excluded from the manifest */
    pthread_barrier_wait(&start_barrier);
    for (int i = 0; i < arg->iterations; i++) {
        size_t small = 8 + (size_t)(i % 13) * 7;
        void *a = wl_malloc(t, small);
        void *b = wl_calloc(t, 3 + i % 4, 24);
        wl_realloc(t, 40 + i % 9, 300 + (size_t)(i % 5) * 100);
        void *c = wl_reallocarray(t, 4, 12 + i % 3, 16);
        void *d = wl_posix_memalign(t, 64, 100 + (size_t)(i % 7));
        void *e = wl_aligned_alloc(t, 128, 256);
        void *f = wl_memalign(t, 32, 1000 + (size_t)(i % 3));
        void *g = wl_valloc(t, 3000);
        void *h = has_pvalloc ? wl_pvalloc(t, 5000) : NULL;
        void *l = i % 10 == 0 ? wl_malloc_large(t, 300000 + (size_t)i) : NULL;
        void *m = i % 10 == 5 ? wl_mmap(t, 10000 + (size_t)i) : NULL;
        wl_not_allocations();

        free(a);
        count_free(t, S_MALLOC, small);
        free(b);
        count_free(t, S_CALLOC, (size_t)(3 + i % 4) * 24);
        if (c) {
            free(c);
            count_free(t, S_REALLOCARRAY, (size_t)(12 + i % 3) * 16);
        }
        free(d);
        count_free(t, S_POSIX_MEMALIGN, 100 + (size_t)(i % 7));
        free(e);
        count_free(t, S_ALIGNED_ALLOC, 256);
        free(f);
        count_free(t, S_MEMALIGN, 1000 + (size_t)(i % 3));
        free(g);
        count_free(t, S_VALLOC, 3000);
        if (h) {
            free(h);
            count_free(t, S_PVALLOC, 5000);
        }
        if (l) {
            free(l);
            count_free(t, S_MALLOC_LARGE, 300000 + (size_t)i);
        }
        if (m) {
            munmap(m, 10000 + (size_t)i);
            t->f[S_MMAP].frees++;
            t->f[S_MMAP].live_allocs--;
            t->f[S_MMAP].live_bytes_req -= 10000 + (size_t)i;
        }
    }
    for (int i = 0; i < arg->leaks; i++)
        sink ^= (uintptr_t)wl_leak(t, 77);
    merge(t);
    free(t);
    return NULL;
}

static void write_manifest(const char *path, int threads, int iterations, int leaks) {
    FILE *out = fopen(path, "w");
    if (!out) {
        perror(path);
        exit(2);
    }
    fprintf(out, "{\"pid\": %d, \"threads\": %d, \"iterations\": %d, \"leaks_per_thread\": %d,\n",
            (int)getpid(), threads, iterations, leaks);
    fprintf(out, " \"sites\": [\n");
    for (int s = 0; s < S_COUNT; s++) {
        const struct figures *f = &totals[s];
        fprintf(out,
                "  {\"function\": \"%s\", \"allocs\": %lu, \"frees\": %lu, \"bytes_req\": %lu, "
                "\"bytes_alloc\": %lu, \"live_allocs\": %lu, \"live_bytes_req\": %lu}%s\n",
                site_names[s], f->allocs, f->frees, f->bytes_req, f->bytes_alloc, f->live_allocs,
                f->live_bytes_req, s + 1 < S_COUNT ? "," : "");
    }
    fprintf(out, " ]}\n");
    fclose(out);
}

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e9 + ts.tv_nsec;
}

NOINLINE static void loop_pair(size_t n) {
    void *p = malloc(n);
    sink ^= (uintptr_t)p;
    free(p);
}

struct loop_arg {
    long pairs;
    size_t bytes;
    double deadline_ns;
    long done;
};

/* malloc+free pairs until `pairs` are done or the deadline passes (checked every 1024). */
static void *loop_thread(void *argp) {
    struct loop_arg *arg = argp;
    for (long i = 0; arg->pairs == 0 || i < arg->pairs; i++) {
        loop_pair(arg->bytes);
        arg->done++;
        if (arg->deadline_ns > 0 && (i & 1023) == 0 && now_ns() >= arg->deadline_ns)
            break;
    }
    return NULL;
}

NOINLINE static void kernel_pair(void) {
    int fds[2];
    if (pipe(fds) != 0)
        abort();
    close(fds[0]);
    close(fds[1]);
}

/* pipe() from two call sites of one depth: the same registers at each syscall, only the
 * caller differs. Each counts its calls after the call: that keeps the call out of tail
 * position and the two functions different (identical ones would be folded into one). */
static volatile long pipe_site_calls[2];

NOINLINE static void pipe_site_a(void) {
    kernel_pair();
    pipe_site_calls[0]++;
}

NOINLINE static void pipe_site_b(void) {
    kernel_pair();
    pipe_site_calls[1]++;
}

/* Four allocation sites called in turn from one loop, as a B-tree insert allocates its
 * node, cell, overflow and cursor buffers: each site's stack repeats every fourth call.
 * Each counts its calls after the call, which keeps the four functions different. */
static volatile long cycle_calls[4];

NOINLINE static void *cycle_site_a(size_t n) {
    void *p = malloc(n);
    cycle_calls[0]++;
    return p;
}

NOINLINE static void *cycle_site_b(size_t n) {
    void *p = malloc(n);
    cycle_calls[1]++;
    return p;
}

NOINLINE static void *cycle_site_c(size_t n) {
    void *p = malloc(n);
    cycle_calls[2]++;
    return p;
}

NOINLINE static void *cycle_site_d(size_t n) {
    void *p = malloc(n);
    cycle_calls[3]++;
    return p;
}

/* `rounds` rounds of the four sites (24, 40, 56 and 72 bytes), each round's blocks freed
 * at its end. */
NOINLINE static void wl_cycle(long rounds) {
    for (long i = 0; i < rounds; i++) {
        void *p[4] = {cycle_site_a(24), cycle_site_b(40), cycle_site_c(56), cycle_site_d(72)};
        for (int k = 0; k < 4; k++) {
            sink ^= (uintptr_t)p[k];
            free(p[k]);
        }
    }
}

/* One allocation wrapper (as GCC's xmalloc, CPython's PyMem_Malloc) called from two
 * places: its call site's row must not be named after either caller alone. Each caller
 * counts its calls after the call, which keeps the two functions different. */
static volatile long wrapped_calls[2];

NOINLINE static void *wl_xmalloc(size_t n) {
    void *p = malloc(n);
    if (!p)
        abort();
    sink ^= (uintptr_t)p;
    return p;
}

NOINLINE static void *wl_wrapped_a(void) {
    void *p = wl_xmalloc(48);
    wrapped_calls[0]++;
    return p;
}

NOINLINE static void *wl_wrapped_b(void) {
    void *p = wl_xmalloc(48);
    wrapped_calls[1]++;
    return p;
}

/* A tiny bump allocator with its own entry points, standing in for jemalloc & co. */
static char mt_arena[1 << 20];
static size_t mt_used;

NOINLINE void *mt_malloc(size_t n) {
    n = (n + 15) & ~(size_t)15;
    if (mt_used + n > sizeof mt_arena)
        return NULL;
    void *p = mt_arena + mt_used;
    mt_used += n;
    return p;
}

NOINLINE void mt_free(void *p) {
    sink ^= (uintptr_t)p; /* a bump allocator never reuses memory */
}

NOINLINE static void wl_custom(long n, const char *manifest) {
    unsigned long bytes = 0, frees = 0, live_bytes = 0;
    for (long i = 0; i < n; i++) {
        size_t size = 24 + (size_t)(i % 8);
        void *p = mt_malloc(size);
        bytes += size;
        if (i % 2 == 0) {
            mt_free(p);
            frees++;
        } else {
            live_bytes += size;
        }
    }
    if (manifest) {
        FILE *out = fopen(manifest, "w");
        if (!out)
            abort();
        fprintf(out,
                "{\"pid\": %d, \"sites\": [{\"function\": \"wl_custom\", \"allocs\": %ld, \"frees\": %lu, "
                "\"bytes_req\": %lu, \"bytes_alloc\": %lu, \"live_allocs\": %lu, \"live_bytes_req\": %lu}]}\n",
                (int)getpid(), n, frees, bytes, bytes, (unsigned long)n - frees, live_bytes);
        fclose(out);
    }
}

static void (*dl_free)(void *);

NOINLINE static void wl_dlopen_alloc(void *(*dl_malloc)(size_t), long n) {
    for (long i = 0; i < n; i++) {
        void *p = dl_malloc(48);
        sink ^= (uintptr_t)p;
        if (dl_free)
            dl_free(p);
    }
}

/* --stacks: blocks whose stacks exercise an unwinder; tests know their sizes. */
static void *stack_blocks[6];

NOIPA static void *wl_signal_alloc(void) {
    void *p = malloc(111);
    touch(p, 111);
    return p;
}

static void on_signal(int sig) {
    (void)sig;
    stack_blocks[0] = wl_signal_alloc();
}

/* The handler runs on the kernel's signal frame, above libc's raise(). */
NOIPA static void wl_raise_site(void) {
    signal(SIGUSR1, on_signal);
    raise(SIGUSR1);
    __asm__ volatile("" ::: "memory"); /* keeps raise from becoming a tail jump */
}

/* Called back from libc's qsort (built without frame pointers): a mixed stack. */
NOIPA static int wl_sort_compare(const void *a, const void *b) {
    if (!stack_blocks[1]) {
        stack_blocks[1] = malloc(222);
        touch(stack_blocks[1], 222);
    }
    return *(const int *)a - *(const int *)b;
}

NOIPA static void wl_sort_site(void) {
    int v[8] = {5, 3, 7, 1, 8, 2, 6, 4};
    qsort(v, 8, sizeof v[0], wl_sort_compare);
    sink ^= (uintptr_t)v[0];
}

NOIPA static void *wl_deep_alloc(size_t n) {
    void *p = malloc(n);
    touch(p, n);
    return p;
}

NOIPA static void *wl_recurse(int depth, size_t n) {
    void *p = depth == 0 ? wl_deep_alloc(n) : wl_recurse(depth - 1, n);
    __asm__ volatile("" ::: "memory"); /* keeps the call from becoming a jump */
    sink ^= (uintptr_t)depth;
    return p;
}

/* Twin callers of one allocating path: under either, the path's frames lie at the same
 * stack addresses with the same return addresses; only the return address into the twin
 * differs. A walk that reuses the previous walk's frames above the place where the two
 * meet must check them on the stack. */
NOIPA static void *wl_twin_inner(size_t n) {
    void *p = malloc(n);
    touch(p, n);
    return p;
}

NOIPA static void *wl_twin_mid(size_t n) {
    void *p = wl_twin_inner(n);
    __asm__ volatile("" ::: "memory"); /* keeps the call from becoming a jump */
    sink ^= (uintptr_t)p;
    return p;
}

NOIPA static void *wl_twin_a(size_t n) {
    void *p = wl_twin_mid(n);
    __asm__ volatile("" ::: "memory");
    sink ^= (uintptr_t)n;
    return p;
}

NOIPA static void *wl_twin_b(size_t n) {
    void *p = wl_twin_mid(n);
    __asm__ volatile("" ::: "memory");
    sink ^= (uintptr_t)n + 1;
    return p;
}

NOIPA static void wl_stack_tests(void) {
    wl_raise_site();
    wl_sort_site();
    stack_blocks[2] = wl_recurse(400, 333);
    stack_blocks[3] = wl_recurse(600, 444);
    stack_blocks[4] = wl_twin_a(555);
    stack_blocks[5] = wl_twin_b(666);
    for (int i = 0; i < 6; i++)
        free(stack_blocks[i]);
    printf("stacks: 6 allocations\n");
}

/* The first thing a forked child does: 10 allocations of 77 bytes, 7 of them freed. */
NOIPA static void wl_child_alloc(void) {
    void *p[10];
    for (int i = 0; i < 10; i++)
        p[i] = malloc(77);
    for (int i = 0; i < 7; i++)
        free(p[i]);
    sink ^= (uintptr_t)p[9];
}

static void fork_children(long n) {
    for (long i = 0; i < n; i++) {
        pid_t pid = fork();
        if (pid < 0)
            abort();
        if (pid == 0) {
            wl_child_alloc();
            _exit(0);
        }
    }
    for (long i = 0; i < n; i++)
        wait(NULL);
    printf("fork-children: %ld children x 10 allocations\n", n);
}

/* --peak: four sites whose blocks (below the mmap threshold: from the heap) rise and fall
 * at known moments. wl_peak_early grows to 800,000 bytes and frees them all; 30 ms later
 * wl_peak_base (16 x 24,000) and wl_peak_top (50 x 16,000) make the peak, 1,184,000 bytes;
 * 50 ms later wl_peak_top frees its blocks and wl_peak_late allocates 30 x 20,000 (984,000
 * live: below the peak); then half of wl_peak_base is freed and the rest left live. Nothing
 * allocates between the peak and the first free after it, so the peak lies in between. */
enum peak_site { P_EARLY, P_BASE, P_TOP, P_LATE, P_COUNT };

static const char *peak_names[P_COUNT] = {"wl_peak_early", "wl_peak_base", "wl_peak_top", "wl_peak_late"};

/* Indexed by peak_site (the first entries of a tally). */
static struct tally peak_tally;
static unsigned long peak_live_bytes[P_COUNT], peak_live_allocs[P_COUNT];

NOINLINE static void *wl_peak_early(size_t n) {
    void *p = malloc(n);
    count_alloc(&peak_tally, (enum site)P_EARLY, p, n);
    touch(p, n);
    return p;
}

NOINLINE static void *wl_peak_base(size_t n) {
    void *p = malloc(n);
    count_alloc(&peak_tally, (enum site)P_BASE, p, n);
    touch(p, n);
    return p;
}

NOINLINE static void *wl_peak_top(size_t n) {
    void *p = malloc(n);
    count_alloc(&peak_tally, (enum site)P_TOP, p, n);
    touch(p, n);
    return p;
}

NOINLINE static void *wl_peak_late(size_t n) {
    void *p = malloc(n);
    count_alloc(&peak_tally, (enum site)P_LATE, p, n);
    touch(p, n);
    return p;
}

static void peak_free(enum peak_site s, void *p, size_t n) {
    free(p);
    count_free(&peak_tally, (enum site)s, n);
}

static void pause_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static double now_ns(void);

static void wl_peak_run(const char *manifest) {
    static void *early[40], *base[16], *top[50], *late[30];
    for (int i = 0; i < 40; i++)
        early[i] = wl_peak_early(20000);
    for (int i = 0; i < 40; i++)
        peak_free(P_EARLY, early[i], 20000);
    pause_ms(30);
    for (int i = 0; i < 16; i++)
        base[i] = wl_peak_base(24000);
    for (int i = 0; i < 50; i++)
        top[i] = wl_peak_top(16000);
    double reached = now_ns();
    for (int s = 0; s < P_COUNT; s++) {
        peak_live_bytes[s] = peak_tally.f[s].live_bytes_req;
        peak_live_allocs[s] = peak_tally.f[s].live_allocs;
    }
    pause_ms(50);
    double left = now_ns();
    for (int i = 0; i < 50; i++)
        peak_free(P_TOP, top[i], 16000);
    for (int i = 0; i < 30; i++)
        late[i] = wl_peak_late(20000);
    pause_ms(30);
    for (int i = 0; i < 8; i++)
        peak_free(P_BASE, base[i], 24000);
    sink ^= (uintptr_t)late[0];
    if (!manifest)
        return;
    FILE *out = fopen(manifest, "w");
    if (!out) {
        perror(manifest);
        exit(2);
    }
    unsigned long total = 0;
    for (int s = 0; s < P_COUNT; s++)
        total += peak_live_bytes[s];
    fprintf(out, "{\"pid\": %d, \"peak_reached_ns\": %.0f, \"peak_left_ns\": %.0f, \"peak_live_bytes_req\": %lu,\n",
            (int)getpid(), reached, left, total);
    fprintf(out, " \"sites\": [\n");
    for (int s = 0; s < P_COUNT; s++) {
        const struct figures *f = &peak_tally.f[s];
        fprintf(out,
                "  {\"function\": \"%s\", \"allocs\": %lu, \"frees\": %lu, \"bytes_req\": %lu, "
                "\"bytes_alloc\": %lu, \"live_allocs\": %lu, \"live_bytes_req\": %lu, "
                "\"live_allocs_at_peak\": %lu, \"live_bytes_req_at_peak\": %lu}%s\n",
                peak_names[s], f->allocs, f->frees, f->bytes_req, f->bytes_alloc, f->live_allocs,
                f->live_bytes_req, peak_live_allocs[s], peak_live_bytes[s], s + 1 < P_COUNT ? "," : "");
    }
    fprintf(out, " ]}\n");
    fclose(out);
}

/* --steady-leak: what a leaking service allocates, per site; exact (malloc_usable_size). */
struct leak_figures {
    unsigned long blocks, bytes_req, bytes_alloc;
};

static struct leak_figures startup_figures, leak_figures;

NOIPA static void wl_startup(void) {
    for (int i = 0; i < 8; i++) {
        void *p = malloc(200000);
        touch(p, 200000);
        startup_figures.blocks++;
        startup_figures.bytes_req += 200000;
        startup_figures.bytes_alloc += malloc_usable_size(p);
    }
}

NOIPA static void wl_steady_leak(long blocks, size_t size) {
    for (long i = 0; i < blocks; i++) {
        void *p = malloc(size);
        touch(p, size);
        leak_figures.blocks++;
        leak_figures.bytes_req += size;
        leak_figures.bytes_alloc += malloc_usable_size(p);
    }
}

NOIPA static void wl_churn(void) {
    void *p[32];
    for (int i = 0; i < 32; i++) {
        p[i] = malloc(1000);
        touch(p[i], 1000);
    }
    for (int i = 0; i < 32; i++)
        free(p[i]);
}

static void print_leak_figures(const char *event) {
    printf("{\"event\": \"%s\", \"pid\": %d, \"startup_blocks\": %lu, \"startup_bytes_req\": %lu, "
           "\"startup_bytes_alloc\": %lu, \"leak_blocks\": %lu, \"leak_bytes_req\": %lu, "
           "\"leak_bytes_alloc\": %lu}\n",
           event, (int)getpid(), startup_figures.blocks, startup_figures.bytes_req, startup_figures.bytes_alloc,
           leak_figures.blocks, leak_figures.bytes_req, leak_figures.bytes_alloc);
    fflush(stdout);
}

static void steady_leak(long steps, long per_step, size_t block, long step_ms) {
    wl_startup();
    print_leak_figures("started");
    for (long i = 0; steps == 0 || i < steps; i++) {
        wl_steady_leak(per_step, block);
        wl_churn();
        usleep((useconds_t)step_ms * 1000);
    }
    print_leak_figures("done");
    char line[16];
    if (read(0, line, sizeof line) < 0)
        abort();
}

static long arg_value(int argc, char **argv, const char *name, long fallback) {
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], name) == 0)
            return strtol(argv[i + 1], NULL, 10);
    return fallback;
}

static const char *arg_string(int argc, char **argv, const char *name) {
    for (int i = 1; i + 1 < argc; i++)
        if (strcmp(argv[i], name) == 0)
            return argv[i + 1];
    return NULL;
}

/* --reserve: address space without memory, beside a mapping that is memory. */
NOINLINE static void *wl_reserve(size_t n) {
    void *p = mmap(NULL, n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    __asm__ volatile("" : : "r"(p) : "memory"); /* not a tail call: the frame stays */
    return p;
}

NOINLINE static void *wl_map_rw(size_t n) {
    void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p != MAP_FAILED)
        memset(p, 1, n);
    return p;
}

int main(int argc, char **argv) {
    long reserve = arg_value(argc, argv, "--reserve", 0);
    if (reserve > 0) {
        void *r = wl_reserve((size_t)reserve);
        void *w = wl_map_rw(1 << 20);
        printf("reserved %ld bytes at %p, mapped 1 MiB at %p\n", reserve, r, w);
        return r == MAP_FAILED || w == MAP_FAILED;
    }
    long sleep_ms = arg_value(argc, argv, "--sleep-ms", 0);
    if (sleep_ms > 0)
        usleep((useconds_t)sleep_ms * 1000);
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--wait-stdin") == 0) {
            char line[16];
            printf("waiting\n");
            fflush(stdout);
            if (read(0, line, sizeof line) < 0)
                abort();
        }
    }

    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--stacks") == 0) {
            wl_stack_tests();
            return 0;
        }
        if (strcmp(argv[i], "--peak") == 0) {
            wl_peak_run(arg_string(argc, argv, "--manifest"));
            printf("peak: 1184000 bytes live at the peak\n");
            return 0;
        }
    }

    long loop = arg_value(argc, argv, "--loop", 0);
    long loop_seconds = arg_value(argc, argv, "--loop-seconds", 0);
    if (loop > 0 || loop_seconds > 0) {
        int loop_threads = (int)arg_value(argc, argv, "--loop-threads", 1);
        long loop_bytes = arg_value(argc, argv, "--loop-bytes", 32);
        struct loop_arg args[64];
        pthread_t loop_tids[64];
        if (loop_threads < 1 || loop_threads > 64)
            abort();
        double t0 = now_ns();
        for (int i = 0; i < loop_threads; i++) {
            args[i].pairs = loop;
            args[i].bytes = loop_bytes > 0 ? (size_t)loop_bytes : 32;
            args[i].deadline_ns = loop_seconds > 0 ? t0 + loop_seconds * 1e9 : 0;
            args[i].done = 0;
            if (pthread_create(&loop_tids[i], NULL, loop_thread, &args[i]) != 0)
                abort();
        }
        long total = 0;
        for (int i = 0; i < loop_threads; i++) {
            pthread_join(loop_tids[i], NULL);
            total += args[i].done;
        }
        double elapsed = now_ns() - t0;
        /* Per pair, per thread: the cost a single thread pays. */
        printf("%.1f ns/pair (%ld pairs, %d threads, %.2f s)\n", elapsed * loop_threads / (double)total, total,
               loop_threads, elapsed / 1e9);
        return 0;
    }
    const char *dl = arg_string(argc, argv, "--dlopen");
    if (dl) {
        void *lib = dlopen(dl, RTLD_NOW | RTLD_LOCAL);
        if (!lib) {
            fprintf(stderr, "%s\n", dlerror());
            return 2;
        }
        const char *prefix = arg_string(argc, argv, "--dlopen-prefix");
        char name[128];
        snprintf(name, sizeof name, "%smalloc", prefix ? prefix : "");
        void *(*dl_malloc)(size_t) = (void *(*)(size_t))dlsym(lib, name);
        snprintf(name, sizeof name, "%sfree", prefix ? prefix : "");
        dl_free = prefix ? (void (*)(void *))dlsym(lib, name) : NULL;
        if (!dl_malloc) {
            fprintf(stderr, "no %smalloc in %s\n", prefix ? prefix : "", dl);
            return 2;
        }
        usleep((useconds_t)arg_value(argc, argv, "--dlopen-wait-ms", 3000) * 1000);
        long n = 0;
        for (int i = 1; i + 2 < argc + 1; i++)
            if (strcmp(argv[i], "--dlopen") == 0 && i + 2 < argc)
                n = strtol(argv[i + 2], NULL, 10);
        wl_dlopen_alloc(dl_malloc, n);
        printf("dlopen: %ld allocations\n", n);
        return 0;
    }
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--steady-leak") == 0) {
            steady_leak(arg_value(argc, argv, "--leak-steps", 0), arg_value(argc, argv, "--leak-per-step", 8),
                        (size_t)arg_value(argc, argv, "--leak-block", 65536), arg_value(argc, argv, "--step-ms", 50));
            return 0;
        }
    }
    long children = arg_value(argc, argv, "--fork-children", 0);
    if (children > 0) {
        fork_children(children);
        return 0;
    }
    long custom = arg_value(argc, argv, "--custom", 0);
    if (custom > 0) {
        wl_custom(custom, arg_string(argc, argv, "--manifest"));
        return 0;
    }
    long remap = arg_value(argc, argv, "--remap", 0);
    if (remap > 0) {
        wl_remap(remap);
        return 0;
    }
    long kernel_sites = arg_value(argc, argv, "--kernel-sites", 0);
    if (kernel_sites > 0) {
        for (long i = 0; i < kernel_sites; i++) {
            if (i & 1)
                pipe_site_b();
            else
                pipe_site_a();
        }
        return 0;
    }
    long cycle = arg_value(argc, argv, "--cycle", 0);
    if (cycle > 0) {
        wl_cycle(cycle);
        return 0;
    }
    long wrapped = arg_value(argc, argv, "--wrapped", 0);
    if (wrapped > 0) {
        for (long i = 0; i < wrapped; i++) {
            free(wl_wrapped_a());
            free(wl_wrapped_b());
        }
        return 0;
    }
    long kernel_loop = arg_value(argc, argv, "--kernel-loop", 0);
    if (kernel_loop > 0) {
        double t0 = now_ns();
        for (long i = 0; i < kernel_loop; i++)
            kernel_pair();
        printf("%.1f ns/pipe\n", (now_ns() - t0) / (double)kernel_loop);
        return 0;
    }

    int threads = (int)arg_value(argc, argv, "--threads", 4);
    int iterations = (int)arg_value(argc, argv, "--iterations", 200);
    int leaks = (int)arg_value(argc, argv, "--leaks", 5);
    const char *manifest = arg_string(argc, argv, "--manifest");
    long kernel_pipes = arg_value(argc, argv, "--pipes", 20);

    struct thread_arg arg = {iterations, leaks};
    pthread_t *tids = calloc((size_t)threads, sizeof *tids);
    check_entry_points();
    pthread_barrier_init(&start_barrier, NULL, (unsigned)threads);
    for (int i = 0; i < threads; i++)
        if (pthread_create(&tids[i], NULL, exercise, &arg) != 0)
            abort();
    for (int i = 0; i < threads; i++)
        pthread_join(tids[i], NULL);
    free(tids);
    for (long i = 0; i < kernel_pipes; i++)
        kernel_pair();

    unsigned long allocs = 0, live = 0;
    for (int s = 0; s < S_COUNT; s++) {
        allocs += totals[s].allocs;
        live += totals[s].live_allocs;
    }
    printf("alloc_workload: %d threads x %d iterations: %lu allocations, %lu left live\n",
           threads, iterations, allocs, live);
    if (manifest)
        write_manifest(manifest, threads, iterations, leaks);
    return 0;
}
