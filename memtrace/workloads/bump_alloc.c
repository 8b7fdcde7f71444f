/*
 * A tiny allocator library exporting malloc and free, for the dlopen test: a program that
 * loads it with dlopen and calls its malloc through dlsym uses a second allocator memtrace
 * must notice and probe.
 */
#include <stddef.h>

static char arena[1 << 20];
static size_t used;

void *malloc(size_t n) {
    n = (n + 15) & ~(size_t)15;
    if (used + n > sizeof arena)
        return 0;
    void *p = arena + used;
    used += n;
    return p;
}

void free(void *p) {
    (void)p;
}
