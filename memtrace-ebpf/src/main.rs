//! memtrace's probes, one file per concern. Kernel side: the kmem tracepoints ([`kmem`],
//! slab objects and pages) and the task lifecycle tracepoints ([`task`]). User side
//! ([`uprobes`]): one entry and one return program shared by the whole malloc family (the
//! attach cookie says which function fired), or one uprobe session program for both, and
//! one program for `free`/`munmap`. Every
//! program writes compact records from `memtrace-common` into the ring of the CPU it runs
//! on ([`ring`]); stacks ([`stack`], walked by [`unwind`]) travel once per distinct hash.
//! Maps are declared once, in [`maps`]; the configuration userspace writes before load is
//! [`config`].
//!
//! Entry points are thin wrappers around `try_*` functions returning `Result`, so every
//! early exit is explicit and the verifier sees one return path.
#![no_std]
#![no_main]
// BPF_ATOMIC adds (core's atomic types have no read-modify-write on this target).
#![allow(internal_features)]
#![feature(core_intrinsics)]

#[macro_use]
mod config;
mod context;
mod finish;
mod gpu;
mod inflight;
mod kmem;
mod kstack;
mod mappings;
mod maps;
mod path;
mod python;
mod reuse;
mod ring;
mod sampling;
mod stack;
mod syscall;
mod task;
mod unwind;
mod uprobes;
mod vma;

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
