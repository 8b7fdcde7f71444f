/*
 * A process with no allocator at all (no libc, raw system calls): `record --pid` on it
 * must say so clearly. It sleeps until killed.
 */
static long sys(long n, long a, long b) {
    long ret;
    __asm__ volatile("syscall" : "=a"(ret) : "a"(n), "D"(a), "S"(b) : "rcx", "r11", "memory");
    return ret;
}

/* The kernel enters with an aligned stack, not one a call would leave: realign. */
__attribute__((force_align_arg_pointer, noreturn)) void _start(void) {
    static const struct {
        long sec, nsec;
    } ts = {1, 0};
    for (;;)
        sys(35 /* nanosleep */, (long)&ts, 0);
}
