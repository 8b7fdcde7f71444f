//! The recording file (`memtrace.data`): a versioned, self-describing binary format.
//!
//! ```text
//! header   "MEMTRACE" | version u16 LE | byte order of the recording machine u8 (1 = little,
//!          2 = big) | pointer size u8 | clock u8 (1 = CLOCK_MONOTONIC) | 3 reserved bytes
//! chunks   kind u8 | payload length u32 LE | CRC-32 of payload u32 LE | payload
//! ```
//! A kind with bit 7 set ([`COMPRESSED`]) holds its payload deflated (RFC 1951), after the
//! length it inflates to (a varint): the writer deflates the chunks that grow with the run
//! (events, stacks, modules, symbols) when that makes them smaller; the CRC covers the bytes
//! as stored, so damage is found before anything is inflated.
//! Integers inside chunks are LEB128 varints (zigzag for signed deltas), whatever the
//! recording machine's byte order. Chunks: `Meta` (JSON, first), `Events` (time-ordered,
//! field by field, delta-encoded, addresses by reference to the chunk's earlier events,
//! each chunk decodable on its own: `events`), `Stacks` (a tree of frames per chunk, field
//! by field: `stacks`) and `Modules` (definitions that events and stacks refer to by id),
//! `Symbols` (frames symbolized while the processes lived, so reports work offline and
//! elsewhere: `symbols`), `Stats` (JSON counters; the last one
//! wins) and `End` (the file was finalized). A reader stops at the first incomplete or
//! corrupt chunk and keeps everything before it, so a crashed recorder leaves a readable
//! file.
pub mod codec;
mod events;
mod events_rows;
mod reader;
mod stacks;
mod symbols;
mod writer;

use std::collections::BTreeMap;

pub use reader::{Chunk, Reader, decode_events, read_all};
use serde::{Deserialize, Serialize};
use thiserror::Error;
pub use writer::Writer;

pub const MAGIC: &[u8; 8] = b"MEMTRACE";
/// 3: chunks may be deflated ([`COMPRESSED`]). 4: events field by field, timestamps to a
/// resolution, stacks as a tree of frames. 5: addresses by reference to the chunk's earlier
/// allocations and frees, stacks field by field. 6: kernel pages' addresses counted in
/// pages (`struct page` strides). 7: an allocation's address by reference to the freed
/// blocks of its own size first. 8: an event's flags written when they change, times,
/// address codes and deltas, and frees' arguments in streams by context; an allocation
/// names a block freed up to 4096 slots back. 9: kernel call sites with the slab cache of
/// their allocations (names in `Stats::slab_caches`). Versions 2 to 8 are read as ever.
pub const VERSION: u16 = 9;
pub const HEADER_LEN: usize = 16;

/// A chunk's checksum (CRC-32): from version 9 over its kind and length too, so that a
/// damaged kind byte is caught (it read as an unknown chunk, skipped in silence, or as the
/// end marker, which dropped the rest of the file); before, over the payload alone.
pub(crate) fn chunk_crc(version: u16, kind: u8, len: u32, payload: &[u8]) -> u32 {
    let mut crc = crc32fast::Hasher::new();
    if version >= 9 {
        crc.update(&[kind]);
        crc.update(&len.to_le_bytes());
    }
    crc.update(payload);
    crc.finalize()
}
pub const CLOCK_MONOTONIC: u8 = 1;
/// Chunks larger than this (stored or inflated) are treated as corruption.
pub const MAX_CHUNK: u32 = 64 << 20;
/// Bit of a chunk's kind byte: the payload is deflated.
pub const COMPRESSED: u8 = 0x80;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ChunkKind {
    Meta = 1,
    Events = 2,
    Stacks = 3,
    Modules = 4,
    Symbols = 5,
    Stats = 6,
    End = 7,
}

impl ChunkKind {
    pub fn from_u8(v: u8) -> Option<Self> {
        Some(match v {
            1 => Self::Meta,
            2 => Self::Events,
            3 => Self::Stacks,
            4 => Self::Modules,
            5 => Self::Symbols,
            6 => Self::Stats,
            7 => Self::End,
            _ => return None,
        })
    }
}

#[derive(Debug, Error)]
pub enum FormatError {
    #[error("not a memtrace recording (no MEMTRACE header)")]
    NotMemtrace,
    #[error("recording format version {0} is newer than this memtrace understands ({VERSION}); upgrade memtrace")]
    UnsupportedVersion(u16),
    /// The file ends at byte `end`, inside the chunk that begins at `offset`.
    #[error("{}", truncated(*offset, *end))]
    Truncated { offset: u64, end: u64 },
    #[error("recording is corrupt at byte {offset}: {reason}")]
    Corrupt { offset: u64, reason: String },
    /// A chunk whose payload fails its checksum: its extent is known, so the chunks after
    /// it can still be read (the reader is past it).
    #[error("recording is corrupt at byte {offset}: checksum mismatch in a chunk of {len} bytes")]
    Damaged { offset: u64, len: u32 },
    #[error("reading the recording: {0}")]
    Io(#[from] std::io::Error),
}

/// What was recorded, how and where (the `Meta` chunk).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Meta {
    pub memtrace_version: String,
    pub hostname: String,
    pub kernel_release: String,
    /// "pid", "command" or "all".
    pub mode: String,
    pub target_pids: Vec<u32>,
    pub target_command: Vec<String>,
    pub start_unix_ns: u64,
    pub start_monotonic_ns: u64,
    pub page_size: u64,
    pub allocator: Option<String>,
    pub allocator_is_glibc: bool,
    pub user: bool,
    pub kernel: bool,
    /// Size-weighted sampling period in bytes (None: every allocation recorded).
    #[serde(default)]
    pub sample_bytes: Option<u64>,
    /// How user stacks were walked: "dwarf" or "fp" (empty in older recordings: fp).
    #[serde(default)]
    pub call_graph: String,
    /// Event timestamps are kept to this many nanoseconds (0 in older recordings: exact).
    #[serde(default)]
    pub time_resolution_ns: u64,
}

/// An allocator the session probed; user allocations carry its index in this list plus one.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct AllocatorMeta {
    /// The file whose functions were probed.
    pub module: String,
    /// glibc, jemalloc, mimalloc, tcmalloc, musl or unknown.
    pub family: String,
    /// The prefix of its function names ("" for the C names).
    pub prefix: String,
    /// Found in a traced program (false: an installed library probed ahead of time).
    #[serde(default = "yes")]
    pub found: bool,
    /// Probed only after a traced process had started running its code: the program
    /// that brought it was exec'd, or the library mapped, before it was looked into.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probed_late: Option<LateProbe>,
}

/// An allocator probed after a traced process could already call it: the first such
/// process, and how long after its exec (or its mapping of the library) the probes came.
/// Its calls in between are not in the recording.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LateProbe {
    pub pid: u32,
    /// Nanoseconds from the exec or mapping to the probes' attachment.
    pub after_ns: u64,
    /// The allocator came with an exec'd program (in its executable, or a library it
    /// links or preloads); else in a library mapped later.
    pub exec: bool,
    /// The exec'd program (its canonical path), with `exec`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub program: String,
    /// The program was kept for the command's next `record`, which probes its allocators
    /// from the start (not when it preloads them, nor without the disk cache).
    #[serde(default)]
    pub remembered: bool,
}

fn yes() -> bool {
    true
}

/// Stacks cut short for want of ring room a recording lists at most (each is a distinct
/// partial stack: a few per program in a cold start).
pub const MAX_NO_ROOM_STACKS: usize = 4096;

/// [`FormatError::Truncated`]'s message: where the file ends, and where what it cut began.
fn truncated(offset: u64, end: u64) -> String {
    let cut = "cut short: the disk filled, memtrace was killed, or the file is still being copied";
    if offset == end {
        format!("recording is truncated: it ends at byte {end}, before the chunk that should follow ({cut})")
    } else {
        format!(
            "recording is truncated: it ends at byte {end}, in the middle of a chunk begun at byte {offset} ({cut})"
        )
    }
}

/// `Stats::end_reason` of a `--pid` session whose target exited (a command's names its
/// status instead, in `Stats::exit_code` too).
pub const TARGET_EXITED: &str = "the target process exited";

/// Counters of the recording (the `Stats` chunk).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stats {
    /// The allocators found during the session (at start, exec and dlopen), by index - 1.
    #[serde(default)]
    pub allocators: Vec<AllocatorMeta>,
    /// Records the probes could not deliver (ring full), summed over CPUs.
    pub lost_events: u64,
    pub lost_events_per_cpu: Vec<u64>,
    pub lost_stacks: u64,
    /// Allocation calls not followed to their return (per-thread table full).
    pub lost_inflight: u64,
    /// Kernel blocks whose later free might be missed (table full).
    pub lost_kernel_live: u64,
    /// Events dropped because a CPU had no ring buffer.
    pub no_ring: u64,
    /// Sampled blocks whose free could not be followed (table full).
    #[serde(default)]
    pub lost_sampled_live: u64,
    pub events: u64,
    pub end_monotonic_ns: u64,
    /// Exit status of the traced command (record -- CMD), shell-style.
    pub exit_code: Option<i32>,
    /// Why the recording ended ("target exited", "interrupted", "duration", ...).
    pub end_reason: String,
    /// CPU time memtrace itself used while recording (user + system).
    #[serde(default)]
    pub recorder_cpu_ns: u64,
    /// memtrace's own peak resident memory.
    #[serde(default)]
    pub recorder_peak_rss_bytes: u64,
    /// Of it, the BPF maps memtrace had mapped (the rings, each one's data once): the
    /// kernel's memory, counted once in `bpf_map_bytes`.
    #[serde(default)]
    pub recorder_bpf_mapped_rss_bytes: u64,
    /// The rings overflowed and sampling was switched on: (from this timestamp, mean bytes).
    #[serde(default)]
    pub sampled_from: Option<(u64, u64)>,
    /// DWARF call graphs: stack copies the probes sent (a frame whose table was not ready)
    /// and stacks left truncated because the ring had no room for a copy.
    #[serde(default)]
    pub unwind_copies: u64,
    #[serde(default)]
    pub unwind_budget_truncated: u64,
    /// Copies that waited for a table, and those finished before it was ready.
    #[serde(default)]
    pub unwind_copies_waited: u64,
    #[serde(default)]
    pub unwind_copies_gave_up: u64,
    /// Copies of the gap below an anchor (the probes walked on past the frames without a
    /// table): joined whole, and those whose walk missed the anchor (cut short there).
    #[serde(default)]
    pub unwind_copies_anchored: u64,
    #[serde(default)]
    pub unwind_copies_anchor_missed: u64,
    /// Kernel allocations finished by the copy an earlier allocation of their syscall sent
    /// (the probes sent it once; counted in `unwind_copies` too), and references whose
    /// copy was not found (cut short, not in `unwind_copies`).
    #[serde(default)]
    pub unwind_copy_repeats: u64,
    #[serde(default)]
    pub unwind_copy_repeats_unmatched: u64,
    /// Fork, exec and exit records read after a later record of their process (from
    /// another CPU's ring) and kept out of its address space.
    #[serde(default)]
    pub unwind_late_task_records: u64,
    /// The stacks (ids) of `unwind_budget_truncated`, as far as listed (the first
    /// [`MAX_NO_ROOM_STACKS`]): the report tells each process's share of that cause.
    #[serde(default)]
    pub unwind_no_room_stacks: Vec<u32>,
    /// The stacks (ids) cut short at a frame in no file memtrace could read (an address
    /// only: JIT code, or a program or library gone, in another mount namespace or in
    /// memory only before it was read), as far as listed (the first
    /// [`MAX_NO_ROOM_STACKS`]): the report names that cause per process.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unwind_unplaced_stacks: Vec<u32>,
    /// The names of the kernel's slab caches the kmem_cache_alloc events name (`struct
    /// kmem_cache *` → name), as the probes sent them (version 9).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub slab_caches: Vec<(u64, String)>,
    /// Per-file unwind tables: built here, read from the disk cache, files without
    /// call-frame information, files refused for the memory cap; bytes and rows installed
    /// in the probes; build time (all files, and the longest).
    #[serde(default)]
    pub unwind_tables_built: u64,
    #[serde(default)]
    pub unwind_tables_cached: u64,
    #[serde(default)]
    pub unwind_tables_without_cfi: u64,
    #[serde(default)]
    pub unwind_tables_over_cap: u64,
    #[serde(default)]
    pub unwind_table_bytes: u64,
    #[serde(default)]
    pub unwind_table_rows: u64,
    #[serde(default)]
    pub unwind_build_ms: u64,
    #[serde(default)]
    pub unwind_longest_build_ms: u64,
    /// Frames the probes walked by table, and how many found their rule in the cache.
    #[serde(default)]
    pub unwind_frames: u64,
    #[serde(default)]
    pub unwind_cache_hits: u64,
    /// Of those frames, the ones taken from the thread's previous walk (their return
    /// addresses checked on the stack) instead of being stepped through by rule.
    #[serde(default)]
    pub unwind_frames_reused: u64,
    /// Kernel stacks taken from an earlier unwind of the same path (every frame's return
    /// address found in its slot on the stack) instead of being unwound.
    #[serde(default)]
    pub kernel_stacks_reused: u64,
    /// Of those, unwound anyway to check them (one in 64 per CPU): the same, and not (a
    /// path found different is always unwound from then on).
    #[serde(default)]
    pub kernel_stacks_checked: u64,
    #[serde(default)]
    pub kernel_stacks_differed: u64,
    /// User walks another program running on their CPU interleaved with (a thread
    /// preempted inside a probe, on a preemptible kernel): their allocations carry their
    /// call site alone, cut short.
    #[serde(default)]
    pub user_walks_interleaved: u64,
    /// User walks of kernel allocations not redone: an earlier allocation in the same
    /// syscall of the same task had walked that user stack.
    #[serde(default)]
    pub unwind_walks_reused: u64,
    /// Returns of malloc-family calls the return probes ran for (with uprobe sessions, only
    /// those of calls recorded).
    #[serde(default)]
    pub user_returns: u64,
    /// Kernel allocations of traced tasks made while a probe updated one of its maps (the
    /// address spaces' trie, the BPF allocator's refill it set off), and their bytes: the
    /// probes' own, left out of the events.
    #[serde(default)]
    pub probe_map_allocs: u64,
    #[serde(default)]
    pub probe_map_bytes: u64,
    /// `mremap`s whose old mapping the probe could not look up (the memory map was busy):
    /// their new mappings were recorded as memory, whatever they were.
    #[serde(default)]
    pub mremaps_unlooked: u64,
    /// Bytes the probes sent through the rings, by kind of record.
    #[serde(default)]
    pub ring_bytes: RingBytes,
    /// Kernel memory of the probes' maps at the end (rings, unwind tables, the rest).
    #[serde(default)]
    pub bpf_map_bytes: u64,
    /// The Python interpreters met, and whether their frames were walked.
    #[serde(default)]
    pub python: Vec<PythonMeta>,
}

/// A Python interpreter met in a traced process.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PythonMeta {
    /// "3.11.2".
    pub version: String,
    /// The file defining `_PyRuntime` (the executable or libpython).
    pub path: String,
    /// Its frames were walked; else `note` says why not.
    pub walked: bool,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub note: String,
}

/// Bytes read from the rings, by kind of record (what each event costs the transport).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RingBytes {
    pub events: u64,
    pub stacks: u64,
    pub stack_copies: u64,
    pub other: u64,
}

/// An object file frames point into, named by build id and path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Module {
    pub id: u32,
    pub build_id: Vec<u8>,
    pub path: String,
}

/// A user frame as stored: a file offset inside a module, or a bare address.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FileFrame {
    Module { module: u32, offset: u64 },
    Address(u64),
}

/// A stack definition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileStack {
    pub id: u32,
    pub pid: u32,
    /// Kernel addresses, innermost first.
    pub kernel: Vec<u64>,
    /// User frames, innermost first.
    pub user: Vec<FileFrame>,
    /// The walk was cut (depth limit, or it left the code).
    pub truncated: bool,
}

/// What a symbolized address is: one entry per function, innermost (inlined) first.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Symbol {
    /// Shared with the frames named after it.
    pub name: std::sync::Arc<str>,
    pub file: Option<std::sync::Arc<str>>,
    pub line: u32,
    /// Inlined into the next entry.
    pub inlined: bool,
}

/// Address a symbol table entry describes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SymbolKey {
    Kernel(u64),
    User(FileFrame),
}

/// A whole recording, read into memory (see [`read_all`]).
#[derive(Debug, Default)]
pub struct Recording {
    pub meta: Meta,
    pub events: Vec<crate::event::Event>,
    pub stacks: BTreeMap<u32, FileStack>,
    pub modules: BTreeMap<u32, Module>,
    pub symbols: BTreeMap<SymbolKey, Vec<Symbol>>,
    pub stats: Stats,
    pub finalized: bool,
    /// Problems met while reading (truncation, corruption): the report shows them.
    pub warnings: Vec<String>,
}

#[cfg(test)]
mod tests;
