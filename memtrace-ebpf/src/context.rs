//! What a program knows of where it runs: the current task's ids, whether its process is
//! traced, its registers, and checked reads of user and kernel memory.
use core::{ffi::c_void, mem::size_of, ptr::addr_of_mut};

use aya_ebpf::{
    EbpfContext,
    bindings::pt_regs,
    helpers::{bpf_get_current_pid_tgid, generated},
};
use memtrace_common::traced;

use crate::{
    maps::{SCRATCH, TRACED},
    stack::Scratch,
};

/// What the current task's memory holds of the user stack its saved registers point at.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum UserMemory {
    /// Its program's memory: the stack can be walked.
    Program,
    /// None: a kernel thread, or a process past `exit_mm` (the page tables and batches
    /// freed as it exits are allocated after that).
    Gone,
    /// A program being loaded: `execve` past its point of no return (`exec_mmap`), before
    /// it sets the new memory's code bounds. The registers are still the old program's,
    /// whose memory is gone.
    Replaced,
}

/// See [`UserMemory`].
#[inline(always)]
pub(crate) fn current_user_memory() -> UserMemory {
    let layout = config!(kernel);
    // SAFETY: no preconditions; the pointer is only read through checked reads.
    let task = unsafe { generated::bpf_get_current_task() };
    let Some(mm) = read_kernel_at::<u64>(task, layout.task_mm).filter(|&mm| mm != 0) else { return UserMemory::Gone };
    match read_kernel_at::<u64>(mm, layout.mm_end_code) {
        Some(0) => UserMemory::Replaced,
        _ => UserMemory::Program,
    }
}

#[inline(always)]
pub(crate) fn pid_tgid() -> (u64, u32, u32) {
    let id = bpf_get_current_pid_tgid();
    (id, (id >> 32) as u32, id as u32)
}

/// Whether events of `tgid` are wanted.
#[inline(always)]
pub(crate) fn is_traced(tgid: u32) -> bool {
    if tgid == config!(self_tgid) {
        return false;
    }
    if config!(trace_all) != 0 {
        return true;
    }
    // SAFETY: the value is a plain u32 copied out at once.
    matches!(unsafe { TRACED.get(tgid) }, Some(&traced::ACTIVE))
}

/// Whether `tgid` is traced or about to be (a command memtrace forked, before its exec):
/// what the address-space bookkeeping follows.
#[inline(always)]
pub(crate) fn is_traced_or_pending(tgid: u32) -> bool {
    if tgid == config!(self_tgid) {
        return false;
    }
    // SAFETY: the value is a plain u32 copied out at once.
    config!(trace_all) != 0 || unsafe { TRACED.get(tgid) }.is_some()
}

#[inline(always)]
pub(crate) fn regs(ctx: &impl EbpfContext) -> *const pt_regs {
    ctx.as_ptr() as *const pt_regs
}

#[inline(always)]
pub(crate) fn scratch() -> Option<&'static mut Scratch> {
    // SAFETY: this CPU's value, in a map that lives while programs run. Programs on one
    // CPU may interleave (an interrupt's kmem program, a preempted uprobe program): plain
    // loads and stores of plain data, whatever they read is memory-safe, and what a walk
    // sends is checked against its claim (`finish::claim_scratch`).
    SCRATCH.get_ptr_mut(this_cpu()).map(|p| unsafe { &mut *p })
}

/// The CPU this program runs on: its entry in the maps kept per CPU by index.
#[inline(always)]
pub(crate) fn this_cpu() -> u32 {
    // SAFETY: the helper has no preconditions.
    unsafe { generated::bpf_get_smp_processor_id() }
}

#[inline(always)]
pub(crate) fn read_kernel_u64(src: *const u64) -> Option<u64> {
    let mut v = 0u64;
    // SAFETY: checked read of 8 bytes into a local.
    let ret = unsafe { generated::bpf_probe_read_kernel(addr_of_mut!(v) as *mut c_void, 8, src as *const c_void) };
    if ret == 0 { Some(v) } else { None }
}

#[inline(always)]
pub(crate) fn read_user_u64(addr: u64) -> Option<u64> {
    let mut v = 0u64;
    // SAFETY: checked read of 8 bytes of user memory into a local.
    let ret = unsafe { generated::bpf_probe_read_user(addr_of_mut!(v) as *mut c_void, 8, addr as *const c_void) };
    if ret == 0 { Some(v) } else { None }
}

/// Reads a kernel value of type `T` at `base + offset` (an offset from the BTF layout).
#[inline(always)]
pub(crate) fn read_kernel_at<T: Copy + Default>(base: u64, offset: u32) -> Option<T> {
    let mut v = T::default();
    // SAFETY: checked read of size_of::<T>() bytes into a local.
    let ret = unsafe {
        generated::bpf_probe_read_kernel(
            addr_of_mut!(v) as *mut c_void,
            size_of::<T>() as u32,
            (base.wrapping_add(u64::from(offset))) as *const c_void,
        )
    };
    if ret == 0 { Some(v) } else { None }
}

/// Copies a NUL-terminated kernel string into `dst`; returns its length with the NUL (0 on
/// failure).
#[inline(always)]
pub(crate) fn read_kernel_str(src: u64, dst: &mut [u8]) -> usize {
    // SAFETY: writes at most dst.len() bytes into dst; the source read is checked.
    let n = unsafe {
        generated::bpf_probe_read_kernel_str(dst.as_mut_ptr() as *mut c_void, dst.len() as u32, src as *const c_void)
    };
    if n > 0 { n as usize } else { 0 }
}
