//! Every map the programs share, declared once (but the threads' in-flight allocator
//! calls, in task storage: `inflight`): the per-CPU rings, loss counters, the
//! traced set, kernel blocks of traced tasks, sampling state,
//! the unwinder's address spaces, per-file tables and rule cache, and what the mapping
//! tracker remembers between a file's open and its mmap, and the program arrays that lead
//! to the second halves of the allocation programs.
use aya_ebpf::{
    bindings::BPF_F_NO_PREALLOC,
    btf_maps::{Array, ArrayOfMaps, HashMap, LpmTrie, LruHashMap, PerCpuArray, ProgramArray, RingBuf},
    macros::btf_map,
};
use memtrace_common::{
    FILENAME_LEN, FileId, FileTable, MAX_CPUS, MAX_TABLES, MAX_USER_DEPTH, MappingKey, MappingValue, RULE_CACHE_SLOTS,
    SAMPLED_LIVE_ENTRIES, SampledKey, TABLE_MAPS, counter, python::PY_SENT_KEYS, unwind::RETURN_SLOTS,
};

use crate::{
    kstack::{KStackSet, KStackWork},
    stack::Scratch,
};

pub(crate) const RING_TEMPLATE_BYTES: usize = 1 << 20;

#[btf_map]
pub(crate) static RINGS: ArrayOfMaps<RingBuf<u8, RING_TEMPLATE_BYTES>, { MAX_CPUS as usize }> = ArrayOfMaps::new();

pub(crate) type Ring = RingBuf<u8, RING_TEMPLATE_BYTES>;

#[btf_map]
pub(crate) static COUNTERS: PerCpuArray<u64, { counter::COUNT as usize }> = PerCpuArray::new();

/// tgid → `traced::*` state, when not tracing every process.
#[btf_map]
pub(crate) static TRACED: HashMap<u32, u32, 16384> = HashMap::new();

/// Changes after every change of [`TRACED`] (by the probes or by userspace, the map first):
/// a thread's answer kept in its task storage (`inflight::traced_thread`) holds while this
/// reads as it did when the answer was looked up.
#[btf_map]
pub(crate) static TRACED_GEN: Array<u64, 1> = Array::new();

/// Adds one to a generation word, atomically: the add is also a full barrier, so the
/// change it marks is visible to any CPU that sees the new generation, and racing CPUs
/// cannot leave it unchanged.
#[inline(always)]
pub(crate) fn bump_generation(word: Option<*mut u64>) {
    if let Some(g) = word {
        // SAFETY: a word of a global array map, changed by a BPF atomic add.
        unsafe { core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::SeqCst }>(g, 1) };
    }
}

/// Marks a change of [`TRACED`] (after it is made).
#[inline(always)]
pub(crate) fn traced_changed() {
    bump_generation(TRACED_GEN.get_ptr_mut(0));
}

/// Kernel blocks allocated by traced tasks (pid mode), so their frees are seen from any
/// context. Pages (keyed by their `struct page`) carry [`PAGE_KEY`].
#[btf_map]
pub(crate) static KERNEL_LIVE: HashMap<u64, u8, 262144> = HashMap::new();
pub(crate) const PAGE_KEY: u64 = 1 << 63;

/// Stack hashes whose frames were already sent. Forgetting one only costs a resend.
#[btf_map]
pub(crate) static STACKS_SENT: LruHashMap<u64, u8, 65536> = LruHashMap::new();

/// Changes whenever a stack record could not be sent (its hash left [`STACKS_SENT`]): each
/// CPU's memory of the stacks it saw sent (`Scratch::sent_recent`) holds only while this
/// reads as it did when they were remembered.
#[btf_map]
pub(crate) static STACKS_LOST_GEN: Array<u64, 1> = Array::new();

/// Keys of the Python frames sent (`PyStackHeader::shared`), by process and frames: not
/// an LRU, so that a key the probes hold is one userspace holds too (it forgets a
/// process's keys when it exits, here and there); when full, frames go with each stack.
#[btf_map]
pub(crate) static PY_SENT: HashMap<u64, u8, { PY_SENT_KEYS as usize }> = HashMap::new();

/// Slab caches whose name was already sent.
#[btf_map]
pub(crate) static CACHES_SENT: LruHashMap<u64, u8, 4096> = LruHashMap::new();

/// Sampling switched on at run time when the rings overflow: index 0, the mean bytes (0:
/// off); index 1, non-zero once userspace has put the blocks live at the switch into
/// SAMPLED_LIVE, from when only the frees of blocks there are sent (before, all are).
#[btf_map]
pub(crate) static SAMPLE_OVERRIDE: Array<u64, 2> = Array::new();

/// Sampled mode: bytes left before the next sample, per CPU.
#[btf_map]
pub(crate) static SAMPLE_COUNTDOWN: PerCpuArray<i64, 1> = PerCpuArray::new();

/// Sampled mode (configured, or switched on under overload): the sampled user blocks still
/// live (once frees are filtered, theirs are the only ones sent). Entries are allocated
/// when inserted: preallocating 2^18 of them took ~9 ms of every start.
#[btf_map]
pub(crate) static SAMPLED_LIVE: HashMap<SampledKey, u8, SAMPLED_LIVE_ENTRIES, { BPF_F_NO_PREALLOC as usize }> =
    HashMap::new();

/// Configured sampling: how many blocks in [`SAMPLED_LIVE`] hash to each slot
/// (`sampling::filter_slot`), so that most frees, of blocks never sampled, are turned away
/// by one array read instead of a hash lookup. Counted atomically by the probes alone
/// (under the overload switch userspace fills `SAMPLED_LIVE` too, and the set is asked
/// directly).
#[btf_map]
pub(crate) static SAMPLED_FILTER: Array<u64, { SAMPLED_FILTER_SLOTS as usize }> = Array::new();
pub(crate) const SAMPLED_FILTER_SLOTS: u32 = 16384;

/// Each CPU's scratch space, at the CPU's index (userspace sizes it for the possible CPUs
/// at load). A plain array, not a per-CPU one: a per-CPU value is at most 32 KiB, and the
/// walk of [`MAX_USER_DEPTH`] frames with a stack copy needs more.
#[btf_map]
pub(crate) static SCRATCH: Array<Scratch, 1> = Array::new();

/// Kernel stacks kept with the slots of their return addresses (`kstack`), by kind, call
/// site and syscall.
#[btf_map]
pub(crate) static KSTACKS: LruHashMap<u64, KStackSet, 2048> = LruHashMap::new();

/// `kstack`'s per-CPU working space.
#[btf_map]
pub(crate) static KSTACK_WORK: PerCpuArray<KStackWork, 1> = PerCpuArray::new();

/// Index 0: `kmem_finish`, the second half of the kmem allocation programs (`finish`);
/// index 1: `kmem_user`, which `kmem_finish` tail-calls for the user part of the stack. A
/// program array takes programs of one type, hence one per type.
#[btf_map]
pub(crate) static KERNEL_FINISH: ProgramArray<2> = ProgramArray::new();

/// Index 0: `user_finish`, the second half of the allocation return probes (`finish`).
#[btf_map]
pub(crate) static USER_FINISH: ProgramArray<1> = ProgramArray::new();

/// Index 0: `user_finish_session`, the second half of the uprobe session program.
#[btf_map]
pub(crate) static SESSION_FINISH: ProgramArray<1> = ProgramArray::new();

/// tgid → its address-space id: a new one at each exec (given in the kernel), the
/// parent's at fork; userspace gives one to processes that existed before tracing began.
#[btf_map]
pub(crate) static ASIDS: HashMap<u32, u32, 65536> = HashMap::new();

/// Changes after every change of [`ASIDS`] or of `PY_PROCS` (by the probes or by
/// userspace, the map first): each CPU's memory of the last process it walked a stack of
/// (`Scratch::proc_*`) holds while this reads as it did when that was looked up.
#[btf_map]
pub(crate) static PROC_GEN: Array<u64, 1> = Array::new();

/// Marks a change of [`ASIDS`] or `PY_PROCS` (after it is made).
#[inline(always)]
pub(crate) fn process_changed() {
    bump_generation(PROC_GEN.get_ptr_mut(0));
}

/// Execs counted per CPU, for new address-space ids.
#[btf_map]
pub(crate) static NEXT_ASID: PerCpuArray<u32, 1> = PerCpuArray::new();

/// (address space, address) → the file table and bias of the executable mapping there.
#[btf_map]
pub(crate) static MAPPINGS: LpmTrie<MappingKey, MappingValue, 262144> = LpmTrie::new();

/// `BPF_F_INNER_MAP | BPF_F_MMAPABLE`: tables differ in size and userspace fills them
/// through a memory mapping.
pub(crate) const TABLE_FLAGS: usize = (1 << 12) | (1 << 10);

/// One unwind table per file (`memtrace_common::unwind::table` says how it is laid out),
/// at its slot, or in a map installed ahead of need past `MAX_TABLES` ([`SLOT_MAPS`]); no
/// map there: the table is not built yet.
#[btf_map]
pub(crate) static TABLES: ArrayOfMaps<Array<u64, 1, TABLE_FLAGS>, { TABLE_MAPS as usize }> = ArrayOfMaps::new();

/// Slot → the entry of [`TABLES`] its table was written into (0: its own slot's).
#[btf_map]
pub(crate) static SLOT_MAPS: Array<u32, { MAX_TABLES as usize }> = Array::new();

/// Files whose table is installed: the probes add their mappings to an address space at
/// exec and mmap, before userspace hears of them.
#[btf_map]
pub(crate) static FILE_TABLES: HashMap<FileId, FileTable, 16384> = HashMap::new();

/// The current task's return instances (slot, return address), newest first, as a miss's
/// stack copy is sent (`unwind::memtrace_return_slots`): a map of its own, not the
/// scratch, which the program sending the copy holds borrowed.
#[btf_map]
pub(crate) static RETURNS_SEEN: PerCpuArray<[u64; 2 * RETURN_SLOTS], 1> = PerCpuArray::new();

/// Set while a program of ours updates a map that allocates kernel memory (the address
/// spaces' trie): the kmem programs that run nested on this CPU ignore those allocations,
/// which are memtrace's own, not the traced program's.
#[btf_map]
pub(crate) static PROBE_BUSY: PerCpuArray<u32, 1> = PerCpuArray::new();

/// Changes when userspace replaces an executable range of a live address space with
/// another file's (dlclose, then a library mapped at the same address): the rule cache is
/// keyed by address and address space, and what it held there is the old file's.
#[btf_map]
pub(crate) static RANGES_GEN: Array<u64, 1> = Array::new();

/// A rule found for an address of an address space, cached per CPU (direct-mapped).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct CachedRule {
    /// The address, its top 16 bits XORed with [`RANGES_GEN`]'s low 16 when it was cached
    /// (user addresses leave them clear): an entry from before a range was replaced misses.
    pub(crate) addr: u64,
    pub(crate) asid: u32,
    /// `unwind::encode_rule` of the rule.
    pub(crate) rule: u32,
}

/// Each CPU's last table walks (see [`Anchors`]), at the CPU's index (sized at load, as
/// [`SCRATCH`] and for the same reason: four walks of [`MAX_USER_DEPTH`] frames are 48 KiB).
#[btf_map]
pub(crate) static ANCHORS: Array<Anchors, 1> = Array::new();

/// Buffers of walked frames each CPU keeps in [`Anchors`] (a power of two: indices are masked).
pub(crate) const ANCHOR_BUFFERS: usize = 4;

/// The frames (return address, stack pointer, frame pointer) of the last table walks on
/// this CPU, and of the walk under way: [`ANCHOR_BUFFERS`] buffers. `good` names the last
/// walk's (joined by earlier ones above its last frame); the walk under way writes `cur`,
/// the least recently used of the others. A later walk of the same thread that misses a
/// table goes on from the innermost of `good`'s frames still on its stack
/// (`unwind::memtrace_anchor_step`), taken from the CPU where that thread walked last; one
/// whose first frame is the first frame of any buffer's whole walk, with every return
/// address above still in its slot, takes that walk's frames without a step
/// (`reuse::memtrace_repeat_walk`): a thread alternating between a few allocation sites
/// (a B-tree insert's node, cell and overflow buffers) repeats one of its last few stacks
/// far more often than its very last one.
#[repr(C)]
pub(crate) struct Anchors {
    /// The thread and address space of the walk in buffer `good`, and its frame count.
    pub(crate) tid: u32,
    pub(crate) asid: u32,
    pub(crate) n: u32,
    pub(crate) good: u32,
    /// When that walk ended: a thread moved to another CPU left newer anchors there.
    pub(crate) time: u64,
    /// That walk reached the outermost frame by itself (not joined by earlier anchors):
    /// the next walk of the thread may reuse its frames (`reuse`).
    pub(crate) whole: u32,
    /// That walk's first frame was an exact instruction (a kmem walk from the syscall's
    /// registers), not a return address: a later walk from a return address at the same
    /// place is not the same frame, and takes nothing from it at its first frame.
    pub(crate) first_exact: u32,
    /// The buffer the next walk writes: never `good`.
    pub(crate) cur: u32,
    pub(crate) _pad: u32,
    /// Per buffer, the walk it holds: its thread, address space and frame count (0 when a
    /// repeat cannot take it: cut short, joined, or from an exact first frame), and when
    /// it was last walked or repeated.
    pub(crate) buf_tid: [u32; ANCHOR_BUFFERS],
    pub(crate) buf_asid: [u32; ANCHOR_BUFFERS],
    pub(crate) buf_n: [u32; ANCHOR_BUFFERS],
    pub(crate) _pad_buf: [u32; ANCHOR_BUFFERS],
    pub(crate) buf_used: [u64; ANCHOR_BUFFERS],
    /// Each buffer's frames, innermost first.
    pub(crate) frames: [[AnchorFrame; MAX_USER_DEPTH]; ANCHOR_BUFFERS],
}

/// A walked frame: its return address (or exact instruction), stack and frame pointers,
/// side by side: a check of a frame reads one cache line and a copy writes one (three
/// arrays of each made it six, in a value bigger than the L1 cache).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct AnchorFrame {
    pub(crate) ip: u64,
    pub(crate) sp: u64,
    pub(crate) bp: u64,
}

impl Anchors {
    /// `good` and `cur` as indices.
    #[inline(always)]
    pub(crate) fn good_cur(&self) -> (usize, usize) {
        (self.good as usize & (ANCHOR_BUFFERS - 1), self.cur as usize & (ANCHOR_BUFFERS - 1))
    }

    /// Makes buffer `j`, which holds a walk that ended (or was repeated) at `time`, the
    /// newest, and `cur` the least recently used of the others.
    #[inline(always)]
    pub(crate) fn make_newest(&mut self, j: usize, time: u64) {
        let j = j & (ANCHOR_BUFFERS - 1);
        self.good = j as u32;
        self.time = time;
        self.buf_used[j] = time;
        let mut pick = (j + 1) & (ANCHOR_BUFFERS - 1);
        let mut k = 0;
        while k < ANCHOR_BUFFERS {
            if k != j && self.buf_used[k] < self.buf_used[pick] {
                pick = k;
            }
            k += 1;
        }
        self.cur = pick as u32;
    }
}

/// Each CPU's `RULE_CACHE_SLOTS` slots, from `cpu * RULE_CACHE_SLOTS` on (userspace sizes
/// it for the possible CPUs at load). A plain array, not a per-CPU one: the kernel makes a
/// per-CPU array's slots one allocation each, 8192 of them (~8 ms of every start).
#[btf_map]
pub(crate) static RULE_CACHE: Array<CachedRule, { RULE_CACHE_SLOTS as usize }> = Array::new();

/// `openat` in flight: pid_tgid → the user pointer to the file name.
#[btf_map]
pub(crate) static OPENAT_ARGS: HashMap<u64, u64, 16384> = HashMap::new();

/// Files traced processes opened: (tgid << 32 | fd) → path.
#[btf_map]
pub(crate) static FD_PATHS: LruHashMap<u64, [u8; FILENAME_LEN], 8192> = LruHashMap::new();

/// Names a path is walked up through at most (`path`; a power of two).
pub(crate) const PATH_PARTS: usize = 32;

/// Where a file's absolute path is built (`path`): the names' pointers, innermost first,
/// then the path, twice as long as a path can be so that each name's read stays inside.
#[repr(C)]
pub(crate) struct PathWalk {
    pub(crate) parts: [u64; PATH_PARTS],
    pub(crate) buf: [u8; 2 * FILENAME_LEN],
}

#[btf_map]
pub(crate) static PATH_WALK: PerCpuArray<PathWalk, 1> = PerCpuArray::new();

#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct MmapArgs {
    pub(crate) len: u64,
    pub(crate) offset: u64,
    /// The file descriptor; u64::MAX for anonymous memory.
    pub(crate) fd: u64,
    /// `mprotect`'s address (0: an `mmap`, whose start is what it returns; nothing is
    /// mapped at 0).
    pub(crate) addr: u64,
}

/// `mmap` with PROT_EXEC in flight: pid_tgid → its arguments.
#[btf_map]
pub(crate) static MMAP_ARGS: HashMap<u64, MmapArgs, 16384> = HashMap::new();

/// A CUDA driver allocation call between entry and return (`gpu.rs`).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct GpuInFlight {
    pub(crate) kind: u8,
    /// Device ordinal + 1 (0: not known).
    pub(crate) device: u8,
    pub(crate) _pad: [u8; 6],
    pub(crate) sp: u64,
    pub(crate) bytes_req: u64,
    /// Where the call stores its result (device pointer, handle).
    pub(crate) out: u64,
    /// Pitched: where the pitch is stored; map: the address mapped.
    pub(crate) pitch: u64,
    pub(crate) height: u64,
}

/// CUDA driver allocation calls between entry and return, by pid_tgid.
#[btf_map]
pub(crate) static GPU_INFLIGHT: HashMap<u64, GpuInFlight, 16384> = HashMap::new();

/// tgid → how to walk its CPython interpreter's frames (`python.rs`), written by
/// userspace when it finds an interpreter in a traced process.
#[btf_map]
pub(crate) static PY_PROCS: HashMap<u32, memtrace_common::python::PyProcInfo, 16384> = HashMap::new();

/// A code object whose record was sent: (tgid, code address, its check: the first line and
/// a hash of the globals of the frame that showed it). Forgetting one only costs a resend.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct PyCodeKey {
    pub(crate) tgid: u64,
    pub(crate) code: u64,
    pub(crate) check: u64,
}

#[btf_map]
pub(crate) static PY_CODES_SENT: LruHashMap<PyCodeKey, u8, 65536> = LruHashMap::new();

/// The bytes at a code object's `co_firstlineno` as a walk read them, for a frame of that
/// code object with those globals, cached per CPU (direct-mapped) for a few milliseconds
/// (`python.rs`).
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct CachedCheck {
    pub(crate) code: u64,
    pub(crate) globals: u64,
    pub(crate) check: u64,
    /// When it was read (`bpf_ktime_get_ns`).
    pub(crate) stamp: u64,
    pub(crate) tgid: u32,
    pub(crate) _pad: u32,
}

pub(crate) const PY_CHECK_SLOTS: u32 = 1024;

#[btf_map]
pub(crate) static PY_CHECKS: PerCpuArray<CachedCheck, { PY_CHECK_SLOTS as usize }> = PerCpuArray::new();
