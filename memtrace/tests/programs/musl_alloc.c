/* Built with musl-gcc -static by the allocators test: malloc in the executable, musl's
 * mallocng (usable size = the request). 300 malloc/free pairs from wl_musl_malloc. */
#include <stdio.h>
#include <stdlib.h>

__attribute__((noipa)) static void *wl_musl_malloc(size_t n) {
    void *p = malloc(n);
    __asm__ volatile("" ::: "memory"); /* no tail call: this frame stays on the stack */
    return p;
}

int main(void) {
    for (int i = 0; i < 300; i++) {
        void *p = wl_musl_malloc(10 + (size_t)i);
        free(p);
    }
    puts("musl_alloc: 300");
    return 0;
}
