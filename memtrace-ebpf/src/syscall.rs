//! Syscall windows: which task is inside which syscall on this CPU, so that the kmem
//! programs walk a task's user stack once per syscall, not once per kernel allocation (a
//! `pipe()` makes a dozen; the user stack cannot change while its task is in the kernel).
//!
//! `sys_enter` opens a window on its CPU for the current task, numbered, with the task's
//! context-switch count; any `sys_exit` on the CPU closes it. A kmem allocation is inside
//! the window when the current task is its task and has not been switched out since: it
//! then ran on this CPU from its entry on, and had it left the syscall, this CPU would
//! have run its `sys_exit`. The walk made in a window is reused in that window only, and
//! only for the same user registers (the key in `Scratch`).
use memtrace_common::unwind_mode;

use crate::{
    context::{pid_tgid, read_kernel_at, scratch},
    stack::Scratch,
};

/// Whether the kmem programs join user stacks walked by the tables: the only walks reused.
#[inline(always)]
fn windows_wanted() -> bool {
    config!(unwind_mode) != unwind_mode::FRAME_POINTERS && config!(user_stacks) != 0 && config!(kernel_stacks) != 0
}

/// The current task's context switches, voluntary and not.
#[inline(always)]
fn switches() -> Option<u64> {
    let layout = config!(kernel);
    // SAFETY: no preconditions; the task stays valid while this program runs.
    let task = unsafe { aya_ebpf::helpers::generated::bpf_get_current_task() };
    let voluntary: u64 = read_kernel_at(task, layout.task_nvcsw)?;
    let involuntary: u64 = read_kernel_at(task, layout.task_nivcsw)?;
    Some(voluntary.wrapping_add(involuntary))
}

/// `sys_enter`: opens this CPU's window for the current task.
#[inline(always)]
pub(crate) fn enter() {
    if !windows_wanted() {
        return;
    }
    let Some(s) = scratch() else { return };
    let (_, _, tid) = pid_tgid();
    s.syscall_tid = 0;
    let Some(switches) = switches() else { return };
    s.syscall_seq = s.syscall_seq.wrapping_add(1);
    s.syscall_switches = switches;
    s.syscall_tid = tid;
}

/// `sys_exit`: closes this CPU's window, whichever task it was for.
#[inline(always)]
pub(crate) fn exit() {
    if !windows_wanted() {
        return;
    }
    if let Some(s) = scratch() {
        s.syscall_tid = 0;
    }
}

/// The number of the window the current task is in on this CPU, if any (never 0).
#[inline(always)]
pub(crate) fn current(s: &Scratch) -> Option<u64> {
    let (_, _, tid) = pid_tgid();
    if tid == 0 || s.syscall_tid != tid || s.syscall_seq == 0 {
        return None;
    }
    (switches()? == s.syscall_switches).then_some(s.syscall_seq)
}
