// C++ allocations for memtrace's tests: N `new Node` / `delete` (sized delete, as g++
// emits in C++14 and later), N/5 `new char[]` / `delete[]` and N/10 over-aligned `new` /
// `delete` (C++17), each from its own function. Under glibc libstdc++'s operators call
// malloc/free; jemalloc, mimalloc and tcmalloc serve the operators themselves. Every call
// must be counted once. Usage: new_workload [N] (default 5000) [vector]: with `vector`,
// also one std::vector<int> filled by push_back with 1000 ints in wl_fill_vector, which
// grows it 11 times (capacity 1, 2, 4, ... 1024) through libstdc++ and operator new: the
// allocations' site must be wl_fill_vector, not the library's plumbing.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <vector>

#define NOIPA __attribute__((noipa))

struct Node {
    long value[5];
    Node *next;
};

struct alignas(64) Aligned {
    char bytes[200];
};

static volatile unsigned long sink;

NOIPA static Node *wl_new_node(Node *next) {
    Node *n = new Node;
    n->next = next;
    n->value[0] = 1;
    return n;
}

NOIPA static char *wl_new_array(int i) {
    char *p = new char[100 + i % 7];
    p[0] = 1;
    return p;
}

NOIPA static Aligned *wl_new_aligned() {
    Aligned *a = new Aligned;
    a->bytes[0] = 1;
    return a;
}

NOIPA static unsigned long wl_fill_vector() {
    std::vector<int> v;
    for (int i = 0; i < 1000; i++)
        v.push_back(i);
    return v.size() + v.capacity();
}

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 5000;
    Node *list = nullptr;
    for (int i = 0; i < n; i++)
        list = wl_new_node(list);
    while (list) {
        Node *next = list->next;
        delete list;
        list = next;
    }
    for (int i = 0; i < n / 5; i++) {
        char *p = wl_new_array(i);
        sink ^= (unsigned long)p;
        delete[] p;
    }
    for (int i = 0; i < n / 10; i++) {
        Aligned *a = wl_new_aligned();
        sink ^= (unsigned long)a;
        delete a;
    }
    if (argc > 2 && strcmp(argv[2], "vector") == 0)
        sink ^= wl_fill_vector();
    printf("new_workload: %d nodes, %d arrays, %d aligned\n", n, n / 5, n / 10);
    return 0;
}
