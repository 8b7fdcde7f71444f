//! The probes' configuration: [`CONFIG`], written by userspace into `.rodata` before load
//! (so the verifier treats every field as a constant), and the `config!` macro that reads a
//! field of it, and the `tracepoint_program!` / `raw_tracepoint_program!` macros that write the thin
//! entry points.
use core::ptr::read_volatile;

use memtrace_common::ProbeConfig;

#[unsafe(no_mangle)]
pub(crate) static CONFIG: ProbeConfig = ProbeConfig::zeroed();

#[inline(always)]
pub(crate) fn read_config<T: Copy>(field: *const T) -> T {
    // SAFETY: `field` points into the CONFIG static, which is always valid to read.
    unsafe { read_volatile(field) }
}

/// Reads one field of [`CONFIG`] without letting the compiler fold the zeroed initializer.
macro_rules! config {
    ($($field:tt)+) => {
        $crate::config::read_config(core::ptr::addr_of!($crate::config::CONFIG.$($field)+))
    };
}

/// A raw tracepoint program: a thin entry point that runs `$body` (a `try_*` call returning
/// a `Result`, with `$ctx: &RawTracePointContext`, whose arguments are the tracepoint's
/// `TP_PROTO`) and always returns 0 to the kernel. Userspace attaches it by its name.
macro_rules! raw_tracepoint_program {
    ($name:ident, |$ctx:ident| $body:expr) => {
        #[aya_ebpf::macros::raw_tracepoint]
        pub fn $name(ctx: aya_ebpf::programs::RawTracePointContext) -> u32 {
            let $ctx = &ctx;
            let _ = $body;
            0
        }
    };
    // `$body` returns `Result<finish::Next, ()>`; a pending record goes on to `$finish`.
    ($name:ident, |$ctx:ident| $body:expr => $finish:path) => {
        #[aya_ebpf::macros::raw_tracepoint]
        pub fn $name(ctx: aya_ebpf::programs::RawTracePointContext) -> u32 {
            let $ctx = &ctx;
            if $body == Ok($crate::finish::Next::Finish) {
                $finish($ctx);
            }
            0
        }
    };
}
