//! The malloc family, from user space: one entry and one return program for every
//! allocating function (the attach cookie says which fired) and one entry program for
//! `free`/`munmap`. Calls the allocator makes to itself are recognised by the stack
//! pointer and not counted twice; the empty programs are the benchmark's baseline. The
//! return program leaves the stack to `finish::user_finish`, which it tail-calls.
//! On Linux 6.13 and later the entry and return run as one uprobe session program
//! (`alloc_session`): an entry that needs no return (an unsampled call, a call the
//! allocator makes to itself, a process not traced) says so, and the kernel skips the
//! return probe's trap.
use aya_ebpf::{
    EbpfContext,
    helpers::{bpf_ktime_get_ns, bpf_probe_read_user, generated},
    macros::{uprobe, uretprobe},
    programs::{ProbeContext, RetProbeContext},
};
use memtrace_common::{FreeRecord, Kind, RecordType, counter, flags, inflight};

use crate::{
    context::{pid_tgid, regs},
    finish::{Half, Next, finish_user_alloc, pend_user_alloc},
    inflight::Thread,
    maps::SAMPLED_LIVE,
    ring::{bump, emit, this_ring},
    sampling::{
        frees_filtered, insert_sampled, may_be_sampled, remove_sampled, sample_hit, sampled_key, sampling_mean,
    },
    vma::{Vma, vma_at},
};

// ---------------------------------------------------------------------------------------
// User space: the malloc family.
// ---------------------------------------------------------------------------------------

#[uprobe]
pub fn alloc_enter(ctx: ProbeContext) -> u32 {
    // SAFETY: the helper only reads the attach cookie of this program's link.
    let cookie = unsafe { generated::bpf_get_attach_cookie(ctx.as_ptr()) };
    let _ = try_alloc_enter(&ctx, cookie, false);
    0
}

/// The entry and the return of the malloc family as one uprobe session program (Linux
/// 6.13, `BPF_TRACE_UPROBE_SESSION`): the kernel runs it at the entry and, when that run
/// returned 0, again at the return. Which run this is: at the entry the instruction
/// pointer is the probed address (`bpf_get_func_ip`), at the return it is the caller's
/// return address. Returning 1 from the entry skips the return. (Written without aya's
/// `#[uprobe]`, whose wrapper returns 0 whatever the program answers.) The freeing
/// functions of the same file are on the same link, their cookie's kind a free: one link
/// per file instead of two, so attaching and detaching wait for half the grace periods;
/// their entry never asks for the return.
#[unsafe(no_mangle)]
#[unsafe(link_section = "uprobe")]
pub fn alloc_session(ctx: *mut core::ffi::c_void) -> u32 {
    // A free first, by its cookie: it only ever has an entry run, so it skips the test of
    // which run this is (frees are every other call, and under sampling most returns are
    // skipped: the cookie is the cheaper thing to read first).
    let probe = ProbeContext::new(ctx);
    // SAFETY: the helper only reads the attach cookie of this program's link.
    let cookie = unsafe { generated::bpf_get_attach_cookie(probe.as_ptr()) };
    let kind = cookie as u8;
    if kind == Kind::Free as u8 || kind == Kind::Munmap as u8 {
        let _ = try_free(&probe, kind);
        return 1;
    }
    run_session(ctx, |c| try_alloc_enter(c, cookie, true), try_alloc_return)
}

/// The body of a uprobe session program: at the return, `ret` and the second half; at the
/// entry, `enter`, whose answer (whether the return needs to run) becomes the program's.
#[inline(always)]
pub(crate) fn run_session(
    ctx: *mut core::ffi::c_void,
    enter: impl FnOnce(&ProbeContext) -> Result<bool, ()>,
    ret: impl FnOnce(&RetProbeContext) -> Result<Next, ()>,
) -> u32 {
    let ctx = ProbeContext::new(ctx);
    if is_session_return(&ctx) {
        let at_return = RetProbeContext::new(ctx.as_ptr());
        if ret(&at_return) == Ok(Next::Finish) {
            finish_user_alloc(&at_return, Half::Session);
        }
        return 0;
    }
    match enter(&ctx) {
        Ok(true) => 0,
        _ => 1,
    }
}

/// Whether a uprobe session program runs for the return: at the entry the instruction
/// pointer is the probed address (`bpf_get_func_ip`), at the return the caller's return
/// address (a call's return address is never the probed instruction of the function it
/// called).
#[inline(always)]
fn is_session_return(ctx: &ProbeContext) -> bool {
    // SAFETY: the helper reads the probed address from this program's run context.
    let probed = unsafe { generated::bpf_get_func_ip(ctx.as_ptr()) };
    // SAFETY: ctx is this probe's pt_regs.
    let ip = unsafe { (*regs(ctx)).rip };
    ip != probed
}

/// The entry of an allocating call: its arguments and sampling decision, kept in the
/// thread's task storage (`inflight`) for the return. Whether the return needs to run
/// (`session`: the entry of [`alloc_session`], where calls the allocator makes to itself
/// get no return to count down a depth with, and are left alone).
/// An allocating call's entry; `cookie`: its link's attach cookie (kind, allocator, flags).
pub(crate) fn try_alloc_enter(ctx: &ProbeContext, cookie: u64, session: bool) -> Result<bool, ()> {
    let kind = cookie as u8;
    let arg = |n: usize| -> u64 { ctx.arg::<u64>(n).unwrap_or(0) };
    // log2 of an alignment argument (0: none or not a power of two).
    let lg = |a: u64| -> u8 { if a.is_power_of_two() { a.trailing_zeros() as u8 } else { 0 } };
    let (bytes_req, ptr_arg, lg_align) = match Kind::from_u8(kind) {
        Some(Kind::Malloc | Kind::New) => (arg(0), 0, 0),
        Some(Kind::Valloc | Kind::Pvalloc) => (arg(0), 0, 12),
        Some(Kind::Calloc) => (arg(0).wrapping_mul(arg(1)), 0, 0),
        Some(Kind::Realloc) => (arg(1), arg(0), 0),
        Some(Kind::ReallocArray) => (arg(1).wrapping_mul(arg(2)), arg(0), 0),
        Some(Kind::PosixMemalign) => (arg(2), arg(0), lg(arg(1))),
        Some(Kind::AlignedAlloc | Kind::Memalign) => (arg(1), 0, lg(arg(0))),
        Some(Kind::NewAligned) => (arg(0), 0, lg(arg(1))),
        // jemalloc's flags: the low six bits are lg(alignment).
        Some(Kind::Mallocx) => (arg(0), 0, (arg(1) & 63) as u8),
        Some(Kind::Rallocx) => (arg(1), arg(0), (arg(2) & 63) as u8),
        Some(Kind::Mmap) => (arg(1), 0, 0),
        // The new length, the old mapping (unmapped at the return, if it succeeded).
        Some(Kind::Mremap) => (arg(2), arg(0), 0),
        _ => return Err(()),
    };
    // A read-only mapping of a file (no MAP_ANONYMOUS, no PROT_WRITE) is a view of the file
    // in the page cache, not memory allocated: not recorded (a 103-byte file mapped showed
    // as a page allocated, 97 % wasted); its munmap frees nothing recorded and is ignored.
    // Writable ones stay: shared memory (memfd, /dev/shm) and private copies written to.
    const MAP_ANONYMOUS: u64 = 0x20;
    const PROT_WRITE: u64 = 0x2;
    if kind == Kind::Mmap as u8 && arg(3) & MAP_ANONYMOUS == 0 && arg(2) & PROT_WRITE == 0 {
        return Ok(false);
    }
    let reallocating = matches!(Kind::from_u8(kind), Some(Kind::Realloc | Kind::ReallocArray | Kind::Rallocx));
    // An mremap's unmapping is recorded whatever the new mapping draws, as munmap's is.
    let remapping = kind == Kind::Mremap as u8;
    let mean = sampling_mean();
    // Sampling, where an unsampled call skips its return (a session): most calls are drawn
    // out here, before anything is looked up. A call that is not the user's (the allocator
    // calling itself inside a recorded call, a process not traced) draws too: the bytes it
    // adds to this CPU's countdown leave every other byte's chance of being sampled as it
    // was (the gaps between samples are memoryless). (As before this draw moved here, a
    // probed call made inside an unsampled one, which left no state, is drawn as a call
    // of its own: glibc's mmap under a large malloc, say.) A reallocation draws below,
    // once its old block is known.
    let drawn = session && mean != 0 && !reallocating && !remapping;
    if drawn && !sample_hit(bytes_req, mean) {
        return Ok(false);
    }
    let (_, tgid, _) = pid_tgid();
    let Thread::Traced(slot) = crate::inflight::traced_thread(tgid, true) else { return Ok(false) };
    let Some(slot) = slot else {
        bump(counter::LOST_INFLIGHT);
        return Ok(false);
    };
    let glibc = if cookie & memtrace_common::cookie::GLIBC != 0 { inflight::GLIBC } else { 0 }
        | if cookie & memtrace_common::cookie::MIMALLOC != 0 { inflight::MIMALLOC } else { 0 };
    // SAFETY: ctx is this probe's pt_regs.
    let sp = unsafe { (*regs(ctx)).rsp };
    if slot.sp != 0 {
        let state = &mut *slot;
        if sp < state.sp {
            // Called from inside another allocator call (realloc → malloc): not the user's.
            if !session {
                state.depth += 1;
            }
            return Ok(false);
        }
        if sp == state.sp {
            // A tail call at the same depth (realloc(NULL, n) jumping to malloc,
            // reallocarray to realloc): the call the user made, and its sampling decision,
            // stay the outer one's; both return probes fire once, at the same return.
            // From glibc into another allocator (glibc's reallocarray jumps to the realloc
            // the program uses, a preloaded jemalloc's or tcmalloc's): the block is that
            // one's, and so are its size classes, not a glibc chunk header's. (A prefixed
            // copy's wrapper jumping into its library stays the allocator the user called.)
            if state.flags & inflight::GLIBC != 0 && glibc & inflight::GLIBC == 0 {
                state.allocator = (cookie >> memtrace_common::cookie::ALLOCATOR_SHIFT) as u8;
                state.flags = state.flags & !inflight::GLIBC | glibc;
            }
            return Ok(false);
        }
        // Otherwise the entry is stale (its return was never seen): replace it.
    }
    let mut sampling = inflight::SAMPLE_NEW | inflight::OLD_SAMPLED;
    if drawn {
        sampling = inflight::SAMPLE_NEW;
    } else if mean != 0 {
        let has_old = ptr_arg != 0 && reallocating;
        // Until frees are filtered (the overload switch's first phase), every old block's
        // end is reported, as its free would be.
        // SAFETY: plain byte value.
        let old_key = sampled_key(tgid, ptr_arg);
        let old_sampled = has_old
            && (!frees_filtered() || may_be_sampled(&old_key) && unsafe { SAMPLED_LIVE.get(old_key) }.is_some());
        sampling = if sample_hit(bytes_req, mean) { inflight::SAMPLE_NEW } else { 0 }
            | if old_sampled { inflight::OLD_SAMPLED } else { 0 };
        if sampling == 0 && !reallocating && !remapping {
            // Nothing of this call is recorded: its return finds no state. (realloc keeps
            // an empty state, so the malloc it may tail-call, whatever it draws, finds the
            // call already decided: no second chance.)
            return Ok(false);
        }
    }
    // An mremap's mapping is what its mmap was (looked up here, past the nested calls:
    // glibc's realloc of a mapped chunk calls mremap inside): a file's read-only view is
    // not memory, so only the old range's unmapping goes (quiet where nothing was
    // recorded there; a shared anonymous mapping has a file too, and was recorded); a
    // reservation stays reserved.
    let old_vma = if remapping { vma_at(ptr_arg) } else { Vma::Unknown };
    if old_vma == Vma::Busy {
        bump(counter::MREMAP_UNLOOKED);
    }
    if old_vma == Vma::FileView {
        sampling &= !inflight::SAMPLE_NEW;
    }
    // PROT_NONE (0): address space only.
    let no_access =
        if kind == Kind::Mmap as u8 && arg(2) == 0 || old_vma == Vma::NoAccess { inflight::NO_ACCESS } else { 0 };
    // Field by field: the pending record and claim after them are the return's to write.
    slot.kind = kind;
    slot.flags = sampling | glibc | no_access;
    slot.allocator = (cookie >> memtrace_common::cookie::ALLOCATOR_SHIFT) as u8;
    slot.lg_align = lg_align;
    slot.depth = 0;
    slot.sp = sp;
    // Only a reallocation's free (of the old block) is timed at the entry.
    // SAFETY: no preconditions.
    slot.ts_entry = if reallocating { unsafe { bpf_ktime_get_ns() } } else { 0 };
    slot.bytes_req = bytes_req;
    slot.ptr_arg = ptr_arg;
    const MREMAP_DONTUNMAP: u64 = 4;
    slot.old_len = if remapping && arg(3) & MREMAP_DONTUNMAP == 0 { arg(1) } else { 0 };
    Ok(true)
}

#[uretprobe]
pub fn alloc_return(ctx: RetProbeContext) -> u32 {
    if try_alloc_return(&ctx) == Ok(Next::Finish) {
        finish_user_alloc(&ctx, Half::Return);
    }
    0
}

/// glibc's `malloc_usable_size`, from the size word before the block.
#[inline(always)]
pub(crate) fn glibc_usable_size(ptr: u64) -> Option<u64> {
    // SAFETY: reads user memory through the checked helper.
    let size_word: u64 = unsafe { bpf_probe_read_user((ptr - 8) as *const u64) }.ok()?;
    let chunk = size_word & !7;
    let is_mmapped = size_word & 2 != 0;
    let overhead = if is_mmapped { 16 } else { 8 };
    chunk.checked_sub(overhead)
}

/// mimalloc 2.0's `mi_usable_size` (release build, x86_64), from the block's segment
/// (32 MiB aligned) and page metadata: three reads. The offsets are those of the 2.0.9
/// layout (`mi_segment_t.slices` at 264, 80-byte `mi_page_t`: `slice_count` at 0,
/// `slice_offset` at 4, `xblock_size` at 28).
#[inline(always)]
pub(crate) fn mimalloc_usable_size(ptr: u64) -> Option<u64> {
    const SEGMENT: u64 = 32 << 20;
    const SLICES: u64 = 264;
    const SLICE_SIZE: u64 = 80;
    let segment = (ptr - 1) & !(SEGMENT - 1);
    let slice = segment + SLICES + ((ptr - segment) >> 16) * SLICE_SIZE;
    // SAFETY: reads user memory through the checked helper.
    let slice_offset: u32 = unsafe { bpf_probe_read_user((slice + 4) as *const u32) }.ok()?;
    let page = slice.checked_sub(u64::from(slice_offset))?;
    // SAFETY: as above.
    let xblock: u32 = unsafe { bpf_probe_read_user((page + 28) as *const u32) }.ok()?;
    let start = if (8..=1024).contains(&xblock) { 384 } else { 0 };
    let bsize = if xblock < (2 << 30) {
        u64::from(xblock)
    } else {
        // SAFETY: as above.
        let slice_count: u32 = unsafe { bpf_probe_read_user(page as *const u32) }.ok()?;
        (u64::from(slice_count) << 16).checked_sub(start)?
    };
    if bsize == 0 {
        return None;
    }
    let page_index = page.checked_sub(segment + SLICES)? / SLICE_SIZE;
    let page_start = segment + (page_index << 16) + start;
    let into = ptr.checked_sub(page_start)?;
    Some(bsize - into % bsize)
}

pub(crate) fn try_alloc_return(ctx: &RetProbeContext) -> Result<Next, ()> {
    bump(counter::USER_RETURNS);
    let (_, tgid, tid) = pid_tgid();
    let current = crate::inflight::current().ok_or(())?;
    let state = *current;
    // SAFETY: ctx is the return probe's pt_regs.
    let sp = unsafe { (*regs(ctx)).rsp };
    if sp < state.sp + 8 {
        // The return of a nested allocator call.
        current.depth = current.depth.saturating_sub(1);
        return Ok(Next::Done);
    }
    // The call is over (its storage is the thread's: no second lookup).
    current.sp = 0;
    if sp != state.sp + 8 {
        return Ok(Next::Done); // stale entry: its return was missed
    }
    let kind = Kind::from_u8(state.kind).ok_or(())?;
    let ret: u64 = ctx.ret();
    // SAFETY: no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    let ptr = match kind {
        Kind::PosixMemalign => {
            if ret != 0 {
                return Ok(Next::Done); // error code: nothing allocated
            }
            // SAFETY: checked read of the caller's result slot.
            unsafe { bpf_probe_read_user(state.ptr_arg as *const u64) }.map_err(|_| ())?
        }
        Kind::Mmap | Kind::Mremap => {
            if ret as i64 == -1 {
                return Ok(Next::Done); // MAP_FAILED: an mremap's old mapping is untouched
            }
            ret
        }
        _ => ret,
    };
    let ring = this_ring().ok_or(())?;
    if kind == Kind::Mremap && state.old_len != 0 {
        // The old mapping is gone (moved, or resized where it was: the new one follows).
        emit::<FreeRecord>(ring, |r| {
            r.rtype = RecordType::Free as u8;
            r.kind = Kind::Munmap as u8;
            r.flags = flags::BY_REALLOC;
            r.pid = tgid;
            r.tid = tid;
            r.arg = state.old_len.div_ceil(4096).min(u32::MAX as u64) as u32;
            r.ts_ns = now;
            r.ptr = state.ptr_arg;
        });
    }
    let is_realloc = matches!(kind, Kind::Realloc | Kind::ReallocArray | Kind::Rallocx);
    let sampling = sampling_mean() != 0;
    if is_realloc && state.ptr_arg != 0 && state.flags & inflight::OLD_SAMPLED != 0 {
        if ptr == 0 && state.bytes_req != 0 {
            return Ok(Next::Done); // failed: the old block is untouched
        }
        if sampling {
            remove_sampled(sampled_key(tgid, state.ptr_arg));
        }
        // The old block is gone: freed (size 0) or replaced by the new one.
        emit::<FreeRecord>(ring, |r| {
            r.rtype = RecordType::Free as u8;
            r.kind = Kind::Free as u8;
            r.flags = flags::BY_REALLOC;
            r.pid = tgid;
            r.tid = tid;
            r.ts_ns = state.ts_entry;
            r.ptr = state.ptr_arg;
        });
    }
    if ptr == 0 || state.flags & inflight::SAMPLE_NEW == 0 {
        return Ok(Next::Done);
    }
    if sampling && !insert_sampled(sampled_key(tgid, ptr)) {
        bump(counter::LOST_SAMPLED_LIVE);
    }
    let (bytes_alloc, exact) = if kind == Kind::Mmap || kind == Kind::Mremap {
        ((state.bytes_req + 4095) & !4095, true)
    } else if state.flags & inflight::GLIBC != 0 {
        match glibc_usable_size(ptr) {
            Some(usable) if usable >= state.bytes_req => (usable, true),
            _ => (state.bytes_req, false),
        }
    } else if state.flags & inflight::MIMALLOC != 0
        && matches!(
            kind,
            Kind::PosixMemalign | Kind::AlignedAlloc | Kind::Memalign | Kind::Valloc | Kind::Pvalloc | Kind::NewAligned
        )
    {
        // Aligned blocks: their usable size depends on the heap's state, not on the call.
        match mimalloc_usable_size(ptr) {
            Some(usable) if usable >= state.bytes_req && usable - state.bytes_req <= u32::MAX as u64 => (usable, true),
            _ => (state.bytes_req, false),
        }
    } else {
        // Another family: user space computes the usable size from its size classes and
        // the alignment asked (never a glibc header in front of another allocator's block).
        (state.bytes_req, false)
    };
    let extra = if exact {
        (bytes_alloc - state.bytes_req).min(u32::MAX as u64) as u32
    } else if state.lg_align > 0 {
        1u32 << state.lg_align.min(31)
    } else {
        0
    };
    let recorded_kind = if matches!(kind, Kind::Mmap | Kind::Mremap) && state.flags & inflight::NO_ACCESS != 0 {
        Kind::MmapReserved as u8
    } else if kind == Kind::Mremap {
        Kind::Mmap as u8
    } else {
        state.kind
    };
    pend_user_alloc(Some(current), |r| {
        r.rtype = RecordType::UserAlloc as u8;
        r.kind = recorded_kind;
        r.allocator = state.allocator;
        r.flags =
            if exact { flags::USABLE_EXACT } else { 0 } | if kind == Kind::Mremap { flags::BY_REALLOC } else { 0 };
        r.pid = tgid;
        r.tid = tid;
        r.bytes_extra = extra;
        r.ts_ns = now;
        r.ptr = ptr;
        r.bytes_req = state.bytes_req;
    })
}

#[uprobe]
pub fn free_enter(ctx: ProbeContext) -> u32 {
    let _ = try_free_enter(&ctx);
    0
}

pub(crate) fn try_free_enter(ctx: &ProbeContext) -> Result<(), ()> {
    // SAFETY: the helper only reads the attach cookie.
    let kind = unsafe { generated::bpf_get_attach_cookie(ctx.as_ptr()) } as u8;
    try_free(ctx, kind)
}

/// A freeing call of `kind` (free or an unmapping).
#[inline(always)]
fn try_free(ctx: &ProbeContext, kind: u8) -> Result<(), ()> {
    let ptr: u64 = ctx.arg(0).ok_or(())?;
    if ptr == 0 {
        return Ok(());
    }
    let (_, tgid, tid) = pid_tgid();
    let heap = kind == Kind::Free as u8;
    let sampled_heap = heap && sampling_mean() != 0;
    // Sampled mode: only the frees of sampled blocks matter (most frees stop here, before
    // the traced-set lookup: a block of this process in the sampled set was allocated
    // while it was traced). Under the overload switch's first phase all are still sent.
    // Configured sampling asks its filter first: most frees are of blocks never sampled.
    let key = sampled_key(tgid, ptr);
    // SAFETY: plain byte value.
    if heap && frees_filtered() && (!may_be_sampled(&key) || unsafe { SAMPLED_LIVE.get(key) }.is_none()) {
        return Ok(());
    }
    let Thread::Traced(slot) = crate::inflight::traced_thread(tgid, false) else { return Ok(()) };
    if let Some(state) = slot.filter(|s| s.sp != 0) {
        // SAFETY: ctx is this probe's pt_regs.
        if unsafe { (*regs(ctx)).rsp } < state.sp {
            return Ok(()); // the allocator freeing inside realloc: reported by realloc
        }
    }
    if sampled_heap {
        remove_sampled(key);
    }
    let pages = if kind == Kind::Munmap as u8 { length_in_pages(ctx) } else { 0 };
    send_free(kind, tgid, tid, ptr, pages)
}

/// The length argument (the second) of an unmapping call, in 4 KiB pages.
#[inline(always)]
pub(crate) fn length_in_pages(ctx: &ProbeContext) -> u32 {
    let len: u64 = ctx.arg(1).unwrap_or(0);
    len.div_ceil(4096).min(u32::MAX as u64) as u32
}

/// Sends a free of `ptr` (`arg`: pages unmapped, for the unmapping kinds).
#[inline(always)]
pub(crate) fn send_free(kind: u8, tgid: u32, tid: u32, ptr: u64, arg: u32) -> Result<(), ()> {
    let ring = this_ring().ok_or(())?;
    emit::<FreeRecord>(ring, |r| {
        r.rtype = RecordType::Free as u8;
        r.kind = kind;
        r.pid = tgid;
        r.tid = tid;
        r.arg = arg;
        // SAFETY: no preconditions.
        r.ts_ns = unsafe { bpf_ktime_get_ns() };
        r.ptr = ptr;
    });
    Ok(())
}

/// Benchmark baseline: an empty entry probe (`memtrace bench-baseline`).
#[uprobe]
pub fn empty_enter(_ctx: ProbeContext) -> u32 {
    0
}

/// Benchmark baseline: an empty return probe.
#[uretprobe]
pub fn empty_return(_ctx: RetProbeContext) -> u32 {
    0
}
