/* A module with a prefixed jemalloc API, as bundled copies have (DuckDB's duckdb_je_*,
 * Rust's _rjem_*): xyz_je_malloc, xyz_je_free, ... forwarding to libjemalloc. memtrace must
 * find it by its symbol set, without --symbol-prefix. Linked with -ljemalloc. */
#include <jemalloc/jemalloc.h>
#include <stddef.h>

#define EXPORT __attribute__((visibility("default"), noinline))

EXPORT void *xyz_je_malloc(size_t n) { return mallocx(n, 0); }
EXPORT void xyz_je_free(void *p) {
    if (p)
        dallocx(p, 0);
}
EXPORT void *xyz_je_calloc(size_t k, size_t n) { return mallocx(k * n, MALLOCX_ZERO); }
EXPORT void *xyz_je_realloc(void *p, size_t n) { return p ? rallocx(p, n, 0) : mallocx(n, 0); }
EXPORT void *xyz_je_mallocx(size_t n, int flags) { return mallocx(n, flags); }
EXPORT void xyz_je_sdallocx(void *p, size_t n, int flags) { sdallocx(p, n, flags); }
EXPORT int xyz_je_mallctl(const char *name, void *old, size_t *oldlen, void *new_, size_t newlen) {
    return mallctl(name, old, oldlen, new_, newlen);
}
