//! The wire contract between memtrace's eBPF programs and its userspace reader: the records
//! the probes write into the per-CPU ring buffers, the probe configuration userspace writes
//! into the programs' read-only data, and the map/counter indices both sides agree on.
//!
//! Every record is `#[repr(C)]`, starts with a one-byte [`RecordType`], and has no implicit
//! padding (the `const` assertions at the bottom check sizes, so a field added in the wrong
//! place fails the build). Userspace must check a record's length before reading it.
//!
//! Over 500 lines: the wire contract is one place both sides compile against: each record with its layout and the constants both sides agree on (the unwind part is in unwind.rs).
#![no_std]

pub mod python;
pub mod unwind;

pub use unwind::{
    FileId, FileTable, KERNEL_STACK_SEED, MAX_TABLES, MISS_HASH_MARK, MappingKey, MappingValue, RULE_CACHE_SLOTS,
    TABLE_MAPS, UNWIND_ANCHORED_COPY_BYTES, UNWIND_COPY_BYTES, UPROBE_TRAMPOLINE_PAGE, USER_STACK_SEED, UnwindMiss,
    UnwindRule, stack_hash_step,
};

/// Deepest kernel part, and deepest frame-pointer walk (the kernel's walks are bounded by
/// `perf_event_max_stack` as well, 127 by default).
pub const MAX_STACK_DEPTH: usize = 255;

/// Deepest user part the probes' table walk takes: Python programs commonly run 150–250
/// native frames deep, and a chain of nested imports (a package importing its
/// submodules, each importing more) well over 255: seven in ten of the allocations with
/// a cut-short stack in a pandas/pyarrow script were cut at 255 frames.
pub const MAX_USER_DEPTH: usize = 511;

/// One kernel stack taken from an earlier unwind of its path in this many (per CPU) is
/// unwound anyway and compared (the probes' `kstack`; the report's warning says so).
pub const KSTACK_CHECK_EVERY: u32 = 64;
/// Size of the outer array that holds one ring buffer per CPU.
pub const MAX_CPUS: u32 = 1024;
/// Length of `task->comm`.
pub const COMM_LEN: usize = 16;
/// Bytes of the exec'd file name kept in a [`TaskRecord`].
pub const FILENAME_LEN: usize = 256;

/// First byte of every ring record.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordType {
    UserAlloc = 1,
    Free = 2,
    KernelAlloc = 3,
    Stack = 4,
    Task = 5,
    Mapping = 6,
    Cache = 7,
    /// A Python code object, the first time a stack of its process shows it
    /// ([`python::PyCodeRecord`]).
    PyCode = 8,
    /// The Python frames of a stack, just before the stack's record
    /// ([`python::PyStackHeader`] and its frames).
    PyStack = 9,
}

impl RecordType {
    pub const fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::UserAlloc,
            2 => Self::Free,
            3 => Self::KernelAlloc,
            4 => Self::Stack,
            8 => Self::PyCode,
            9 => Self::PyStack,
            5 => Self::Task,
            6 => Self::Mapping,
            7 => Self::Cache,
            _ => return None,
        })
    }
}

/// Which entry point produced an allocation or a free. The value doubles as the uprobe
/// attach cookie, so one program serves every function of the malloc family.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Malloc = 1,
    Calloc = 2,
    Realloc = 3,
    ReallocArray = 4,
    PosixMemalign = 5,
    AlignedAlloc = 6,
    Memalign = 7,
    Valloc = 8,
    Pvalloc = 9,
    Mmap = 10,
    /// C++ `operator new`/`new[]` (plain and nothrow) served by the allocator itself.
    New = 11,
    /// C++17 aligned `operator new` (size, alignment).
    NewAligned = 12,
    /// jemalloc's `mallocx(size, flags)`.
    Mallocx = 13,
    /// jemalloc's `rallocx(ptr, size, flags)`.
    Rallocx = 14,
    /// An `mmap` with `PROT_NONE`: address space reserved, no memory (the CUDA driver
    /// reserves tens of GB at `cuInit`; allocators reserve their arenas so). Recorded by
    /// the `mmap` probes; pairs with `munmap` like any mapping.
    MmapReserved = 15,
    Free = 16,
    Munmap = 17,
    /// CUDA driver API (`Kind::is_gpu`): `cuMemAlloc_v2`.
    GpuDevice = 18,
    /// `cuMemAllocAsync` (the device's default pool).
    GpuAsync = 19,
    /// `cuMemAllocFromPoolAsync`.
    GpuPool = 20,
    /// `cuMemAllocManaged`.
    GpuManaged = 21,
    /// `cuMemAllocPitch_v2`: bytes_alloc is pitch × height.
    GpuPitched = 22,
    /// `cuMemCreate`: physical memory, named by a handle.
    GpuPhysical = 23,
    /// `cuMemAddressReserve`: a virtual address range, no memory.
    GpuReserve = 24,
    /// `cuMemAllocHost_v2`, `cuMemHostAlloc`: page-locked host memory.
    GpuHostPinned = 25,
    /// `cuMemMap`: physical memory mapped into a reserved range.
    GpuMap = 26,
    /// `cuMemFree_v2`, `cuMemFreeAsync`.
    GpuFree = 27,
    /// `cuMemFreeHost`.
    GpuFreeHost = 28,
    /// `cuMemRelease`.
    GpuRelease = 29,
    /// `cuMemAddressFree`.
    GpuAddressFree = 30,
    /// `cuMemUnmap`.
    GpuUnmap = 31,
    Kmalloc = 32,
    KmemCacheAlloc = 33,
    PageAlloc = 34,
    /// `mremap(old, old_len, new_len, flags, …)`: a probe's kind only. The call is
    /// recorded as what it does: the old mapping's `Munmap` (unless `MREMAP_DONTUNMAP`)
    /// and the new one's `Mmap`, at the caller's stack.
    Mremap = 35,
    Kfree = 40,
    KmemCacheFree = 41,
    PageFree = 42,
}

impl Kind {
    pub const fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::Malloc,
            2 => Self::Calloc,
            3 => Self::Realloc,
            4 => Self::ReallocArray,
            5 => Self::PosixMemalign,
            6 => Self::AlignedAlloc,
            7 => Self::Memalign,
            8 => Self::Valloc,
            9 => Self::Pvalloc,
            10 => Self::Mmap,
            11 => Self::New,
            12 => Self::NewAligned,
            13 => Self::Mallocx,
            14 => Self::Rallocx,
            15 => Self::MmapReserved,
            16 => Self::Free,
            17 => Self::Munmap,
            18 => Self::GpuDevice,
            19 => Self::GpuAsync,
            20 => Self::GpuPool,
            21 => Self::GpuManaged,
            22 => Self::GpuPitched,
            23 => Self::GpuPhysical,
            24 => Self::GpuReserve,
            25 => Self::GpuHostPinned,
            26 => Self::GpuMap,
            27 => Self::GpuFree,
            28 => Self::GpuFreeHost,
            29 => Self::GpuRelease,
            30 => Self::GpuAddressFree,
            31 => Self::GpuUnmap,
            32 => Self::Kmalloc,
            33 => Self::KmemCacheAlloc,
            34 => Self::PageAlloc,
            35 => Self::Mremap,
            40 => Self::Kfree,
            41 => Self::KmemCacheFree,
            42 => Self::PageFree,
            _ => return None,
        })
    }

    /// The address space a block of this kind lives in; allocations and frees pair up only
    /// within one.
    pub const fn space(self) -> Space {
        match self {
            Self::Malloc
            | Self::Calloc
            | Self::Realloc
            | Self::ReallocArray
            | Self::PosixMemalign
            | Self::AlignedAlloc
            | Self::Memalign
            | Self::Valloc
            | Self::Pvalloc
            | Self::New
            | Self::NewAligned
            | Self::Mallocx
            | Self::Rallocx
            | Self::Free => Space::Heap,
            Self::Mmap | Self::MmapReserved | Self::Munmap | Self::Mremap => Space::Mmap,
            Self::Kmalloc | Self::KmemCacheAlloc | Self::Kfree | Self::KmemCacheFree => Space::Slab,
            Self::PageAlloc | Self::PageFree => Space::Page,
            Self::GpuDevice
            | Self::GpuAsync
            | Self::GpuPool
            | Self::GpuManaged
            | Self::GpuPitched
            | Self::GpuHostPinned
            | Self::GpuFree
            | Self::GpuFreeHost => Space::GpuMemory,
            Self::GpuPhysical | Self::GpuRelease => Space::GpuHandle,
            Self::GpuReserve | Self::GpuAddressFree => Space::GpuReserve,
            Self::GpuMap | Self::GpuUnmap => Space::GpuMap,
        }
    }

    pub const fn is_free(self) -> bool {
        matches!(
            self,
            Self::Free
                | Self::Munmap
                | Self::Kfree
                | Self::KmemCacheFree
                | Self::PageFree
                | Self::GpuFree
                | Self::GpuFreeHost
                | Self::GpuRelease
                | Self::GpuAddressFree
                | Self::GpuUnmap
        )
    }

    /// A CUDA driver API call (the `gpu` domain).
    pub const fn is_gpu(self) -> bool {
        matches!(self.space(), Space::GpuMemory | Space::GpuHandle | Space::GpuReserve | Space::GpuMap)
    }

    /// GPU address ranges (reserved, mapped) rather than memory: counted apart so physical
    /// memory is not counted twice.
    pub const fn is_gpu_address(self) -> bool {
        matches!(self.space(), Space::GpuReserve | Space::GpuMap)
    }

    pub const fn is_kernel(self) -> bool {
        matches!(self.space(), Space::Slab | Space::Page)
    }

    pub const fn name(self) -> &'static str {
        match self {
            Self::Malloc => "malloc",
            Self::Calloc => "calloc",
            Self::Realloc => "realloc",
            Self::ReallocArray => "reallocarray",
            Self::PosixMemalign => "posix_memalign",
            Self::AlignedAlloc => "aligned_alloc",
            Self::Memalign => "memalign",
            Self::Valloc => "valloc",
            Self::Pvalloc => "pvalloc",
            Self::Mmap => "mmap",
            Self::MmapReserved => "mmap_reserve",
            Self::New => "new",
            Self::NewAligned => "new_aligned",
            Self::Mallocx => "mallocx",
            Self::Rallocx => "rallocx",
            Self::Free => "free",
            Self::Munmap => "munmap",
            Self::Mremap => "mremap",
            Self::Kmalloc => "kmalloc",
            Self::KmemCacheAlloc => "cache",
            Self::PageAlloc => "page",
            Self::Kfree => "kfree",
            Self::KmemCacheFree => "cache_free",
            Self::PageFree => "page_free",
            Self::GpuDevice => "device",
            Self::GpuAsync => "async",
            Self::GpuPool => "pool",
            Self::GpuManaged => "managed",
            Self::GpuPitched => "pitched",
            Self::GpuPhysical => "physical",
            Self::GpuReserve => "reserve",
            Self::GpuHostPinned => "host_pinned",
            Self::GpuMap => "map",
            Self::GpuFree => "gpu_free",
            Self::GpuFreeHost => "gpu_free_host",
            Self::GpuRelease => "gpu_release",
            Self::GpuAddressFree => "gpu_address_free",
            Self::GpuUnmap => "gpu_unmap",
        }
    }
}

/// Address spaces in which blocks are paired.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Space {
    /// The user allocator's heap, per process.
    Heap = 0,
    /// Anonymous or file mappings made through the allocator library's `mmap`, per process.
    Mmap = 1,
    /// Kernel slab objects (kmalloc and kmem caches), one space for the machine.
    Slab = 2,
    /// Kernel pages, keyed by page frame number.
    Page = 3,
    /// GPU device, managed and pinned host memory from the CUDA driver, per process.
    GpuMemory = 4,
    /// Physical GPU memory made with `cuMemCreate`, keyed by its handle, per process.
    GpuHandle = 5,
    /// GPU virtual address ranges reserved with `cuMemAddressReserve`, per process.
    GpuReserve = 6,
    /// Physical memory mapped into a reserved range (`cuMemMap`), freed by range.
    GpuMap = 7,
}

/// Bits of a record's `flags` byte.
pub mod flags {
    /// `bytes_alloc` is the allocator's usable size (`malloc_usable_size`): read from its
    /// own metadata (glibc chunk header) by the probes, or computed from the family's size
    /// classes in user space; otherwise it is a copy of `bytes_req` ("unknown").
    pub const USABLE_EXACT: u8 = 1 << 0;
    /// The free is the old block of a successful `realloc`/`reallocarray`, or the old
    /// mapping of an `mremap`; the mmap is the new mapping of an `mremap`.
    pub const BY_REALLOC: u8 = 1 << 1;
    /// Kernel event raised in hard-IRQ, soft-IRQ or NMI context: not on behalf of a task.
    pub const IRQ: u8 = 1 << 2;
    /// `stack` holds a valid stack hash.
    pub const HAS_STACK: u8 = 1 << 3;
    /// The allocation came from a thread whose tgid is traced, while the block is freed from
    /// a context that is not (kernel frees of blocks the target allocated).
    pub const FOREIGN_FREE: u8 = 1 << 4;
    /// TaskRecord exit: the whole thread group is gone.
    pub const GROUP_DEAD: u8 = 1 << 5;
    /// TaskRecord exec: `filename` is the absolute path of the file the kernel mapped, from
    /// the root of the mount tree (the probes walked it up from the file); else it is the
    /// name exec was given.
    pub const EXE_PATH: u8 = 1 << 0;
    /// TaskRecord fork: the child shares its parent's memory (`CLONE_VM`: `vfork`,
    /// `posix_spawn`) until it execs or exits; what it allocates there is its parent's heap.
    pub const SHARED_MEMORY: u8 = 1 << 6;
    /// A GPU allocation call that failed: `ptr` holds the `CUresult`, nothing was allocated
    /// (its stack and requested size are what a user looks for after an out-of-memory).
    pub const FAILED: u8 = 1 << 7;
}

/// An allocation by the user-space allocator (malloc family, mmap). 48 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UserAllocRecord {
    pub rtype: u8,
    pub kind: u8,
    pub flags: u8,
    /// The allocator's index in the session plus one (0: not known); GPU kinds: the device
    /// ordinal plus one (0: not known).
    pub allocator: u8,
    pub pid: u32,
    pub tid: u32,
    /// With `flags::USABLE_EXACT`: `bytes_alloc - bytes_req` (what the allocator handed out
    /// beyond the request). Without it: the alignment the call asked for (0: none), from
    /// which user space computes the usable size of the allocator's family.
    pub bytes_extra: u32,
    /// `bpf_ktime_get_ns()` (CLOCK_MONOTONIC) when the call returned.
    pub ts_ns: u64,
    pub ptr: u64,
    pub bytes_req: u64,
    /// Hash naming the user stack; its frames arrive once in a [`StackHeader`] record.
    pub stack: u64,
}

/// A free of any space. 32 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FreeRecord {
    pub rtype: u8,
    pub kind: u8,
    pub flags: u8,
    pub _pad: u8,
    pub pid: u32,
    pub tid: u32,
    /// munmap: length in pages (rounded up); page free: order; otherwise 0.
    pub arg: u32,
    /// For a realloc's old block: when realloc was entered, so the free sorts before any
    /// other thread's reuse of the address.
    pub ts_ns: u64,
    /// Address freed (the `struct page` for pages).
    pub ptr: u64,
}

/// A kernel allocation (kmalloc, kmem_cache_alloc, page allocator). 72 bytes.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelAllocRecord {
    pub rtype: u8,
    pub kind: u8,
    pub flags: u8,
    /// Page allocations: the order.
    pub order: u8,
    pub pid: u32,
    pub tid: u32,
    /// NUMA node asked for (-1: any); page allocations: the migrate type.
    pub node: i32,
    pub bytes_req: u32,
    pub bytes_alloc: u32,
    pub gfp_flags: u32,
    pub _pad: u32,
    pub ts_ns: u64,
    /// Object address (the `struct page` for pages).
    pub ptr: u64,
    /// The kernel function that asked (`call_site` of the tracepoint; 0 for pages).
    pub call_site: u64,
    /// Hash of the kernel stack joined with the user stack of the task it ran for.
    pub stack: u64,
    /// kmem_cache_alloc: the cache (its name arrives once in a [`CacheRecord`]); else 0.
    pub cache: u64,
}

/// Header of a stack record, followed by `n_kernel` kernel addresses (u64) and `n_user`
/// user frames: [`UserFrame`]s from the kernel's frame-pointer walk, or, with
/// [`stack_flags::USER_IPS`], bare addresses (u64) from the probes' own unwinder. A record
/// with [`stack_flags::MISS`] then carries an [`UnwindMiss`] and a copy of the user stack
/// from the frame where the probes' unwinder found no rule. Sent once per distinct stack
/// hash (again if the probes forget it).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackHeader {
    pub rtype: u8,
    /// `stack_flags::*` bits.
    pub flags: u8,
    /// Up to [`MAX_USER_DEPTH`].
    pub n_user: u16,
    /// Process whose address space the user frames belong to.
    pub pid: u32,
    pub hash: u64,
    /// That address space (table walks; 0 for frame-pointer walks).
    pub asid: u32,
    /// Up to [`MAX_STACK_DEPTH`].
    pub n_kernel: u16,
    pub _pad: u16,
    /// The key of the stack's Python frames (`PyStackHeader::hash`; 0: none).
    pub py_key: u64,
}

/// A user frame as `bpf_get_stack(BPF_F_USER_BUILD_ID)` reports it (`struct
/// bpf_stack_build_id`): a build id and file offset when the kernel could resolve them,
/// else the raw instruction pointer.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UserFrame {
    pub status: i32,
    pub build_id: [u8; 20],
    /// File offset when `status == BUILD_ID_VALID`, else the address.
    pub offset_or_ip: u64,
}

impl UserFrame {
    pub const BUILD_ID_EMPTY: i32 = 0;
    pub const BUILD_ID_VALID: i32 = 1;
    pub const BUILD_ID_IP: i32 = 2;
}

/// `StackHeader::flags`.
pub mod stack_flags {
    /// The user frames are u64 addresses, not [`super::UserFrame`]s.
    pub const USER_IPS: u8 = 1;
    /// The user walk stopped before the outermost frame (no unwind information, an
    /// unreadable stack, or the depth limit).
    pub const TRUNCATED: u8 = 2;
    /// The user walk stopped at a frame with no rule learned yet: an [`super::UnwindMiss`]
    /// and a stack copy follow the frames, and userspace finishes the walk.
    pub const MISS: u8 = 4;
    /// A kernel stack joined with the user stack of its task (hashed with the kernel seed).
    pub const KERNEL: u8 = 8;
    /// With [`TRUNCATED`]: cut short at a frame with no rule learned yet, the ring having
    /// no room for the copy that would have finished it.
    pub const NO_ROOM: u8 = 16;
    /// A kernel allocation's stack whose user part is that of the copy sent for an earlier
    /// allocation of the same syscall on this CPU (the same user registers: the user stack
    /// cannot change while its task is in the kernel): after the user addresses, in place
    /// of an [`super::UnwindMiss`] and a copy, the hash of that copy's record, which goes
    /// before it in this CPU's ring (an allocation in an interrupt of the one sending the
    /// copy never refers to it). Userspace finishes it with that copy. (A `fork` of a
    /// shell under a big environment sent 119 copies of 16 KiB, one per page table and
    /// other allocation of the syscall.)
    pub const COPY_REPEAT: u8 = 32;
}

/// `ProbeConfig::unwind_mode`: how the probes walk user stacks.
pub mod unwind_mode {
    /// The kernel's frame-pointer walk (`bpf_get_stack`), frames named by build id.
    pub const FRAME_POINTERS: u32 = 0;
    /// The per-file tables built from `.eh_frame`/`.debug_frame`, walked in the probe;
    /// frames whose table is not ready yet go to userspace with a stack copy.
    pub const TABLES: u32 = 1;
    /// No walk in the probe: every stack is sent as a copy for userspace to unwind (how
    /// `perf --call-graph dwarf` works; kept to measure the two designs side by side).
    pub const COPY_ALWAYS: u32 = 2;
}

/// Code a traced process mapped: an `mmap` with `PROT_EXEC`, of a file opened with
/// `openat` (how ld.so and dlopen load libraries) or of anonymous memory (JIT code), or
/// memory an `mprotect` made executable (JIT code pages), so
/// userspace knows which file an address lies in even when the process is gone before its
/// maps can be read. (A program and its interpreter, which the kernel maps at exec, come
/// with the exec's [`TaskRecord`].)
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MappingRecord {
    pub rtype: u8,
    pub _pad: [u8; 3],
    pub pid: u32,
    /// The address space the mapping is in.
    pub asid: u32,
    /// `mapping_record::*` bits.
    pub flags: u32,
    /// When the mapping was made (the reader handles it in time order with the task
    /// records of other CPUs' rings).
    pub ts_ns: u64,
    pub start: u64,
    pub len: u64,
    /// File offset of `start`.
    pub file_offset: u64,
    /// The path the file was opened by, NUL-terminated.
    pub path: [u8; FILENAME_LEN],
}

/// `MappingRecord::flags`.
pub mod mapping_record {
    /// Executable memory without a file (JIT code).
    pub const ANONYMOUS: u32 = 1;
    /// Made executable by `mprotect` (JIT code pages; rarely a file's pages, which keep
    /// what their file says).
    pub const MADE_EXECUTABLE: u32 = 2;
}

/// The name of a kernel slab cache (`kmem_cache.name`), sent once per cache.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheRecord {
    pub rtype: u8,
    pub _pad: [u8; 7],
    pub cache: u64,
    pub name: [u8; CACHE_NAME_LEN],
}

/// Bytes of a slab cache's name kept.
pub const CACHE_NAME_LEN: usize = 32;

/// What happened to a task.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskEvent {
    /// A new thread group (process) was created by fork/clone without CLONE_THREAD.
    Fork = 1,
    /// A thread was created.
    Thread = 2,
    Exec = 3,
    Exit = 4,
    /// `comm` changed (prctl PR_SET_NAME, pthread_setname_np).
    Rename = 5,
}

impl TaskEvent {
    pub const fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::Fork,
            2 => Self::Thread,
            3 => Self::Exec,
            4 => Self::Exit,
            5 => Self::Rename,
            _ => return None,
        })
    }
}

/// Process lifecycle, so pairing knows when an address space begins and ends and reports
/// can name tasks that are gone. 304 bytes; rare.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TaskRecord {
    pub rtype: u8,
    pub event: u8,
    pub flags: u8,
    pub _pad: u8,
    /// tgid of the task the event is about (the child for Fork/Thread).
    pub pid: u32,
    /// Thread id the event is about.
    pub tid: u32,
    /// Fork/Thread: the parent's tgid; otherwise 0.
    pub ppid: u32,
    pub ts_ns: u64,
    /// Fork: the child's address space (its parent's); exec: the new program's.
    pub asid: u32,
    pub _pad2: u32,
    /// Exec: where the program's code was mapped (`mm.start_code`, `mm.end_code`) and
    /// where its interpreter was loaded (`AT_BASE`; 0: none).
    pub code_start: u64,
    pub code_end: u64,
    pub interp_base: u64,
    pub comm: [u8; COMM_LEN],
    /// Exec: the file name passed to exec, NUL-terminated.
    pub filename: [u8; FILENAME_LEN],
}

impl Default for TaskRecord {
    fn default() -> Self {
        Self {
            rtype: RecordType::Task as u8,
            event: 0,
            flags: 0,
            _pad: 0,
            pid: 0,
            tid: 0,
            ppid: 0,
            ts_ns: 0,
            asid: 0,
            _pad2: 0,
            code_start: 0,
            code_end: 0,
            interp_base: 0,
            comm: [0; COMM_LEN],
            filename: [0; FILENAME_LEN],
        }
    }
}

/// Indices of the per-CPU `COUNTERS` array: what the probes could not deliver or track.
pub mod counter {
    /// Records dropped because the CPU's ring buffer was full.
    pub const LOST_EVENTS: u32 = 0;
    /// Stack records dropped because the ring was full (events keep the hash).
    pub const LOST_STACKS: u32 = 1;
    /// Allocation calls not tracked because the in-flight table was full.
    pub const LOST_INFLIGHT: u32 = 2;
    /// Kernel blocks of traced tasks not remembered because the live table was full; a
    /// later free of one from another context goes unseen.
    pub const LOST_KERNEL_LIVE: u32 = 3;
    /// CPUs with no ring buffer installed (events dropped).
    pub const NO_RING: u32 = 4;
    /// Sampled blocks not remembered because the table was full (their frees go unseen).
    pub const LOST_SAMPLED_LIVE: u32 = 5;
    /// User stacks left truncated at a frame whose table was not ready because the ring had
    /// no room for a stack copy.
    pub const UNWIND_BUDGET: u32 = 6;
    /// Stack walks that met an address in no known mapping of its address space (the
    /// process was not learned yet): a copy was sent.
    pub const UNWIND_NO_MAPPING: u32 = 7;
    /// Stack walks that met a file whose table was not installed yet: a copy was sent.
    pub const UNWIND_NO_TABLE: u32 = 8;
    /// Stack frames walked by the probes (their rule looked up).
    pub const UNWIND_FRAMES: u32 = 9;
    /// Frames whose rule came from the per-CPU rule cache.
    pub const UNWIND_CACHE_HITS: u32 = 10;
    /// Ranges the probes added to an address space themselves (exec, mmap of a file whose
    /// table was registered).
    pub const RANGES_INSTALLED: u32 = 11;
    /// User walks of kmem allocations not redone: an earlier allocation in the same
    /// syscall of the same task walked the same user stack.
    pub const UNWIND_REUSED: u32 = 12;
    /// Returns of malloc-family calls the probes ran for (a uprobe session skips the return
    /// of a call it does not record: an unsampled one, one the allocator makes to itself).
    pub const USER_RETURNS: u32 = 13;
    /// Walks that met a frame without a table and went on from an anchor above it (a frame
    /// of the thread's earlier walks still on the stack): only the gap is copied.
    pub const UNWIND_ANCHORED: u32 = 14;
    /// Frames a walk took from the thread's previous walk, their return addresses checked
    /// on the stack, instead of stepping through each with its rule.
    pub const UNWIND_FRAMES_REUSED: u32 = 15;
    /// Kernel stacks taken from an earlier unwind of the same path, every frame's return
    /// address found in its slot, instead of being unwound.
    pub const KSTACKS_REUSED: u32 = 16;
    /// Kernel stacks unwound anyway (one reuse in 64 per CPU) and found the same as kept.
    pub const KSTACKS_CHECKED: u32 = 17;
    /// Kernel stacks unwound anyway that differed from the kept frames whose slots all
    /// matched: the path is always unwound from then on.
    pub const KSTACKS_DIFFERED: u32 = 18;
    /// User walks whose CPU scratch another program claimed before their frames were sent
    /// (a thread preempted inside a uprobe program, or a kmem tracepoint in an interrupt):
    /// their allocations carry only their call site, marked cut short.
    pub const USER_WALKS_INTERLEAVED: u32 = 19;
    /// Kernel allocations of traced tasks made while a program of ours updated a map
    /// (`PROBE_BUSY`: the address spaces' trie, and the refill of the BPF allocator's
    /// caches it triggers), and their bytes: the probes' own, left out and only counted.
    pub const PROBE_BUSY_ALLOCS: u32 = 20;
    pub const PROBE_BUSY_BYTES: u32 = 21;
    /// `mremap`s whose old mapping the probe could not look up (the memory map's lock was
    /// held for writing: `bpf_find_vma` only tries it): their new mapping is recorded as
    /// memory, whatever it is (a file's read-only view, a reservation).
    pub const MREMAP_UNLOOKED: u32 = 22;
    pub const COUNT: u32 = 23;
}

/// States of a tgid in the `TRACED` map.
pub mod traced {
    /// Forked by `record -- CMD`, not yet exec'd: ignore its events (they are memtrace's).
    pub const PENDING_EXEC: u32 = 1;
    pub const ACTIVE: u32 = 2;
}

/// Byte offsets of the kernel structure fields the programs read, taken from the kernel's
/// BTF at load time (userspace `probes::btf`), so the programs do not depend on one
/// kernel's layout.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelLayout {
    pub task_pid: u32,
    pub task_tgid: u32,
    /// `task_struct.thread.fsbase`: where a thread's TLS block is.
    pub task_fsbase: u32,
    pub task_mm: u32,
    pub binprm_filename: u32,
    pub mm_start_code: u32,
    pub mm_end_code: u32,
    pub mm_saved_auxv: u32,
    pub cache_name: u32,
    pub cache_object_size: u32,
    pub cache_size: u32,
    /// 1 when `sched_process_exit` passes `group_dead` (Linux 6.13+); else the group is
    /// taken as dead when its leader exits.
    pub exit_has_group_dead: u32,
    /// From a file descriptor to the file's identity (`task.files->fdt->fd[n]->f_inode`,
    /// `i_ino`, `i_sb->s_dev`), and the file an exec runs (`linux_binprm.file`).
    pub task_files: u32,
    pub files_fdt: u32,
    pub fdtable_fd: u32,
    pub file_inode: u32,
    pub inode_ino: u32,
    pub inode_sb: u32,
    pub sb_dev: u32,
    pub binprm_file: u32,
    /// `task_struct.nvcsw`, `nivcsw` (unsigned long): the task's context switches, which
    /// tell a kmem program that a task has run on its CPU since it entered its syscall.
    pub task_nvcsw: u32,
    pub task_nivcsw: u32,
    /// `task_struct.stack`: the lowest address of the task's kernel stack.
    pub task_stack: u32,
    /// Where the uprobe machinery keeps the return addresses its return probes replaced
    /// (`task_struct.utask->return_instances`, a list, newest first, of `return_instance`
    /// with `stack`, `orig_ret_vaddr`, `next`): a stack walk during an allocator call puts
    /// back the one the trampoline stands for.
    pub task_utask: u32,
    pub utask_return_instances: u32,
    pub ri_stack: u32,
    pub ri_orig_ret_vaddr: u32,
    pub ri_next: u32,
    /// `vm_area_struct.vm_flags` and `vm_file`: what an mremap's old mapping is (`vma`).
    pub vma_flags: u32,
    pub vma_file: u32,
    /// A file's absolute path, walked up as `d_path` does (`file.f_path.mnt`/`.dentry`,
    /// `dentry.d_parent`, `dentry.d_name.name`, `vfsmount.mnt_root`, and the `struct mount`
    /// around a `vfsmount`: `mnt`, `mnt_parent`, `mnt_mountpoint`). `dentry_parent` 0: not
    /// walked (a kernel whose BTF lacks one of them).
    pub file_path_mnt: u32,
    pub file_path_dentry: u32,
    pub dentry_parent: u32,
    pub dentry_name: u32,
    pub vfsmount_root: u32,
    pub mount_mnt: u32,
    pub mount_parent: u32,
    pub mount_mountpoint: u32,
    /// `dentry.d_hash.pprev`: 0 for a dentry unhashed, the file deleted (whose name now
    /// names another file, or none), where the walk gives up as `d_path` marks it.
    /// (An odd count of fields would leave `ProbeConfig::sample_bytes` unaligned.)
    pub dentry_hash_pprev: u32,
}

/// Written by userspace into the programs' `.rodata` before load; the verifier then treats
/// every field as a constant and prunes the branches that do not apply.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProbeConfig {
    /// memtrace's own tgid: never traced.
    pub self_tgid: u32,
    /// 1: every process (`record -a`); 0: only tgids in `TRACED`.
    pub trace_all: u32,
    /// Walk user stacks for user allocations.
    pub user_stacks: u32,
    /// Walk kernel stacks (and the user stack of the task they ran for) for kernel allocations.
    pub kernel_stacks: u32,
    /// `unwind_mode::*`.
    pub unwind_mode: u32,
    /// Wake the reader once this many bytes wait in a ring (others are submitted quietly;
    /// the reader also polls on a timer).
    pub wakeup_bytes: u32,
    /// Emit frees of kernel blocks only if a traced task allocated them (pid mode), else all.
    pub track_kernel_live: u32,
    /// Add the children of traced processes to the traced set (`-- CMD`, `--follow-forks`).
    pub follow_children: u32,
    /// Report the executable mappings traced processes make (the table walk learns its
    /// files from them, and the Python frames their interpreter).
    pub track_mappings: u32,
    /// CPUs possible on this machine (the per-CPU maps' width).
    pub cpus: u32,
    /// Take a repeat kernel stack from its earlier unwind when its return addresses are
    /// all in their slots (`kstack`), rather than unwinding it.
    pub kernel_stack_reuse: u32,
    /// Tests only (`MEMTRACE_TEST_INTERLEAVE=N`): every N-th claim of a CPU's scratch is
    /// taken from the user walk that made it before the walk's check, and the next claim
    /// after its check (a new stack's record is built then), as another program running
    /// on the CPU meanwhile would (0: never).
    pub test_interleave: u32,
    pub _pad: u32,
    pub kernel: KernelLayout,
    /// Size-weighted sampling of user allocations: each byte is sampled with probability
    /// 1/sample_bytes (0: every allocation is recorded).
    pub sample_bytes: u64,
}

impl ProbeConfig {
    pub const fn zeroed() -> Self {
        Self {
            self_tgid: 0,
            trace_all: 0,
            user_stacks: 0,
            kernel_stacks: 0,
            unwind_mode: 0,
            wakeup_bytes: 0,
            track_kernel_live: 0,
            follow_children: 0,
            track_mappings: 0,
            cpus: 0,
            kernel_stack_reuse: 0,
            test_interleave: 0,
            _pad: 0,
            kernel: KernelLayout {
                task_pid: 0,
                task_tgid: 0,
                task_fsbase: 0,
                task_mm: 0,
                binprm_filename: 0,
                mm_start_code: 0,
                mm_end_code: 0,
                mm_saved_auxv: 0,
                cache_name: 0,
                cache_object_size: 0,
                cache_size: 0,
                exit_has_group_dead: 0,
                task_files: 0,
                files_fdt: 0,
                fdtable_fd: 0,
                file_inode: 0,
                inode_ino: 0,
                inode_sb: 0,
                sb_dev: 0,
                binprm_file: 0,
                task_nvcsw: 0,
                task_nivcsw: 0,
                task_stack: 0,
                task_utask: 0,
                utask_return_instances: 0,
                ri_stack: 0,
                ri_orig_ret_vaddr: 0,
                ri_next: 0,
                vma_flags: 0,
                vma_file: 0,
                file_path_mnt: 0,
                file_path_dentry: 0,
                dentry_parent: 0,
                dentry_name: 0,
                vfsmount_root: 0,
                mount_mnt: 0,
                mount_parent: 0,
                mount_mountpoint: 0,
                dentry_hash_pprev: 0,
            },
            sample_bytes: 0,
        }
    }
}

/// Entries of the probes' set of sampled blocks (`SAMPLED_LIVE`): allocated as they are
/// used (`BPF_F_NO_PREALLOC`), so its size costs nothing at start.
pub const SAMPLED_LIVE_ENTRIES: usize = 1 << 18;

/// A sampled user block (sampled mode): its free must be reported, others' need not be.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SampledKey {
    pub tgid: u32,
    pub _pad: u32,
    pub ptr: u64,
}

/// `InFlight::flags`: the new block is sampled / the old block (realloc) was.
pub mod inflight {
    pub const SAMPLE_NEW: u8 = 1;
    pub const OLD_SAMPLED: u8 = 2;
    /// The allocator is glibc's (from the attach cookie).
    pub const GLIBC: u8 = 4;
    /// The allocator is mimalloc 2.0 (release layout): aligned blocks' usable size is read
    /// from its segment and page metadata.
    pub const MIMALLOC: u8 = 8;
    /// An `mmap` asking for `PROT_NONE`: recorded as [`super::Kind::MmapReserved`].
    pub const NO_ACCESS: u8 = 16;
    /// `InFlight::traced`: not known yet (a new thread's storage), or as last looked up.
    pub const TRACED_UNKNOWN: u32 = 0;
    pub const TRACED_NO: u32 = 1;
    pub const TRACED_YES: u32 = 2;
}

/// Attach cookies of the malloc-family probes: the `Kind` in the low byte, flags above,
/// and the allocator's index in the session (`UserAllocRecord::allocator`) from bit 16.
pub mod cookie {
    /// The allocator is glibc's: read `malloc_usable_size` from the chunk header.
    pub const GLIBC: u64 = 1 << 8;
    /// mimalloc 2.0, release layout: read an aligned block's usable size from its page.
    pub const MIMALLOC: u64 = 1 << 9;
    pub const ALLOCATOR_SHIFT: u32 = 16;
}

/// Per-thread state between an allocation function's entry and its return.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InFlight {
    pub kind: u8,
    /// `inflight::*` bits.
    pub flags: u8,
    /// `UserAllocRecord::allocator`, from the attach cookie.
    pub allocator: u8,
    /// log2 of the alignment the call asked for (0: none).
    pub lg_align: u8,
    /// Allocator calls nested inside this one (realloc calling malloc): ignored.
    pub depth: u32,
    /// Stack pointer at entry; a call is nested only if it runs deeper than this.
    pub sp: u64,
    pub ts_entry: u64,
    pub bytes_req: u64,
    /// realloc/reallocarray: the old block; posix_memalign: where the result is stored.
    pub ptr_arg: u64,
    /// mremap: the length of the old mapping it unmaps (0: `MREMAP_DONTUNMAP`, it stays).
    pub old_len: u64,
    /// Whether the thread's process is traced (`inflight::TRACED_*`), as the traced set said
    /// when its generation (`TRACED_GEN`) was `traced_gen`: kept across calls, so a call
    /// costs one lookup of this storage rather than one of the traced set too.
    pub traced_gen: u32,
    pub traced: u32,
    /// The allocation record the return probe made, waiting for its stack in the program
    /// it tail-calls: kept with the thread, not in the CPU's scratch, which another thread
    /// may use meanwhile (a uprobe program can be preempted on a preemptible kernel).
    pub pending: UserAllocRecord,
    /// The token the return probe claimed the CPU's scratch with (`Scratch::claim`): the
    /// walk's frames are sent only while the scratch still holds it.
    pub claim: u64,
}

#[cfg(feature = "user")]
mod pod {
    use super::*;
    // SAFETY: every type below is #[repr(C)], Copy, made only of integers and integer
    // arrays, and has no padding (sizes are asserted below), so any bit pattern is valid.
    unsafe impl aya::Pod for ProbeConfig {}
    // SAFETY: as above.
    unsafe impl aya::Pod for InFlight {}
    // SAFETY: as above.
    unsafe impl aya::Pod for MappingKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for MappingValue {}
    // SAFETY: as above.
    unsafe impl aya::Pod for FileId {}
    // SAFETY: as above.
    unsafe impl aya::Pod for FileTable {}
    // SAFETY: as above.
    unsafe impl aya::Pod for python::PyProcInfo {}
    // SAFETY: as above.
    unsafe impl aya::Pod for SampledKey {}
}

const _: () = {
    assert!(core::mem::size_of::<UserAllocRecord>() == 48);
    assert!(core::mem::size_of::<FreeRecord>() == 32);
    assert!(core::mem::size_of::<KernelAllocRecord>() == 72);
    assert!(core::mem::size_of::<StackHeader>() == 32);
    assert!((MAX_USER_DEPTH + 1).is_power_of_two() && MAX_USER_DEPTH <= u16::MAX as usize);
    assert!(core::mem::size_of::<UserFrame>() == 32);
    assert!(core::mem::size_of::<TaskRecord>() == 56 + COMM_LEN + FILENAME_LEN);
    assert!(core::mem::size_of::<KernelLayout>() == 39 * 4);
    assert!(core::mem::size_of::<ProbeConfig>() == 52 + 39 * 4 + 8);
    assert!(core::mem::size_of::<CacheRecord>() == 16 + CACHE_NAME_LEN);
    assert!(core::mem::size_of::<SampledKey>() == 16);
    assert!(core::mem::size_of::<InFlight>() == 56 + 48 + 8);
    assert!(core::mem::size_of::<MappingRecord>() == 48 + FILENAME_LEN);
};
