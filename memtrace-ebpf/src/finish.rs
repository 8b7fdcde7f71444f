//! The second half of every allocation that carries a stack. The first half (a kmem
//! tracepoint, or a return probe of the malloc family or of the GPU driver) fills a pending
//! record in the per-CPU scratch and tail-calls one of the two programs here, which walk
//! the stacks and send the record. The walks are most of the instructions the verifier
//! checks; reached this way they are verified twice at load (once per program type), not
//! once per tracepoint and return probe.
use aya_ebpf::{
    macros::{raw_tracepoint, uretprobe},
    programs::{RawTracePointContext, RetProbeContext},
};
use memtrace_common::{KernelAllocRecord, UserAllocRecord, flags};

use crate::{
    context::scratch,
    maps::{KERNEL_FINISH, USER_FINISH},
    ring::{emit, this_ring},
    stack::{kernel_stack, user_stack},
};

/// What the first half of an allocation program leaves to the second.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Nothing to send (not traced, failed call, unsampled, …).
    Done,
    /// A record waits in the scratch for its stack.
    Finish,
}

/// Fills the pending kernel allocation record (zeroed first).
#[inline(always)]
pub(crate) fn pend_kernel_alloc(fill: impl FnOnce(&mut KernelAllocRecord)) -> Result<Next, ()> {
    let scratch = scratch().ok_or(())?;
    scratch.pending_kernel = KernelAllocRecord::default();
    fill(&mut scratch.pending_kernel);
    Ok(Next::Finish)
}

/// Fills the pending user allocation record (zeroed first).
#[inline(always)]
pub(crate) fn pend_user_alloc(fill: impl FnOnce(&mut UserAllocRecord)) -> Result<Next, ()> {
    let scratch = scratch().ok_or(())?;
    scratch.pending_user = UserAllocRecord::default();
    fill(&mut scratch.pending_user);
    Ok(Next::Finish)
}

/// Hands the pending kernel record to `kmem_finish`; sends it without a stack here when
/// stacks are off (or when the tail call fails, which it does only before userspace has
/// installed the program: userspace installs it before attaching any kmem program).
#[inline(always)]
pub(crate) fn finish_kernel_alloc(ctx: &RawTracePointContext) {
    if config!(kernel_stacks) != 0 {
        // SAFETY: a tail call to a raw tracepoint program given the same context; on
        // failure control returns here.
        unsafe { KERNEL_FINISH.tail_call(ctx, 0) };
    }
    let (Some(ring), Some(scratch)) = (this_ring(), scratch()) else { return };
    emit::<KernelAllocRecord>(ring, |r| *r = scratch.pending_kernel);
}

/// As [`finish_kernel_alloc`], for user allocations and `user_finish`.
#[inline(always)]
pub(crate) fn finish_user_alloc(ctx: &RetProbeContext) {
    if config!(user_stacks) != 0 {
        // SAFETY: a tail call to a return probe program given the same registers; on
        // failure control returns here.
        unsafe { USER_FINISH.tail_call(ctx, 0) };
    }
    let (Some(ring), Some(scratch)) = (this_ring(), scratch()) else { return };
    emit::<UserAllocRecord>(ring, |r| *r = scratch.pending_user);
}

/// Tail-called by the kmem allocation programs: the kernel stack joined with the user
/// stack of the task the allocation ran for. Never attached.
#[raw_tracepoint]
pub fn kmem_finish(ctx: RawTracePointContext) -> u32 {
    let _ = try_kmem_finish(&ctx);
    0
}

fn try_kmem_finish(ctx: &RawTracePointContext) -> Result<(), ()> {
    let pid = scratch().ok_or(())?.pending_kernel.pid;
    let ring = this_ring().ok_or(())?;
    let stack = kernel_stack(aya_ebpf::EbpfContext::as_ptr(ctx), ring, pid);
    let scratch = scratch().ok_or(())?;
    emit::<KernelAllocRecord>(ring, |r| {
        *r = scratch.pending_kernel;
        if let Some(hash) = stack {
            r.flags |= flags::HAS_STACK;
            r.stack = hash;
        }
    });
    Ok(())
}

/// Tail-called by the return probes of the malloc family and of the GPU driver: the user
/// stack. Never attached.
#[uretprobe]
pub fn user_finish(ctx: RetProbeContext) -> u32 {
    let _ = try_user_finish(&ctx);
    0
}

fn try_user_finish(ctx: &RetProbeContext) -> Result<(), ()> {
    let pid = scratch().ok_or(())?.pending_user.pid;
    let ring = this_ring().ok_or(())?;
    let stack = user_stack(ctx, ring, pid);
    let scratch = scratch().ok_or(())?;
    emit::<UserAllocRecord>(ring, |r| {
        *r = scratch.pending_user;
        if let Some(hash) = stack {
            r.flags |= flags::HAS_STACK;
            r.stack = hash;
        }
    });
    Ok(())
}
