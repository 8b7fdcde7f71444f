// Prints the usable-size step function of the linked allocator.
// Lines: "<api> <align> <size> <usable>" whenever usable changes as size grows by 1.
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <malloc.h>
#if defined(JE)
#include <jemalloc/jemalloc.h>
#define GOOD(n,a) nallocx((n), (a) ? MALLOCX_ALIGN(a) : 0)
#elif defined(MI)
#include <mimalloc.h>
#define GOOD(n,a) mi_good_size(n)
#elif defined(TC)
#include <gperftools/tcmalloc.h>
size_t tc_nallocx(size_t size, int flags);
#define GOOD(n,a) tc_nallocx((n), (a) ? __builtin_ctzl(a) : 0)
#else
#define GOOD(n,a) 0
#endif
static size_t real(const char *api, size_t n, size_t a) {
  void *p = NULL;
  if (!strcmp(api, "malloc")) p = malloc(n);
  else if (!strcmp(api, "posix_memalign")) { if (posix_memalign(&p, a, n)) p = NULL; }
  else if (!strcmp(api, "aligned_alloc")) p = aligned_alloc(a, n);
  else if (!strcmp(api, "memalign")) p = memalign(a, n);
  else if (!strcmp(api, "calloc")) p = calloc(1, n);
  else if (!strcmp(api, "good")) return GOOD(n, a);
  if (!p) return (size_t)-1;
  size_t u = malloc_usable_size(p);
  free(p);
  return u;
}
int main(int argc, char **argv) {
  // usage: harness API ALIGN FROM TO [STEP]
  const char *api = argv[1];
  size_t a = strtoull(argv[2], 0, 0), from = strtoull(argv[3], 0, 0), to = strtoull(argv[4], 0, 0);
  size_t step = argc > 5 ? strtoull(argv[5], 0, 0) : 1;
  size_t prev = (size_t)-2;
  for (size_t n = from; n <= to; n += step) {
    size_t u = real(api, n, a);
    if (u != prev) printf("%s %zu %zu %zu\n", api, a, n, u);
    prev = u;
  }
  return 0;
}
