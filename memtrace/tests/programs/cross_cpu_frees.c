/* Blocks allocated on one CPU and freed on another: a producer thread pinned to CPU 0
 * allocates `cross_passed` blocks and hands them to a consumer pinned to CPU 1, which frees
 * them; between two hand-overs the producer makes NOISE pairs of its own (`cross_noise`),
 * so CPU 0's ring fills several times faster than CPU 1's. Waits for a line on stdin before
 * the work and after it (printing "waiting" and "done"). */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define N 20000
#define NOISE 4

static void *volatile passed[N];
static atomic_long handed;

__attribute__((noinline)) static void *cross_passed(void) {
    void *p = malloc(40);
    __asm__ volatile("" : : "r"(p) : "memory");
    return p;
}

__attribute__((noinline)) static void cross_noise(void) {
    for (int i = 0; i < NOISE; i++) {
        void *p = malloc(24);
        __asm__ volatile("" : : "r"(p) : "memory");
        free(p);
    }
}

static void pin(int cpu) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) != 0)
        abort();
}

static void *consumer(void *arg) {
    (void)arg;
    pin(1);
    for (long i = 0; i < N; i++) {
        while (atomic_load(&handed) <= i)
            sched_yield();
        free(passed[i]);
    }
    return NULL;
}

static void wait_line(const char *say) {
    char line[16];
    printf("%s\n", say);
    fflush(stdout);
    if (read(0, line, sizeof line) < 0)
        abort();
}

int main(void) {
    wait_line("waiting");
    pthread_t t;
    if (pthread_create(&t, NULL, consumer, NULL) != 0)
        abort();
    pin(0);
    for (long i = 0; i < N; i++) {
        passed[i] = cross_passed();
        atomic_store(&handed, i + 1);
        cross_noise();
    }
    pthread_join(t, NULL);
    wait_line("done");
    return 0;
}
