//! What a program knows of where it runs: the current task's ids, whether its process is
//! traced, its registers, checked reads of user and kernel memory, and the head of a
//! tracepoint record.
use core::{ffi::c_void, ptr::addr_of_mut};

use aya_ebpf::{
    EbpfContext,
    bindings::pt_regs,
    helpers::{bpf_get_current_pid_tgid, generated},
    programs::TracePointContext,
};
use memtrace_common::{TP_HEAD_BYTES, traced};

use crate::{
    maps::{SCRATCH, TRACED},
    stack::Scratch,
};

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

#[inline(always)]
pub(crate) fn regs(ctx: &impl EbpfContext) -> *const pt_regs {
    ctx.as_ptr() as *const pt_regs
}

#[inline(always)]
pub(crate) fn scratch() -> Option<&'static mut Scratch> {
    // SAFETY: per-CPU value, used by one program at a time on this CPU.
    SCRATCH.get_ptr_mut(0).map(|p| unsafe { &mut *p })
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

/// The head of a tracepoint record, copied in one read; fields are picked by offset.
pub(crate) struct TpHead([u64; TP_HEAD_BYTES / 8]);

impl TpHead {
    #[inline(always)]
    pub(crate) fn read(ctx: &TracePointContext) -> Option<Self> {
        // SAFETY: reads the tracepoint's record (or the per-CPU trace buffer behind it)
        // through the checked helper.
        unsafe { ctx.read_at::<[u64; TP_HEAD_BYTES / 8]>(0) }.ok().map(Self)
    }

    /// The 8-byte field at `offset` (which userspace checked is 8-byte aligned).
    #[inline(always)]
    pub(crate) fn u64_at(&self, offset: u32) -> u64 {
        let i = (offset / 8) as usize;
        if i < self.0.len() { self.0[i] } else { 0 }
    }

    /// The 4-byte field at `offset` (4-byte aligned).
    #[inline(always)]
    pub(crate) fn u32_at(&self, offset: u32) -> u32 {
        let word = self.u64_at(offset & !7);
        if offset & 4 != 0 { (word >> 32) as u32 } else { word as u32 }
    }
}
