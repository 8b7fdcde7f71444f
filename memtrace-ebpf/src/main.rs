//! memtrace's probes. Kernel side: the kmem tracepoints (slab objects and pages) and the
//! task lifecycle tracepoints. User side: one entry program and one return program shared
//! by the whole malloc family (the attach cookie says which function fired) and one program
//! for `free`/`munmap`. Every program writes compact records from `memtrace-common` into the
//! ring buffer of the CPU it runs on; stacks travel once per distinct hash.
//!
//! Entry points are thin wrappers around `try_*` functions returning `Result`, so every
//! early exit is explicit and the verifier sees one return path.
#![no_std]
#![no_main]

use core::{
    ffi::c_void,
    mem::size_of,
    ptr::{addr_of, addr_of_mut, read_volatile},
};

use aya_ebpf::{
    EbpfContext,
    bindings::{
        BPF_ANY, BPF_F_USER_BUILD_ID, BPF_F_USER_STACK, BPF_NOEXIST, BPF_RB_AVAIL_DATA, BPF_RB_FORCE_WAKEUP,
        BPF_RB_NO_WAKEUP, pt_regs,
    },
    btf_maps::{Array, ArrayOfMaps, HashMap, LruHashMap, PerCpuArray, RingBuf},
    helpers::{bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_user, generated},
    macros::{btf_map, tracepoint, uprobe, uretprobe},
    programs::{ProbeContext, RetProbeContext, TracePointContext},
};
use memtrace_common::{
    COMM_LEN, FILENAME_LEN, FreeRecord, InFlight, KERNEL_STACK_SEED, KernelAllocRecord, Kind, MAX_CPUS,
    MAX_STACK_DEPTH, ProbeConfig, RecordType, SampledKey, StackHeader, TP_HEAD_BYTES, TaskEvent, TaskRecord,
    USER_STACK_SEED, UserAllocRecord, UserFrame, counter, flags, inflight, stack_hash_step, traced,
};

/// Written by userspace before load (`EbpfLoader::override_global`).
#[unsafe(no_mangle)]
static CONFIG: ProbeConfig = ProbeConfig::zeroed();

#[inline(always)]
fn read_config<T: Copy>(field: *const T) -> T {
    // SAFETY: `field` points into the CONFIG static, which is always valid to read.
    unsafe { read_volatile(field) }
}

/// Reads one field of [`CONFIG`] without letting the compiler fold the zeroed initializer.
macro_rules! config {
    ($($field:tt)+) => {
        read_config(addr_of!(CONFIG.$($field)+))
    };
}

/// Byte size of the ring template; userspace creates one ring of its chosen size per CPU.
const RING_TEMPLATE_BYTES: usize = 1 << 20;

#[btf_map]
static RINGS: ArrayOfMaps<RingBuf<u8, RING_TEMPLATE_BYTES>, { MAX_CPUS as usize }> = ArrayOfMaps::new();

#[btf_map]
static COUNTERS: PerCpuArray<u64, { counter::COUNT as usize }> = PerCpuArray::new();

/// Allocation calls between entry and return, by pid_tgid.
#[btf_map]
static INFLIGHT: HashMap<u64, InFlight, 65536> = HashMap::new();

/// tgid → `traced::*` state, when not tracing every process.
#[btf_map]
static TRACED: HashMap<u32, u32, 16384> = HashMap::new();

/// Kernel blocks allocated by traced tasks (pid mode), so their frees are seen from any
/// context. Page frame numbers carry [`PAGE_KEY`].
#[btf_map]
static KERNEL_LIVE: HashMap<u64, u8, 262144> = HashMap::new();
const PAGE_KEY: u64 = 1 << 63;

/// Stack hashes whose frames were already sent. Forgetting one only costs a resend.
#[btf_map]
static STACKS_SENT: LruHashMap<u64, u8, 65536> = LruHashMap::new();

/// Sampling switched on at run time (index 0: mean bytes, 0 = off) when the rings
/// overflow; frees are then all still reported.
#[btf_map]
static SAMPLE_OVERRIDE: Array<u64, 1> = Array::new();

/// The sampling period in force: configured, or switched on by userspace under load.
#[inline(always)]
fn sampling_mean() -> u64 {
    let configured = config!(sample_bytes);
    if configured != 0 {
        return configured;
    }
    SAMPLE_OVERRIDE.get(0).copied().unwrap_or(0)
}

/// Sampled mode: bytes left before the next sample, per CPU.
#[btf_map]
static SAMPLE_COUNTDOWN: PerCpuArray<i64, 1> = PerCpuArray::new();

/// Sampled mode: the sampled user blocks still live (their frees are the only ones sent).
#[btf_map]
static SAMPLED_LIVE: HashMap<SampledKey, u8, 262144> = HashMap::new();

/// log2(1 + k/16) in Q16, for the exponential sampling intervals.
const LOG2_1_PLUS: [u32; 17] =
    [0, 5732, 11136, 16248, 21098, 25711, 30109, 34312, 38336, 42196, 45904, 49472, 52911, 56229, 59434, 62534, 65536];

/// An exponentially distributed number of bytes with mean `mean`: -ln(U)·mean, U uniform
/// in (0, 1], computed in fixed point (log2 by leading zeros and a 16-entry table).
#[inline(always)]
fn exponential_bytes(mean: u64) -> u64 {
    // SAFETY: no preconditions.
    let r = unsafe { generated::bpf_get_prandom_u32() } | 1;
    let msb = 31 - r.leading_zeros();
    let frac = if msb >= 20 { (r >> (msb - 20)) & 0xf_ffff } else { (r << (20 - msb)) & 0xf_ffff };
    let idx = ((frac >> 16) & 15) as usize;
    let (lo, hi) = (LOG2_1_PLUS[idx], LOG2_1_PLUS[idx + 1]);
    let log2_r = (msb << 16) + lo + (((hi - lo) * (frac & 0xffff)) >> 16);
    let minus_log2_u = u64::from((32 << 16) - log2_r);
    // ln 2 = 45426 / 65536. Userspace keeps `mean` below 2^40, so neither product can
    // overflow (mean·2^21, then 2^45·2^16).
    ((mean.wrapping_mul(minus_log2_u) >> 16).wrapping_mul(45426) >> 16).max(1)
}

/// Whether an allocation of `size` bytes is sampled: each byte with probability
/// 1/`mean`, so large blocks are nearly always sampled and small ones rarely.
#[inline(always)]
fn sample_hit(size: u64, mean: u64) -> bool {
    let Some(slot) = SAMPLE_COUNTDOWN.get_ptr_mut(0) else { return true };
    // SAFETY: this CPU's slot; programs on one CPU do not run concurrently.
    let remaining = unsafe { &mut *slot };
    let size = size.min(i64::MAX as u64) as i64;
    if *remaining > size {
        *remaining -= size;
        return false;
    }
    *remaining = exponential_bytes(mean).min(i64::MAX as u64) as i64;
    true
}

#[inline(always)]
fn sampled_key(tgid: u32, ptr: u64) -> SampledKey {
    SampledKey { tgid, _pad: 0, ptr }
}

const USER_FRAMES_BYTES: usize = MAX_STACK_DEPTH * size_of::<UserFrame>();
const KERNEL_FRAMES_BYTES: usize = MAX_STACK_DEPTH * size_of::<u64>();
const STACK_RECORD_MAX: usize = size_of::<StackHeader>() + KERNEL_FRAMES_BYTES + USER_FRAMES_BYTES;

/// Per-CPU scratch space: stacks are far larger than the 512-byte BPF stack.
#[repr(C)]
struct Scratch {
    /// User instruction pointers, hashed to name the stack.
    user_ips: [u64; MAX_STACK_DEPTH],
    /// A stack record being assembled: header, kernel addresses, user frames.
    record: [u8; STACK_RECORD_MAX],
}

#[btf_map]
static SCRATCH: PerCpuArray<Scratch, 1> = PerCpuArray::new();

type Ring = RingBuf<u8, RING_TEMPLATE_BYTES>;

#[inline(always)]
fn bump(index: u32) {
    if let Some(slot) = COUNTERS.get_ptr_mut(index) {
        // SAFETY: per-CPU slot of this CPU; programs on one CPU do not run concurrently.
        unsafe { *slot += 1 };
    }
}

#[inline(always)]
fn this_ring() -> Option<&'static Ring> {
    // SAFETY: the helper has no preconditions.
    let cpu = unsafe { generated::bpf_get_smp_processor_id() };
    let ring = RINGS.get(cpu);
    if ring.is_none() {
        bump(counter::NO_RING);
    }
    ring
}

/// Submit flags: stay quiet until enough data waits, so the reader wakes per batch.
#[inline(always)]
fn wakeup_flags(ring: &Ring) -> u64 {
    let ring_ptr = ring as *const Ring as *mut c_void;
    // SAFETY: `ring` is a ring buffer map returned by the outer map lookup.
    let waiting = unsafe { generated::bpf_ringbuf_query(ring_ptr, BPF_RB_AVAIL_DATA as u64) };
    if waiting >= config!(wakeup_bytes) as u64 { BPF_RB_FORCE_WAKEUP as u64 } else { BPF_RB_NO_WAKEUP as u64 }
}

/// Reserves a `T` in `ring`, lets `fill` write it, submits it; counts a loss when full.
#[inline(always)]
fn emit<T: 'static>(ring: &Ring, fill: impl FnOnce(&mut T)) {
    emit_waking::<T>(ring, false, fill)
}

/// As [`emit`]; `wake` wakes the reader at once (new processes: it attaches to them).
#[inline(always)]
fn emit_waking<T: 'static>(ring: &Ring, wake: bool, fill: impl FnOnce(&mut T)) {
    let flags = if wake { BPF_RB_FORCE_WAKEUP as u64 } else { wakeup_flags(ring) };
    match ring.reserve_untyped::<T>(0) {
        Some(mut entry) => {
            // SAFETY: the reservation is size_of::<T>() bytes, 8-byte aligned; every record
            // type is plain data for which all-zero is valid, so zeroing then filling it
            // initialises it fully.
            let record = unsafe {
                let p = entry.as_mut_ptr();
                core::ptr::write_bytes(p, 0, 1);
                &mut *p
            };
            fill(record);
            entry.submit(flags);
        }
        None => bump(counter::LOST_EVENTS),
    }
}

#[inline(always)]
fn pid_tgid() -> (u64, u32, u32) {
    let id = bpf_get_current_pid_tgid();
    (id, (id >> 32) as u32, id as u32)
}

/// Whether events of `tgid` are wanted.
#[inline(always)]
fn is_traced(tgid: u32) -> bool {
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
fn regs(ctx: &impl EbpfContext) -> *const pt_regs {
    ctx.as_ptr() as *const pt_regs
}

#[inline(always)]
fn scratch() -> Option<&'static mut Scratch> {
    // SAFETY: per-CPU value, used by one program at a time on this CPU.
    SCRATCH.get_ptr_mut(0).map(|p| unsafe { &mut *p })
}

/// Walks the current task's user stack into `scratch.user_ips`; returns the frame count.
#[inline(always)]
fn walk_user_ips(ctx: *mut c_void, scratch: &mut Scratch) -> usize {
    // SAFETY: the buffer is MAX_STACK_DEPTH u64s long and its size is passed.
    let n = unsafe {
        generated::bpf_get_stack(
            ctx,
            scratch.user_ips.as_mut_ptr() as *mut c_void,
            KERNEL_FRAMES_BYTES as u32,
            BPF_F_USER_STACK as u64,
        )
    };
    if n <= 0 { 0 } else { (n as usize / 8).min(MAX_STACK_DEPTH) }
}

/// Hashes the frames of a buffer `bpf_get_stack` filled (it zeroes the unused tail), up to
/// the first zero. Stopping on the data rather than on the frame count keeps the count's
/// range unrefined, so the verifier prunes every exit of the loop into one state.
#[inline(always)]
fn hash_words(mut h: u64, words: *const u64) -> u64 {
    for i in 0..MAX_STACK_DEPTH {
        // SAFETY: i < MAX_STACK_DEPTH, within the caller's buffer of that many words.
        let word = unsafe { *words.add(i) };
        if word == 0 {
            break;
        }
        h = stack_hash_step(h, word);
    }
    h
}

/// Sends the stack record for `hash` unless it was sent before. The header and the
/// kernel part (if any) are already in `scratch.record`; this adds the user frames with
/// build ids. Frames are only walked again for stacks not seen before.
#[inline(always)]
fn send_stack_once(
    ctx: *mut c_void,
    ring: &Ring,
    scratch: &mut Scratch,
    hash: u64,
    pid: u32,
    n_kernel: usize,
    n_user: usize,
) {
    // SAFETY: value is a plain byte.
    if unsafe { STACKS_SENT.get(hash) }.is_some() {
        return;
    }
    if STACKS_SENT.insert(hash, 1u8, BPF_NOEXIST as u64).is_err() {
        return; // another CPU is sending it
    }
    let n_kernel = n_kernel.min(MAX_STACK_DEPTH);
    let user_off = size_of::<StackHeader>() + n_kernel * 8;
    let mut n_user_frames = 0usize;
    if n_user > 0 && user_off <= size_of::<StackHeader>() + KERNEL_FRAMES_BYTES {
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
    }
    let header = StackHeader {
        rtype: RecordType::Stack as u8,
        _pad: 0,
        n_kernel: n_kernel as u8,
        n_user: n_user_frames as u8,
        pid,
        hash,
    };
    // SAFETY: the record buffer starts with room for a header; unaligned-safe write.
    unsafe { core::ptr::write_unaligned(scratch.record.as_mut_ptr() as *mut StackHeader, header) };
    let len = user_off + n_user_frames * size_of::<UserFrame>();
    if len > STACK_RECORD_MAX {
        return;
    }
    let ring_ptr = ring as *const Ring as *mut c_void;
    // SAFETY: `len` bytes of the per-CPU record buffer are initialised and in bounds.
    let ret = unsafe {
        generated::bpf_ringbuf_output(
            ring_ptr,
            scratch.record.as_mut_ptr() as *mut c_void,
            len as u64,
            wakeup_flags(ring),
        )
    };
    if ret != 0 {
        let _ = STACKS_SENT.remove(hash);
        bump(counter::LOST_STACKS);
    }
}

/// Hash of the user stack of the current task, sending its frames if new.
#[inline(always)]
fn user_stack(ctx: *mut c_void, ring: &Ring, pid: u32) -> Option<u64> {
    if config!(user_stacks) == 0 {
        return None;
    }
    let scratch = scratch()?;
    let n = walk_user_ips(ctx, scratch);
    if n == 0 {
        return None;
    }
    let hash = hash_words(stack_hash_step(USER_STACK_SEED, pid as u64), scratch.user_ips.as_ptr());
    send_stack_once(ctx, ring, scratch, hash, pid, 0, n);
    Some(hash)
}

/// Hash of the kernel stack joined with the user stack of the task it runs for.
#[inline(always)]
fn kernel_stack(ctx: *mut c_void, ring: &Ring, pid: u32) -> Option<u64> {
    if config!(kernel_stacks) == 0 {
        return None;
    }
    let scratch = scratch()?;
    let kernel_off = size_of::<StackHeader>();
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
    let n_user = if pid != 0 && config!(user_stacks) != 0 { walk_user_ips(ctx, scratch) } else { 0 };
    if n_kernel == 0 && n_user == 0 {
        return None;
    }
    let mut hash = stack_hash_step(KERNEL_STACK_SEED, pid as u64);
    if n_kernel > 0 {
        // SAFETY: the kernel frames were just written (zero-padded) at kernel_off.
        hash = hash_words(hash, unsafe { scratch.record.as_ptr().add(kernel_off) } as *const u64);
    }
    // Separates the kernel part from the user part.
    hash = stack_hash_step(hash, u64::MAX);
    if n_user > 0 {
        hash = hash_words(hash, scratch.user_ips.as_ptr());
    }
    send_stack_once(ctx, ring, scratch, hash, pid, n_kernel, n_user);
    Some(hash)
}

// ---------------------------------------------------------------------------------------
// User space: the malloc family.
// ---------------------------------------------------------------------------------------

#[uprobe]
pub fn alloc_enter(ctx: ProbeContext) -> u32 {
    let _ = try_alloc_enter(&ctx);
    0
}

fn try_alloc_enter(ctx: &ProbeContext) -> Result<(), ()> {
    let (id, tgid, _) = pid_tgid();
    if !is_traced(tgid) {
        return Ok(());
    }
    // SAFETY: the helper only reads the attach cookie of this program's link.
    let cookie = unsafe { generated::bpf_get_attach_cookie(ctx.as_ptr()) };
    let kind = cookie as u8;
    let glibc = if cookie & memtrace_common::cookie::GLIBC != 0 { inflight::GLIBC } else { 0 };
    // SAFETY: ctx is this probe's pt_regs.
    let sp = unsafe { (*regs(ctx)).rsp };
    // SAFETY: the value is copied out and written back whole.
    if let Some(state) = INFLIGHT.get_ptr_mut(id) {
        let state = unsafe { &mut *state };
        if sp < state.sp {
            // Called from inside another allocator call (realloc → malloc): not the user's.
            state.depth += 1;
            return Ok(());
        }
        if sp == state.sp {
            // A tail call at the same depth (realloc(NULL, n) jumping to malloc,
            // reallocarray to realloc): the call the user made, and its sampling decision,
            // stay the outer one's; both return probes fire once, at the same return.
            return Ok(());
        }
        // Otherwise the entry is stale (its return was never seen): replace it.
    }
    let arg = |n: usize| -> u64 { ctx.arg::<u64>(n).unwrap_or(0) };
    let (bytes_req, ptr_arg) = match Kind::from_u8(kind) {
        Some(Kind::Malloc | Kind::Valloc | Kind::Pvalloc) => (arg(0), 0),
        Some(Kind::Calloc) => (arg(0).wrapping_mul(arg(1)), 0),
        Some(Kind::Realloc) => (arg(1), arg(0)),
        Some(Kind::ReallocArray) => (arg(1).wrapping_mul(arg(2)), arg(0)),
        Some(Kind::PosixMemalign) => (arg(2), arg(0)),
        Some(Kind::AlignedAlloc | Kind::Memalign) => (arg(1), 0),
        Some(Kind::Mmap) => (arg(1), 0),
        _ => return Err(()),
    };
    let mut sampling = inflight::SAMPLE_NEW | inflight::OLD_SAMPLED;
    let mean = sampling_mean();
    if mean != 0 {
        let has_old = ptr_arg != 0 && matches!(Kind::from_u8(kind), Some(Kind::Realloc | Kind::ReallocArray));
        // SAFETY: plain byte value.
        let old_sampled = has_old && unsafe { SAMPLED_LIVE.get(sampled_key(tgid, ptr_arg)) }.is_some();
        sampling = if sample_hit(bytes_req, mean) { inflight::SAMPLE_NEW } else { 0 }
            | if old_sampled { inflight::OLD_SAMPLED } else { 0 };
        if sampling == 0 && !matches!(Kind::from_u8(kind), Some(Kind::Realloc | Kind::ReallocArray)) {
            // Nothing of this call is recorded: its return finds no state. (realloc keeps
            // an empty state, so the malloc it may tail-call does not draw a second chance.)
            return Ok(());
        }
    }
    let state = InFlight {
        kind,
        flags: sampling | glibc,
        _pad: [0; 2],
        depth: 0,
        sp,
        // SAFETY: no preconditions.
        ts_entry: unsafe { bpf_ktime_get_ns() },
        bytes_req,
        ptr_arg,
    };
    if INFLIGHT.insert(id, state, BPF_ANY as u64).is_err() {
        bump(counter::LOST_INFLIGHT);
    }
    Ok(())
}

#[uretprobe]
pub fn alloc_return(ctx: RetProbeContext) -> u32 {
    let _ = try_alloc_return(&ctx);
    0
}

/// glibc's `malloc_usable_size`, from the size word before the block.
#[inline(always)]
fn glibc_usable_size(ptr: u64) -> Option<u64> {
    // SAFETY: reads user memory through the checked helper.
    let size_word: u64 = unsafe { bpf_probe_read_user((ptr - 8) as *const u64) }.ok()?;
    let chunk = size_word & !7;
    let is_mmapped = size_word & 2 != 0;
    let overhead = if is_mmapped { 16 } else { 8 };
    chunk.checked_sub(overhead)
}

fn try_alloc_return(ctx: &RetProbeContext) -> Result<(), ()> {
    let (id, tgid, tid) = pid_tgid();
    // SAFETY: copied out at once.
    let state = *unsafe { INFLIGHT.get(id) }.ok_or(())?;
    // SAFETY: ctx is the return probe's pt_regs.
    let sp = unsafe { (*regs(ctx)).rsp };
    if sp < state.sp + 8 {
        // The return of a nested allocator call.
        if let Some(s) = INFLIGHT.get_ptr_mut(id) {
            // SAFETY: the entry belongs to this thread.
            unsafe { (*s).depth = (*s).depth.saturating_sub(1) };
        }
        return Ok(());
    }
    let _ = INFLIGHT.remove(id);
    if sp != state.sp + 8 {
        return Ok(()); // stale entry: its return was missed
    }
    let kind = Kind::from_u8(state.kind).ok_or(())?;
    let ret: u64 = ctx.ret();
    // SAFETY: no preconditions.
    let now = unsafe { bpf_ktime_get_ns() };
    let ptr = match kind {
        Kind::PosixMemalign => {
            if ret != 0 {
                return Ok(()); // error code: nothing allocated
            }
            // SAFETY: checked read of the caller's result slot.
            unsafe { bpf_probe_read_user(state.ptr_arg as *const u64) }.map_err(|_| ())?
        }
        Kind::Mmap => {
            if ret as i64 == -1 {
                return Ok(()); // MAP_FAILED
            }
            ret
        }
        _ => ret,
    };
    let ring = this_ring().ok_or(())?;
    let is_realloc = matches!(kind, Kind::Realloc | Kind::ReallocArray);
    let sampling = config!(sample_bytes) != 0;
    if is_realloc && state.ptr_arg != 0 && state.flags & inflight::OLD_SAMPLED != 0 {
        if ptr == 0 && state.bytes_req != 0 {
            return Ok(()); // failed: the old block is untouched
        }
        if sampling {
            let _ = SAMPLED_LIVE.remove(sampled_key(tgid, state.ptr_arg));
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
        return Ok(());
    }
    if sampling && SAMPLED_LIVE.insert(sampled_key(tgid, ptr), 1u8, BPF_ANY as u64).is_err() {
        bump(counter::LOST_SAMPLED_LIVE);
    }
    let stack = user_stack(ctx.as_ptr(), ring, tgid);
    let (bytes_alloc, exact) = if kind == Kind::Mmap {
        ((state.bytes_req + 4095) & !4095, true)
    } else if state.flags & inflight::GLIBC != 0 {
        match glibc_usable_size(ptr) {
            Some(usable) if usable >= state.bytes_req => (usable, true),
            _ => (state.bytes_req, false),
        }
    } else {
        (state.bytes_req, false)
    };
    emit::<UserAllocRecord>(ring, |r| {
        r.rtype = RecordType::UserAlloc as u8;
        r.kind = state.kind;
        r.flags = if exact { flags::USABLE_EXACT } else { 0 } | if stack.is_some() { flags::HAS_STACK } else { 0 };
        r.pid = tgid;
        r.tid = tid;
        r.bytes_extra = (bytes_alloc - state.bytes_req).min(u32::MAX as u64) as u32;
        r.ts_ns = now;
        r.ptr = ptr;
        r.bytes_req = state.bytes_req;
        r.stack = stack.unwrap_or(0);
    });
    Ok(())
}

#[uprobe]
pub fn free_enter(ctx: ProbeContext) -> u32 {
    let _ = try_free_enter(&ctx);
    0
}

fn try_free_enter(ctx: &ProbeContext) -> Result<(), ()> {
    let ptr: u64 = ctx.arg(0).ok_or(())?;
    if ptr == 0 {
        return Ok(());
    }
    let (id, tgid, tid) = pid_tgid();
    if !is_traced(tgid) {
        return Ok(());
    }
    // SAFETY: the helper only reads the attach cookie.
    let kind = unsafe { generated::bpf_get_attach_cookie(ctx.as_ptr()) } as u8;
    let sampled_heap = config!(sample_bytes) != 0 && kind == Kind::Free as u8;
    // Sampled mode: only the frees of sampled blocks matter (most frees stop here).
    // SAFETY: plain byte value.
    if sampled_heap && unsafe { SAMPLED_LIVE.get(sampled_key(tgid, ptr)) }.is_none() {
        return Ok(());
    }
    // SAFETY: copied out at once.
    if let Some(state) = unsafe { INFLIGHT.get(id) } {
        // SAFETY: ctx is this probe's pt_regs.
        if unsafe { (*regs(ctx)).rsp } < state.sp {
            return Ok(()); // the allocator freeing inside realloc: reported by realloc
        }
    }
    if sampled_heap {
        let _ = SAMPLED_LIVE.remove(sampled_key(tgid, ptr));
    }
    let arg = if kind == Kind::Munmap as u8 {
        let len: u64 = ctx.arg(1).unwrap_or(0);
        (len.div_ceil(4096)).min(u32::MAX as u64) as u32
    } else {
        0
    };
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

// ---------------------------------------------------------------------------------------
// Kernel: kmem tracepoints.
// ---------------------------------------------------------------------------------------

/// The head of a tracepoint record, copied in one read; fields are picked by offset.
struct TpHead([u64; TP_HEAD_BYTES / 8]);

impl TpHead {
    #[inline(always)]
    fn read(ctx: &TracePointContext) -> Option<Self> {
        // SAFETY: reads the tracepoint's record (or the per-CPU trace buffer behind it)
        // through the checked helper.
        unsafe { ctx.read_at::<[u64; TP_HEAD_BYTES / 8]>(0) }.ok().map(Self)
    }

    /// The 8-byte field at `offset` (which userspace checked is 8-byte aligned).
    #[inline(always)]
    fn u64_at(&self, offset: u32) -> u64 {
        let i = (offset / 8) as usize;
        if i < self.0.len() { self.0[i] } else { 0 }
    }

    /// The 4-byte field at `offset` (4-byte aligned).
    #[inline(always)]
    fn u32_at(&self, offset: u32) -> u32 {
        let word = self.u64_at(offset & !7);
        if offset & 4 != 0 { (word >> 32) as u32 } else { word as u32 }
    }
}

#[inline(always)]
fn remember_kernel_block(key: u64) {
    if config!(track_kernel_live) != 0 && KERNEL_LIVE.insert(key, 1u8, BPF_ANY as u64).is_err() {
        bump(counter::LOST_KERNEL_LIVE);
    }
}

/// Whether a kernel free of `key` should be reported, and whether it comes from a context
/// that is not itself traced.
#[inline(always)]
fn kernel_free_wanted(key: u64, tgid: u32) -> Option<bool> {
    if config!(track_kernel_live) == 0 {
        return if is_traced(tgid) { Some(false) } else { None };
    }
    // SAFETY: plain byte value.
    unsafe { KERNEL_LIVE.get(key) }?;
    let _ = KERNEL_LIVE.remove(key);
    Some(!is_traced(tgid))
}

#[inline(always)]
fn slab_alloc(ctx: &TracePointContext, kind: Kind, layout_is_cache: bool) -> Result<(), ()> {
    let (_, tgid, tid) = pid_tgid();
    if !is_traced(tgid) {
        return Ok(());
    }
    let head = TpHead::read(ctx).ok_or(())?;
    let (call_site, ptr, req, alloc, gfp, node) = if layout_is_cache {
        (
            head.u64_at(config!(tp.cache_alloc.call_site)),
            head.u64_at(config!(tp.cache_alloc.ptr)),
            head.u64_at(config!(tp.cache_alloc.bytes_req)),
            head.u64_at(config!(tp.cache_alloc.bytes_alloc)),
            head.u64_at(config!(tp.cache_alloc.gfp_flags)),
            head.u32_at(config!(tp.cache_alloc.node)),
        )
    } else {
        (
            head.u64_at(config!(tp.kmalloc.call_site)),
            head.u64_at(config!(tp.kmalloc.ptr)),
            head.u64_at(config!(tp.kmalloc.bytes_req)),
            head.u64_at(config!(tp.kmalloc.bytes_alloc)),
            head.u64_at(config!(tp.kmalloc.gfp_flags)),
            head.u32_at(config!(tp.kmalloc.node)),
        )
    };
    if ptr == 0 {
        return Ok(()); // failed allocation
    }
    let ring = this_ring().ok_or(())?;
    let stack = kernel_stack(ctx.as_ptr(), ring, tgid);
    remember_kernel_block(ptr);
    emit::<KernelAllocRecord>(ring, |r| {
        r.rtype = RecordType::KernelAlloc as u8;
        r.kind = kind as u8;
        r.flags = if stack.is_some() { flags::HAS_STACK } else { 0 };
        r.pid = tgid;
        r.tid = tid;
        r.node = node as i32;
        r.bytes_req = req.min(u32::MAX as u64) as u32;
        r.bytes_alloc = alloc.min(u32::MAX as u64) as u32;
        r.gfp_flags = gfp as u32;
        // SAFETY: no preconditions.
        r.ts_ns = unsafe { bpf_ktime_get_ns() };
        r.ptr = ptr;
        r.call_site = call_site;
        r.stack = stack.unwrap_or(0);
    });
    Ok(())
}

#[inline(always)]
fn kernel_free(ctx: &TracePointContext, kind: Kind, ptr: u64, key: u64, arg: u32) -> Result<(), ()> {
    if ptr == 0 {
        return Ok(());
    }
    let (_, tgid, tid) = pid_tgid();
    let foreign = kernel_free_wanted(key, tgid).ok_or(())?;
    let _ = ctx;
    let ring = this_ring().ok_or(())?;
    emit::<FreeRecord>(ring, |r| {
        r.rtype = RecordType::Free as u8;
        r.kind = kind as u8;
        r.flags = if foreign { flags::FOREIGN_FREE } else { 0 };
        r.pid = tgid;
        r.tid = tid;
        r.arg = arg;
        // SAFETY: no preconditions.
        r.ts_ns = unsafe { bpf_ktime_get_ns() };
        r.ptr = ptr;
    });
    Ok(())
}

#[tracepoint]
pub fn kmalloc(ctx: TracePointContext) -> u32 {
    let _ = slab_alloc(&ctx, Kind::Kmalloc, false);
    0
}

#[tracepoint]
pub fn kmem_cache_alloc(ctx: TracePointContext) -> u32 {
    let _ = slab_alloc(&ctx, Kind::KmemCacheAlloc, true);
    0
}

#[tracepoint]
pub fn kfree(ctx: TracePointContext) -> u32 {
    let _ = try_slab_free(&ctx, Kind::Kfree, config!(tp.kfree_ptr));
    0
}

#[tracepoint]
pub fn kmem_cache_free(ctx: TracePointContext) -> u32 {
    let _ = try_slab_free(&ctx, Kind::KmemCacheFree, config!(tp.cache_free_ptr));
    0
}

#[inline(always)]
fn try_slab_free(ctx: &TracePointContext, kind: Kind, ptr_offset: u32) -> Result<(), ()> {
    // SAFETY: checked read of the tracepoint record.
    let ptr: u64 = unsafe { ctx.read_at(ptr_offset as usize) }.map_err(|_| ())?;
    kernel_free(ctx, kind, ptr, ptr, 0)
}

#[tracepoint]
pub fn mm_page_alloc(ctx: TracePointContext) -> u32 {
    let _ = try_page_alloc(&ctx);
    0
}

fn try_page_alloc(ctx: &TracePointContext) -> Result<(), ()> {
    let (_, tgid, tid) = pid_tgid();
    if !is_traced(tgid) {
        return Ok(());
    }
    let head = TpHead::read(ctx).ok_or(())?;
    let pfn = head.u64_at(config!(tp.page_alloc_pfn));
    if pfn == u64::MAX {
        return Ok(()); // failed allocation
    }
    let order = head.u32_at(config!(tp.page_alloc_order));
    let gfp = head.u64_at(config!(tp.page_alloc_gfp));
    let migratetype = head.u32_at(config!(tp.page_alloc_migratetype));
    let ring = this_ring().ok_or(())?;
    let stack = kernel_stack(ctx.as_ptr(), ring, tgid);
    remember_kernel_block(pfn | PAGE_KEY);
    let bytes = 4096u32 << (order & 15);
    emit::<KernelAllocRecord>(ring, |r| {
        r.rtype = RecordType::KernelAlloc as u8;
        r.kind = Kind::PageAlloc as u8;
        r.flags = if stack.is_some() { flags::HAS_STACK } else { 0 };
        r.order = order as u8;
        r.pid = tgid;
        r.tid = tid;
        r.node = migratetype as i32;
        r.bytes_req = bytes;
        r.bytes_alloc = bytes;
        r.gfp_flags = gfp as u32;
        // SAFETY: no preconditions.
        r.ts_ns = unsafe { bpf_ktime_get_ns() };
        r.ptr = pfn;
        r.stack = stack.unwrap_or(0);
    });
    Ok(())
}

#[tracepoint]
pub fn mm_page_free(ctx: TracePointContext) -> u32 {
    let _ = try_page_free(&ctx, config!(tp.page_free_pfn), config!(tp.page_free_order));
    0
}

#[tracepoint]
pub fn mm_page_free_batched(ctx: TracePointContext) -> u32 {
    let _ = try_page_free(&ctx, config!(tp.page_free_batched_pfn), u32::MAX);
    0
}

#[inline(always)]
fn try_page_free(ctx: &TracePointContext, pfn_offset: u32, order_offset: u32) -> Result<(), ()> {
    let head = TpHead::read(ctx).ok_or(())?;
    let pfn = head.u64_at(pfn_offset);
    let order = if order_offset == u32::MAX { 0 } else { head.u32_at(order_offset) };
    kernel_free(ctx, Kind::PageFree, pfn, pfn | PAGE_KEY, order)
}

// ---------------------------------------------------------------------------------------
// Task lifecycle.
// ---------------------------------------------------------------------------------------

#[inline(always)]
fn emit_task(ring: &Ring, event: TaskEvent, pid: u32, tid: u32, ppid: u32, extra_flags: u8) {
    emit_waking::<TaskRecord>(ring, event == TaskEvent::Fork, |r| {
        r.rtype = RecordType::Task as u8;
        r.event = event as u8;
        r.flags = extra_flags;
        r.pid = pid;
        r.tid = tid;
        r.ppid = ppid;
        // SAFETY: no preconditions.
        r.ts_ns = unsafe { bpf_ktime_get_ns() };
        if let Ok(comm) = bpf_get_current_comm() {
            r.comm = comm;
        }
    });
}

#[tracepoint]
pub fn task_newtask(ctx: TracePointContext) -> u32 {
    let _ = try_task_newtask(&ctx);
    0
}

fn try_task_newtask(ctx: &TracePointContext) -> Result<(), ()> {
    const CLONE_THREAD: u64 = 0x0001_0000;
    let (_, parent_tgid, _) = pid_tgid();
    let head = TpHead::read(ctx).ok_or(())?;
    let child = head.u32_at(config!(tp.newtask_pid));
    let clone_flags = head.u64_at(config!(tp.newtask_clone_flags));
    let is_thread = clone_flags & CLONE_THREAD != 0;
    if !is_traced(parent_tgid) {
        return Ok(());
    }
    if !is_thread && config!(trace_all) == 0 && config!(follow_children) != 0 {
        // Children of traced processes are traced (record -- CMD; --follow-forks).
        let _ = TRACED.insert(child, traced::ACTIVE, BPF_ANY as u64);
    }
    let ring = this_ring().ok_or(())?;
    let (event, pid) = if is_thread { (TaskEvent::Thread, parent_tgid) } else { (TaskEvent::Fork, child) };
    emit_task(ring, event, pid, child, parent_tgid, 0);
    Ok(())
}

#[tracepoint]
pub fn sched_process_exec(ctx: TracePointContext) -> u32 {
    let _ = try_exec(&ctx);
    0
}

fn try_exec(ctx: &TracePointContext) -> Result<(), ()> {
    let (_, tgid, tid) = pid_tgid();
    if tgid == config!(self_tgid) {
        return Ok(());
    }
    if config!(trace_all) == 0 {
        // SAFETY: plain u32 value.
        match unsafe { TRACED.get(tgid) } {
            Some(&traced::PENDING_EXEC) => {
                let _ = TRACED.insert(tgid, traced::ACTIVE, BPF_ANY as u64);
            }
            Some(_) => {}
            None => return Ok(()),
        }
    }
    let head = TpHead::read(ctx).ok_or(())?;
    let loc = head.u32_at(config!(tp.exec_filename));
    let ring = this_ring().ok_or(())?;
    // The reader re-resolves the allocator of the new program: wake it at once.
    let flags = BPF_RB_FORCE_WAKEUP as u64;
    let Some(mut entry) = ring.reserve_untyped::<TaskRecord>(0) else {
        bump(counter::LOST_EVENTS);
        return Ok(());
    };
    let r = entry.as_mut_ptr();
    // SAFETY: the reservation holds one TaskRecord; zeroed, then filled field by field.
    unsafe {
        core::ptr::write_bytes(r, 0, 1);
        (*r).rtype = RecordType::Task as u8;
        (*r).event = TaskEvent::Exec as u8;
        (*r).pid = tgid;
        (*r).tid = tid;
        (*r).ts_ns = bpf_ktime_get_ns();
        if let Ok(comm) = bpf_get_current_comm() {
            (*r).comm = comm;
        }
        // __data_loc: offset in the low 16 bits, length in the high 16.
        let src = (ctx.as_ptr() as *const u8).add((loc & 0xffff) as usize);
        let dst = addr_of_mut!((*r).filename) as *mut u8;
        generated::bpf_probe_read_kernel_str(dst as *mut c_void, FILENAME_LEN as u32, src as *const c_void);
    }
    entry.submit(flags);
    Ok(())
}

#[tracepoint]
pub fn sched_process_exit(ctx: TracePointContext) -> u32 {
    let _ = try_exit(&ctx);
    0
}

fn try_exit(ctx: &TracePointContext) -> Result<(), ()> {
    let (_, tgid, tid) = pid_tgid();
    if !is_traced(tgid) {
        return Ok(());
    }
    let head = TpHead::read(ctx).ok_or(())?;
    let group_dead = head.u64_at(config!(tp.exit_group_dead) & !7) >> ((config!(tp.exit_group_dead) & 7) * 8);
    let group_dead = group_dead & 0xff != 0;
    if group_dead && config!(trace_all) == 0 {
        let _ = TRACED.remove(tgid);
    }
    let ring = this_ring().ok_or(())?;
    emit_task(ring, TaskEvent::Exit, tgid, tid, 0, if group_dead { flags::GROUP_DEAD } else { 0 });
    Ok(())
}

#[tracepoint]
pub fn task_rename(ctx: TracePointContext) -> u32 {
    let _ = try_rename(&ctx);
    0
}

fn try_rename(ctx: &TracePointContext) -> Result<(), ()> {
    let (_, tgid, tid) = pid_tgid();
    if !is_traced(tgid) {
        return Ok(());
    }
    // SAFETY: checked read of the tracepoint record.
    let comm: [u8; COMM_LEN] = unsafe { ctx.read_at(config!(tp.rename_newcomm) as usize) }.map_err(|_| ())?;
    let ring = this_ring().ok_or(())?;
    emit::<TaskRecord>(ring, |r| {
        r.rtype = RecordType::Task as u8;
        r.event = TaskEvent::Rename as u8;
        r.pid = tgid;
        r.tid = tid;
        // SAFETY: no preconditions.
        r.ts_ns = unsafe { bpf_ktime_get_ns() };
        r.comm = comm;
    });
    Ok(())
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[unsafe(link_section = "license")]
#[unsafe(no_mangle)]
static LICENSE: [u8; 4] = *b"GPL\0";
