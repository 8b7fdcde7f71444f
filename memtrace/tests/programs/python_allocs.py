# Allocations at known lines, for the Python-frames tests (memtrace/tests/python.rs reads
# the line numbers from the markers at the ends of lines). With "wait" it first reads a
# line from stdin, so memtrace can attach to it while it runs. With "spin" it allocates at
# one line without a pause for two seconds, so memtrace attaches while it allocates.
import sys
import time
import zlib

DATA = zlib.compress(bytes(3_000_007))
keep = []


def f():
    return bytearray(1_000_003)  # LINE:f


def g():
    return [bytearray(50_000 + i) for i in range(5)]  # LINE:g


def h():
    return zlib.decompress(DATA)  # LINE:h


def spin():
    end = time.monotonic() + 2
    while time.monotonic() < end:
        bytearray(77_777)  # LINE:spin


def main():
    if sys.argv[1:] == ["spin"]:
        spin()  # LINE:main-spin
        return
    if sys.argv[1:] == ["wait"]:
        sys.stdin.readline()
    for _ in range(3):
        keep.append(f())  # LINE:main-f
    keep.append(g())  # LINE:main-g
    keep.append(h())  # LINE:main-h


main()  # LINE:module
