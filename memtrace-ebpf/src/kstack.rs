//! Kernel stacks without the kernel's unwinder, for a path seen before. The kernel's
//! unwinder (ORC, behind `bpf_get_stack`) is most of what a kmem event costs, ~3 µs, for
//! stacks that repeat (a `pipe()` makes the same nine allocations on every call). An
//! unwind is a function of the return addresses on the task's kernel stack: from the same
//! place, the same addresses in the same slots give the same frames. So a path's first
//! unwind is kept with the slot of each frame's return address, found on the stack
//! (`learn`), and the next event of the same allocation kind, call site and syscall reads
//! its stack once and, when every slot of a kept path holds that path's address, takes the
//! kept frames (`memtrace_kstack_taken`). Else the stack is unwound and learned too; each
//! key keeps [`KSTACK_WAYS`] paths (one call site reached several ways in one syscall).
//!
//! Slots are counted from the tracepoint's arguments (on the stack of `bpf_trace_runN`),
//! except the outermost frame's, counted from the task's user registers: the syscall entry
//! moves the rest of the stack by a random offset on every call
//! (`CONFIG_RANDOMIZE_KSTACK_OFFSET`), between its own frame and the next.
//!
//! A slot is found by value. The outermost frame's is the highest word holding its
//! address (just below the user registers); the others', the lowest word holding each
//! address above the previous frame's, from the arguments up: above a slot, in the
//! syscall's random offset, lie copies left by earlier calls that ran higher; below one,
//! mostly copies the path itself made (a caller's `_RET_IP_` kept on the stack), which
//! hold the same value whenever the slot does. A stale copy would not, so one reuse in
//! [`KSTACK_CHECK_EVERY`] on each CPU is unwound anyway and compared, and a
//! key caught differing is always unwound from then on (counted, and reported). The frames
//! below the arguments (the probe's own: the helper, the program, `bpf_trace_runN`) are
//! not read; they are the same for every event of a tracepoint, whose kind is in the key.
//! Interrupt stacks, stacks of [`KSTACK_FRAMES`] frames or more or deeper than 16 KiB, and
//! paths whose frames are not all found are always unwound.
use core::{
    ffi::c_void,
    mem::size_of,
    ptr::{addr_of, addr_of_mut, read_volatile, write_volatile},
};

use aya_ebpf::{bindings::pt_regs, helpers::generated};
use memtrace_common::{KSTACK_CHECK_EVERY, MAX_STACK_DEPTH, StackHeader, counter, stack_hash_step};

use crate::{
    context::{read_kernel_at, read_kernel_u64, scratch},
    maps::{KSTACK_WORK, KSTACKS},
    ring::bump,
};

/// Frames of a kernel stack kept: fewer than this.
pub(crate) const KSTACK_FRAMES: usize = 64;
/// Paths kept per key.
pub(crate) const KSTACK_WAYS: usize = 4;
/// Words of stack read: a whole task stack (16 KiB on x86-64).
pub(crate) const WINDOW_WORDS: usize = 2048;
const WINDOW_BYTES: u64 = (WINDOW_WORDS * 8) as u64;
/// The probe's own frames below the tracepoint's arguments, at most.
const INNER_FRAMES_MAX: u32 = 4;
/// The slot of a frame below the arguments.
const NOT_READ: u16 = u16::MAX;
/// Failed learns after which a key with no path kept stops learning.
const LEARN_TRIES: u32 = 64;
/// The outermost frame's slot lies this close below the user registers at most (the
/// entry's call of `do_syscall_64` or of an exception handler: 1 word), above the
/// syscall's random offset; a path whose outermost frame is elsewhere (a truncated
/// unwind) is not kept.
const TOP_SLOT_MAX: u64 = 4;
const _: () = assert!(KSTACK_CHECK_EVERY.is_power_of_two() && WINDOW_WORDS.is_power_of_two());
const _: () = assert!(KSTACK_FRAMES.is_power_of_two() && KSTACK_WAYS.is_power_of_two());
const _: () = assert!(KSTACK_FRAMES <= MAX_STACK_DEPTH);

/// A kernel stack kept: its frames and where each frame's return address lies.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct KStack {
    /// Frames; 0: none kept in this way.
    pub(crate) n: u32,
    pub(crate) _pad: u32,
    /// Words from the user registers down to the outermost frame's slot.
    pub(crate) top_slot: u32,
    /// Even while the way is whole; odd while a CPU writes it (a sequence count: a reader
    /// that copied it between two equal even readings has a whole copy).
    pub(crate) seq: u32,
    /// Word of each other frame's return address, from the arguments ([`NOT_READ`] for
    /// the probe's own frames below them).
    pub(crate) slots: [u16; KSTACK_FRAMES],
    /// The frames, zero after the last.
    pub(crate) ips: [u64; KSTACK_FRAMES],
}

/// The paths kept for one key.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct KStackSet {
    /// The way the next path learned goes into.
    pub(crate) next: u32,
    /// Learns that found no path (the key stops learning after [`LEARN_TRIES`]).
    pub(crate) failed: u32,
    /// 1: a reuse was caught differing from an unwind; the key is always unwound.
    pub(crate) differed: u32,
    pub(crate) _pad: u32,
    pub(crate) ways: [KStack; KSTACK_WAYS],
}

/// Per-CPU working space: the stack read, the place and key of the event under way, and
/// the set being learned when its key has none yet.
#[repr(C)]
pub(crate) struct KStackWork {
    pub(crate) win: [u64; WINDOW_WORDS],
    pub(crate) fresh: KStackSet,
    /// This CPU's copy of the way being matched (and then taken or compared): other CPUs
    /// may write the map's meanwhile.
    pub(crate) cand: KStack,
    /// The tracepoint's arguments and the task's user registers, as numbers.
    pub(crate) base: u64,
    pub(crate) top: u64,
    pub(crate) key: u64,
    /// What follows an unwind (`Then`).
    pub(crate) then: u32,
    /// Reuses on this CPU, for [`KSTACK_CHECK_EVERY`].
    pub(crate) ticks: u32,
}

/// What `memtrace_kstack_unwound` does with the frames just unwound.
#[repr(u32)]
enum Then {
    /// Nothing (no place for this event, or a key always unwound).
    Nothing = 0,
    /// Learn them for the key.
    Learn = 1,
    /// Compare them with the way copied to `KStackWork::cand`, whose slots all matched.
    Compare = 2,
}

/// `i` as a frame index, masked where the verifier sees it (the compiler drops a mask it
/// can prove needless, and indexes with a register the verifier knows less of).
#[inline(always)]
fn masked(i: usize) -> usize {
    // SAFETY: a volatile read of a local.
    unsafe { read_volatile(&i) & (KSTACK_FRAMES - 1) }
}

#[inline(always)]
fn work() -> Option<&'static mut KStackWork> {
    // SAFETY: per-CPU value, used by one program at a time on this CPU.
    KSTACK_WORK.get_ptr_mut(0).map(|p| unsafe { &mut *p })
}

#[inline(always)]
fn set_of(key: u64) -> Option<&'static mut KStackSet> {
    // SAFETY: a map value pointer, used while this program runs.
    KSTACKS.get_ptr_mut(key).map(|p| unsafe { &mut *p })
}

/// `p` as a number (a pointer stored in a map value reads back as a scalar; the programs
/// load with the privilege that allows it).
#[inline(always)]
fn as_number<T>(slot: &mut u64, p: *const T) -> u64 {
    // SAFETY: volatile accesses to a field of this CPU's work space.
    unsafe {
        write_volatile(slot, p as u64);
        read_volatile(slot)
    }
}

/// Notes where the kmem event's tracepoint arguments `ctx` lie, for [`memtrace_kstack_taken`].
#[inline(always)]
pub(crate) fn note_arguments(ctx: *mut c_void) {
    if let Some(w) = work() {
        as_number(&mut w.base, ctx);
    }
}

/// For the kmem event whose arguments were noted, with key seed `seed` (kind and call
/// site): when a path kept for its key is on the stack again, writes its frames to
/// `scratch.record` after the header and returns their count. Else 0: the caller unwinds
/// and calls [`memtrace_kstack_unwound`]. A global BPF function: checked once.
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn memtrace_kstack_taken(seed: u64) -> u64 {
    let Some(w) = work() else { return 0 };
    w.then = Then::Nothing as u32;
    if config!(kernel_stack_reuse) == 0 {
        return 0;
    }
    // SAFETY: both helpers take the current task, which stays valid while we run.
    let regs = unsafe { generated::bpf_task_pt_regs(generated::bpf_get_current_task_btf()) } as *const pt_regs;
    if regs.is_null() {
        return 0;
    }
    let base = w.base;
    let top = as_number(&mut w.top, regs);
    // The arguments must lie on the task's stack, below its user registers (not on an
    // interrupt stack).
    // SAFETY: no preconditions; the task stays valid while this program runs.
    let task = unsafe { generated::bpf_get_current_task() };
    let Some(bottom) = read_kernel_at::<u64>(task, config!(kernel.task_stack)) else { return 0 };
    if base < bottom || base >= top || top - base >= WINDOW_BYTES || top - base < 8 {
        return 0;
    }
    // SAFETY: a field address only; the read is checked.
    let syscall = read_kernel_u64(unsafe { addr_of!((*regs).orig_rax) }).unwrap_or(u64::MAX);
    let key = stack_hash_step(seed, syscall);
    w.key = key;
    let Some(set) = set_of(key) else {
        w.then = Then::Learn as u32;
        return 0;
    };
    if set.differed != 0 {
        return 0;
    }
    if set.failed < LEARN_TRIES || set.ways.iter().any(|way| way.n != 0) {
        w.then = Then::Learn as u32;
    }
    // The stack from the arguments up to the highest slot but the outermost of any path
    // kept (the outermost lies above the syscall entry's random offset: read apart).
    let depth = (top - base) / 8;
    let mut reach = 0u64;
    for kept in &set.ways {
        let n = kept.n as usize;
        if (2..KSTACK_FRAMES).contains(&n) {
            // SAFETY: `masked` keeps the index below KSTACK_FRAMES.
            let highest = u64::from(unsafe { *kept.slots.get_unchecked(masked(n - 2)) }) + 1;
            if highest > reach && highest <= depth {
                reach = highest;
            }
        }
    }
    if reach == 0 {
        return 0;
    }
    // SAFETY: at most WINDOW_BYTES bytes into the window; the source read is checked.
    let ret = unsafe {
        generated::bpf_probe_read_kernel(
            w.win.as_mut_ptr() as *mut c_void,
            (reach * 8) as u32 & (WINDOW_BYTES as u32 - 1),
            base as *const c_void,
        )
    };
    if ret != 0 {
        return 0;
    }
    let mut found = KSTACK_WAYS;
    for way in 0..KSTACK_WAYS {
        if set.ways[way].n != 0 && copy_way(&mut w.cand, &set.ways[way]) && matches(w, top, depth.min(reach)) {
            found = way;
            break;
        }
    }
    if found == KSTACK_WAYS {
        return 0;
    }
    w.ticks = w.ticks.wrapping_add(1);
    if w.ticks & (KSTACK_CHECK_EVERY - 1) == 0 {
        w.then = Then::Compare as u32;
        return 0;
    }
    w.then = Then::Nothing as u32;
    let Some(scratch) = scratch() else { return 0 };
    let kept = &w.cand;
    let n = (kept.n as u64).min(KSTACK_FRAMES as u64 - 1);
    // SAFETY: the frames and the zero after them, at most KSTACK_FRAMES words, from the
    // kept path into the record after its header, which has room for MAX_STACK_DEPTH >=
    // KSTACK_FRAMES frames there.
    unsafe {
        generated::bpf_probe_read_kernel(
            scratch.record.as_mut_ptr().add(size_of::<StackHeader>()) as *mut c_void,
            ((n as u32 + 1) * 8).min((KSTACK_FRAMES * 8) as u32),
            addr_of!(kept.ips) as *const c_void,
        )
    };
    bump(counter::KSTACKS_REUSED);
    n
}

/// Copies `way` into `to` whole: false while a CPU is writing it.
#[inline(always)]
fn copy_way(to: &mut KStack, way: &KStack) -> bool {
    // SAFETY: volatile reads of a field of a map value.
    let before = unsafe { read_volatile(&way.seq) };
    if before & 1 != 0 {
        return false;
    }
    // SAFETY: one kept path from the map value into this CPU's work space.
    let ret = unsafe {
        generated::bpf_probe_read_kernel(
            to as *mut KStack as *mut c_void,
            size_of::<KStack>() as u32,
            way as *const KStack as *const c_void,
        )
    };
    // SAFETY: as above.
    ret == 0 && unsafe { read_volatile(&way.seq) } == before
}

/// Whether the way copied to `w.cand` is a path whose every slot holds its address: the
/// outermost read below the user registers at `top`, the others in the window's `words`
/// words.
#[inline(always)]
fn matches(w: &KStackWork, top: u64, words: u64) -> bool {
    let kept = &w.cand;
    let n = kept.n as usize;
    if !(2..KSTACK_FRAMES).contains(&n) || kept.top_slot == 0 {
        return false;
    }
    let outer = top.wrapping_sub(u64::from(kept.top_slot) * 8);
    // SAFETY: a checked read of a word of the task's stack.
    // SAFETY: `masked` keeps the index below KSTACK_FRAMES.
    if read_kernel_u64(outer as *const u64) != Some(unsafe { *kept.ips.get_unchecked(masked(n - 1)) }) {
        return false;
    }
    // The frames below the arguments are marked by their slot, not counted: a test of
    // `i >= first` would refine `first` once per frame for the verifier, and its states
    // would not merge.
    for i in 0..KSTACK_FRAMES - 1 {
        if i + 1 >= n {
            break;
        }
        let slot = kept.slots[i];
        if slot != NOT_READ && (u64::from(slot) >= words || w.win[slot as usize & (WINDOW_WORDS - 1)] != kept.ips[i]) {
            return false;
        }
    }
    true
}

/// After an unwind of `n` frames into `scratch.record` (after the header, zero-padded):
/// learns them for the event's key, or compares them with the path that was to be taken.
/// A global BPF function: checked once.
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn memtrace_kstack_unwound(n: u64) -> u64 {
    let Some(w) = work() else { return 0 };
    // Read at once: a kmem event in an interrupt on this CPU may run its own programs
    // before this one ends (and leaves `then` at Nothing for a later one).
    let (then, base, top, key) = (w.then, w.base, w.top, w.key);
    w.then = Then::Nothing as u32;
    let Some(scratch) = scratch() else { return 0 };
    // SAFETY: the record has room for MAX_STACK_DEPTH >= KSTACK_FRAMES frames after its
    // header.
    let frames = unsafe { scratch.record.as_ptr().add(size_of::<StackHeader>()) } as *const u64;
    let n = n as usize;
    if then == Then::Compare as u32 {
        let Some(set) = set_of(key) else { return 0 };
        let kept = &w.cand;
        let mut same = kept.n as usize == n;
        // Stopping at the first difference or at `n` keeps the verifier's states to one a
        // frame (a test of `i < n` that goes on refines `n` once per frame).
        for i in 0..KSTACK_FRAMES {
            if !same || i >= n {
                break;
            }
            // SAFETY: i < KSTACK_FRAMES, within the record's frames.
            if kept.ips[i] != unsafe { *frames.add(i) } {
                same = false;
            }
        }
        if same {
            bump(counter::KSTACKS_CHECKED);
        } else {
            bump(counter::KSTACKS_DIFFERED);
            set.differed = 1;
        }
    } else if then == Then::Learn as u32 {
        learn(w, frames, n, base, top, key);
    }
    0
}

/// Finds the slots of the `n` frames just unwound on the stack and keeps them for the key,
/// in the key's next way (or counts a failed learn).
#[inline(always)]
fn learn(w: &mut KStackWork, frames: *const u64, n: usize, base: u64, top: u64, key: u64) {
    let depth = top.wrapping_sub(base) / 8;
    let existing = set_of(key);
    if existing.is_none() {
        // A way with no frames is skipped whatever else it holds.
        w.fresh.differed = 0;
        for way in 0..KSTACK_WAYS {
            w.fresh.ways[way].n = 0;
            w.fresh.ways[way].seq = 0;
        }
    }
    let entry = &mut w.fresh.ways[0];
    entry.n = 0;
    // SAFETY: KSTACK_FRAMES words of the caller's buffer into the entry's frames.
    unsafe {
        generated::bpf_probe_read_kernel(
            addr_of_mut!(entry.ips) as *mut c_void,
            (KSTACK_FRAMES * 8) as u32,
            frames as *const c_void,
        )
    };
    if (2..KSTACK_FRAMES).contains(&n) && (1..WINDOW_WORDS as u64).contains(&depth) {
        // The window holds the stack from the arguments up (read by the taken check, or
        // not yet when the key is new).
        // SAFETY: at most WINDOW_BYTES bytes into the window; the source read is checked.
        let ret = unsafe {
            generated::bpf_probe_read_kernel(
                w.win.as_mut_ptr() as *mut c_void,
                (depth * 8) as u32 & (WINDOW_BYTES as u32 - 1),
                base as *const c_void,
            )
        };
        if ret == 0 {
            let mut scan = Scan { word: depth as u32, frame: n as u32 - 1, all: 0, _pad: 0 };
            // SAFETY: scan_step is a BPF callback taking (index, ctx); ctx is our stack state.
            unsafe {
                generated::bpf_loop(WINDOW_WORDS as u32, scan_step as *mut c_void, addr_of_mut!(scan) as *mut c_void, 0)
            };
            // Frames n-1 down to `scan.frame + 1` were found; those below were not (below the
            // arguments), unless all were.
            let first = if scan.all != 0 { 0 } else { scan.frame + 1 };
            // SAFETY: `masked` keeps the index below KSTACK_FRAMES.
            let outer = u64::from(unsafe { *entry.slots.get_unchecked(masked(n - 1)) });
            if first <= INNER_FRAMES_MAX
                && first + 1 < n as u32
                && outer < depth
                && depth - outer <= TOP_SLOT_MAX
                && place_rising(first, n as u32, outer as u32)
            {
                for i in 0..INNER_FRAMES_MAX as usize {
                    if i >= first as usize {
                        break;
                    }
                    entry.slots[i] = NOT_READ;
                }
                entry.n = n as u32;
                entry.top_slot = (depth - outer) as u32;
            }
        }
    }
    let learned = entry.n != 0;
    match existing {
        Some(set) => {
            if learned {
                let way = set.next as usize & (KSTACK_WAYS - 1);
                set.next = set.next.wrapping_add(1);
                let kept = &mut set.ways[way];
                // Odd while written (see `copy_way`), the copy's included.
                // SAFETY: volatile accesses to a field of a map value.
                let seq = unsafe { read_volatile(&kept.seq) } | 1;
                // SAFETY: as above.
                unsafe { write_volatile(&mut kept.seq, seq) };
                w.fresh.ways[0].seq = seq;
                // SAFETY: one kept path from this CPU's work space into the map value.
                unsafe {
                    generated::bpf_probe_read_kernel(
                        kept as *mut KStack as *mut c_void,
                        size_of::<KStack>() as u32,
                        addr_of!(w.fresh.ways[0]) as *const c_void,
                    )
                };
                // SAFETY: as above.
                unsafe { write_volatile(&mut kept.seq, seq.wrapping_add(1)) };
            } else {
                set.failed = set.failed.saturating_add(1);
            }
        }
        None => {
            w.fresh.next = 1;
            w.fresh.failed = u32::from(!learned);
            // Borrowed: by value, the set (2.6 KiB) would be copied onto the 512-byte stack.
            #[allow(clippy::needless_borrows_for_generic_args)]
            let _ = KSTACKS.insert(key, &w.fresh, 0);
        }
    }
}

/// Places frames `first` to `n - 2` again, looking up the stack from the arguments: each
/// at the lowest word holding its address above the previous one's, below the outermost
/// frame's slot. The look down that found `first` and the outermost slot takes the highest
/// word, and the syscall's random offset, between the outermost frame and the rest, holds
/// copies left there by earlier calls that ran higher; copies below a slot are mostly the
/// path's own (a caller's `_RET_IP_` kept on the stack), which hold the same address
/// whenever the slot does. Whether every frame was placed.
#[inline(always)]
fn place_rising(first: u32, n: u32, outer: u32) -> bool {
    let mut rise = Rise { word: 0, frame: first, last: n - 1, words: outer };
    // SAFETY: rise_step is a BPF callback taking (index, ctx); ctx is our stack state.
    unsafe { generated::bpf_loop(WINDOW_WORDS as u32, rise_step as *mut c_void, addr_of_mut!(rise) as *mut c_void, 0) };
    rise.frame == rise.last
}

/// Looking up the stack for the frames' return addresses, innermost first.
#[repr(C)]
struct Rise {
    /// The next word of the window to look at.
    word: u32,
    /// The frame looked for.
    frame: u32,
    /// The outermost frame (not looked for).
    last: u32,
    /// The outermost frame's slot: the words looked at end there.
    words: u32,
}

#[inline(never)]
extern "C" fn rise_step(_index: u64, state: *mut c_void) -> i64 {
    // SAFETY: bpf_loop hands back the pointer to the Rise on the caller's stack.
    let s = unsafe { &mut *(state as *mut Rise) };
    let Some(w) = work() else { return 1 };
    if s.frame >= s.last || s.word >= s.words {
        return 1;
    }
    let word = s.word as usize & (WINDOW_WORDS - 1);
    s.word += 1;
    let frame = s.frame as usize & (KSTACK_FRAMES - 1);
    let entry = &mut w.fresh.ways[0];
    if w.win[word] != entry.ips[frame] {
        return 0;
    }
    entry.slots[frame] = word as u16;
    s.frame += 1;
    0
}

/// Looking down the stack for the frames' return addresses, outermost first.
#[repr(C)]
struct Scan {
    /// Words of the window not looked at yet (the next is `word - 1`).
    word: u32,
    /// The frame looked for.
    frame: u32,
    /// 1: every frame was found. (No count of them: a count known at each step would
    /// keep the verifier from seeing the steps converge.)
    all: u32,
    _pad: u32,
}

#[inline(never)]
extern "C" fn scan_step(_index: u64, state: *mut c_void) -> i64 {
    // SAFETY: bpf_loop hands back the pointer to the Scan on the caller's stack.
    let s = unsafe { &mut *(state as *mut Scan) };
    let Some(w) = work() else { return 1 };
    if s.word == 0 {
        return 1;
    }
    s.word -= 1;
    let frame = s.frame as usize & (KSTACK_FRAMES - 1);
    let entry = &mut w.fresh.ways[0];
    if w.win[s.word as usize & (WINDOW_WORDS - 1)] != entry.ips[frame] {
        return 0;
    }
    entry.slots[frame] = s.word as u16;
    if s.frame == 0 {
        s.all = 1;
        return 1;
    }
    s.frame -= 1;
    0
}
