//! The user-stack walk without frame pointers, one frame per `bpf_loop` step: each
//! frame's address is found in its process's address space ([`MAPPINGS`], by
//! address-space id), its rule in the table of the file mapped there ([`TABLES`], built
//! once per file by userspace) or in the per-CPU rule cache, and the step to the caller is
//! `memtrace_common::unwind::step`, the code userspace runs too. Where a frame's mapping or
//! table is not known yet, the walk stops with the registers there, for userspace to finish
//! from a stack copy once the table is built.
use core::{ffi::c_void, ptr::addr_of_mut};

use aya_ebpf::{
    bindings::{BPF_ANY, BPF_NOEXIST, pt_regs},
    helpers::generated,
    maps::lpm_trie::Key,
    programs::RetProbeContext,
};
use memtrace_common::{
    FileId, FileTable, MAX_CPUS, MAX_USER_DEPTH, MappingKey, MappingValue, RULE_CACHE_SLOTS,
    UNWIND_ANCHORED_COPY_BYTES, UPROBE_TRAMPOLINE_PAGE, UnwindMiss, UnwindRule, counter, stack_flags, stack_hash_step,
    unwind::{self, NO_SLOT, Regs, Step, decode_rule, encode_rule, kind, mapping_flags, table},
    unwind::{RESUME_SPS, RETURN_SLOTS},
    unwind_mode,
};

use crate::{
    context::{pid_tgid, read_kernel_at, read_user_u64, regs, scratch, this_cpu},
    maps::{
        ANCHOR_BUFFERS, ANCHORS, ASIDS, AnchorFrame, Anchors, CachedRule, FILE_TABLES, MAPPINGS, NEXT_ASID, PROBE_BUSY,
        PROC_GEN, PY_PROCS, RANGES_GEN, RETURNS_SEEN, RULE_CACHE, SLOT_MAPS, TABLES, bump_generation, process_changed,
    },
    reuse::{memtrace_begin_reuse, memtrace_repeat_walk, memtrace_reuse_frames},
    ring::{bump, bump_by, zero},
    stack::{STACK_WINDOW_WORDS, Scratch},
};

/// User registers a walk starts from.
#[derive(Clone, Copy)]
pub(crate) struct UserRegs {
    pub(crate) ip: u64,
    pub(crate) sp: u64,
    pub(crate) bp: u64,
    /// `ip` is the exact instruction, not a return address.
    pub(crate) exact: bool,
    /// The return address the uprobe trampoline hides on this stack while an allocator call
    /// runs (0: none).
    pub(crate) hidden_return: u64,
}

impl UserRegs {
    /// At a return probe: `ip` is the return address into the caller of the probed function.
    #[inline(always)]
    pub(crate) fn of_return(ctx: &RetProbeContext) -> Self {
        let r = regs(ctx);
        // SAFETY: ctx is the return probe's pt_regs.
        // After the return nothing on the stack is hidden by the uprobe trampoline.
        unsafe { Self { ip: (*r).rip, sp: (*r).rsp, bp: (*r).rbp, exact: false, hidden_return: 0 } }
    }

    /// The registers the current task entered the kernel with (None for kernel threads).
    #[inline(always)]
    pub(crate) fn of_current_task() -> Option<Self> {
        // Direct loads from the typed pointer (three checked reads cost three helper calls
        // per kernel allocation).
        // SAFETY: both helpers take the current task, which stays valid while we run, and
        // every task has a register area (a kernel thread's is zeroed, below); the verifier
        // checks the loads against the BTF of pt_regs and makes them faulting-safe ones.
        let (ip, sp, bp) = unsafe {
            let r = generated::bpf_task_pt_regs(generated::bpf_get_current_task_btf()) as *const pt_regs;
            ((*r).rip, (*r).rsp, (*r).rbp)
        };
        // Kernel threads have no user registers (zeroed); user addresses are below 2^47.
        if ip == 0 || ip >= 1 << 47 {
            return None;
        }
        let hidden_return = match crate::inflight::current() {
            Some(s) if s.depth == 0 => memtrace_hidden_return(s.sp),
            _ => 0,
        };
        Some(Self { ip, sp, bp, exact: true, hidden_return })
    }
}

/// The return address the uprobe trampoline stands for in the slot at `slot` (the stack
/// pointer at the probed function's entry), from the uprobe machinery's own record of it
/// (0: not found). Read only when a walk meets an allocator call in progress (a kernel
/// allocation inside malloc), not at every entry. A global BPF function: checked once.
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn memtrace_hidden_return(slot: u64) -> u64 {
    let layout = config!(kernel);
    // SAFETY: no preconditions; the task stays valid while this program runs.
    let task = unsafe { generated::bpf_get_current_task() };
    let Some(utask) = read_kernel_at::<u64>(task, layout.task_utask).filter(|&u| u != 0) else { return 0 };
    let mut ri = read_kernel_at::<u64>(utask, layout.utask_return_instances).unwrap_or(0);
    for _ in 0..RETURN_SLOTS {
        if ri == 0 {
            return 0;
        }
        if read_kernel_at::<u64>(ri, layout.ri_stack) == Some(slot) {
            return read_kernel_at::<u64>(ri, layout.ri_orig_ret_vaddr).unwrap_or(0);
        }
        ri = read_kernel_at::<u64>(ri, layout.ri_next).unwrap_or(0);
    }
    0
}

/// Fills [`RETURNS_SEEN`] with the current task's return instances (slot, return
/// address), newest first, 0 past the last, for userspace's walk over a miss's copy: each
/// trampoline it meets is put back by its own slot. Only on a miss, as its copy is sent.
/// A global BPF function: checked once.
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn memtrace_return_slots() -> u64 {
    let Some(seen) = RETURNS_SEEN.get_ptr_mut(0) else { return 0 };
    // SAFETY: this CPU's slot; programs on one CPU do not run concurrently.
    let seen = unsafe { &mut *seen };
    for w in seen.iter_mut() {
        // SAFETY: a word of the map value.
        unsafe { core::ptr::write_volatile(w, 0) };
    }
    let layout = config!(kernel);
    // SAFETY: no preconditions; the task stays valid while this program runs.
    let task = unsafe { generated::bpf_get_current_task() };
    let Some(utask) = read_kernel_at::<u64>(task, layout.task_utask).filter(|&u| u != 0) else { return 0 };
    let mut ri = read_kernel_at::<u64>(utask, layout.utask_return_instances).unwrap_or(0);
    let mut n = 0;
    for k in 0..RETURN_SLOTS {
        if ri == 0 {
            break;
        }
        seen[2 * k] = read_kernel_at::<u64>(ri, layout.ri_stack).unwrap_or(0);
        seen[2 * k + 1] = read_kernel_at::<u64>(ri, layout.ri_orig_ret_vaddr).unwrap_or(0);
        n += 1;
        ri = read_kernel_at::<u64>(ri, layout.ri_next).unwrap_or(0);
    }
    n
}

/// The address space of `tgid` (None: not known yet, a process that existed before
/// tracing began and that userspace has not learned).
#[inline(always)]
pub(crate) fn asid_of(tgid: u32) -> Option<u32> {
    // SAFETY: plain u32 copied out at once.
    unsafe { ASIDS.get(tgid) }.copied()
}

/// A new address-space id: this CPU's count of execs and the CPU, below 2^31 (userspace
/// hands out ids from 2^31 for processes that existed before tracing began).
#[inline(always)]
pub(crate) fn new_asid() -> u32 {
    let Some(count) = NEXT_ASID.get_ptr_mut(0) else { return 0 };
    // SAFETY: this CPU's slot; programs on one CPU do not run concurrently.
    let n = unsafe {
        *count = (*count).wrapping_add(1);
        *count
    };
    let cpu = this_cpu();
    ((n << 10 | (cpu & 1023)) & 0x7fff_ffff).max(1)
}

/// `tgid` exec'd: a new address space, whose mappings the mapping tracker reports as the
/// new program is loaded.
#[inline(always)]
pub(crate) fn begin_address_space(tgid: u32) {
    if config!(unwind_mode) == unwind_mode::FRAME_POINTERS {
        return;
    }
    let _ = ASIDS.insert(tgid, new_asid(), BPF_ANY as u64);
    process_changed();
}

/// A forked child starts with its parent's address space.
#[inline(always)]
pub(crate) fn share_address_space(child: u32, parent: u32) {
    if config!(unwind_mode) == unwind_mode::FRAME_POINTERS {
        return;
    }
    if let Some(asid) = asid_of(parent) {
        let _ = ASIDS.insert(child, asid, BPF_NOEXIST as u64);
        process_changed();
    }
}

pub(crate) fn end_address_space(tgid: u32) {
    let _ = ASIDS.remove(tgid);
    process_changed();
}

/// What a stack walk needs to know of process `tgid`: its address space (None: not known
/// yet) and whether it runs a Python interpreter userspace described (`PY_PROCS`). From
/// this CPU's memory of the last process it walked while [`PROC_GEN`] is unchanged, else
/// looked up and remembered: two hash lookups per stack become one array read.
#[inline(always)]
pub(crate) fn process_facts(scratch: &mut Scratch, tgid: u32) -> (Option<u32>, bool) {
    let generation = PROC_GEN.get(0).copied().unwrap_or(0) as u32;
    let flags = scratch.proc_flags;
    if flags & proc_flags::VALID != 0 && scratch.proc_tgid == tgid && scratch.proc_gen == generation {
        return ((flags & proc_flags::ASID != 0).then_some(scratch.proc_asid), flags & proc_flags::PYTHON != 0);
    }
    let asid = asid_of(tgid);
    // SAFETY: only whether the entry exists is read.
    let python = unsafe { PY_PROCS.get(tgid) }.is_some();
    scratch.proc_tgid = tgid;
    scratch.proc_gen = generation;
    scratch.proc_asid = asid.unwrap_or(0);
    scratch.proc_flags = proc_flags::VALID
        | if asid.is_some() { proc_flags::ASID } else { 0 }
        | if python { proc_flags::PYTHON } else { 0 };
    (asid, python)
}

/// `Scratch::proc_flags`.
pub(crate) mod proc_flags {
    pub(crate) const VALID: u32 = 1;
    pub(crate) const ASID: u32 = 2;
    pub(crate) const PYTHON: u32 = 4;
}

/// The identity of a `struct file`.
#[inline(always)]
pub(crate) fn file_id(file: u64) -> Option<FileId> {
    let layout = config!(kernel);
    let inode: u64 = read_kernel_at(file, layout.file_inode).filter(|&i| i != 0)?;
    let ino: u64 = read_kernel_at(inode, layout.inode_ino)?;
    let sb: u64 = read_kernel_at(inode, layout.inode_sb).filter(|&s| s != 0)?;
    let dev: u32 = read_kernel_at(sb, layout.sb_dev)?;
    Some(FileId { dev, _pad: 0, ino })
}

/// The table userspace registered for a file, if any.
#[inline(always)]
pub(crate) fn file_table(file: u64) -> Option<FileTable> {
    let id = file_id(file)?;
    // SAFETY: copied out at once.
    unsafe { FILE_TABLES.get(id) }.copied()
}

/// A range to add to an address space, prefix by prefix (a `bpf_loop` callback).
#[repr(C)]
struct Install {
    at: u64,
    end: u64,
    asid: u32,
    _pad: u32,
    value: MappingValue,
}

#[inline(never)]
extern "C" fn install_prefix(_index: u64, state: *mut c_void) -> i64 {
    // SAFETY: bpf_loop hands back the pointer to the Install on the caller's stack.
    let st = unsafe { &mut *(state as *mut Install) };
    if st.at >= st.end {
        return 1;
    }
    // The largest aligned block at `at` that ends within the range: no larger than the
    // alignment of `at`, nor than the length left (no loop: the verifier checks it once).
    let align_log = if st.at == 0 { 63 } else { st.at.trailing_zeros().min(63) };
    let span_log = 63 - (st.end - st.at).leading_zeros();
    let size_log = align_log.min(span_log);
    let key = Key::new(MappingKey::ASID_BITS + 64 - size_log, MappingKey::new(st.asid, st.at));
    if MAPPINGS.insert(&key, st.value, BPF_ANY as u64).is_err() {
        return 1;
    }
    st.at = st.at.wrapping_add(1 << size_log);
    0
}

/// Adds `[start, end)` of address space `asid`, mapping the table in `slot` at `bias`, as
/// userspace would (it adds it again when it hears of the mapping: the same entries).
#[inline(always)]
pub(crate) fn install_range(asid: u32, start: u64, end: u64, slot: u32, bias: u64) {
    memtrace_install_range(u64::from(asid), start, end, u64::from(slot), bias);
}

/// [`install_range`] as a global BPF function: the verifier checks it once, on its own,
/// not once per call site and state (the exec program installs twice).
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn memtrace_install_range(asid: u64, start: u64, end: u64, slot: u64, bias: u64) -> u64 {
    let (asid, slot) = (asid as u32, slot as u32);
    if slot == NO_SLOT || start >= end {
        return 0;
    }
    // Another file's range there (or this one's at another bias: a library mapped where
    // another was unloaded): the rules each CPU cached for those addresses are stale.
    let key = Key::new(MappingKey::ASID_BITS + 64, MappingKey::new(asid, start));
    if let Some(old) = MAPPINGS.get(&key)
        && (old.table != slot || old.bias != bias)
    {
        bump_generation(RANGES_GEN.get_ptr_mut(0));
    }
    let mut st =
        Install { at: start, end, asid, _pad: 0, value: MappingValue { table: slot, flags: 0, start, end, bias } };
    set_busy(1);
    // SAFETY: install_prefix is a BPF callback taking (index, ctx); ctx is our stack state.
    unsafe { generated::bpf_loop(128, install_prefix as *mut c_void, addr_of_mut!(st) as *mut c_void, 0) };
    set_busy(0);
    bump(counter::RANGES_INSTALLED);
    0
}

#[inline(always)]
fn set_busy(value: u32) {
    if let Some(slot) = PROBE_BUSY.get_ptr_mut(0) {
        // SAFETY: this CPU's slot.
        unsafe { *slot = value };
    }
}

/// Whether the kernel is allocating on behalf of one of our own programs (see
/// [`PROBE_BUSY`]).
#[inline(always)]
pub(crate) fn probe_busy() -> bool {
    PROBE_BUSY.get(0).is_some_and(|&v| v != 0)
}

/// The state of a walk, on the BPF stack between `bpf_loop` steps.
#[repr(C)]
pub(crate) struct WalkState {
    pub(crate) ip: u64,
    pub(crate) sp: u64,
    pub(crate) bp: u64,
    /// The stack hash, continued with each frame.
    pub(crate) hash: u64,
    /// The mapping the previous frame was in: consecutive frames in one file skip the
    /// address-space lookup.
    pub(crate) map_start: u64,
    pub(crate) map_end: u64,
    pub(crate) map_bias: u64,
    pub(crate) map_table: u32,
    pub(crate) map_flags: u32,
    pub(crate) asid: u32,
    /// `ip` is the exact instruction, not a return address.
    pub(crate) exact: u32,
    /// Rules found in the per-CPU rule cache (counted once per walk, not per frame).
    pub(crate) cache_hits: u32,
    /// The thread walked.
    pub(crate) tid: u32,
    /// What the rule cache's entries of this walk's time carry in their address's top bits
    /// ([`crate::maps::CachedRule`]).
    pub(crate) cache_tag: u64,
}

/// Sets `miss` to a walk stopped at these registers: no copy, no anchor. Zeroed a word at
/// a time, then filled (a struct literal's zeroed arrays became a byte-by-byte `memset`
/// call the verifier followed on every pass over the walk step).
#[inline(always)]
fn set_miss(miss: &mut UnwindMiss, ip: u64, sp: u64, bp: u64, asid: u32, exact: u8) {
    zero(miss);
    miss.ip = ip;
    miss.sp = sp;
    miss.bp = bp;
    miss.asid = asid;
    miss.exact = exact;
}

/// Phases of a table walk.
mod phase {
    /// Frame by frame from the registers.
    pub(super) const WALK: u32 = 0;
    /// Past a frame without a table: looking for an anchor above it.
    pub(super) const SEARCH: u32 = 1;
    /// Frame by frame again, from an anchor.
    pub(super) const RESUMED: u32 = 2;
}

/// Anchors read from the stack at most per miss (each a `bpf_probe_read_user`).
const ANCHOR_TRIES: u32 = 16;

/// Why no rule was found for an address.
enum NoRule {
    /// Its mapping or its file's table is not known yet: userspace finishes from a copy.
    NotYet(u32),
    /// No rule can exist (no table covers it): the stack is truncated there.
    Never,
}

#[inline(always)]
fn cache_slot(addr: u64, asid: u32) -> u32 {
    (stack_hash_step(addr, u64::from(asid)) >> 40) as u32 & (RULE_CACHE_SLOTS - 1)
}

/// The rule for lookup address `addr` of the walk's address space (`encode_rule` of it).
#[inline(always)]
fn rule_at(st: &mut WalkState, addr: u64) -> Result<u32, NoRule> {
    let cpu = this_cpu();
    let slot = RULE_CACHE.get_ptr_mut(cpu.wrapping_mul(RULE_CACHE_SLOTS) | cache_slot(addr, st.asid));
    if let Some(entry) = slot {
        // SAFETY: this CPU's slot; programs on one CPU do not run concurrently.
        let entry = unsafe { &*entry };
        if entry.addr == addr ^ st.cache_tag && entry.asid == st.asid {
            st.cache_hits += 1;
            return Ok(entry.rule);
        }
    }
    if addr & !0xfff == UPROBE_TRAMPOLINE_PAGE {
        // The uprobe machinery's own code ([uprobes]): no file, no table.
        return Err(NoRule::Never);
    }
    if addr < st.map_start || addr >= st.map_end {
        let key = Key::new(MappingKey::ASID_BITS + 64, MappingKey::new(st.asid, addr));
        let Some(m) = MAPPINGS.get(&key).copied() else {
            return Err(NoRule::NotYet(counter::UNWIND_NO_MAPPING));
        };
        st.map_start = m.start;
        st.map_end = m.end;
        st.map_bias = m.bias;
        st.map_table = m.table;
        st.map_flags = m.flags;
    }
    if st.map_flags & (mapping_flags::NO_FILE | mapping_flags::NO_TABLE) != 0 {
        // JIT-compiled code, or a file without call-frame information: its frame pointer.
        return Ok(encode_rule(UnwindRule::FRAME_POINTER));
    }
    let found = memtrace_table_rule(u64::from(st.map_table), addr.wrapping_sub(st.map_bias));
    let rule = match found >> 32 {
        0 => found as u32,
        NO_TABLE_YET => return Err(NoRule::NotYet(counter::UNWIND_NO_TABLE)),
        _ => return Err(NoRule::Never),
    };
    if let Some(entry) = slot {
        // SAFETY: as above.
        unsafe { *entry = CachedRule { addr: addr ^ st.cache_tag, asid: st.asid, rule } };
    }
    Ok(rule)
}

/// [`memtrace_table_rule`]'s answers besides a rule (in the high half).
const NO_RULE: u64 = 1;
const NO_TABLE_YET: u64 = 2;

/// The rule for file address `vaddr` in the table in `slot`: `encode_rule` of it, or
/// `NO_RULE << 32`, or `NO_TABLE_YET << 32`. A global BPF function: the verifier checks the
/// search once, on its own, not once per state of the walk step that calls it.
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn memtrace_table_rule(slot: u64, vaddr: u64) -> u64 {
    match table_rule(slot as u32, vaddr) {
        Ok(rule) => u64::from(rule),
        Err(NoRule::NotYet(_)) => NO_TABLE_YET << 32,
        Err(NoRule::Never) => NO_RULE << 32,
    }
}

#[inline(always)]
fn table_rule(slot: u32, vaddr: u64) -> Result<u32, NoRule> {
    // The map the slot's table was written into, if not its own.
    let slot = match SLOT_MAPS.get(slot) {
        Some(&entry) if entry != 0 => entry,
        _ => slot,
    };
    let Some(rows) = TABLES.get(slot) else { return Err(NoRule::NotYet(counter::UNWIND_NO_TABLE)) };
    let get = |i: u32| rows.get(i).copied();
    let (Some(pc_base), Some(counts)) = (get(table::PC_BASE), get(table::COUNTS)) else {
        return Err(NoRule::Never);
    };
    let pages = counts as u32;
    let rel = vaddr.wrapping_sub(pc_base);
    let page = rel >> table::PAGE_SHIFT;
    if page >= u64::from(pages) {
        // Code of the file no FDE covers (`.plt`, `.init`, before the first or past the
        // last): its frame pointer, as the table's gaps give.
        return Ok(encode_rule(UnwindRule::FRAME_POINTER));
    }
    let page = page as u32;
    let (Some(lo), Some(hi)) = (get(table::PAGES + page), get(table::PAGES + page + 1)) else {
        return Err(NoRule::Never);
    };
    let Some(first) = get(table::row_element(pages, lo as u32)) else { return Err(NoRule::Never) };
    if unwind::row_pc(first) > rel as u32 {
        return Ok(encode_rule(UnwindRule::FRAME_POINTER));
    }
    // The search of `memtrace_common::unwind::find_row`, one step per `bpf_loop`
    // iteration, so the verifier checks the step once instead of every unrolled one.
    let mut search = Search { slot, pages, lo: lo as u32, hi: hi as u32, pc: rel as u32, failed: 0, best: first };
    // SAFETY: search_step is a BPF callback taking (index, ctx); ctx is our stack state.
    unsafe {
        generated::bpf_loop(table::SEARCH_STEPS, search_step as *mut c_void, addr_of_mut!(search) as *mut c_void, 0)
    };
    if search.failed != 0 || search.lo < search.hi {
        return Err(NoRule::Never);
    }
    // The row's low half is the rule, encoded.
    Ok(search.best as u32)
}

/// A binary search among the rows of one page of a table, on the BPF stack between
/// `bpf_loop` steps: the answer is the last row with pc ≤ `pc`, in `lo..=hi`.
#[repr(C)]
struct Search {
    slot: u32,
    pages: u32,
    lo: u32,
    hi: u32,
    pc: u32,
    failed: u32,
    /// The last row found with pc ≤ `pc`.
    best: u64,
}

#[inline(never)]
extern "C" fn search_step(_index: u64, state: *mut c_void) -> i64 {
    // SAFETY: bpf_loop hands back the pointer to the Search on the caller's stack.
    let s = unsafe { &mut *(state as *mut Search) };
    if s.lo >= s.hi {
        return 1;
    }
    let mid = s.lo + (s.hi - s.lo).div_ceil(2);
    let row = TABLES.get(s.slot).and_then(|rows| rows.get(table::row_element(s.pages, mid)).copied());
    let Some(row) = row else {
        s.failed = 1;
        return 1;
    };
    if unwind::row_pc(row) <= s.pc {
        s.lo = mid;
        s.best = row;
    } else {
        s.hi = mid - 1;
    }
    0
}

/// One frame of the walk (a `bpf_loop` callback: verified once, whatever the depth).
/// Records the frame, finds its rule and steps to the caller; returns 1 to stop.
#[inline(never)]
pub(crate) extern "C" fn walk_step(_index: u64, state: *mut c_void) -> i64 {
    // SAFETY: bpf_loop hands back the pointer to the WalkState on the caller's stack.
    let st = unsafe { &mut *(state as *mut WalkState) };
    let Some(scratch) = scratch() else { return 1 };
    if scratch.walk_phase == phase::SEARCH {
        return match memtrace_anchor_step(u64::from(st.tid), u64::from(st.asid)) {
            SEARCHING => 0,
            ANCHORED => {
                let Some(scratch) = crate::context::scratch() else { return 1 };
                let [ip, sp, bp] = scratch.walk_resume;
                st.ip = ip;
                st.sp = sp;
                st.bp = bp;
                st.exact = 0;
                // Past the last step the walk is cut at the depth limit.
                scratch.walk_result = stack_flags::TRUNCATED as u32;
                0
            }
            _ => 1,
        };
    }
    let i = scratch.walk_n as usize;
    if i >= MAX_USER_DEPTH {
        return 1;
    }
    scratch.user_ips[i] = st.ip;
    scratch.walk_n = i as u32 + 1;
    st.hash = stack_hash_step(st.hash, st.ip);
    memtrace_note_frame(i as u64, st.ip, st.sp, st.bp);
    if scratch.walk_phase == phase::WALK
        && st.exact == 0
        && scratch.walk_reuse != 0
        && memtrace_reuse_frames(i as u64, st.ip, st.sp, st.bp, st.hash) != 0
    {
        let Some(scratch) = crate::context::scratch() else { return 1 };
        st.hash = scratch.walk_reuse_hash;
        scratch.walk_result = 0;
        return 1;
    }
    let regs = Regs { ip: st.ip, sp: st.sp, bp: st.bp, exact: st.exact != 0 };
    let rule_bits = match rule_at(st, regs.lookup_addr()) {
        Ok(bits) => bits,
        Err(NoRule::NotYet(why)) => {
            bump(why);
            if scratch.walk_phase == phase::RESUMED {
                // A second frame without a table: the stack stops at the first, as without
                // an anchor (a copy covers one gap).
                memtrace_note_frame(i as u64, 0, 0, 0);
                scratch.walk_n = scratch.miss.resume_at;
                let m = scratch.miss;
                set_miss(&mut scratch.miss, m.ip, m.sp, m.bp, m.asid, m.exact);
                scratch.walk_result = stack_flags::MISS as u32;
                return 1;
            }
            // No anchor at a frame without a table: a walk from it would miss at once.
            memtrace_note_frame(i as u64, 0, 0, 0);
            set_miss(&mut scratch.miss, regs.ip, regs.sp, regs.bp, st.asid, st.exact as u8);
            scratch.walk_result = stack_flags::MISS as u32;
            // The thread's earlier walks may have left frames above (the search picks the
            // CPU whose anchors are its newest first).
            scratch.walk_phase = phase::SEARCH;
            scratch.walk_anchor = 0;
            scratch.walk_tries = ANCHOR_TRIES;
            return 0;
        }
        Err(NoRule::Never) => {
            scratch.walk_result = stack_flags::TRUNCATED as u32;
            return 1;
        }
    };
    let rule = decode_rule(rule_bits);
    memtrace_note_rule(i as u64, u64::from(rule.kind), rule.rbp_offset as i64 as u64);
    cover_step(&regs, rule);
    let outcome = memtrace_step_frame(regs.ip, regs.sp, regs.bp, u64::from(rule_bits) | u64::from(regs.exact) << 32);
    let Some(scratch) = crate::context::scratch() else { return 1 };
    match outcome {
        STEP_CALLER => {
            let [ip, sp, bp, exact] = scratch.step_next;
            st.ip = ip;
            st.sp = sp;
            st.bp = bp;
            st.exact = exact as u32;
            // Past the last step the walk is cut at the depth limit.
            scratch.walk_result = stack_flags::TRUNCATED as u32;
            0
        }
        STEP_OUTERMOST => {
            scratch.walk_result = 0;
            1
        }
        _ => {
            scratch.walk_result = stack_flags::TRUNCATED as u32;
            1
        }
    }
}

/// What `unwind::step` is told the uprobe trampoline stands for, to see where it met one:
/// no code is at address 1.
const TRAMPOLINE_SEEN: u64 = 1;

/// [`memtrace_step_frame`]'s answers.
const STEP_CALLER: u64 = 0;
const STEP_OUTERMOST: u64 = 1;
const STEP_STOP: u64 = 2;

/// Applies a rule (`encode_rule` of it, `exact` in bit 32) to the frame at `ip`, `sp`,
/// `bp`: [`STEP_CALLER`] with the caller's registers in `scratch.step_next`, or
/// [`STEP_OUTERMOST`], or [`STEP_STOP`]. A return address the uprobe trampoline stands
/// in for is put back from the uprobe machinery's record of its slot: each one met its own
/// (a kernel allocation in the `mmap` that `malloc` calls meets `mmap`'s return probe's
/// trampoline, then `malloc`'s; taking `malloc`'s return address for both skipped its
/// frames and read the rest of the stack from the wrong place). A global BPF function: its
/// ways through (the rule kinds, each stack read from the window or not) are checked once,
/// on their own, not multiplied by every state of the walk step.
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn memtrace_step_frame(ip: u64, sp: u64, bp: u64, rule_exact: u64) -> u64 {
    let Some(scratch) = scratch() else { return STEP_STOP };
    let regs = Regs { ip, sp, bp, exact: rule_exact >> 32 != 0 };
    let rule = decode_rule(rule_exact as u32);
    if rule.kind == kind::RA_RDI {
        return step_ra_in_rdi(scratch, regs, rule);
    }
    match unwind::step(regs, rule, TRAMPOLINE_SEEN, |addr| read_stack(scratch, addr)) {
        Step::Caller(next) => {
            let ip = if next.ip == TRAMPOLINE_SEEN {
                // The return address was read from the slot just below the caller's stack
                // pointer (the CFA).
                match memtrace_hidden_return(next.sp.wrapping_sub(8)) {
                    0 => return STEP_STOP,
                    ip => ip,
                }
            } else {
                next.ip
            };
            let Some(scratch) = crate::context::scratch() else { return STEP_STOP };
            scratch.step_next = [ip, next.sp, next.bp, u64::from(next.exact)];
            STEP_CALLER
        }
        Step::Outermost => STEP_OUTERMOST,
        Step::Stop => STEP_STOP,
    }
}

/// A frame whose return address is in %rdi (glibc's `vfork` during its syscall): followed
/// only where the frame is the one the task's saved user registers are (a kernel
/// allocation in the syscall), whose %rdi the kernel kept; anywhere else %rdi is unknown.
#[inline(always)]
fn step_ra_in_rdi(scratch: &mut Scratch, regs: Regs, rule: UnwindRule) -> u64 {
    // SAFETY: both helpers take the current task, which stays valid while we run; the
    // verifier checks the loads against the BTF of pt_regs.
    let (rip, rsp, rdi) = unsafe {
        let r = generated::bpf_task_pt_regs(generated::bpf_get_current_task_btf()) as *const pt_regs;
        ((*r).rip, (*r).rsp, (*r).rdi)
    };
    if !regs.exact || rip != regs.ip || rsp != regs.sp || rdi == 0 {
        return STEP_STOP;
    }
    scratch.step_next = [rdi, regs.sp.wrapping_add(rule.cfa_offset as i64 as u64), regs.bp, 0];
    STEP_CALLER
}

/// One step of the search for an anchor after a miss (`scratch.miss`) by thread `tid` in
/// address space `asid`: first picks the CPU holding the thread's newest anchors (its last
/// walk's frames, joined by earlier ones above them), then tries them one by one, from the
/// second (the first is the walk's innermost frame, an exact instruction, not a return
/// address in a slot).
/// The innermost one above the miss, within a copy's reach, whose return address is still
/// in its slot is taken: its registers go to `scratch.walk_resume`, and the copy will cover
/// the gap below it. Stale frames can pass this check (a slot not overwritten since);
/// userspace keeps the frames walked from an anchor only where its own walk of the gap
/// lands on one of them. Returns [`SEARCHING`], [`NO_ANCHOR`] or [`ANCHORED`]. A global
/// BPF function: the verifier checks it once, not once per state of the walk step.
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn memtrace_anchor_step(tid: u64, asid: u64) -> u64 {
    let Some(scratch) = scratch() else { return NO_ANCHOR };
    if scratch.walk_anchor == 0 {
        // First step: the anchors of the thread's newest walk, on whichever CPU.
        let mut pick = Pick { tid: tid as u32, asid: asid as u32, cpu: u32::MAX, _pad: 0, time: 0 };
        // SAFETY: pick_step is a BPF callback taking (index, ctx); ctx is our stack state.
        unsafe {
            generated::bpf_loop(
                config!(cpus).min(MAX_CPUS),
                pick_step as *mut c_void,
                addr_of_mut!(pick) as *mut c_void,
                0,
            )
        };
        if pick.cpu == u32::MAX {
            return NO_ANCHOR;
        }
        scratch.walk_anchor_cpu = pick.cpu;
        scratch.walk_anchor = 1;
        return SEARCHING;
    }
    let Some(a) = anchors_of(scratch.walk_anchor_cpu) else { return NO_ANCHOR };
    let good = a.good_cur().0;
    let j = scratch.walk_anchor as usize;
    if j >= MAX_USER_DEPTH || j as u32 >= a.n || scratch.walk_tries == 0 {
        return NO_ANCHOR;
    }
    scratch.walk_anchor += 1;
    let AnchorFrame { ip, sp, bp } = a.frames[good][j];
    let miss_sp = scratch.miss.sp;
    if sp <= miss_sp {
        return SEARCHING; // below the miss: the next one
    }
    if sp - miss_sp > UNWIND_ANCHORED_COPY_BYTES as u64 {
        return NO_ANCHOR; // the gap would not fit a copy
    }
    scratch.walk_tries -= 1;
    if read_user_u64(sp.wrapping_sub(8)) != Some(ip) {
        return SEARCHING;
    }
    bump(counter::UNWIND_ANCHORED);
    scratch.miss.resume_at = scratch.walk_n;
    scratch.walk_phase = phase::RESUMED;
    scratch.walk_bp_restored = 0;
    scratch.walk_resume = [ip, sp, bp];
    ANCHORED
}

/// Notes frame `i` of the walk under way as a possible anchor for the thread's later
/// walks (sp 0: no frame there, the one whose table was missing), and, walked from an
/// anchor, its stack pointer for the copy. A global BPF function, for the same reason as
/// the anchor step.
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn memtrace_note_frame(i: u64, ip: u64, sp: u64, bp: u64) -> u64 {
    let Some(scratch) = scratch() else { return 0 };
    if scratch.walk_phase == phase::RESUMED {
        let k = i.wrapping_sub(u64::from(scratch.miss.resume_at)) as usize;
        if k < RESUME_SPS {
            scratch.miss.resume_sps[k] = sp;
            scratch.miss.resume_bps[k] = bp;
        }
    }
    if sp > scratch.walk_top_sp {
        scratch.walk_top_sp = sp;
    }
    let i = i as usize;
    if i >= MAX_USER_DEPTH {
        return 0;
    }
    if let Some(a) = ANCHORS.get_ptr_mut(this_cpu()) {
        // SAFETY: this CPU's value; programs on one CPU do not run concurrently.
        let a = unsafe { &mut *a };
        let cur = a.good_cur().1;
        a.frames[cur][i] = AnchorFrame { ip, sp, bp };
    }
    0
}

/// The anchors of CPU `cpu` (another CPU's may be changing as they are read: what is read
/// is checked against the stack, and userspace checks what the walk from it found).
#[inline(always)]
fn anchors_of(cpu: u32) -> Option<&'static Anchors> {
    ANCHORS.get(cpu)
}

/// Looking for the CPU holding a thread's newest anchors.
#[repr(C)]
struct Pick {
    tid: u32,
    asid: u32,
    /// The best CPU so far (u32::MAX: none), and when its walk ended.
    cpu: u32,
    _pad: u32,
    time: u64,
}

#[inline(never)]
extern "C" fn pick_step(index: u64, state: *mut c_void) -> i64 {
    // SAFETY: bpf_loop hands back the pointer to the Pick on the caller's stack.
    let p = unsafe { &mut *(state as *mut Pick) };
    let cpu = index as u32;
    if let Some(a) = anchors_of(cpu)
        && a.tid == p.tid
        && a.asid == p.asid
        && a.n > 0
        && (p.cpu == u32::MAX || a.time > p.time)
    {
        p.cpu = cpu;
        p.time = a.time;
    }
    0
}

/// Notes, walking from an anchor, whether frame `i`'s rule (of `kind`, restoring %rbp from
/// `rbp_offset`, 0: keeping it) finds its frame from %rbp before %rbp was restored from the
/// stack since each of the first frames from the anchor (`UnwindMiss::bp_used`): their
/// %rbp is the anchor's as an earlier walk saw it, or read through a stale first frame, so
/// userspace joins the frames from one of them only if its own walk has the same %rbp
/// there, or none used it. A global BPF function: checked once.
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn memtrace_note_rule(i: u64, kind: u64, rbp_offset: u64) -> u64 {
    let Some(scratch) = scratch() else { return 0 };
    if scratch.walk_phase != phase::RESUMED {
        return 0;
    }
    let k = i.wrapping_sub(u64::from(scratch.miss.resume_at));
    if k >= 64 {
        return 0;
    }
    // Bit j: frames from the j-th from the anchor on (those at or after it).
    let since = ((1u16 << (k + 1).min(RESUME_SPS as u64)) - 1) as u8;
    let kind = kind as u8;
    if kind == unwind::kind::CFA_BP || kind == unwind::kind::CFA_BP_DEREF {
        scratch.miss.bp_used |= since & !scratch.walk_bp_restored;
    }
    if rbp_offset != 0 || kind == unwind::kind::SIGNAL {
        scratch.walk_bp_restored |= since;
    }
    0
}

/// Answers of [`memtrace_anchor_step`].
const SEARCHING: u64 = 0;
const NO_ANCHOR: u64 = 1;
const ANCHORED: u64 = 2;

/// Bytes below the lowest address a step reads that a window also takes.
const WINDOW_SLACK: u64 = 64;

/// Makes the stack window in `scratch` cover what stepping out of a frame with `rule`
/// reads (its return address and saved `%rbp`, just below the canonical frame address),
/// reading it in bulk when it does not: each `bpf_probe_read_user` costs far more than the
/// bytes it copies, and frames lie one above the other, so one 2 KiB read serves several.
/// (The window is filled here, before the step, not from inside its reads: there the
/// compiler computed on an undefined register, which the verifier refuses.)
#[inline(always)]
fn cover_step(regs: &Regs, rule: UnwindRule) {
    let base = match rule.kind {
        kind::CFA_SP => regs.sp,
        kind::CFA_BP => regs.bp,
        _ => return, // read word by word
    };
    let cfa = base.wrapping_add(rule.cfa_offset as i64 as u64);
    let low = if rule.rbp_offset < -8 { cfa.wrapping_add(rule.rbp_offset as i64 as u64) } else { cfa.wrapping_sub(8) };
    memtrace_cover_window(low, cfa);
}

/// Reads `[low, high)` of the current task's user stack, and what follows up to 2 KiB,
/// into this CPU's window unless it holds it already (`low` 8-byte aligned: else nothing
/// is read, the step reads word by word). When the full read fails (the top of the stack
/// ends within it), from `low` to the end of its page. A global BPF function: the verifier
/// checks it once, not once per state of the walk step.
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn memtrace_cover_window(low: u64, high: u64) -> u64 {
    const BYTES: u64 = (STACK_WINDOW_WORDS * 8) as u64;
    let Some(scratch) = scratch() else { return 0 };
    let covered = |a: u64| a.wrapping_sub(scratch.win_base) / 8 < scratch.win_words;
    if low & 7 != 0 || (covered(low) && covered(high.wrapping_sub(8))) {
        return 0;
    }
    scratch.win_words = 0;
    let buf = scratch.win.as_mut_ptr() as *mut c_void;
    let from = low.saturating_sub(WINDOW_SLACK);
    // SAFETY: the buffer holds BYTES bytes; the read is checked.
    if unsafe { generated::bpf_probe_read_user(buf, BYTES as u32, from as *const c_void) } == 0 {
        scratch.win_base = from;
        scratch.win_words = BYTES / 8;
        return 1;
    }
    let to_page_end = 4096 - (low & 4095);
    let len = if to_page_end > BYTES { BYTES } else { to_page_end };
    // SAFETY: as above, `len` ≤ BYTES.
    if unsafe { generated::bpf_probe_read_user(buf, len as u32, low as *const c_void) } == 0 {
        scratch.win_base = low;
        scratch.win_words = len / 8;
        return 1;
    }
    0
}

/// A word of the walked user stack: from the window when it holds it, else read alone.
#[inline(always)]
pub(crate) fn read_stack(scratch: &Scratch, addr: u64) -> Option<u64> {
    let index = addr.wrapping_sub(scratch.win_base) / 8;
    if addr & 7 == 0 && index < scratch.win_words {
        return scratch.win.get(index as usize & (STACK_WINDOW_WORDS - 1)).copied();
    }
    read_user_u64(addr)
}

/// The CPU's scratch, if return address `ip` of a frame taken from an earlier walk is still
/// in its slot, just below the frame's stack pointer `sp` (the caller's CFA): the slot read
/// through the stack window, moved first to cover it when it lies outside.
#[inline(always)]
pub(crate) fn still_in_slot(ip: u64, sp: u64) -> Option<&'static mut Scratch> {
    let slot = sp.wrapping_sub(8);
    let outside = {
        let scratch = scratch()?;
        slot.wrapping_sub(scratch.win_base) / 8 >= scratch.win_words
    };
    if outside {
        memtrace_cover_window(slot, sp);
    }
    let scratch = scratch()?;
    (read_stack(scratch, slot) == Some(ip)).then_some(scratch)
}

/// Walks the user stack of process `tgid` from `regs` into `scratch.user_ips`,
/// continuing `hash` with each frame. Returns the frame count, `stack_flags` (TRUNCATED, or
/// MISS with `scratch.miss` holding the registers of the frame that had no table), the
/// hash and the address space.
#[inline(always)]
pub(crate) fn walk_user_tables(scratch: &mut Scratch, tgid: u32, regs: UserRegs, hash: u64) -> (usize, u8, u64, u32) {
    let (known, _) = process_facts(scratch, tgid);
    let Some(asid) = known.filter(|_| config!(unwind_mode) != unwind_mode::COPY_ALWAYS) else {
        // A process not learned yet (or every stack sent as a copy, the perf-style design
        // kept to measure against): the first frame is a miss.
        if known.is_none() {
            bump(counter::UNWIND_NO_MAPPING);
        }
        scratch.user_ips[0] = regs.ip;
        scratch.user_ips[1] = 0;
        scratch.user_ips[MAX_USER_DEPTH] = 0;
        set_miss(&mut scratch.miss, regs.ip, regs.sp, regs.bp, known.unwrap_or(0), regs.exact as u8);
        return (1, stack_flags::MISS | stack_flags::USER_IPS, stack_hash_step(hash, regs.ip), known.unwrap_or(0));
    };
    // The stack is another one now (or has moved on).
    scratch.win_words = 0;
    // A zero the compiler cannot see: five zeroed fields in a row became a call of the
    // byte-at-a-time `memset`, run for every walk.
    // SAFETY: a volatile read of a local.
    let zero = unsafe { core::ptr::read_volatile(&0u64) };
    let mut st = WalkState {
        ip: regs.ip,
        sp: regs.sp,
        bp: regs.bp,
        hash,
        map_start: zero,
        map_end: zero,
        map_bias: zero,
        map_table: zero as u32,
        map_flags: zero as u32,
        asid,
        exact: regs.exact as u32,
        cache_hits: 0,
        tid: pid_tgid().2,
        cache_tag: RANGES_GEN.get(0).map_or(0, |g| *g << 48),
    };
    // Volatile: the steps change these through their own reference to the scratch value,
    // which the compiler cannot see across the helper call.
    // SAFETY (the four accesses): fields of this CPU's scratch value.
    unsafe {
        core::ptr::write_volatile(&mut scratch.walk_n, 0);
        core::ptr::write_volatile(&mut scratch.walk_phase, phase::WALK);
        core::ptr::write_volatile(&mut scratch.walk_top_sp, 0);
        core::ptr::write_volatile(&mut scratch.walk_result, stack_flags::TRUNCATED as u32);
    }
    memtrace_begin_reuse(u64::from(st.tid), u64::from(asid), regs.ip, regs.sp, regs.bp);
    // The same stack as one of the thread's last walks here: taken whole, no step.
    let repeated = !regs.exact && memtrace_repeat_walk(regs.ip, hash) != 0;
    if !repeated {
        // SAFETY: walk_step is a BPF callback taking (index, ctx); ctx is our stack state.
        unsafe { generated::bpf_loop(WALK_STEPS, walk_step as *mut c_void, addr_of_mut!(st) as *mut c_void, 0) };
    }
    // SAFETY: fields of this CPU's scratch value, read after the steps wrote them.
    let (n, walk_phase, result) = unsafe {
        (
            core::ptr::read_volatile(&scratch.walk_n),
            core::ptr::read_volatile(&scratch.walk_phase),
            core::ptr::read_volatile(&scratch.walk_result),
        )
    };
    let n = (n as usize).min(MAX_USER_DEPTH);
    bump_by(counter::UNWIND_FRAMES, n as u64);
    bump_by(counter::UNWIND_CACHE_HITS, u64::from(st.cache_hits));
    if n < MAX_USER_DEPTH {
        scratch.user_ips[n] = 0;
    }
    scratch.user_ips[MAX_USER_DEPTH] = 0;
    if repeated {
        // The anchors are the previous walk's, still true: nothing to note.
        // SAFETY: a field of this CPU's scratch value, written by the repeat.
        return (n, stack_flags::USER_IPS, unsafe { core::ptr::read_volatile(&scratch.walk_reuse_hash) }, asid);
    }
    let phase_exact = u64::from(walk_phase) | u64::from(regs.exact) << FIRST_EXACT_SHIFT;
    let flags = memtrace_end_walk(phase_exact, u64::from(result), u64::from(st.tid), u64::from(asid), n as u64);
    (n, flags as u8 | stack_flags::USER_IPS, st.hash, asid)
}

/// The `stack_flags` of a walk that ended in `walk_phase` with `result` after `n` frames.
/// Its frames become the anchors of the thread's next walks: all of them for a walk that
/// reached the outermost frame, else joined by the earlier anchors above its last frame
/// (a walk cut short at a frame without a table knows only the inner part of the stack).
/// A global BPF function: its answer is one value to the verifier, and what follows the
/// walk is checked once, not once per way it ended. Bit [`FIRST_EXACT_SHIFT`] of
/// `phase_exact`: the walk's first frame was an exact instruction.
#[inline(never)]
#[unsafe(no_mangle)]
pub extern "C" fn memtrace_end_walk(phase_exact: u64, result: u64, tid: u64, asid: u64, n: u64) -> u64 {
    let walk_phase = phase_exact & 0xff;
    let (miss, truncated) = (u64::from(stack_flags::MISS), u64::from(stack_flags::TRUNCATED));
    let flags = match walk_phase as u32 {
        // Frames from an anchor: the copy covers the gap; how the walk from it ended.
        phase::RESUMED if result != miss => miss | (result & truncated),
        phase::RESUMED | phase::SEARCH => miss,
        _ => result,
    };
    let whole = walk_phase as u32 == phase::WALK && result == 0;
    let (Some(a), Some(scratch)) = (ANCHORS.get_ptr_mut(this_cpu()), scratch()) else { return flags };
    // SAFETY: this CPU's value; programs on one CPU do not run concurrently.
    let a = unsafe { &mut *a };
    let mut n = n.min(MAX_USER_DEPTH as u64) as u32;
    if !whole && u64::from(a.tid) == tid && u64::from(a.asid) == asid {
        let (good, cur) = a.good_cur();
        let mut merge = Merge { from: 0, to: n, top_sp: scratch.walk_top_sp, good: good as u32, cur: cur as u32 };
        // SAFETY: merge_step is a BPF callback taking (index, ctx); ctx is our stack state.
        unsafe {
            generated::bpf_loop(MAX_USER_DEPTH as u32, merge_step as *mut c_void, addr_of_mut!(merge) as *mut c_void, 0)
        };
        n = merge.to;
    }
    let first_exact = (phase_exact >> FIRST_EXACT_SHIFT) as u32 & 1;
    a.whole = whole as u32;
    a.first_exact = first_exact;
    a.tid = tid as u32;
    a.asid = asid as u32;
    a.n = n;
    let time = match core::mem::replace(&mut scratch.walk_time, 0) {
        // SAFETY: no preconditions.
        0 => unsafe { generated::bpf_ktime_get_ns() },
        t => t,
    };
    // The walk's buffer: a repeat may take it when it is whole from a return address.
    let cur = a.good_cur().1;
    a.buf_tid[cur] = tid as u32;
    a.buf_asid[cur] = asid as u32;
    a.buf_n[cur] = if whole && first_exact == 0 { n } else { 0 };
    a.make_newest(cur, time);
    flags
}

/// Where `memtrace_end_walk` finds whether the walk's first frame was exact.
const FIRST_EXACT_SHIFT: u32 = 8;

/// Appending the earlier anchors above a partial walk's last frame to it.
#[repr(C)]
struct Merge {
    /// The next earlier anchor to look at, and where it goes.
    from: u32,
    to: u32,
    top_sp: u64,
    /// The buffer of the earlier anchors, and the walk's.
    good: u32,
    cur: u32,
}

#[inline(never)]
extern "C" fn merge_step(_index: u64, state: *mut c_void) -> i64 {
    // SAFETY: bpf_loop hands back the pointer to the Merge on the caller's stack.
    let m = unsafe { &mut *(state as *mut Merge) };
    let Some(a) = ANCHORS.get_ptr_mut(this_cpu()) else { return 1 };
    // SAFETY: this CPU's value; programs on one CPU do not run concurrently.
    let a = unsafe { &mut *a };
    let (from, to) = (m.from as usize, m.to as usize);
    if from >= MAX_USER_DEPTH || to >= MAX_USER_DEPTH || m.from >= a.n {
        return 1;
    }
    m.from += 1;
    let (good, cur) = (m.good as usize & (ANCHOR_BUFFERS - 1), m.cur as usize & (ANCHOR_BUFFERS - 1));
    let frame = a.frames[good][from];
    if frame.sp > m.top_sp {
        a.frames[cur][to] = frame;
        m.to += 1;
    }
    0
}

/// `bpf_loop` steps of a walk at most: a step per frame, and per frame of the last whole
/// walk an anchor search may pass.
const WALK_STEPS: u32 = 2 * MAX_USER_DEPTH as u32 + ANCHOR_TRIES;
