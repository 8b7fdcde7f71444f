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
        BPF_RB_NO_WAKEUP, BPF_RB_RING_SIZE, pt_regs,
    },
    btf_maps::{Array, ArrayOfMaps, HashMap, LruHashMap, PerCpuArray, RingBuf},
    helpers::{bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_user, generated},
    macros::{btf_map, tracepoint, uprobe, uretprobe},
    programs::{ProbeContext, RetProbeContext, TracePointContext},
};
use memtrace_common::{
    COMM_LEN, FILENAME_LEN, FreeRecord, InFlight, KERNEL_STACK_SEED, KernelAllocRecord, Kind, MAX_CPUS,
    MAX_STACK_DEPTH, MISS_HASH_MARK, MappingRecord, ProbeConfig, RecordType, SampledKey, StackHeader, TP_HEAD_BYTES,
    TaskEvent, TaskRecord, UNWIND_COPY_BYTES, UPROBE_TRAMPOLINE_PAGE, USER_STACK_SEED, UnwindKey, UnwindMiss,
    UnwindRule, UserAllocRecord, UserFrame, counter, flags, inflight, sigframe, stack_flags, stack_hash_step, traced,
    unwind_kind, unwind_mode,
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
const USER_IPS_BYTES: usize = MAX_STACK_DEPTH * size_of::<u64>();
/// Where the user part of a stack record may start at the latest (after all kernel frames).
const USER_PART_MAX_OFF: usize = size_of::<StackHeader>() + KERNEL_FRAMES_BYTES;
/// Where the miss part of a DWARF stack record may start at the latest.
const MISS_MAX_OFF: usize = USER_PART_MAX_OFF + USER_IPS_BYTES;
const FP_RECORD_MAX: usize = USER_PART_MAX_OFF + USER_FRAMES_BYTES;
const DWARF_RECORD_MAX: usize = MISS_MAX_OFF + size_of::<UnwindMiss>() + UNWIND_COPY_BYTES;
const STACK_RECORD_MAX: usize = if FP_RECORD_MAX > DWARF_RECORD_MAX { FP_RECORD_MAX } else { DWARF_RECORD_MAX };

/// Per-CPU scratch space: stacks are far larger than the 512-byte BPF stack.
#[repr(C)]
struct Scratch {
    /// User instruction pointers, hashed to name the stack (zero-terminated when shorter).
    user_ips: [u64; MAX_STACK_DEPTH + 1],
    /// Where the learned-rule walk stopped for want of a rule.
    miss: UnwindMiss,
    /// A stack record being assembled: header, kernel addresses, user frames, miss part.
    record: [u8; STACK_RECORD_MAX],
}

#[btf_map]
static SCRATCH: PerCpuArray<Scratch, 1> = PerCpuArray::new();

/// Unwind rules userspace learned from the modules' call-frame information, per address
/// space and lookup address. Forgetting one only costs a stack copy and a lookup.
#[btf_map]
static UNWIND: LruHashMap<UnwindKey, UnwindRule, 131072> = LruHashMap::new();

/// tgid → generation of its address space, set at fork and exec (absent: 0, a process
/// that existed before tracing began).
#[btf_map]
static GENERATIONS: LruHashMap<u32, u32, 65536> = LruHashMap::new();

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

/// Walks the current task's user stack by frame pointers into `scratch.user_ips`; returns
/// the frame count.
#[inline(always)]
fn walk_user_ips(ctx: *mut c_void, scratch: &mut Scratch) -> usize {
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

/// User registers a walk starts from.
#[derive(Clone, Copy)]
struct UserRegs {
    ip: u64,
    sp: u64,
    bp: u64,
    /// `ip` is the exact instruction, not a return address.
    exact: bool,
    /// The return address the uprobe trampoline hides on this stack while an allocator call
    /// runs (0: none).
    hidden_return: u64,
}

impl UserRegs {
    /// At a return probe: `ip` is the return address into the caller of the probed function.
    #[inline(always)]
    fn of_return(ctx: &RetProbeContext) -> Self {
        let r = regs(ctx);
        // SAFETY: ctx is the return probe's pt_regs.
        // After the return nothing on the stack is hidden by the uprobe trampoline.
        unsafe { Self { ip: (*r).rip, sp: (*r).rsp, bp: (*r).rbp, exact: false, hidden_return: 0 } }
    }

    /// The registers the current task entered the kernel with (None for kernel threads).
    #[inline(always)]
    fn of_current_task() -> Option<Self> {
        // SAFETY: both helpers take the current task, which stays valid while we run.
        let r = unsafe { generated::bpf_task_pt_regs(generated::bpf_get_current_task_btf()) } as *const pt_regs;
        if r.is_null() {
            return None;
        }
        // SAFETY (the three reads): field addresses only; the reads are checked.
        let ip = read_kernel_u64(unsafe { addr_of!((*r).rip) })?;
        let sp = read_kernel_u64(unsafe { addr_of!((*r).rsp) })?;
        let bp = read_kernel_u64(unsafe { addr_of!((*r).rbp) })?;
        // Kernel threads have no user registers (zeroed); user addresses are below 2^47.
        if ip == 0 || ip >= 1 << 47 {
            return None;
        }
        let (id, _, _) = pid_tgid();
        // SAFETY: copied out at once.
        let hidden_return = match unsafe { INFLIGHT.get(id) } {
            Some(s) if s.depth == 0 => s.ret_addr,
            _ => 0,
        };
        Some(Self { ip, sp, bp, exact: true, hidden_return })
    }
}

#[inline(always)]
fn read_kernel_u64(src: *const u64) -> Option<u64> {
    let mut v = 0u64;
    // SAFETY: checked read of 8 bytes into a local.
    let ret = unsafe { generated::bpf_probe_read_kernel(addr_of_mut!(v) as *mut c_void, 8, src as *const c_void) };
    if ret == 0 { Some(v) } else { None }
}

#[inline(always)]
fn read_user_u64(addr: u64) -> Option<u64> {
    let mut v = 0u64;
    // SAFETY: checked read of 8 bytes of user memory into a local.
    let ret = unsafe { generated::bpf_probe_read_user(addr_of_mut!(v) as *mut c_void, 8, addr as *const c_void) };
    if ret == 0 { Some(v) } else { None }
}

/// The generation of `tgid`'s address space (see [`GENERATIONS`]).
#[inline(always)]
fn generation(tgid: u32) -> u32 {
    // SAFETY: plain u32 copied out at once.
    unsafe { GENERATIONS.get(tgid) }.copied().unwrap_or(0)
}

/// Gives `tgid` a new address-space generation (it forked or exec'd).
#[inline(always)]
fn new_generation(tgid: u32) {
    if config!(dwarf_unwind) == 0 {
        return;
    }
    // SAFETY: no preconditions. A clock reading differs from the tgid's previous one.
    let generation = unsafe { bpf_ktime_get_ns() } as u32 | 1;
    let _ = GENERATIONS.insert(tgid, generation, BPF_ANY as u64);
}

/// The state of a learned-rule walk, on the BPF stack between `bpf_loop` steps.
#[repr(C)]
struct WalkState {
    ip: u64,
    sp: u64,
    bp: u64,
    /// What the uprobe trampoline stands for, if an allocator call is in progress.
    ret_addr: u64,
    /// The stack hash, continued with each frame.
    hash: u64,
    tgid: u32,
    generation: u32,
    /// Frames in `scratch.user_ips`.
    n: u32,
    /// `ip` is the exact instruction, not a return address.
    exact: u32,
    /// `stack_flags` the walk ended with.
    result: u32,
    _pad: u32,
}

/// One frame of the walk (a `bpf_loop` callback: verified once, whatever the depth).
/// Records the frame, looks its rule up and steps to the caller; returns 1 to stop.
#[inline(never)]
extern "C" fn walk_step(index: u64, state: *mut c_void) -> i64 {
    // SAFETY: bpf_loop hands back the pointer to the WalkState on the caller's stack.
    let st = unsafe { &mut *(state as *mut WalkState) };
    let Some(scratch) = scratch() else { return 1 };
    let i = index as usize;
    if i >= MAX_STACK_DEPTH {
        return 1;
    }
    scratch.user_ips[i] = st.ip;
    st.n = i as u32 + 1;
    st.hash = stack_hash_step(st.hash, st.ip);
    let (ip, sp, bp) = (st.ip, st.sp, st.bp);
    let key = UnwindKey { tgid: st.tgid, generation: st.generation, addr: if st.exact != 0 { ip } else { ip - 1 } };
    // SAFETY: the rule is copied out at once.
    let rule =
        if config!(dwarf_unwind) == unwind_mode::COPY_ALWAYS { None } else { unsafe { UNWIND.get(key) }.copied() };
    let Some(rule) = rule else {
        scratch.miss = UnwindMiss {
            ip,
            sp,
            bp,
            ret_addr: st.ret_addr,
            generation: st.generation,
            exact: st.exact as u8,
            _pad: [0; 3],
            copy_len: 0,
            _pad2: 0,
        };
        st.result = stack_flags::MISS as u32;
        return 1;
    };
    let next = match rule.kind {
        unwind_kind::OUTERMOST => {
            st.result = 0;
            return 1;
        }
        unwind_kind::SIGNAL => {
            match (
                read_user_u64(sp + sigframe::RIP),
                read_user_u64(sp + sigframe::RSP),
                read_user_u64(sp + sigframe::RBP),
            ) {
                (Some(i), Some(s), Some(b)) => Some((i, s, b, 1)),
                _ => None,
            }
        }
        unwind_kind::CFA_SP | unwind_kind::CFA_BP | unwind_kind::CFA_BP_DEREF => {
            let offset = rule.cfa_offset as i64 as u64;
            let cfa = match rule.kind {
                unwind_kind::CFA_SP => Some(sp.wrapping_add(offset)),
                unwind_kind::CFA_BP => Some(bp.wrapping_add(offset)),
                _ => read_user_u64(bp.wrapping_add(offset)),
            };
            match cfa {
                Some(cfa) => {
                    let ra = read_user_u64(cfa.wrapping_sub(8));
                    let saved_bp = if rule.rbp_offset != 0 {
                        read_user_u64(cfa.wrapping_add(rule.rbp_offset as i64 as u64))
                    } else {
                        Some(bp)
                    };
                    match (ra, saved_bp) {
                        (Some(ra), Some(b)) => Some((ra, cfa, b, 0)),
                        _ => None,
                    }
                }
                None => None,
            }
        }
        _ => None, // STOP: no usable rule for this code
    };
    let Some((next_ip, next_sp, next_bp, next_exact)) = next else {
        st.result = stack_flags::TRUNCATED as u32;
        return 1;
    };
    if next_ip == 0 {
        st.result = 0; // a zero return address ends the chain
        return 1;
    }
    let next_ip = if next_ip & !0xfff == UPROBE_TRAMPOLINE_PAGE { st.ret_addr } else { next_ip };
    if next_ip == 0 {
        st.result = stack_flags::TRUNCATED as u32; // a trampoline we cannot see through
        return 1;
    }
    st.ip = next_ip;
    st.sp = next_sp;
    st.bp = next_bp;
    st.exact = next_exact;
    // Past the last step the walk is cut at the depth limit.
    st.result = stack_flags::TRUNCATED as u32;
    0
}

/// Walks the user stack with the rules learned for it into `scratch.user_ips`, from
/// `regs`, continuing `hash` with each frame. Returns the frame count, `stack_flags`
/// (TRUNCATED, or MISS with `scratch.miss` holding the registers of the frame that had no
/// rule) and the hash.
#[inline(always)]
fn walk_user_dwarf(scratch: &mut Scratch, tgid: u32, regs: UserRegs, hash: u64) -> (usize, u8, u64) {
    let mut st = WalkState {
        ip: regs.ip,
        sp: regs.sp,
        bp: regs.bp,
        ret_addr: regs.hidden_return,
        hash,
        tgid,
        generation: generation(tgid),
        n: 0,
        exact: regs.exact as u32,
        result: stack_flags::TRUNCATED as u32,
        _pad: 0,
    };
    // SAFETY: walk_step is a BPF callback taking (index, ctx); ctx is our stack state.
    unsafe {
        generated::bpf_loop(MAX_STACK_DEPTH as u32, walk_step as *mut c_void, addr_of_mut!(st) as *mut c_void, 0)
    };
    let n = (st.n as usize).min(MAX_STACK_DEPTH);
    if n < MAX_STACK_DEPTH {
        scratch.user_ips[n] = 0;
    }
    scratch.user_ips[MAX_STACK_DEPTH] = 0;
    (n, st.result as u8 | stack_flags::USER_IPS, st.hash)
}

/// The user part of a stack: frames in `scratch.user_ips`, `stack_flags`, and whether a
/// copy of the stack goes with it (the walk missed a rule).
#[derive(Clone, Copy)]
struct UserPart {
    n: usize,
    flags: u8,
    with_copy: bool,
}

/// Walks the user stack the configured way: by learned rules from `regs`, or by frame
/// pointers (`ctx` names the task's registers to `bpf_get_stack`).
#[inline(always)]
/// Returns the user part and `hash` continued with its frames.
fn walk_user(ctx: *mut c_void, scratch: &mut Scratch, tgid: u32, regs: Option<UserRegs>, hash: u64) -> (UserPart, u64) {
    if config!(dwarf_unwind) != unwind_mode::FRAME_POINTERS {
        match regs {
            Some(regs) => {
                let (n, flags, hash) = walk_user_dwarf(scratch, tgid, regs, hash);
                (UserPart { n, flags, with_copy: false }, hash)
            }
            None => (UserPart { n: 0, flags: 0, with_copy: false }, hash),
        }
    } else {
        let n = walk_user_ips(ctx, scratch);
        let hash = if n > 0 { hash_words(hash, scratch.user_ips.as_ptr()) } else { hash };
        (UserPart { n, flags: 0, with_copy: false }, hash)
    }
}

/// Hashes the frames of a zero-terminated buffer, up to the first zero. Stopping on the
/// data rather than on the frame count keeps the count's range unrefined, so the verifier
/// prunes every exit of the loop into one state.
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

/// Whether a stack copy may go into `ring`: only while it is less than half full, so
/// copies (sent while rules are being learned) never crowd out events.
#[inline(always)]
fn room_for_copy(ring: &Ring) -> bool {
    let ring_ptr = ring as *const Ring as *mut c_void;
    // SAFETY: `ring` is a ring buffer map returned by the outer map lookup.
    let (waiting, size) = unsafe {
        (
            generated::bpf_ringbuf_query(ring_ptr, BPF_RB_AVAIL_DATA as u64),
            generated::bpf_ringbuf_query(ring_ptr, BPF_RB_RING_SIZE as u64),
        )
    };
    waiting + (STACK_RECORD_MAX as u64) < size / 2
}

/// For a stack whose walk stopped at a frame without a rule: the hash of a copy sent for
/// userspace to finish the walk (and learn the rules from), unique to this event; or, when
/// the ring has no room for it, None: the event keeps the partial stack, marked truncated.
#[inline(always)]
fn copy_hash(ring: &Ring, h: u64) -> Option<u64> {
    if config!(dwarf_unwind) != unwind_mode::COPY_ALWAYS && !room_for_copy(ring) {
        bump(counter::UNWIND_BUDGET);
        return None;
    }
    // SAFETY: no preconditions.
    let (now, cpu) = unsafe { (bpf_ktime_get_ns(), generated::bpf_get_smp_processor_id()) };
    Some(stack_hash_step(stack_hash_step(stack_hash_step(h, MISS_HASH_MARK), now), u64::from(cpu)))
}

/// The hash, and the user part with whether to send a copy, for a walk that may have missed.
#[inline(always)]
fn after_miss(ring: &Ring, hash: u64, user: UserPart) -> (u64, UserPart) {
    if user.flags & stack_flags::MISS == 0 {
        return (hash, user);
    }
    match copy_hash(ring, hash) {
        Some(unique) => (unique, UserPart { with_copy: true, ..user }),
        None => (
            stack_hash_step(hash, MISS_HASH_MARK),
            UserPart { n: user.n, flags: (user.flags & !stack_flags::MISS) | stack_flags::TRUNCATED, with_copy: false },
        ),
    }
}

/// Writes the stack record for `hash` (header and kernel part already in
/// `scratch.record`) and sends it, unless it was sent before. Frame-pointer stacks get
/// their frames with build ids from the kernel; learned-rule stacks get their addresses,
/// and with `with_copy` the miss registers and a copy of the stack from there.
#[inline(always)]
fn send_stack_once(
    ctx: *mut c_void,
    ring: &Ring,
    scratch: &mut Scratch,
    hash: u64,
    pid: u32,
    n_kernel: usize,
    user: UserPart,
) {
    let with_copy = user.with_copy;
    if !with_copy {
        // SAFETY: value is a plain byte.
        if unsafe { STACKS_SENT.get(hash) }.is_some() {
            return;
        }
        if STACKS_SENT.insert(hash, 1u8, BPF_NOEXIST as u64).is_err() {
            return; // another CPU is sending it
        }
    }
    let n_kernel = n_kernel.min(MAX_STACK_DEPTH);
    let user_off = size_of::<StackHeader>() + n_kernel * 8;
    if user_off > USER_PART_MAX_OFF {
        return;
    }
    let mut n_user_frames = 0usize;
    let mut len = user_off;
    if user.flags & stack_flags::USER_IPS != 0 {
        let n = user.n.min(MAX_STACK_DEPTH);
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
        n_kernel: n_kernel as u8,
        n_user: n_user_frames as u8,
        pid,
        hash,
    };
    // SAFETY: the record buffer starts with room for a header; unaligned-safe write.
    unsafe { core::ptr::write_unaligned(scratch.record.as_mut_ptr() as *mut StackHeader, header) };
    if len > STACK_RECORD_MAX {
        return;
    }
    let ring_ptr = ring as *const Ring as *mut c_void;
    // A copy waits for userspace to learn from it: wake the reader at once.
    let flags = if with_copy { BPF_RB_FORCE_WAKEUP as u64 } else { wakeup_flags(ring) };
    // SAFETY: `len` bytes of the per-CPU record buffer are initialised and in bounds.
    let ret = unsafe {
        generated::bpf_ringbuf_output(ring_ptr, scratch.record.as_mut_ptr() as *mut c_void, len as u64, flags)
    };
    if ret != 0 {
        if !with_copy {
            let _ = STACKS_SENT.remove(hash);
        }
        bump(counter::LOST_STACKS);
    }
}

/// Appends `scratch.miss` and a copy of the user stack from its stack pointer to the
/// record at `off`; returns the bytes added. Near the top of a stack the full length is
/// not mapped: the copy then ends where the mapping does.
#[inline(always)]
fn append_stack_copy(scratch: &mut Scratch, off: usize) -> usize {
    let copy_off = off + size_of::<UnwindMiss>();
    if copy_off > MISS_MAX_OFF + size_of::<UnwindMiss>() {
        return 0;
    }
    let sp = scratch.miss.sp;
    let to_page_end = 4096 - (sp & 4095) as u32;
    let mut copied = 0u32;
    for want in [UNWIND_COPY_BYTES as u32, to_page_end + 4096, to_page_end] {
        let want = want.min(UNWIND_COPY_BYTES as u32);
        // SAFETY: copy_off + UNWIND_COPY_BYTES <= STACK_RECORD_MAX; `want` is at most that.
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
    // SAFETY: off + size_of::<UnwindMiss>() = copy_off, within the buffer.
    unsafe { core::ptr::write_unaligned(scratch.record.as_mut_ptr().add(off) as *mut UnwindMiss, scratch.miss) };
    size_of::<UnwindMiss>() + copied as usize
}

/// Hash of the user stack of the current task, sending its frames if new.
#[inline(always)]
fn user_stack(ctx: &RetProbeContext, ring: &Ring, pid: u32) -> Option<u64> {
    if config!(user_stacks) == 0 {
        return None;
    }
    let scratch = scratch()?;
    let seed = stack_hash_step(USER_STACK_SEED, pid as u64);
    let (user, hash) = walk_user(ctx.as_ptr(), scratch, pid, Some(UserRegs::of_return(ctx)), seed);
    if user.n == 0 {
        return None;
    }
    let (hash, user) = after_miss(ring, hash, user);
    send_stack_once(ctx.as_ptr(), ring, scratch, hash, pid, 0, user);
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
    let mut hash = stack_hash_step(KERNEL_STACK_SEED, pid as u64);
    if n_kernel > 0 {
        // SAFETY: the kernel frames were just written (zero-padded) at kernel_off.
        hash = hash_words(hash, unsafe { scratch.record.as_ptr().add(kernel_off) } as *const u64);
    }
    // Separates the kernel part from the user part.
    hash = stack_hash_step(hash, u64::MAX);
    let (user, hash) = if pid != 0 && config!(user_stacks) != 0 {
        let regs =
            if config!(dwarf_unwind) != unwind_mode::FRAME_POINTERS { UserRegs::of_current_task() } else { None };
        walk_user(ctx, scratch, pid, regs, hash)
    } else {
        (UserPart { n: 0, flags: 0, with_copy: false }, hash)
    };
    if n_kernel == 0 && user.n == 0 {
        return None;
    }
    let (hash, user) = after_miss(ring, hash, user);
    let user = UserPart { flags: user.flags | stack_flags::KERNEL, ..user };
    send_stack_once(ctx, ring, scratch, hash, pid, n_kernel, user);
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
        // The return probe plants its trampoline here after this program runs.
        ret_addr: read_user_u64(sp).unwrap_or(0),
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
    let stack = user_stack(ctx, ring, tgid);
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
    if !is_thread {
        new_generation(child);
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
    new_generation(tgid);
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
    if group_dead && config!(dwarf_unwind) != unwind_mode::FRAME_POINTERS {
        let _ = GENERATIONS.remove(tgid);
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

// ---------------------------------------------------------------------------------------
// Executable file mappings (learned-rule call graphs only).
// ---------------------------------------------------------------------------------------

/// Syscall tracepoints share one layout: the arguments, 8 bytes each, from offset 16 (after
/// the common header and the syscall number); the return value of `sys_exit_*` at 16.
const SYSCALL_ARG: usize = 16;
const SYSCALL_RET: usize = 16;
const PROT_EXEC: u64 = 4;

/// `openat` in flight: pid_tgid → the user pointer to the file name.
#[btf_map]
static OPENAT_ARGS: HashMap<u64, u64, 16384> = HashMap::new();

/// Files traced processes opened: (tgid << 32 | fd) → path.
#[btf_map]
static FD_PATHS: LruHashMap<u64, [u8; FILENAME_LEN], 4096> = LruHashMap::new();

#[repr(C)]
#[derive(Clone, Copy)]
struct MmapArgs {
    len: u64,
    offset: u64,
    fd: u64,
}

/// `mmap` of a file with PROT_EXEC in flight: pid_tgid → its arguments.
#[btf_map]
static MMAP_ARGS: HashMap<u64, MmapArgs, 16384> = HashMap::new();

#[inline(always)]
fn tracks_mappings(tgid: u32) -> bool {
    config!(dwarf_unwind) != unwind_mode::FRAME_POINTERS && config!(user_stacks) != 0 && is_traced(tgid)
}

#[tracepoint]
pub fn sys_enter_openat(ctx: TracePointContext) -> u32 {
    let _ = try_enter_openat(&ctx);
    0
}

fn try_enter_openat(ctx: &TracePointContext) -> Result<(), ()> {
    let (id, tgid, _) = pid_tgid();
    if !tracks_mappings(tgid) {
        return Ok(());
    }
    // SAFETY: checked read of the tracepoint record (openat's second argument).
    let filename: u64 = unsafe { ctx.read_at(SYSCALL_ARG + 8) }.map_err(|_| ())?;
    OPENAT_ARGS.insert(id, filename, BPF_ANY as u64).map_err(|_| ())
}

#[tracepoint]
pub fn sys_exit_openat(ctx: TracePointContext) -> u32 {
    let _ = try_exit_openat(&ctx);
    0
}

fn try_exit_openat(ctx: &TracePointContext) -> Result<(), ()> {
    let (id, tgid, _) = pid_tgid();
    // SAFETY: copied out at once.
    let filename = *unsafe { OPENAT_ARGS.get(id) }.ok_or(())?;
    let _ = OPENAT_ARGS.remove(id);
    // SAFETY: checked read of the tracepoint record.
    let fd: i64 = unsafe { ctx.read_at(SYSCALL_RET) }.map_err(|_| ())?;
    if fd < 0 {
        return Ok(());
    }
    let scratch = scratch().ok_or(())?;
    let buf = scratch.record.as_mut_ptr();
    // SAFETY: the record buffer is far longer than FILENAME_LEN; the read is checked and
    // NUL-terminates what it copies.
    let n = unsafe {
        generated::bpf_probe_read_user_str(buf as *mut c_void, FILENAME_LEN as u32, filename as *const c_void)
    };
    if n <= 1 {
        return Ok(());
    }
    // SAFETY: the first FILENAME_LEN bytes of the buffer are readable as an array.
    let path = unsafe { &*(buf as *const [u8; FILENAME_LEN]) };
    FD_PATHS.insert((u64::from(tgid) << 32) | fd as u64, path, BPF_ANY as u64).map_err(|_| ())
}

#[tracepoint]
pub fn sys_enter_mmap(ctx: TracePointContext) -> u32 {
    let _ = try_enter_mmap(&ctx);
    0
}

fn try_enter_mmap(ctx: &TracePointContext) -> Result<(), ()> {
    let (id, tgid, _) = pid_tgid();
    if !tracks_mappings(tgid) {
        return Ok(());
    }
    // SAFETY (the four reads): checked reads of the tracepoint record: len, prot, fd, off.
    let len: u64 = unsafe { ctx.read_at(SYSCALL_ARG + 8) }.map_err(|_| ())?;
    let prot: u64 = unsafe { ctx.read_at(SYSCALL_ARG + 16) }.map_err(|_| ())?;
    let fd: u64 = unsafe { ctx.read_at(SYSCALL_ARG + 32) }.map_err(|_| ())?;
    let offset: u64 = unsafe { ctx.read_at(SYSCALL_ARG + 40) }.map_err(|_| ())?;
    if prot & PROT_EXEC == 0 || (fd as i64) < 0 {
        return Ok(());
    }
    MMAP_ARGS.insert(id, MmapArgs { len, offset, fd }, BPF_ANY as u64).map_err(|_| ())
}

#[tracepoint]
pub fn sys_exit_mmap(ctx: TracePointContext) -> u32 {
    let _ = try_exit_mmap(&ctx);
    0
}

fn try_exit_mmap(ctx: &TracePointContext) -> Result<(), ()> {
    let (id, tgid, _) = pid_tgid();
    // SAFETY: copied out at once.
    let args = *unsafe { MMAP_ARGS.get(id) }.ok_or(())?;
    let _ = MMAP_ARGS.remove(id);
    // SAFETY: checked read of the tracepoint record.
    let start: u64 = unsafe { ctx.read_at(SYSCALL_RET) }.map_err(|_| ())?;
    if start >= (-4095i64) as u64 {
        return Ok(()); // an error code
    }
    // SAFETY: copied into the record below before the map can change it.
    let path = unsafe { FD_PATHS.get((u64::from(tgid) << 32) | (args.fd & 0xffff_ffff)) }.ok_or(())?;
    let ring = this_ring().ok_or(())?;
    emit_waking::<MappingRecord>(ring, true, |r| {
        r.rtype = RecordType::Mapping as u8;
        r.pid = tgid;
        r.start = start;
        r.len = args.len;
        r.file_offset = args.offset;
        r.path = *path;
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
