//! Every map the programs share, declared once: the per-CPU rings, loss counters, the
//! traced set, in-flight allocator calls, kernel blocks of traced tasks, sampling state,
//! the unwinder's tables and the syscall arguments the mapping tracker keeps.
use aya_ebpf::{
    btf_maps::{Array, ArrayOfMaps, HashMap, LruHashMap, PerCpuArray, RingBuf},
    macros::btf_map,
};
use memtrace_common::{FILENAME_LEN, InFlight, MAX_CPUS, SampledKey, UnwindKey, UnwindRule, counter};

use crate::stack::Scratch;

pub(crate) const RING_TEMPLATE_BYTES: usize = 1 << 20;

#[btf_map]
pub(crate) static RINGS: ArrayOfMaps<RingBuf<u8, RING_TEMPLATE_BYTES>, { MAX_CPUS as usize }> = ArrayOfMaps::new();

#[btf_map]
pub(crate) static COUNTERS: PerCpuArray<u64, { counter::COUNT as usize }> = PerCpuArray::new();

/// Allocation calls between entry and return, by pid_tgid.
#[btf_map]
pub(crate) static INFLIGHT: HashMap<u64, InFlight, 65536> = HashMap::new();

/// tgid → `traced::*` state, when not tracing every process.
#[btf_map]
pub(crate) static TRACED: HashMap<u32, u32, 16384> = HashMap::new();

/// Kernel blocks allocated by traced tasks (pid mode), so their frees are seen from any
/// context. Page frame numbers carry [`PAGE_KEY`].
#[btf_map]
pub(crate) static KERNEL_LIVE: HashMap<u64, u8, 262144> = HashMap::new();
pub(crate) const PAGE_KEY: u64 = 1 << 63;

/// Stack hashes whose frames were already sent. Forgetting one only costs a resend.
#[btf_map]
pub(crate) static STACKS_SENT: LruHashMap<u64, u8, 65536> = LruHashMap::new();

/// Sampling switched on at run time (index 0: mean bytes, 0 = off) when the rings
/// overflow; frees are then all still reported.
#[btf_map]
pub(crate) static SAMPLE_OVERRIDE: Array<u64, 1> = Array::new();

/// Sampled mode: bytes left before the next sample, per CPU.
#[btf_map]
pub(crate) static SAMPLE_COUNTDOWN: PerCpuArray<i64, 1> = PerCpuArray::new();

/// Sampled mode: the sampled user blocks still live (their frees are the only ones sent).
#[btf_map]
pub(crate) static SAMPLED_LIVE: HashMap<SampledKey, u8, 262144> = HashMap::new();

#[btf_map]
pub(crate) static SCRATCH: PerCpuArray<Scratch, 1> = PerCpuArray::new();

/// Unwind rules userspace learned from the modules' call-frame information, per address
/// space and lookup address. Forgetting one only costs a stack copy and a lookup.
#[btf_map]
pub(crate) static UNWIND: LruHashMap<UnwindKey, UnwindRule, 131072> = LruHashMap::new();

/// tgid → generation of its address space, set at fork and exec (absent: 0, a process
/// that existed before tracing began).
#[btf_map]
pub(crate) static GENERATIONS: LruHashMap<u32, u32, 65536> = LruHashMap::new();

pub(crate) type Ring = RingBuf<u8, RING_TEMPLATE_BYTES>;

/// `openat` in flight: pid_tgid → the user pointer to the file name.
#[btf_map]
pub(crate) static OPENAT_ARGS: HashMap<u64, u64, 16384> = HashMap::new();

/// Files traced processes opened: (tgid << 32 | fd) → path.
#[btf_map]
pub(crate) static FD_PATHS: LruHashMap<u64, [u8; FILENAME_LEN], 4096> = LruHashMap::new();

#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct MmapArgs {
    pub(crate) len: u64,
    pub(crate) offset: u64,
    pub(crate) fd: u64,
}

/// `mmap` of a file with PROT_EXEC in flight: pid_tgid → its arguments.
#[btf_map]
pub(crate) static MMAP_ARGS: HashMap<u64, MmapArgs, 16384> = HashMap::new();
