//! Python frames at an allocation: for a process whose interpreter userspace described in
//! [`PY_PROCS`], the thread's `PyThreadState` is found through the pthread key CPython
//! keeps it under (glibc's `pthread_getspecific`, read from the thread's fsbase: right
//! whether or not the thread holds the GIL), and its frame chain is walked one frame per
//! `bpf_loop` step, reading a KiB at a time (a frame and, on 3.11+, the callers below it
//! on the thread's data stack). Each frame gives its code object and instruction index;
//! the frame that started a C call of the evaluation loop is marked, so userspace can put
//! each group of frames in place of its `_PyEval_EvalFrameDefault`. The first time a
//! process's new stack shows a code object, its names and line table are sent too
//! ([`PyCodeRecord`]): code objects of modules being imported, and whole processes, are
//! often gone by the time userspace reads the ring. A repeat stack is known by its hash,
//! and a code object's check is read once per few milliseconds ([`code_check`]).
use core::{ffi::c_void, mem::size_of, ptr::addr_of_mut};

use aya_ebpf::{
    bindings::BPF_NOEXIST,
    helpers::{bpf_get_current_task, generated},
};
use memtrace_common::{
    RecordType, counter,
    python::{
        MAX_PY_FRAMES, PY_LINETABLE_LEN, PY_NONE, PY_SHARED_SEED, PyCodeRecord, PyFrame, PyProcInfo, PyStackHeader,
        py_frame_flags,
    },
    stack_hash_step,
};

use crate::{
    context::{pid_tgid, read_kernel_at, read_user_u64, scratch},
    maps::{CachedCheck, PY_CHECK_SLOTS, PY_CHECKS, PY_CODES_SENT, PY_PROCS, PY_SENT, PyCodeKey, Ring, STACKS_SENT},
    ring::{bump, emit_deciding, this_ring, wakeup_flags},
};

/// Bytes of a frame the walk needs: every field on 3.10 (`f_lasti` at 96) and later
/// versions (the first 72 bytes).
pub(crate) const PY_FRAME_READ: usize = 104;
/// Bytes read at once, ending with a frame's: its callers' frames below it come with it.
pub(crate) const PY_WINDOW: usize = 1024;
/// Seeds the hash of a stack's Python frames.
const PY_STACK_SEED: u64 = 0x5079_7468_6f6e_0001;
/// Frames the owner test may skip on top of the frames kept (3.12+ entry frames).
const MAX_STEPS: u32 = MAX_PY_FRAMES as u32 * 2;

/// How long a code object's check read by one walk is trusted by later walks on the CPU.
const CHECK_TRUSTED_NS: u64 = 4_000_000;

/// The walk's state between `bpf_loop` steps (the frame count is in the scratch map).
#[repr(C)]
struct Walk {
    info: PyProcInfo,
    frame: u64,
    hash: u64,
    /// When the walk started.
    now: u64,
    tgid: u32,
    _pad: u32,
}

/// Walks the current thread's Python frames into `scratch.py_frames` when its process runs
/// an interpreter userspace described; returns their hash (a constant when there are
/// none). The count and whether the depth bound cut the walk stay in the scratch map.
#[inline(always)]
pub(crate) fn walk_python(tgid: u32) -> u64 {
    memtrace_walk_python(u64::from(tgid))
}

/// The walk as a global BPF function: the verifier checks it once, on its own, whatever
/// state each program calls it in, and sees one unknown value come out (inlined, its ways
/// out multiplied the checking of the rest of every program that walks stacks).
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn memtrace_walk_python(tgid: u64) -> u64 {
    let Some(s) = scratch() else { return 0 };
    // Word by word: adjacent zeroed fields became a call of the byte-at-a-time `memset`,
    // run for every allocation.
    // SAFETY (the four writes): fields of this CPU's scratch value.
    unsafe {
        core::ptr::write_volatile(&mut s.py_n, 0);
        core::ptr::write_volatile(&mut s.py_cut, 0);
        core::ptr::write_volatile(&mut s.py_hash, 0);
        core::ptr::write_volatile(&mut s.py_win_len, 0);
    }
    // Most processes run no interpreter: known without a lookup.
    if !crate::unwind::process_facts(s, tgid as u32).1 {
        return 0;
    }
    // SAFETY: the value is copied out at once.
    if let Some(info) = (unsafe { PY_PROCS.get(tgid as u32) }).copied()
        && let Some(first) = innermost_frame(&info)
    {
        // SAFETY: no preconditions.
        let now = unsafe { generated::bpf_ktime_get_ns() };
        let mut walk = Walk { info, frame: first, hash: PY_STACK_SEED, now, tgid: tgid as u32, _pad: 0 };
        // SAFETY: step is a BPF callback taking (index, ctx); ctx is the Walk on our stack.
        unsafe { generated::bpf_loop(MAX_STEPS, step as *mut c_void, &mut walk as *mut Walk as *mut c_void, 0) };
        if let Some(s) = scratch() {
            s.py_hash = walk.hash;
        }
    }
    scratch().map_or(0, |s| s.py_hash)
}

/// Sends the Python frames walked for the stack `hash` names, unless that stack was sent
/// before (its record follows this one) or these frames of this process were, with the
/// record of each code object among them that this process has not shown before (ahead of
/// the stack, which names them). A repeat stack, most of them, costs one lookup here, not
/// one per frame; a new stack with frames sent before (another native path under the same
/// Python lines, a stack copy) two. Returns the key the stack's record names its frames by
/// (0: none). A global function, for the same reason as the walk.
#[inline(always)]
pub(crate) fn send_python_once(hash: u64) -> u64 {
    memtrace_send_python(hash)
}

/// State of the loop that sends a new stack's code records.
#[repr(C)]
struct SendCodes {
    info: PyProcInfo,
    tgid: u64,
}

#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn memtrace_send_python(hash: u64) -> u64 {
    let Some(s) = scratch() else { return 0 };
    let n = s.py_n.min(MAX_PY_FRAMES as u32);
    // SAFETY: plain byte value.
    if n == 0 || unsafe { STACKS_SENT.get(hash) }.is_some() {
        return 0;
    }
    let (_, tgid, _) = pid_tgid();
    // The frames' key in this process, shared by every stack under them; when the table of
    // keys sent is full, the stack's own hash (sent with the stack, as one record).
    let shared = stack_hash_step(stack_hash_step(PY_SHARED_SEED, u64::from(tgid)), s.py_hash);
    // SAFETY: plain byte value.
    if unsafe { PY_SENT.get(shared) }.is_some() {
        return shared;
    }
    let key = match PY_SENT.insert(shared, 1u8, BPF_NOEXIST as u64) {
        Ok(()) => shared,
        // Another CPU is sending them.
        Err(e) if e == -EEXIST => return shared,
        Err(_) => hash,
    };
    // SAFETY: the value is copied out at once.
    if let Some(info) = (unsafe { PY_PROCS.get(tgid) }).copied() {
        let mut codes = SendCodes { info, tgid: u64::from(tgid) };
        // SAFETY: send_code_step is a BPF callback taking (index, ctx); ctx is the
        // SendCodes on our stack.
        unsafe {
            generated::bpf_loop(n, send_code_step as *mut c_void, &mut codes as *mut SendCodes as *mut c_void, 0)
        };
    }
    let (Some(s), Some(ring)) = (scratch(), this_ring()) else {
        forget_key(key, shared);
        return 0;
    };
    s.py_header = PyStackHeader {
        rtype: RecordType::PyStack as u8,
        truncated: s.py_cut as u8,
        n: n as u8,
        shared: u8::from(key == shared),
        pid: tgid,
        hash: key,
    };
    let len = size_of::<PyStackHeader>() as u64 + u64::from(n) * size_of::<PyFrame>() as u64;
    let ring_ptr = ring as *const Ring as *mut c_void;
    // SAFETY: `len` bytes from the header are the header and `n` initialised frames of the
    // per-CPU scratch value (py_frames follows py_header). It waits for the batch: the code
    // records it names carry what userspace needs, and one that does not woke the reader.
    let sent = unsafe {
        generated::bpf_ringbuf_output(ring_ptr, addr_of_mut!(s.py_header) as *mut c_void, len, wakeup_flags(ring))
    };
    if sent != 0 {
        // The ring was full: the next stack with these frames sends them again.
        forget_key(key, shared);
        bump(counter::LOST_STACKS);
        return 0;
    }
    key
}

/// A shared key whose frames did not go out is not kept as sent.
#[inline(always)]
fn forget_key(key: u64, shared: u64) {
    if key == shared {
        let _ = PY_SENT.remove(shared);
    }
}

/// `EEXIST`: the error of a map insert whose key another program put there first.
const EEXIST: i32 = 17;

#[inline(never)]
extern "C" fn send_code_step(index: u64, state: *mut c_void) -> i64 {
    // SAFETY: bpf_loop hands back the pointer to the SendCodes on the caller's stack.
    let codes = unsafe { &*(state as *const SendCodes) };
    let Some(s) = scratch() else { return 1 };
    let Some(frame) = s.py_frames.get(index as usize).copied() else { return 1 };
    send_code_once(codes.tgid, frame.code, frame.check, &codes.info);
    0
}

/// The innermost frame of the current thread: its `PyThreadState` from the pthread key's
/// slot in the thread's `struct pthread` (at fsbase), checked to be this thread's.
#[inline(always)]
fn innermost_frame(info: &PyProcInfo) -> Option<u64> {
    // SAFETY: no preconditions; the task pointer is only read through checked reads.
    let task = unsafe { bpf_get_current_task() };
    let fsbase: u64 = read_kernel_at(task, config!(kernel.task_fsbase))?;
    if fsbase == 0 {
        return None;
    }
    let key = read_user_u64(info.tss_key_addr)? as u32;
    let slot = if key < 32 {
        fsbase + u64::from(info.pthread_specific_1st) + 16 * u64::from(key) + 8
    } else if key < 1024 {
        let block = read_user_u64(fsbase + u64::from(info.pthread_specific) + 8 * u64::from(key / 32))?;
        if block == 0 {
            return None;
        }
        block + 16 * u64::from(key % 32) + 8
    } else {
        return None;
    };
    let tstate = read_user_u64(slot)?;
    if tstate == 0 || read_user_u64(tstate + u64::from(info.ts_thread_id))? != fsbase {
        return None;
    }
    let mut frame = read_user_u64(tstate + u64::from(info.ts_frame))?;
    if info.cframe_current != PY_NONE && frame != 0 {
        frame = read_user_u64(frame + u64::from(info.cframe_current))?;
    }
    (frame != 0).then_some(frame)
}

/// A u64 of the frame at `at` in the window, `off` bytes in (None past the bytes read).
#[inline(always)]
fn window_u64(window: &[u8; PY_WINDOW], at: u64, off: u16, len: u64) -> Option<u64> {
    let i = at.checked_add(u64::from(off))?;
    if i > (PY_WINDOW - 8) as u64 || i + 8 > len {
        return None;
    }
    // SAFETY: i + 8 <= PY_WINDOW; unaligned-safe read.
    Some(unsafe { core::ptr::read_unaligned(window.as_ptr().add(i as usize) as *const u64) })
}

#[inline(always)]
fn window_u8(window: &[u8; PY_WINDOW], at: u64, off: u16, len: u64) -> Option<u8> {
    let i = at.checked_add(u64::from(off))?;
    if i >= len {
        return None;
    }
    window.get(i as usize).copied()
}

#[inline(never)]
extern "C" fn step(_index: u64, state: *mut c_void) -> i64 {
    // SAFETY: bpf_loop hands back the pointer to the Walk on the caller's stack.
    let walk = unsafe { &mut *(state as *mut Walk) };
    match try_step(walk) {
        Some(()) => 0,
        None => 1,
    }
}

/// Where the bytes of the frame at `frame` are in `s.py_window` (read now, or by an earlier
/// step: frames of 3.11+ are pushed on the thread's data stack one after the other, so a
/// read of the bytes below a frame usually holds its caller too, and the next few); the
/// window's extent is in `s.py_win_start` and `s.py_win_len`. The window starts no lower
/// than the frame's own page, which is mapped; a frame at the very end of a mapping is read
/// alone, in its first 72 bytes (every field 3.11+ needs). Returns `u64::MAX` when the
/// frame cannot be read. A global BPF function: the verifier checks its three ways once,
/// not each with every state of the step after it.
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn memtrace_py_frame_at(frame: u64) -> u64 {
    let Some(s) = scratch() else { return u64::MAX };
    let Some(end) = frame.checked_add(PY_FRAME_READ as u64) else { return u64::MAX };
    if frame >= s.py_win_start && end <= s.py_win_start.wrapping_add(s.py_win_len) {
        return frame - s.py_win_start;
    }
    let start = end.saturating_sub(PY_WINDOW as u64).max(frame & !0xfff);
    let len = end - start;
    if len > PY_WINDOW as u64 {
        return u64::MAX;
    }
    let window = s.py_window.as_mut_ptr() as *mut c_void;
    // SAFETY: reads at most PY_WINDOW bytes of user memory into the per-CPU window.
    if unsafe { generated::bpf_probe_read_user(window, len as u32, start as *const c_void) } == 0 {
        s.py_win_start = start;
        s.py_win_len = len;
        return frame - start;
    }
    // SAFETY: as above, 72 bytes.
    if unsafe { generated::bpf_probe_read_user(window, 72, frame as *const c_void) } == 0 {
        s.py_win_start = frame;
        s.py_win_len = 72;
        return 0;
    }
    s.py_win_len = 0;
    u64::MAX
}

#[inline(always)]
fn try_step(walk: &mut Walk) -> Option<()> {
    if walk.frame == 0 {
        return None;
    }
    let at = memtrace_py_frame_at(walk.frame);
    let s = scratch()?;
    if at == u64::MAX {
        return None;
    }
    let info = walk.info;
    let len = s.py_win_len;
    let code = window_u64(&s.py_window, at, info.f_code, len)?;
    let back = window_u64(&s.py_window, at, info.f_back, len)?;
    if info.f_owner != PY_NONE && window_u8(&s.py_window, at, info.f_owner, len)? == 3 {
        // An entry frame the evaluation loop keeps on the C stack: the group before it ends.
        let last = (s.py_n as usize).wrapping_sub(1);
        if let Some(f) = s.py_frames.get_mut(last) {
            f.flags |= py_frame_flags::GROUP_END;
        }
        walk.frame = back;
        return Some(());
    }
    let lasti = if info.co_code == PY_NONE {
        window_u64(&s.py_window, at, info.f_instr, len)? as u32 as i32
    } else {
        let instr = window_u64(&s.py_window, at, info.f_instr, len)?;
        let delta = (instr as i64).wrapping_sub(code.wrapping_add(u64::from(info.co_code)) as i64) / 2;
        if (-1..=i64::from(i32::MAX)).contains(&delta) { delta as i32 } else { -2 }
    };
    let mut flags = 0;
    if info.minor == 10 || (info.f_entry != PY_NONE && window_u8(&s.py_window, at, info.f_entry, len)? != 0) {
        flags |= py_frame_flags::GROUP_END;
    }
    let globals = if info.f_globals == PY_NONE { None } else { window_u64(&s.py_window, at, info.f_globals, len) };
    let check = with_globals(code_check(walk, code, globals), globals);
    let n = s.py_n as usize;
    let Some(slot) = s.py_frames.get_mut(n) else {
        s.py_cut = 1;
        return None;
    };
    *slot = PyFrame { code, lasti, flags, check };
    s.py_n = n as u32 + 1;
    walk.hash = stack_hash_step(stack_hash_step(stack_hash_step(walk.hash, code), lasti as u32 as u64), check);
    walk.frame = back;
    Some(())
}

/// The bytes at `co_firstlineno` of code object `code`, run by a frame with `globals`:
/// they tell a code object from one made later at the same address (a module's code, freed
/// once the module ran, and the next module's at its address), in the stack hash and in
/// the key of the records sent. The read costs as much as the frame's own, and the frames
/// under the innermost repeat from one allocation to the next, so walks on this CPU reuse
/// a read for CHECK_TRUSTED_NS when the frame shows the same code object and the same
/// globals. A code object that took a freed one's address in the same module within
/// those milliseconds is what that gives up (code compiled by `exec` at run time; the
/// check itself does not tell those apart when their first lines are the same).
#[inline(always)]
fn code_check(walk: &Walk, code: u64, globals: Option<u64>) -> u64 {
    let read = || read_user_u64(code.wrapping_add(u64::from(walk.info.co_firstlineno))).unwrap_or(0);
    let Some(globals) = globals else { return read() };
    let index = (stack_hash_step(code, u64::from(walk.tgid)) >> 40) as u32 & (PY_CHECK_SLOTS - 1);
    let Some(entry) = PY_CHECKS.get_ptr_mut(index) else { return read() };
    // SAFETY: this CPU's slot; a program nested on the CPU at worst costs a read.
    let entry = unsafe { &mut *entry };
    if entry.code == code
        && entry.globals == globals
        && entry.tgid == walk.tgid
        && walk.now.wrapping_sub(entry.stamp) < CHECK_TRUSTED_NS
    {
        return entry.check;
    }
    let check = read();
    *entry = CachedCheck { code, globals, check, stamp: walk.now, tgid: walk.tgid, _pad: 0 };
    check
}

/// A frame's check: its code object's first line (the low 32 bits, which userspace reads
/// as such) and a hash of its globals (the high 32). Every module's `<module>` code starts
/// at line 1, and the next module imported often gets the address of the last one's
/// code, freed once it ran: the globals, the module's own dict, tell the two apart.
#[inline(always)]
fn with_globals(check: u64, globals: Option<u64>) -> u64 {
    match globals {
        Some(g) => (check & 0xffff_ffff) | (stack_hash_step(PY_STACK_SEED, g) & !0xffff_ffff),
        None => check,
    }
}

/// Sends the record of code object `code` of process `tgid`, unless it was sent before.
#[inline(always)]
fn send_code_once(tgid: u64, code: u64, check: u64, info: &PyProcInfo) {
    let key = PyCodeKey { tgid, code, check };
    // SAFETY: plain byte value.
    if unsafe { PY_CODES_SENT.get(key) }.is_some() || PY_CODES_SENT.insert(key, 1u8, BPF_NOEXIST as u64).is_err() {
        return;
    }
    let Some(ring) = this_ring() else { return };
    // The reader is woken at once only for a record the probe could not read whole (a name
    // not in ASCII, a line table over PY_LINETABLE_LEN): userspace reads the rest from the
    // process, while it lives. Whole records wait for the batch, as events do.
    emit_deciding::<PyCodeRecord>(ring, |r| {
        r.rtype = RecordType::PyCode as u8;
        r.pid = tgid as u32;
        r.code = code;
        r.check = check;
        if let Some(s) = read_user_u64(code.wrapping_add(u64::from(info.co_filename))) {
            r.filename_len = read_ascii(s, &mut r.filename, info);
        }
        if let Some(s) = read_user_u64(code.wrapping_add(u64::from(info.co_qualname))) {
            r.qualname_len = read_ascii(s, &mut r.qualname, info);
        }
        if let Some(table) = read_user_u64(code.wrapping_add(u64::from(info.co_linetable)))
            && let Some(size) = read_user_u64(table.wrapping_add(16))
        {
            let n = size.min(PY_LINETABLE_LEN as u64) as u32;
            // SAFETY: reads at most PY_LINETABLE_LEN bytes into the record's array of that size.
            let ret = unsafe {
                generated::bpf_probe_read_user(
                    r.linetable.as_mut_ptr() as *mut c_void,
                    n,
                    table.wrapping_add(32) as *const c_void,
                )
            };
            if ret == 0 {
                r.linetable_len = n as u16;
                r.linetable_size = size;
            }
        }
        r.filename_len == 0 || r.qualname_len == 0 || r.linetable_size != u64::from(r.linetable_len)
    });
}

/// Copies a compact ASCII `str` object's characters (NUL-terminated, as CPython keeps
/// them) into `dst`; returns the bytes copied with the NUL (0: not ASCII, or unreadable).
#[inline(always)]
fn read_ascii(obj: u64, dst: &mut [u8], info: &PyProcInfo) -> u16 {
    // `state` (at 32): compact 0x20, ascii 0x40.
    let Some(state) = read_user_u64(obj.wrapping_add(32)) else { return 0 };
    if state & 0x60 != 0x60 {
        return 0;
    }
    // SAFETY: writes at most dst.len() bytes into dst; the source read is checked.
    let n = unsafe {
        generated::bpf_probe_read_user_str(
            dst.as_mut_ptr() as *mut c_void,
            dst.len() as u32,
            obj.wrapping_add(u64::from(info.str_ascii_data)) as *const c_void,
        )
    };
    if n > 0 { n as u16 } else { 0 }
}
