//! Stacks: walking the user part (frame pointers, or the per-file tables of `unwind`) and
//! the kernel part, hashing them, and sending each distinct stack's frames once (with a
//! stack copy when the user walk met a frame whose table is not ready yet). The thread's
//! Python frames (`python`) are walked first and hashed in; they travel in a record of
//! their own, just before the stack's.
use core::{ffi::c_void, mem::size_of};

use aya_ebpf::{
    EbpfContext,
    bindings::{BPF_F_USER_BUILD_ID, BPF_F_USER_STACK, BPF_NOEXIST, BPF_RB_FORCE_WAKEUP},
    helpers::{bpf_ktime_get_ns, generated},
    programs::RetProbeContext,
};
use memtrace_common::{
    KERNEL_STACK_SEED, KernelAllocRecord, MAX_STACK_DEPTH, MAX_USER_DEPTH, MISS_HASH_MARK, RecordType, StackHeader,
    UNWIND_ANCHORED_COPY_BYTES, UNWIND_COPY_BYTES, USER_STACK_SEED, UnwindMiss, UserFrame, counter,
    python::{MAX_PY_FRAMES, PyFrame, PyStackHeader},
    stack_flags, stack_hash_step, unwind_mode,
};

use crate::{
    context::{scratch, this_cpu},
    kstack,
    maps::{ANCHOR_BUFFERS, ANCHORS, ASIDS, Ring, STACKS_LOST_GEN, STACKS_SENT},
    python::{PY_WINDOW, send_python_once, walk_python},
    ring::{bump, emit, room_for_copy, wakeup_flags, zero},
    syscall,
    unwind::{UserRegs, walk_user_tables},
};

pub(crate) const USER_FRAMES_BYTES: usize = MAX_STACK_DEPTH * size_of::<UserFrame>();
pub(crate) const KERNEL_FRAMES_BYTES: usize = MAX_STACK_DEPTH * size_of::<u64>();
pub(crate) const USER_IPS_BYTES: usize = MAX_USER_DEPTH * size_of::<u64>();
/// Where the user part of a stack record may start at the latest (after all kernel frames).
pub(crate) const USER_PART_MAX_OFF: usize = size_of::<StackHeader>() + KERNEL_FRAMES_BYTES;
/// Where the miss part of a DWARF stack record may start at the latest.
pub(crate) const MISS_MAX_OFF: usize = USER_PART_MAX_OFF + USER_IPS_BYTES;
pub(crate) const FP_RECORD_MAX: usize = USER_PART_MAX_OFF + USER_FRAMES_BYTES;
pub(crate) const DWARF_RECORD_MAX: usize = MISS_MAX_OFF + size_of::<UnwindMiss>() + UNWIND_ANCHORED_COPY_BYTES;
/// The ring room a stack copy is sent only with: a record whose copy is as long as an
/// unanchored one. Longer copies (the gap below a far anchor, rare) take more; the quarter
/// of the ring kept free covers them, and tiny rings (`--ring-size 64K`) still take copies.
pub(crate) const COPY_ROOM: usize = MISS_MAX_OFF + size_of::<UnwindMiss>() + UNWIND_COPY_BYTES;
pub(crate) const STACK_RECORD_MAX: usize =
    if FP_RECORD_MAX > DWARF_RECORD_MAX { FP_RECORD_MAX } else { DWARF_RECORD_MAX };

/// Per-CPU scratch space: stacks are far larger than the 512-byte BPF stack.
#[repr(C)]
pub(crate) struct Scratch {
    /// User instruction pointers, hashed to name the stack (zero-terminated when shorter):
    /// up to [`MAX_USER_DEPTH`] from a table walk, [`MAX_STACK_DEPTH`] by frame pointers.
    pub(crate) user_ips: [u64; MAX_USER_DEPTH + 1],
    /// Where the table walk stopped for want of a table.
    pub(crate) miss: UnwindMiss,
    /// A stack record being assembled: header, kernel addresses, user frames, miss part.
    pub(crate) record: [u8; STACK_RECORD_MAX],
    /// The Python frames of the stack (`python.rs`), after the header of their record.
    pub(crate) py_header: PyStackHeader,
    pub(crate) py_frames: [PyFrame; MAX_PY_FRAMES],
    /// User memory holding the Python frame being walked, and often its callers.
    pub(crate) py_window: [u8; PY_WINDOW],
    /// Frames in `py_frames`, whether the depth bound cut the walk, and their hash: kept
    /// here rather than on the BPF stack, so the verifier sees values it does not know and
    /// checks the walk once, not once per possible count.
    pub(crate) py_n: u32,
    pub(crate) py_cut: u32,
    pub(crate) py_hash: u64,
    /// The user memory in `py_window`: from where, how many bytes (0: none yet).
    pub(crate) py_win_start: u64,
    pub(crate) py_win_len: u64,
    /// The allocation records waiting for their stack in a tail-called program (`finish`).
    /// Kernel ones by nesting level: a kmem tracepoint can fire in an interrupt while the
    /// task's own allocation is between its two halves.
    pub(crate) pending_kernel: [KernelAllocRecord; KERNEL_NESTING],
    /// Their kernel parts' hashes and frame counts, from `kmem_finish` to `kmem_user`.
    pub(crate) pending_kernel_hash: [u64; KERNEL_NESTING],
    pub(crate) pending_kernel_frames: [u32; KERNEL_NESTING],
    /// Kernel allocations between their two halves on this CPU.
    pub(crate) kernel_depth: u32,
    /// The syscall window of this CPU (`syscall`): the task `syscall_tid` entered syscall
    /// number `syscall_seq` here with `syscall_switches` context switches behind it.
    pub(crate) syscall_tid: u32,
    pub(crate) syscall_switches: u64,
    pub(crate) syscall_seq: u64,
    /// The walk in `user_ips` was made in window `reuse_seq` (0: by no kmem program, or
    /// overwritten since) from these registers; it found these frames, flags and address
    /// space, and the stack's hash (of the last allocation that used it).
    pub(crate) reuse_seq: u64,
    pub(crate) reuse_regs: [u64; 4],
    pub(crate) reuse_hash: u64,
    pub(crate) reuse_n: u32,
    pub(crate) reuse_flags: u32,
    pub(crate) reuse_asid: u32,
    pub(crate) _pad: u32,
    /// The walk in `user_ips` missed a rule, in window `copy_seq` (0: none, or overwritten
    /// since), from `reuse_regs`, and its copy goes out in the record of hash `copy_hash`
    /// (set before the record is sent, 0 once it failed to go): the window's later
    /// allocations refer to that copy ([`stack_flags::COPY_REPEAT`]) rather than send
    /// their own (not one in an interrupt of the allocation sending it).
    pub(crate) copy_seq: u64,
    pub(crate) copy_hash: u64,
    /// A window of the user stack the table walk is reading (`unwind::read_stack`): one
    /// bulk read serves the return addresses and saved registers of several frames.
    /// `win_words` words from `win_base`; 0 before each walk.
    pub(crate) win: [u64; STACK_WINDOW_WORDS],
    pub(crate) win_base: u64,
    pub(crate) win_words: u64,
    /// The caller's registers (ip, sp, bp, exact) `unwind::memtrace_step_frame` found.
    pub(crate) step_next: [u64; 4],
    /// The table walk under way (`unwind::walk_step`): frames so far, `phase`, the next
    /// anchor to try and the tries left. Kept here rather than on the BPF stack, so the
    /// verifier sees values it does not know and checks the walk step once, not once per
    /// frame count.
    pub(crate) walk_n: u32,
    pub(crate) walk_phase: u32,
    pub(crate) walk_anchor: u32,
    pub(crate) walk_tries: u32,
    /// The registers (ip, sp, bp) of the anchor the walk goes on from.
    pub(crate) walk_resume: [u64; 3],
    /// The highest stack pointer of a frame the walk met.
    pub(crate) walk_top_sp: u64,
    /// The `stack_flags` the walk ends with so far.
    pub(crate) walk_result: u32,
    /// The CPU whose anchors the search reads.
    pub(crate) walk_anchor_cpu: u32,
    /// Walking from an anchor: bit k, %rbp was restored from the stack by a frame from the
    /// k-th from the anchor on (`unwind::memtrace_note_rule`).
    pub(crate) walk_bp_restored: u8,
    pub(crate) _pad_walk: [u8; 7],
    /// Reusing the previous walk's outer frames (`reuse`): whether it may still be tried,
    /// the previous walk's next frame to compare, and the hash of a stack completed so.
    pub(crate) walk_reuse: u32,
    pub(crate) walk_reuse_k: u32,
    pub(crate) walk_reuse_hash: u64,
    /// The anchor buffer whose whole walk starts with the first frame of the walk under
    /// way (`reuse::memtrace_repeat_walk`), or `ANCHOR_BUFFERS`: none.
    pub(crate) walk_repeat: u32,
    /// Always 0, never written: a zero neither the compiler nor the verifier knows.
    pub(crate) walk_zero: u32,
    /// Frames of the kernel part being taken (`kernel_part`).
    pub(crate) kernel_n: u32,
    pub(crate) _pad_kernel: u32,
    /// Stack hashes this CPU saw in [`STACKS_SENT`] or sent itself, by their low bits: a
    /// repeat stack, most of them, skips the shared map's lookup. Valid while
    /// [`STACKS_LOST_GEN`] reads `sent_gen`.
    pub(crate) sent_recent: [u64; SENT_RECENT],
    pub(crate) sent_gen: u64,
    /// The time of the event the next walk is for, when its first half read the clock
    /// already (0: the walk reads it): when the thread's anchors were left.
    pub(crate) walk_time: u64,
    /// The last process this CPU walked a stack of (`unwind::process_facts`): its tgid, its
    /// address space, `proc_flags`, and the generation they were looked up in.
    pub(crate) proc_tgid: u32,
    pub(crate) proc_asid: u32,
    pub(crate) proc_flags: u32,
    pub(crate) proc_gen: u32,
    /// Who holds this scratch: the token of the last claim (`finish::claim_scratch`), and
    /// the claims counted, which make each token new. A user walk sends its frames only if
    /// its token is still here: on a preemptible kernel a uprobe program can be preempted,
    /// and another thread's programs then run on this CPU with this scratch.
    pub(crate) claim: u64,
    pub(crate) claim_seq: u32,
    pub(crate) _pad_claim: u32,
}

/// Entries of `Scratch::sent_recent` (a power of two).
pub(crate) const SENT_RECENT: usize = 16;
const _: () = assert!(SENT_RECENT.is_power_of_two());

// The record buffer and the parts written into it are 8-byte aligned: the header and the
// miss part are written with aligned stores (word moves the verifier checks once each,
// not byte moves).
const _: () = assert!(core::mem::offset_of!(Scratch, record).is_multiple_of(8));
const _: () = assert!(size_of::<StackHeader>().is_multiple_of(8) && USER_PART_MAX_OFF.is_multiple_of(8));
const _: () = assert!(size_of::<UserFrame>().is_multiple_of(8) && size_of::<UnwindMiss>().is_multiple_of(8));

/// Words in the stack window: 2 KiB, a few frames of an interpreter's evaluation loop.
pub(crate) const STACK_WINDOW_WORDS: usize = 256;
const _: () = assert!(STACK_WINDOW_WORDS.is_power_of_two());

/// Levels of kmem tracepoints nesting on one CPU (task, softirq, hardirq, NMI).
pub(crate) const KERNEL_NESTING: usize = 4;
const _: () = assert!(KERNEL_NESTING.is_power_of_two());

/// Walks the current task's user stack by frame pointers into `scratch.user_ips`; returns
/// the frame count.
#[inline(always)]
pub(crate) fn walk_user_ips(ctx: *mut c_void, scratch: &mut Scratch) -> usize {
    // SAFETY: the buffer is at least MAX_STACK_DEPTH u64s long and that size is passed.
    let n = unsafe {
        generated::bpf_get_stack(
            ctx,
            scratch.user_ips.as_mut_ptr() as *mut c_void,
            KERNEL_FRAMES_BYTES as u32,
            BPF_F_USER_STACK as u64,
        )
    };
    scratch.user_ips[MAX_STACK_DEPTH] = 0;
    if n <= 0 { 0 } else { (n as usize / 8).min(MAX_STACK_DEPTH) }
}

/// The user part of a stack: frames in `scratch.user_ips`, `stack_flags`, and whether a
/// copy of the stack goes with it (the walk missed a rule).
#[derive(Clone, Copy)]
pub(crate) struct UserPart {
    pub(crate) n: usize,
    pub(crate) flags: u8,
    pub(crate) with_copy: bool,
    /// The address space of a table walk (0 otherwise).
    pub(crate) asid: u32,
    /// The key of its Python frames (`python::send_python_once`; 0: none).
    pub(crate) py_key: u64,
}

/// Walks the user stack the configured way: by the files' tables from `regs`, or by frame
/// pointers (`ctx` names the task's registers to `bpf_get_stack`). Returns the user part
/// and `hash` continued with its frames.
#[inline(always)]
pub(crate) fn walk_user(
    ctx: *mut c_void,
    scratch: &mut Scratch,
    tgid: u32,
    regs: Option<UserRegs>,
    hash: u64,
) -> (UserPart, u64) {
    // `user_ips` is about to hold another walk.
    scratch.reuse_seq = 0;
    scratch.copy_seq = 0;
    if config!(unwind_mode) != unwind_mode::FRAME_POINTERS {
        match regs {
            Some(regs) => {
                let (n, flags, hash, asid) = walk_user_tables(scratch, tgid, regs, hash);
                (UserPart { n, flags, with_copy: false, asid, py_key: 0 }, hash)
            }
            None => (UserPart { n: 0, flags: 0, with_copy: false, asid: 0, py_key: 0 }, hash),
        }
    } else {
        let n = walk_user_ips(ctx, scratch);
        let hash = if n > 0 { hash_words::<MAX_STACK_DEPTH>(hash, scratch.user_ips.as_ptr()) } else { hash };
        (UserPart { n, flags: 0, with_copy: false, asid: 0, py_key: 0 }, hash)
    }
}

/// Hashes the frames of a buffer of `N` words, up to the first zero. Stopping on the
/// data rather than on the frame count keeps the count's range unrefined, so the verifier
/// prunes every exit of the loop into one state.
#[inline(always)]
pub(crate) fn hash_words<const N: usize>(mut h: u64, words: *const u64) -> u64 {
    for i in 0..N {
        // SAFETY: i < N, within the caller's buffer of that many words.
        let word = unsafe { *words.add(i) };
        if word == 0 {
            break;
        }
        h = stack_hash_step(h, word);
    }
    h
}

/// For a stack whose walk stopped at a frame without a table: the hash of a copy sent for
/// userspace to finish the walk once the table is built, unique to this event; or, when
/// the ring has no room for it, None: the event keeps the partial stack, marked truncated.
#[inline(always)]
pub(crate) fn copy_hash(ring: &Ring, h: u64) -> Option<u64> {
    if config!(unwind_mode) != unwind_mode::COPY_ALWAYS && !room_for_copy(ring) {
        bump(counter::UNWIND_BUDGET);
        return None;
    }
    Some(unique_hash(h))
}

/// A hash for stack `h` unique to this event (a copy's, or a reference to one).
#[inline(always)]
fn unique_hash(h: u64) -> u64 {
    // SAFETY: no preconditions.
    let (now, cpu) = (unsafe { bpf_ktime_get_ns() }, crate::context::this_cpu());
    stack_hash_step(stack_hash_step(stack_hash_step(h, MISS_HASH_MARK), now), u64::from(cpu))
}

/// The hash, and the user part with whether to send a copy, for a walk that may have missed.
#[inline(always)]
pub(crate) fn after_miss(ring: &Ring, hash: u64, user: UserPart) -> (u64, UserPart) {
    if user.flags & stack_flags::MISS == 0 {
        return (hash, user);
    }
    match copy_hash(ring, hash) {
        Some(unique) => (unique, UserPart { with_copy: true, ..user }),
        None => (
            stack_hash_step(hash, MISS_HASH_MARK),
            UserPart {
                n: (opaque(memtrace_frames_without_copy(user.n as u64)) as usize).min(MAX_USER_DEPTH),
                flags: (user.flags & !stack_flags::MISS) | stack_flags::TRUNCATED | stack_flags::NO_ROOM,
                with_copy: false,
                asid: user.asid,
                py_key: 0,
            },
        ),
    }
}

/// Writes the stack record for `hash` (header and kernel part already in
/// `scratch.record`) and sends it, unless it was sent before. Frame-pointer stacks get
/// their frames with build ids from the kernel; learned-rule stacks get their addresses,
/// and with `with_copy` the miss registers and a copy of the stack from there. With a
/// `claim` (0: none), the record goes only while the scratch still holds it: returns false
/// when another program took the scratch before the record was sent (nothing sent, the
/// hash not marked sent).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn send_stack_once(
    ctx: *mut c_void,
    ring: &Ring,
    scratch: &mut Scratch,
    hash: u64,
    pid: u32,
    n_kernel: usize,
    user: UserPart,
    claim: u64,
) -> bool {
    let with_copy = user.with_copy;
    // A copy, or a reference to one, is this allocation's alone: never marked sent.
    if !with_copy {
        if sent_recently(scratch, hash) {
            return true;
        }
        // SAFETY: value is a plain byte.
        if unsafe { STACKS_SENT.get(hash) }.is_some() {
            remember_sent(scratch, hash);
            return true;
        }
        if STACKS_SENT.insert(hash, 1u8, BPF_NOEXIST as u64).is_err() {
            return true; // another CPU is sending it
        }
    }
    let n_kernel = n_kernel.min(MAX_STACK_DEPTH);
    let user_off = size_of::<StackHeader>() + n_kernel * 8;
    if user_off > USER_PART_MAX_OFF {
        return true;
    }
    let mut n_user_frames = 0usize;
    let mut len = user_off;
    if user.flags & stack_flags::USER_IPS != 0 {
        let n = user.n.min(MAX_USER_DEPTH);
        let bytes = (n * 8) as u32;
        // One copy rather than a loop the verifier would walk frame by frame.
        // SAFETY: user_off + USER_IPS_BYTES <= STACK_RECORD_MAX and bytes <= USER_IPS_BYTES;
        // the source is this CPU's scratch array.
        unsafe {
            generated::bpf_probe_read_kernel(
                scratch.record.as_mut_ptr().add(user_off) as *mut c_void,
                bytes.min(USER_IPS_BYTES as u32),
                scratch.user_ips.as_ptr() as *const c_void,
            )
        };
        n_user_frames = n;
        len = user_off + n * 8;
        if with_copy && len <= MISS_MAX_OFF {
            len += append_stack_copy(scratch, len);
        }
    } else if user.n > 0 {
        // SAFETY: user_off + USER_FRAMES_BYTES <= STACK_RECORD_MAX, checked above.
        let n = unsafe {
            generated::bpf_get_stack(
                ctx,
                scratch.record.as_mut_ptr().add(user_off) as *mut c_void,
                USER_FRAMES_BYTES as u32,
                (BPF_F_USER_STACK | BPF_F_USER_BUILD_ID) as u64,
            )
        };
        if n > 0 {
            n_user_frames = (n as usize / size_of::<UserFrame>()).min(MAX_STACK_DEPTH);
        }
        len = user_off + n_user_frames * size_of::<UserFrame>();
    }
    let header = StackHeader {
        rtype: RecordType::Stack as u8,
        flags: user.flags,
        n_user: n_user_frames as u16,
        pid,
        hash,
        asid: user.asid,
        n_kernel: n_kernel as u16,
        _pad: 0,
        py_key: user.py_key,
    };
    // SAFETY: the record buffer starts with room for a header, 8-byte aligned (below).
    unsafe { core::ptr::write(scratch.record.as_mut_ptr() as *mut StackHeader, header) };
    if len > STACK_RECORD_MAX {
        return true;
    }
    if claim != 0 && scratch.claim != claim {
        // Written over since the walk's check (the window is the record's building).
        forget_sent(hash, with_copy);
        return false;
    }
    let ring_ptr = ring as *const Ring as *mut c_void;
    // A copy waits for userspace to learn from it: wake the reader at once.
    let flags = if with_copy { BPF_RB_FORCE_WAKEUP as u64 } else { wakeup_flags(ring) };
    // SAFETY: `len` bytes of the per-CPU record buffer are initialised and in bounds.
    let ret = unsafe {
        generated::bpf_ringbuf_output(ring_ptr, scratch.record.as_mut_ptr() as *mut c_void, len as u64, flags)
    };
    if ret != 0 {
        forget_sent(hash, with_copy);
        bump(counter::LOST_STACKS);
        if with_copy {
            // A copy that did not go out finishes no later allocation (`join_user_part`).
            scratch.copy_hash = 0;
        }
    } else if !with_copy {
        remember_sent(scratch, hash);
    }
    true
}

/// Takes back the mark of stack `hash` as sent (not for a copy, which is never marked).
#[inline(always)]
fn forget_sent(hash: u64, with_copy: bool) {
    if !with_copy {
        let _ = STACKS_SENT.remove(hash);
        // Every CPU's memory of sent stacks is forgotten: one may have seen this hash in
        // the map before it left.
        crate::maps::bump_generation(STACKS_LOST_GEN.get_ptr_mut(0));
    }
}

/// Whether this CPU saw stack `hash` sent, as [`STACKS_SENT`] said, since no stack record
/// was lost; forgets all it saw when one was.
#[inline(always)]
fn sent_recently(scratch: &mut Scratch, hash: u64) -> bool {
    let lost_gen = STACKS_LOST_GEN.get(0).copied().unwrap_or(0);
    if scratch.sent_gen != lost_gen {
        zero(&mut scratch.sent_recent);
        scratch.sent_gen = lost_gen;
        return false;
    }
    hash != 0 && scratch.sent_recent[hash as usize & (SENT_RECENT - 1)] == hash
}

#[inline(always)]
fn remember_sent(scratch: &mut Scratch, hash: u64) {
    scratch.sent_recent[hash as usize & (SENT_RECENT - 1)] = hash;
}

/// Appends `scratch.miss` and a copy of the user stack from its stack pointer to the
/// record at `off`; returns the bytes added. Near the top of a stack the full length is
/// not mapped: the copy then ends where the mapping does.
#[inline(always)]
pub(crate) fn append_stack_copy(scratch: &mut Scratch, off: usize) -> usize {
    let copy_off = off + size_of::<UnwindMiss>();
    if copy_off > MISS_MAX_OFF + size_of::<UnwindMiss>() {
        return 0;
    }
    let sp = scratch.miss.sp;
    let to_page_end = 4096 - (sp & 4095) as u32;
    let mut copied = 0u32;
    // The gap below an anchor, which the walk found mapped; else every whole-page length
    // the copy can have, longest first: the top of the stack (its outermost frames) lies in
    // its last mapped page, which a shorter copy would miss.
    const _: () = assert!(UNWIND_COPY_BYTES == 4 * 4096, "one length per page below");
    let gap = opaque(memtrace_copy_len()) as u32;
    for (k, want) in
        [gap, to_page_end + 12288, to_page_end + 8192, to_page_end + 4096, to_page_end].into_iter().enumerate()
    {
        // Only the gap below an anchor may be longer than an unanchored copy.
        let most = if k == 0 { UNWIND_ANCHORED_COPY_BYTES } else { UNWIND_COPY_BYTES };
        let want = want.min(most as u32);
        // SAFETY: copy_off + UNWIND_ANCHORED_COPY_BYTES <= STACK_RECORD_MAX; `want` is at
        // most that.
        let ret = unsafe {
            generated::bpf_probe_read_user(
                scratch.record.as_mut_ptr().add(copy_off) as *mut c_void,
                want,
                sp as *const c_void,
            )
        };
        if ret == 0 {
            copied = want;
            break;
        }
    }
    scratch.miss.copy_len = copied;
    crate::unwind::memtrace_return_slots();
    if let Some(seen) = crate::maps::RETURNS_SEEN.get(0) {
        for (k, w) in scratch.miss.returns.iter_mut().enumerate() {
            // SAFETY: a word of the map value, read one at a time (a whole-array copy may
            // become a `memcpy` call).
            *w = unsafe { core::ptr::read_volatile(&seen[k]) };
        }
    }
    // SAFETY: off + size_of::<UnwindMiss>() = copy_off, within the buffer; `off` is the
    // header and whole 8-byte frames, so the write is aligned (below).
    unsafe { core::ptr::write(scratch.record.as_mut_ptr().add(off) as *mut UnwindMiss, scratch.miss) };
    size_of::<UnwindMiss>() + copied as usize
}

/// `v` as a value the compiler knows nothing of: it would otherwise drop bounds checks
/// on a global function's answer that it can prove from the function's body, and which
/// the verifier, checking the function apart, needs.
#[inline(always)]
fn opaque(v: u64) -> u64 {
    // SAFETY: a volatile read of a local.
    unsafe { core::ptr::read_volatile(&v) }
}

/// Of the `n` frames of a walk that missed a table, those kept when no copy can go with
/// them: the frames walked from an anchor are not kept without the gap below them. A global
/// BPF function: one answer to the verifier, whichever way it was found.
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn memtrace_frames_without_copy(n: u64) -> u64 {
    match scratch() {
        Some(s) if s.miss.resume_at != 0 => u64::from(s.miss.resume_at).min(n),
        _ => n,
    }
}

/// How many bytes of stack a copy takes first: the gap below an anchor, up to the second
/// frame walked from it, and on to the later frames whose stack pointers go along within
/// [`COPY_SLACK`] of it (the walk of the gap may land on any of them: on a later one when
/// the first ones are stale frames in the locals of a function of the gap); without an
/// anchor, all an unanchored copy may. A global BPF function, as above.
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn memtrace_copy_len() -> u64 {
    let Some(s) = scratch() else { return 0 };
    if s.miss.resume_at == 0 {
        return UNWIND_COPY_BYTES as u64;
    }
    let sp = s.miss.sp;
    let mut top = sp;
    let mut limit = u64::MAX;
    for (k, t) in s.miss.resume_sps.into_iter().enumerate() {
        if t > limit {
            break;
        }
        if t > top {
            top = t;
        }
        if k == 1 {
            limit = top.saturating_add(COPY_SLACK);
        }
    }
    top.wrapping_sub(sp).min(UNWIND_ANCHORED_COPY_BYTES as u64)
}

/// How far past the second frame walked from an anchor a copy reaches for the later ones:
/// stale frames lie in the locals of one function, rarely larger, and copies reaching all
/// eight frames of deep Python stacks are larger than the rings need while tables build.
const COPY_SLACK: u64 = 1024;

/// Hash of the user stack of the current task, sending its frames if new.
#[inline(always)]
pub(crate) fn user_stack(ctx: &RetProbeContext, ring: &Ring, pid: u32, time: u64, token: u64) -> Option<u64> {
    if config!(user_stacks) == 0 {
        return None;
    }
    let python_hash = walk_python(pid);
    let scratch = scratch()?;
    scratch.walk_time = time;
    let seed = stack_hash_step(USER_STACK_SEED, pid as u64);
    let regs = UserRegs::of_return(ctx);
    let (user, hash) = walk_user(ctx.as_ptr(), scratch, pid, Some(regs), seed);
    // Not left for a later walk when this one ended before noting its anchors.
    scratch.walk_time = 0;
    let every = config!(test_interleave);
    if every != 0 && scratch.claim_seq % every == 0 {
        // Tests: another program's claim, and what it would write over.
        scratch.claim = 0;
        scratch.user_ips[0] = 0;
        scratch.walk_n = 0;
    }
    if scratch.claim != token {
        return walk_taken(ring, scratch, pid, regs.ip);
    }
    if user.n == 0 {
        return None;
    }
    if every != 0 && scratch.claim_seq % every == 1 {
        // Tests: the same, after the check, while the record is built.
        scratch.claim = 0;
        scratch.user_ips[0] = 0;
    }
    let (hash, user) = after_miss(ring, stack_hash_step(hash, python_hash), user);
    let user = UserPart { py_key: send_python_once(hash), ..user };
    if !send_stack_once(ctx.as_ptr(), ring, scratch, hash, pid, 0, user, token) {
        return walk_taken(ring, scratch, pid, regs.ip);
    }
    Some(hash)
}

/// Another program used the scratch while a walk ran: its frames and Python frames may be
/// that program's, and the anchors it noted too (this CPU's are dropped). Nor are the
/// other's to be trusted, if it is still under way (a preempted thread's): no token
/// matches the scratch's now. Sends the call site alone; returns its hash.
#[inline(always)]
fn walk_taken(ring: &Ring, scratch: &mut Scratch, pid: u32, ip: u64) -> Option<u64> {
    scratch.claim = INTERLEAVED_CLAIM;
    bump(counter::USER_WALKS_INTERLEAVED);
    if let Some(a) = ANCHORS.get_ptr_mut(this_cpu()) {
        // SAFETY: this CPU's value; plain data.
        let a = unsafe { &mut *a };
        a.n = 0;
        a.whole = 0;
        a.tid = 0;
        a.buf_n = [0; ANCHOR_BUFFERS];
        a.buf_tid = [0; ANCHOR_BUFFERS];
    }
    send_call_site_only(ring, pid, ip)
}

/// What no claim's token is (a token's low half counts from 1).
pub(crate) const INTERLEAVED_CLAIM: u64 = 0;

/// A stack of one frame, the allocation's call site (`ip`, the return address into the
/// caller), marked cut short, for a walk that cannot be trusted: built in the ring, not in
/// the scratch, and sent each time (rare), its frame as the configured walk writes its
/// own (an address in the address space, or a frame-pointer walk's raw address). Returns
/// its hash.
#[inline(always)]
fn send_call_site_only(ring: &Ring, pid: u32, ip: u64) -> Option<u64> {
    let hash = stack_hash_step(stack_hash_step(INTERLEAVED_SEED, pid as u64), ip);
    let header = |flags, asid| StackHeader {
        rtype: RecordType::Stack as u8,
        flags: flags | stack_flags::TRUNCATED,
        n_user: 1,
        pid,
        hash,
        asid,
        n_kernel: 0,
        _pad: 0,
        py_key: 0,
    };
    if config!(unwind_mode) == unwind_mode::FRAME_POINTERS {
        emit::<CallSiteFrame>(ring, |r| {
            r.header = header(0, 0);
            r.frame.status = UserFrame::BUILD_ID_IP;
            r.frame.offset_or_ip = ip;
        });
    } else {
        // SAFETY: plain integer value.
        let asid = unsafe { ASIDS.get(pid) }.copied().unwrap_or(0);
        emit::<CallSiteIp>(ring, |r| {
            r.header = header(stack_flags::USER_IPS, asid);
            r.ip = ip;
        });
    }
    Some(hash)
}

/// Seeds the hash of a [`send_call_site_only`] stack.
const INTERLEAVED_SEED: u64 = 0x696e_7465_726c_6576;

/// A stack record with one user frame, an address.
#[repr(C)]
#[derive(Clone, Copy)]
struct CallSiteIp {
    header: StackHeader,
    ip: u64,
}

/// A stack record with one user frame as a frame-pointer walk's.
#[repr(C)]
#[derive(Clone, Copy)]
struct CallSiteFrame {
    header: StackHeader,
    frame: UserFrame,
}

/// The kernel part of a kmem allocation's stack: its frames written after the header in
/// `scratch.record`, their count, and the stack hash so far (seeded with `pid`, closed by
/// the separator from the user part). None when kernel stacks are off.
#[inline(always)]
pub(crate) fn kernel_part(ctx: *mut c_void, pid: u32, seed: u64) -> Option<(usize, u64)> {
    if config!(kernel_stacks) == 0 {
        return None;
    }
    let scratch = scratch()?;
    let kernel_off = size_of::<StackHeader>();
    kstack::note_arguments(ctx);
    let reused = kstack::memtrace_kstack_taken(seed);
    if reused != 0 {
        scratch.kernel_n = reused as u32;
    } else {
        // SAFETY: kernel_off + KERNEL_FRAMES_BYTES <= STACK_RECORD_MAX.
        let n = unsafe {
            generated::bpf_get_stack(
                ctx,
                scratch.record.as_mut_ptr().add(kernel_off) as *mut c_void,
                KERNEL_FRAMES_BYTES as u32,
                0,
            )
        };
        let n_kernel = if n <= 0 { 0 } else { (n as usize / 8).min(MAX_STACK_DEPTH) };
        scratch.kernel_n = n_kernel as u32;
        kstack::memtrace_kstack_unwound(n_kernel as u64);
    }
    // Read back from memory either way: the two ways end in one state for the verifier,
    // and the hash below is verified once, not once per way.
    // SAFETY: a field of this CPU's scratch, just written.
    let n_kernel = unsafe { core::ptr::read_volatile(&scratch.kernel_n) } as usize & MAX_STACK_DEPTH;
    let mut hash = stack_hash_step(KERNEL_STACK_SEED, pid as u64);
    if n_kernel > 0 {
        // SAFETY: the kernel frames were just written (zero-padded) at kernel_off.
        hash = hash_words::<MAX_STACK_DEPTH>(hash, unsafe { scratch.record.as_ptr().add(kernel_off) } as *const u64);
    }
    // Separates the kernel part from the user part.
    Some((n_kernel, stack_hash_step(hash, u64::MAX)))
}

/// Sends a kernel stack with no user part (kernel frames already in `scratch.record`);
/// returns its hash, or None when it has no frames.
#[inline(always)]
pub(crate) fn kernel_only_stack(ctx: *mut c_void, ring: &Ring, pid: u32, n_kernel: usize, hash: u64) -> Option<u64> {
    if n_kernel == 0 {
        return None;
    }
    let scratch = scratch()?;
    let user = UserPart { n: 0, flags: stack_flags::KERNEL, with_copy: false, asid: 0, py_key: 0 };
    send_stack_once(ctx, ring, scratch, hash, pid, n_kernel, user, 0);
    Some(hash)
}

/// The user part of a kmem allocation's stack, continuing `hash`: the walk an earlier
/// allocation made in the same syscall window from the same registers when there is one
/// (see `syscall`), else a walk, kept for the next allocation of the window. A walk that
/// missed a rule is reused only while the copy sent with it stands for the rest (the
/// record refers to it: [`stack_flags::COPY_REPEAT`]).
#[inline(always)]
fn user_part_in_syscall(
    ctx: *mut c_void,
    scratch: &mut Scratch,
    pid: u32,
    regs: UserRegs,
    hash: u64,
) -> (UserPart, u64) {
    let key = [regs.ip, regs.sp, regs.bp, regs.hidden_return];
    // Compared word by word with no early exit: `==` on the arrays became a call of the
    // byte-at-a-time `memcmp`, run for every kmem event.
    let r = &scratch.reuse_regs;
    let same_regs = ((r[0] ^ key[0]) | (r[1] ^ key[1]) | (r[2] ^ key[2]) | (r[3] ^ key[3])) == 0;
    let window = syscall::current(scratch).unwrap_or(0);
    // Not for an allocation in an interrupt of another's (its level above the first): it
    // may come while that one's copy is still on its way to the ring.
    let copy_out = scratch.kernel_depth <= 1 && scratch.copy_seq == window && scratch.copy_hash != 0;
    if window != 0 && same_regs && (scratch.reuse_seq == window || copy_out) {
        bump(counter::UNWIND_REUSED);
        scratch.reuse_hash = hash_words::<MAX_USER_DEPTH>(hash, scratch.user_ips.as_ptr());
    } else {
        scratch.reuse_regs = key;
        let (user, hash) = walk_user(ctx, scratch, pid, Some(regs), hash);
        // The window is asked again, not kept across the walk: the walk is verified once,
        // not once per way here. A walk that missed a table is kept only through the copy
        // sent with it (`copy_seq`, set by `join_user_part` once it goes).
        scratch.reuse_seq =
            if user.flags & stack_flags::MISS == 0 { syscall::current(scratch).unwrap_or(0) } else { 0 };
        scratch.reuse_n = user.n as u32;
        scratch.reuse_flags = u32::from(user.flags);
        scratch.reuse_asid = user.asid;
        scratch.reuse_hash = hash;
    }
    // Read back from memory either way: the two ways end in one state for the verifier,
    // and what follows is verified once, not once per way (96k instructions, not 54k).
    // SAFETY: fields of this CPU's scratch, just written.
    let (n, flags, asid, hash) = unsafe {
        (
            core::ptr::read_volatile(&scratch.reuse_n),
            core::ptr::read_volatile(&scratch.reuse_flags),
            core::ptr::read_volatile(&scratch.reuse_asid),
            core::ptr::read_volatile(&scratch.reuse_hash),
        )
    };
    // A reused walk that missed stands on the copy sent with it (a walk just made cleared
    // `copy_seq`, a whole one had none): the record refers to it. (The window asked again,
    // as above.)
    let window = syscall::current(scratch).unwrap_or(0);
    // SAFETY: a field of this CPU's scratch.
    let repeat = window != 0 && unsafe { core::ptr::read_volatile(&scratch.copy_seq) } == window;
    let flags = if repeat { (flags as u8 & !stack_flags::MISS) | stack_flags::COPY_REPEAT } else { flags as u8 };
    (UserPart { n: (n as usize).min(MAX_USER_DEPTH), flags, with_copy: false, asid, py_key: 0 }, hash)
}

/// Joins the user stack of the task a kmem allocation ran for (and its Python frames) to
/// the kernel part already in `scratch.record`, and sends the whole stack once; returns
/// its hash, or None when neither part has frames.
#[inline(always)]
pub(crate) fn join_user_part(ctx: *mut c_void, ring: &Ring, pid: u32, n_kernel: usize, hash: u64) -> Option<u64> {
    let python_hash = walk_python(pid);
    let scratch = scratch()?;
    let regs = if config!(unwind_mode) != unwind_mode::FRAME_POINTERS { UserRegs::of_current_task() } else { None };
    let (user, hash) = match regs {
        Some(regs) => user_part_in_syscall(ctx, scratch, pid, regs, hash),
        None => walk_user(ctx, scratch, pid, None, hash),
    };
    if n_kernel == 0 && user.n == 0 {
        return None;
    }
    let hash = stack_hash_step(hash, python_hash);
    if user.flags & stack_flags::COPY_REPEAT != 0 {
        // Finished by the copy an earlier allocation of this syscall sent: a hash of its
        // own (its kernel part is its own), no copy.
        let hash = unique_hash(hash);
        let py_key = send_python_once(hash);
        memtrace_send_repeat(u64::from(pid), n_kernel as u64, hash, py_key);
        return Some(hash);
    }
    let (hash, user) = after_miss(ring, hash, user);
    if user.with_copy {
        // Later allocations of this window refer to it (`send_stack_once` takes it back
        // if it does not go out).
        scratch.copy_seq = syscall::current(scratch).unwrap_or(0);
        scratch.copy_hash = hash;
    }
    let py_key = send_python_once(hash);
    let user = UserPart { flags: user.flags | stack_flags::KERNEL, py_key, ..user };
    send_stack_once(ctx, ring, scratch, hash, pid, n_kernel, user, 0);
    Some(hash)
}

/// Sends the stack record of a kmem allocation whose user part is the walk in `user_ips`
/// that missed a rule, finished by the copy of record `copy_hash` (see
/// [`stack_flags::COPY_REPEAT`]): the header, the kernel frames already in `record`, the
/// user addresses and that hash. A global BPF function: checked once, on its own, and
/// out of the frames of the programs that call it.
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn memtrace_send_repeat(pid: u64, n_kernel: u64, hash: u64, py_key: u64) -> u64 {
    let Some(scratch) = scratch() else { return 0 };
    let Some(ring) = crate::ring::this_ring() else { return 0 };
    let n_kernel = (n_kernel as usize).min(MAX_STACK_DEPTH);
    let user_off = size_of::<StackHeader>() + n_kernel * 8;
    if user_off > USER_PART_MAX_OFF {
        return 0;
    }
    let n = (scratch.reuse_n as usize).min(MAX_USER_DEPTH);
    // SAFETY: user_off + USER_IPS_BYTES <= STACK_RECORD_MAX and the length is at most
    // USER_IPS_BYTES; the source is this CPU's scratch array.
    unsafe {
        generated::bpf_probe_read_kernel(
            scratch.record.as_mut_ptr().add(user_off) as *mut c_void,
            ((n * 8) as u32).min(USER_IPS_BYTES as u32),
            scratch.user_ips.as_ptr() as *const c_void,
        )
    };
    let len = user_off + n * 8;
    if len > MISS_MAX_OFF {
        return 0;
    }
    // SAFETY: len + 8 <= MISS_MAX_OFF + 8 <= STACK_RECORD_MAX, and 8-byte aligned: the
    // buffer is, and the header and every frame are whole words.
    unsafe { core::ptr::write(scratch.record.as_mut_ptr().add(len) as *mut u64, scratch.copy_hash) };
    let flags = (scratch.reuse_flags as u8 & !stack_flags::MISS) | stack_flags::COPY_REPEAT | stack_flags::KERNEL;
    let header = StackHeader {
        rtype: RecordType::Stack as u8,
        flags,
        n_user: n as u16,
        pid: pid as u32,
        hash,
        asid: scratch.reuse_asid,
        n_kernel: n_kernel as u16,
        _pad: 0,
        py_key,
    };
    // SAFETY: the record buffer starts with room for a header, 8-byte aligned.
    unsafe { core::ptr::write(scratch.record.as_mut_ptr() as *mut StackHeader, header) };
    let ring_ptr = ring as *const Ring as *mut c_void;
    // SAFETY: `len + 8` bytes of the per-CPU record buffer are initialised and in bounds.
    let ret = unsafe {
        generated::bpf_ringbuf_output(
            ring_ptr,
            scratch.record.as_mut_ptr() as *mut c_void,
            (len + 8) as u64,
            wakeup_flags(ring),
        )
    };
    if ret != 0 {
        bump(counter::LOST_STACKS);
    }
    0
}
