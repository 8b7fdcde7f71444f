//! The second half of every allocation that carries a stack. The first half (a kmem
//! tracepoint, or a return probe of the malloc family or of the GPU driver) fills a pending
//! record in the per-CPU scratch and tail-calls one of the programs here, which walk the
//! stacks and send the record (a kmem allocation's in two steps: `kmem_finish` takes the
//! kernel part, `kmem_user` joins the user part). The walks are most of the instructions
//! the verifier checks; reached this way they are verified once per program type, not once
//! per tracepoint and return probe.
use aya_ebpf::{
    macros::{raw_tracepoint, uretprobe},
    programs::{RawTracePointContext, RetProbeContext},
};
use memtrace_common::{InFlight, KernelAllocRecord, MAX_STACK_DEPTH, UserAllocRecord, counter, flags, stack_hash_step};

use crate::{
    context::{UserMemory, current_user_memory, pid_tgid, scratch},
    maps::{KERNEL_FINISH, Ring, SESSION_FINISH, USER_FINISH},
    ring::{bump, emit, this_ring},
    stack::{KERNEL_NESTING, Scratch, join_user_part, kernel_only_stack, kernel_part, user_stack},
    syscall,
};

/// What the first half of an allocation program leaves to the second.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Next {
    /// Nothing to send (not traced, failed call, unsampled, …).
    Done,
    /// A record waits for its stack (a user one with its thread, a kernel one in the scratch).
    Finish,
}

/// Fills the pending kernel allocation record of this nesting level (zeroed first) and
/// enters the level; [`finish_kernel_alloc`] or `kmem_finish` leaves it. The level is taken
/// before the record is written, so an allocation in an interrupt meanwhile uses the next.
#[inline(always)]
pub(crate) fn pend_kernel_alloc(fill: impl FnOnce(&mut KernelAllocRecord)) -> Result<Next, ()> {
    let scratch = scratch().ok_or(())?;
    let level = scratch.kernel_depth as usize;
    if level >= KERNEL_NESTING {
        bump(counter::LOST_EVENTS);
        return Err(());
    }
    scratch.kernel_depth = level as u32 + 1;
    // Its walks write over the scratch: a user walk it interrupts must know.
    if config!(kernel_stacks) != 0 {
        claim_scratch(scratch, pid_tgid().2);
    }
    // The mask keeps the index's bound in the verifier's sight (KERNEL_NESTING is a power of two).
    let pending = &mut scratch.pending_kernel[level & (KERNEL_NESTING - 1)];
    // Zeroed a word at a time (`KernelAllocRecord::default()` became a byte-by-byte memset
    // call, run for every kernel allocation).
    crate::ring::zero(pending);
    fill(pending);
    Ok(Next::Finish)
}

/// The pending kernel record of the innermost level, with the level.
#[inline(always)]
fn pending_kernel() -> Option<(&'static mut KernelAllocRecord, usize)> {
    let scratch = scratch()?;
    let depth = scratch.kernel_depth as usize;
    if depth == 0 {
        return None;
    }
    // Never above KERNEL_NESTING (`pend_kernel_alloc` refuses a deeper level); the mask alone
    // bounds the index, where a comparison the compiler folds would leave it unbounded to
    // the verifier.
    let level = (depth - 1) & (KERNEL_NESTING - 1);
    Some((&mut scratch.pending_kernel[level], level))
}

/// Leaves the innermost kernel nesting level.
#[inline(always)]
fn leave_kernel_level() {
    if let Some(scratch) = scratch() {
        scratch.kernel_depth = scratch.kernel_depth.saturating_sub(1);
    }
}

/// Claims this CPU's scratch for a program running for thread `tid`; returns the claim's
/// token, new with every claim. Programs on one CPU run one inside another (a kmem
/// tracepoint in an interrupt) or, on a preemptible kernel, one between the instructions of
/// another (uprobe programs run with migration, not preemption, disabled): a program that
/// finds another's token in the scratch before it sends what it built there knows that
/// was written over.
#[inline(always)]
pub(crate) fn claim_scratch(scratch: &mut Scratch, tid: u32) -> u64 {
    // Never 0 in the low half ([`stack::INTERLEAVED_CLAIM`] is no token).
    let seq = scratch.claim_seq.wrapping_add(1).max(1);
    scratch.claim_seq = seq;
    let token = (u64::from(tid) << 32) | u64::from(seq);
    scratch.claim = token;
    token
}

/// Fills the pending user allocation record (zeroed first), kept with the thread (its
/// task storage: `state`, or looked up, made if need be) for the program that sends it
/// with its stack; claims the scratch the stack is walked in.
#[inline(always)]
pub(crate) fn pend_user_alloc(
    state: Option<&'static mut InFlight>,
    fill: impl FnOnce(&mut UserAllocRecord),
) -> Result<Next, ()> {
    let Some(state) = state.or_else(|| crate::inflight::slot(true)) else {
        bump(counter::LOST_INFLIGHT);
        return Err(());
    };
    state.pending = UserAllocRecord::default();
    fill(&mut state.pending);
    let scratch = scratch().ok_or(())?;
    state.claim = claim_scratch(scratch, pid_tgid().2);
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
    if let (Some(ring), Some((pending, _))) = (this_ring(), pending_kernel()) {
        emit::<KernelAllocRecord>(ring, |r| *r = *pending);
    }
    leave_kernel_level();
}

/// Which kind of program a user allocation's first half is: the second half must be loaded
/// for the same expected attach type, and a program array holds one kind.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Half {
    /// A return probe (`alloc_return`, `gpu_return`): `user_finish`.
    Return,
    /// The uprobe session program (`alloc_session`): `user_finish_session`.
    Session,
}

/// As [`finish_kernel_alloc`], for user allocations and `user_finish` (or its session twin).
#[inline(always)]
pub(crate) fn finish_user_alloc(ctx: &RetProbeContext, half: Half) {
    if config!(user_stacks) != 0 {
        // SAFETY: a tail call to a return probe program given the same registers; on
        // failure control returns here.
        unsafe {
            match half {
                Half::Return => USER_FINISH.tail_call(ctx, 0),
                Half::Session => SESSION_FINISH.tail_call(ctx, 0),
            }
        };
    }
    let Some(ring) = this_ring() else { return };
    let Some(state) = crate::inflight::slot(false) else {
        // (Before 6.2 the storage can be refused while a program on the CPU holds its lock.)
        bump(counter::LOST_INFLIGHT);
        return;
    };
    emit::<UserAllocRecord>(ring, |r| *r = state.pending);
}

/// Tail-called by the kmem allocation programs: the kernel stack, then (tail-calling
/// `kmem_user`) the user stack of the task the allocation ran for. Never attached.
#[raw_tracepoint]
pub fn kmem_finish(ctx: RawTracePointContext) -> u32 {
    let _ = try_kmem_finish(&ctx);
    leave_kernel_level();
    0
}

/// Where `kmem_finish` hands over to `kmem_user` in `KERNEL_FINISH`.
const KMEM_USER_INDEX: u32 = 1;
const _: () = assert!((MAX_STACK_DEPTH + 1).is_power_of_two());

fn try_kmem_finish(ctx: &RawTracePointContext) -> Result<(), ()> {
    let (pending, level) = pending_kernel().ok_or(())?;
    let pid = pending.pid;
    let ring = this_ring().ok_or(())?;
    let ctx_ptr = aya_ebpf::EbpfContext::as_ptr(ctx);
    // The kernel stack kept for a path is found by the allocation's kind and call site.
    let seed = stack_hash_step(u64::from(pending.kind), pending.call_site);
    let (n_kernel, hash) = kernel_part(ctx_ptr, pid, seed).ok_or(())?;
    if pid != 0 && config!(user_stacks) != 0 && user_stack_reachable() {
        let scratch = scratch().ok_or(())?;
        scratch.pending_kernel_hash[level & (KERNEL_NESTING - 1)] = hash;
        scratch.pending_kernel_frames[level & (KERNEL_NESTING - 1)] = n_kernel as u32;
        // The user walk is a program of its own: verified here, behind the kernel part's
        // branches, it was verified once per state they leave (139k instructions, not 69k).
        // SAFETY: a tail call to a raw tracepoint program given the same context; on
        // failure control returns here and the stack goes without its user part.
        unsafe { KERNEL_FINISH.tail_call(ctx, KMEM_USER_INDEX) };
    }
    let stack = kernel_only_stack(ctx_ptr, ring, pid, n_kernel, hash);
    send_kernel_alloc(ring, level, stack)
}

/// Whether a kmem allocation's user stack can be had: walked in its program's memory, or,
/// while `execve` replaces that memory, taken from a walk an earlier allocation of the same
/// syscall made on this CPU, whole or finished by the copy that allocation sent
/// (`stack::user_part_in_syscall`; it walks only when the registers differ, which they do
/// not within a syscall). Else the stack goes without its user part, as a kernel
/// thread's does, rather than with one frame marked cut short (`execve` moves the task to
/// another CPU before it loads the program, so its allocations there were most of a shell
/// loop's stacks cut short).
#[inline(always)]
fn user_stack_reachable() -> bool {
    match current_user_memory() {
        UserMemory::Program => true,
        UserMemory::Gone => false,
        UserMemory::Replaced => scratch().is_some_and(|s| {
            syscall::current(s).is_some_and(|seq| seq == s.reuse_seq || (seq == s.copy_seq && s.copy_hash != 0))
        }),
    }
}

/// Sends the pending kernel record of `level`, with the hash of its stack if it has one.
#[inline(always)]
fn send_kernel_alloc(ring: &Ring, level: usize, stack: Option<u64>) -> Result<(), ()> {
    let scratch = scratch().ok_or(())?;
    let pending = &scratch.pending_kernel[level & (KERNEL_NESTING - 1)];
    emit::<KernelAllocRecord>(ring, |r| {
        *r = *pending;
        if let Some(hash) = stack {
            r.flags |= flags::HAS_STACK;
            r.stack = hash;
        }
    });
    Ok(())
}

/// Tail-called by `kmem_finish`: joins the user stack to the kernel part and sends the
/// record. Never attached.
#[raw_tracepoint]
pub fn kmem_user(ctx: RawTracePointContext) -> u32 {
    let _ = try_kmem_user(&ctx);
    leave_kernel_level();
    0
}

fn try_kmem_user(ctx: &RawTracePointContext) -> Result<(), ()> {
    let (pending, level) = pending_kernel().ok_or(())?;
    let pid = pending.pid;
    let ring = this_ring().ok_or(())?;
    let scratch = scratch().ok_or(())?;
    let hash = scratch.pending_kernel_hash[level & (KERNEL_NESTING - 1)];
    // A mask, not `min`: one range for the verifier, not a constant and a range to verify
    // the walk under twice.
    let n_kernel = scratch.pending_kernel_frames[level & (KERNEL_NESTING - 1)] as usize & MAX_STACK_DEPTH;
    let stack = join_user_part(aya_ebpf::EbpfContext::as_ptr(ctx), ring, pid, n_kernel, hash);
    send_kernel_alloc(ring, level, stack)
}

/// Tail-called by the return probes of the malloc family and of the GPU driver: the user
/// stack. Never attached.
#[uretprobe]
pub fn user_finish(ctx: RetProbeContext) -> u32 {
    let _ = try_user_finish(&ctx);
    0
}

/// `user_finish` for `alloc_session`, loaded with the session's expected attach type (the
/// kernel lets a program tail-call only programs loaded like itself). Never attached.
#[uretprobe]
pub fn user_finish_session(ctx: RetProbeContext) -> u32 {
    let _ = try_user_finish(&ctx);
    0
}

fn try_user_finish(ctx: &RetProbeContext) -> Result<(), ()> {
    // The thread's own record (its storage stays valid while the thread runs this).
    let Some(state) = crate::inflight::slot(false) else {
        bump(counter::LOST_INFLIGHT);
        return Err(());
    };
    let ring = this_ring().ok_or(())?;
    let stack = user_stack(ctx, ring, state.pending.pid, state.pending.ts_ns, state.claim);
    emit::<UserAllocRecord>(ring, |r| {
        *r = state.pending;
        if let Some(hash) = stack {
            r.flags |= flags::HAS_STACK;
            r.stack = hash;
        }
    });
    Ok(())
}
