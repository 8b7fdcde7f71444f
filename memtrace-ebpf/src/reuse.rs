//! Reusing the outer frames of the thread's previous walk. Consecutive allocations of a
//! thread mostly share all but their innermost frames (an interpreter's evaluation loop,
//! `main`, a request handler), so a table walk that reaches a frame of the previous whole
//! walk on this CPU, the same return address at the same stack and frame pointers, takes
//! the frames above it from that walk instead of stepping through each with its rule:
//! each such frame's return address is still checked in its slot on the stack (one bulk
//! read serves many), which costs a fraction of a step (rule lookup, rule, reads). A frame
//! whose slot holds anything else ends the reuse and the walk goes on step by step.
//! Saved registers are not checked again: a caller whose frame is found from a restored
//! %rbp is taken where the previous walk found it, which is right unless every return
//! address above the meeting frame is unchanged while a saved %rbp between them is not.
use core::{ffi::c_void, ptr::addr_of_mut};

use aya_ebpf::helpers::generated;
use memtrace_common::{MAX_USER_DEPTH, counter, stack_hash_step};

use crate::{
    context::{scratch, this_cpu},
    maps::{ANCHOR_BUFFERS, ANCHORS},
    ring::bump_by,
    unwind::{memtrace_cover_window, still_in_slot},
};

/// Prepares the walk of thread `tid` in address space `asid` from `ip`, `sp`, `bp` to reuse
/// the frames of this CPU's previous walk, when that walk was the same thread's and
/// reached the outermost frame, and notes the buffer whose whole walk of the thread starts
/// at the same frame (`scratch.walk_repeat`; the previous walk's first). A global BPF
/// function: checked once.
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn memtrace_begin_reuse(tid: u64, asid: u64, ip: u64, sp: u64, bp: u64) -> u64 {
    let Some(scratch) = scratch() else { return 0 };
    scratch.walk_reuse = 0;
    scratch.walk_reuse_k = 1;
    scratch.walk_repeat = ANCHOR_BUFFERS as u32;
    let Some(a) = ANCHORS.get_ptr_mut(this_cpu()) else { return 0 };
    // SAFETY: this CPU's value; programs on one CPU do not run concurrently.
    let a = unsafe { &mut *a };
    let (good, cur) = a.good_cur();
    if cur == good {
        // Only in a value no walk ended in yet.
        a.cur = ((good + 1) & (ANCHOR_BUFFERS - 1)) as u32;
    }
    if a.whole != 0 && u64::from(a.tid) == tid && u64::from(a.asid) == asid && a.n > 1 {
        scratch.walk_reuse = 1;
        // A first frame that was a return address can be met again at the walk's own
        // first frame: the same allocation site called again from the same place, the
        // whole stack taken without a single step.
        if a.first_exact == 0 {
            scratch.walk_reuse_k = 0;
        }
    }
    let same = |j: usize| {
        a.buf_n[j] > 1
            && u64::from(a.buf_tid[j]) == tid
            && u64::from(a.buf_asid[j]) == asid
            && a.frames[j][0].ip == ip
            && a.frames[j][0].sp == sp
            && a.frames[j][0].bp == bp
    };
    if same(good) {
        scratch.walk_repeat = good as u32;
        return 0;
    }
    let mut j = 0;
    while j < ANCHOR_BUFFERS {
        if j != good && same(j) {
            scratch.walk_repeat = j as u32;
        }
        j += 1;
    }
    0
}

/// Frame `i` of the walk under way is at `ip`, `sp`, `bp`, and `hash` names the stack up
/// to it. When the previous walk had that frame too, its callers are checked on the stack
/// and, all found, appended: returns 1 with `scratch.walk_n` and `scratch.walk_reuse_hash`
/// set for the whole stack. Else 0, and the walk goes on step by step (after a check that
/// failed, without another try: the stacks part there). A global BPF function: checked
/// once, not once per state of the walk step.
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn memtrace_reuse_frames(i: u64, ip: u64, sp: u64, bp: u64, hash: u64) -> u64 {
    let Some(scratch) = scratch() else { return 0 };
    if scratch.walk_reuse == 0 {
        return 0;
    }
    let Some(a) = ANCHORS.get_ptr_mut(this_cpu()) else { return 0 };
    // SAFETY: this CPU's value; programs on one CPU do not run concurrently.
    let a = unsafe { &*a };
    let (good, cur) = a.good_cur();
    // The previous walk's frames go up the stack: skip those below this one (its first is
    // skipped when it was an exact instruction, not a return address: `begin_reuse`).
    let mut seek = Seek { k: scratch.walk_reuse_k, n: a.n, sp, good: good as u32, _pad: 0 };
    // SAFETY: seek_step is a BPF callback taking (index, ctx); ctx is our stack state.
    unsafe {
        generated::bpf_loop(MAX_USER_DEPTH as u32, seek_step as *mut c_void, addr_of_mut!(seek) as *mut c_void, 0)
    };
    scratch.walk_reuse_k = seek.k;
    let k = seek.k as usize;
    if seek.k >= a.n || k >= MAX_USER_DEPTH {
        scratch.walk_reuse = 0; // above the previous walk's outermost frame
        return 0;
    }
    let f = a.frames[good][k];
    if f.sp != sp || f.ip != ip || f.bp != bp {
        return 0;
    }
    scratch.walk_reuse = 0;
    let mut check = Check {
        from: seek.k + 1,
        to: i as u32 + 1,
        hash,
        top_sp: sp,
        good: good as u32,
        cur: cur as u32,
        ok: 1,
        _pad: 0,
    };
    // SAFETY: check_step is a BPF callback taking (index, ctx); ctx is our stack state.
    unsafe {
        generated::bpf_loop(MAX_USER_DEPTH as u32, check_step as *mut c_void, addr_of_mut!(check) as *mut c_void, 0)
    };
    if check.ok == 0 {
        return 0;
    }
    let Some(scratch) = crate::context::scratch() else { return 0 };
    bump_by(counter::UNWIND_FRAMES_REUSED, u64::from(check.to).wrapping_sub(i + 1));
    scratch.walk_n = check.to;
    scratch.walk_reuse_hash = check.hash;
    if check.top_sp > scratch.walk_top_sp {
        scratch.walk_top_sp = check.top_sp;
    }
    1
}

/// Looking for the previous walk's first frame at or above a stack pointer.
#[repr(C)]
struct Seek {
    k: u32,
    n: u32,
    sp: u64,
    good: u32,
    _pad: u32,
}

#[inline(never)]
extern "C" fn seek_step(_index: u64, state: *mut c_void) -> i64 {
    // SAFETY: bpf_loop hands back the pointer to the Seek on the caller's stack.
    let s = unsafe { &mut *(state as *mut Seek) };
    let Some(a) = ANCHORS.get_ptr_mut(this_cpu()) else { return 1 };
    // SAFETY: this CPU's value; programs on one CPU do not run concurrently.
    let a = unsafe { &*a };
    let k = s.k as usize;
    if s.k >= s.n || k >= MAX_USER_DEPTH || a.frames[s.good as usize & (ANCHOR_BUFFERS - 1)][k].sp >= s.sp {
        return 1;
    }
    s.k += 1;
    0
}

/// Checking the previous walk's frames from `from` on against the stack and appending
/// them to the walk under way at `to`.
#[repr(C)]
struct Check {
    from: u32,
    to: u32,
    hash: u64,
    top_sp: u64,
    /// The previous walk's buffer, and the walk under way's.
    good: u32,
    cur: u32,
    /// 0: a return address was not in its slot, or the depth bound was reached.
    ok: u32,
    _pad: u32,
}

#[inline(never)]
extern "C" fn check_step(_index: u64, state: *mut c_void) -> i64 {
    // SAFETY: bpf_loop hands back the pointer to the Check on the caller's stack.
    let c = unsafe { &mut *(state as *mut Check) };
    let Some(a) = ANCHORS.get_ptr_mut(this_cpu()) else {
        c.ok = 0;
        return 1;
    };
    // SAFETY: this CPU's value; programs on one CPU do not run concurrently.
    let a = unsafe { &mut *a };
    if c.from >= a.n {
        return 1; // all there
    }
    let (from, to) = (c.from as usize, c.to as usize);
    if from >= MAX_USER_DEPTH || to >= MAX_USER_DEPTH {
        c.ok = 0;
        return 1;
    }
    let (good, cur) = (c.good as usize & (ANCHOR_BUFFERS - 1), c.cur as usize & (ANCHOR_BUFFERS - 1));
    let frame = a.frames[good][from];
    let (ip, sp) = (frame.ip, frame.sp);
    let Some(scratch) = still_in_slot(ip, sp) else {
        c.ok = 0;
        return 1;
    };
    scratch.user_ips[to] = ip;
    a.frames[cur][to] = frame;
    c.hash = stack_hash_step(c.hash, ip);
    c.top_sp = sp;
    c.from += 1;
    c.to += 1;
    0
}

/// The thread's stack exactly as one of its last walks on this CPU found it (the buffer
/// `begin_reuse` noted): the first frame at the same return address, stack and frame
/// pointers (so the same function, at the same depth, called from the same place), and
/// every caller's return address still in its slot. Then the frames and hash come from
/// that walk, `scratch.walk_n` and `scratch.walk_reuse_hash` are set, the buffer becomes
/// the newest (its anchors still true) and 1 is returned; else 0, and the walk goes on as
/// usual. The same check as [`memtrace_reuse_frames`] at the first frame, without the
/// walk's steps around it: most allocations of a loop or a request handler come from one
/// of a few places again and again. `hash` names the stack before its first frame. A
/// global BPF function: checked once.
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn memtrace_repeat_walk(ip: u64, hash: u64) -> u64 {
    let Some(scratch) = scratch() else { return 0 };
    let j = scratch.walk_repeat as usize;
    if j >= ANCHOR_BUFFERS {
        return 0;
    }
    let Some(a) = ANCHORS.get_ptr_mut(this_cpu()) else { return 0 };
    // SAFETY: this CPU's value; programs on one CPU do not run concurrently.
    let a = unsafe { &mut *a };
    let j = j & (ANCHOR_BUFFERS - 1);
    let n = a.buf_n[j];
    if n < 2 || n as usize > MAX_USER_DEPTH {
        return 0;
    }
    // Every slot in one read when they lie within a window of each other (a whole window:
    // reading just the span they cover measured slower).
    // The index read back from memory: knowing n's range, LLVM turned the bounds test into
    // arithmetic the verifier could not bound.
    // SAFETY: a volatile read of a local.
    let last = unsafe { core::ptr::read_volatile(&(n as usize - 1)) };
    let top = a.frames[j].get(last).map_or(0, |f| f.sp);
    memtrace_cover_window(a.frames[j][1].sp.wrapping_sub(8), top);
    // The first index (1) comes from the map value, unknown to the verifier: a constant
    // would be followed through every step, a new state each, never converging.
    // SAFETY: a volatile read of a field of this CPU's scratch value.
    let first = unsafe { core::ptr::read_volatile(&scratch.walk_zero) } + 1;
    let mut r = Repeat { i: first, n, hash: stack_hash_step(hash, ip), buf: j as u32, ok: 1 };
    // SAFETY: repeat_step is a BPF callback taking (index, ctx); ctx is our stack state.
    unsafe {
        generated::bpf_loop(MAX_USER_DEPTH as u32, repeat_step as *mut c_void, addr_of_mut!(r) as *mut c_void, 0)
    };
    if r.ok == 0 {
        // The stacks part somewhere above the first frame: when that was the previous
        // walk, the walk's reuse tries from its second frame on, not this check again.
        if let Some(scratch) = crate::context::scratch()
            && j == a.good_cur().0
        {
            scratch.walk_reuse_k = 1;
        }
        return 0;
    }
    let Some(scratch) = crate::context::scratch() else { return 0 };
    scratch.user_ips[0] = ip;
    bump_by(counter::UNWIND_FRAMES_REUSED, u64::from(n) - 1);
    scratch.walk_n = n;
    scratch.walk_reuse_hash = r.hash;
    let time = match core::mem::replace(&mut scratch.walk_time, 0) {
        // SAFETY: no preconditions.
        0 => unsafe { generated::bpf_ktime_get_ns() },
        t => t,
    };
    // The buffer's walk is the thread's last now, whole.
    a.tid = a.buf_tid[j];
    a.asid = a.buf_asid[j];
    a.n = n;
    a.whole = 1;
    a.first_exact = 0;
    a.make_newest(j, time);
    1
}

/// Checking the previous walk's frames from the second on against the stack.
#[repr(C)]
struct Repeat {
    i: u32,
    n: u32,
    hash: u64,
    /// The buffer of the walk repeated.
    buf: u32,
    /// 0: a return address was not in its slot.
    ok: u32,
}

#[inline(never)]
extern "C" fn repeat_step(_index: u64, state: *mut c_void) -> i64 {
    // SAFETY: bpf_loop hands back the pointer to the Repeat on the caller's stack.
    let r = unsafe { &mut *(state as *mut Repeat) };
    let i = r.i as usize;
    if r.i >= r.n || i >= MAX_USER_DEPTH {
        return 1; // all there
    }
    let Some(a) = ANCHORS.get_ptr_mut(this_cpu()) else {
        r.ok = 0;
        return 1;
    };
    // SAFETY: this CPU's value; programs on one CPU do not run concurrently.
    let a = unsafe { &*a };
    let buf = r.buf as usize & (ANCHOR_BUFFERS - 1);
    let (ip, sp) = (a.frames[buf][i].ip, a.frames[buf][i].sp);
    let Some(scratch) = still_in_slot(ip, sp) else {
        r.ok = 0;
        return 1;
    };
    scratch.user_ips[i] = ip;
    r.hash = stack_hash_step(r.hash, ip);
    r.i += 1;
    0
}
