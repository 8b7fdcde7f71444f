//! Encoding of one `Events` chunk (format version 4 and later): each field of the events in a stream
//! of its own (tags, times, tasks, addresses, sizes, stacks, the rest), so the deflate step
//! meets runs of like values rather than interleaved fields. Each chunk starts from a clean
//! state (base timestamp, empty task and call-site tables, zero address deltas), so chunks
//! decode independently.
//!
//! ```text
//! payload  base timestamp u64 LE | count u32 LE | time resolution in ns (varint) |
//!          7 stream lengths (varints; version 8: 14) | the streams, in this order:
//! tags     per event a tag byte (bits 0-5: the event code, a `Kind` or 48 + a task event;
//!          bit 6: a flags byte follows here; bit 7: same task as the previous event).
//!          Version 8: without the flags byte, an event's flags are those of the chunk's
//!          previous event of its code (0 for the first); before, 0
//! times    zigzag delta of the timestamp counted in resolution units from the previous
//!          event's (version 8: only those of events that are not frees after events that are
//!          not; the other three contexts follow `other`)
//! tasks    unless bit 7: an index into the chunk's task table (its length: new, pid and
//!          tid follow)
//! addrs    version 5: allocations, 0 and the zigzag delta from the end of the previous
//!          allocation of its address space (its address + bytes allocated: an allocator
//!          carving fresh memory hands out the next block there), or k (1-64): the address
//!          the k-th most recent free of the space gave back and no allocation took since (glibc's tcache and fastbins hand
//!          back the block freed last); frees, 0 and the zigzag delta from the previous free
//!          of the space, or k: the block of the k-th most recent allocation of the chunk
//!          still live (most blocks die young, in reverse order of birth). Version 4: the
//!          zigzag delta from the previous address of the space, for both. Version 6
//!          codes the kernel page space's addresses (`struct page` pointers) rotated right
//!          by 6 bits, counting pages (`AddrRefs::key`). Version 7: an allocation's
//!          k in 1-64 is the k-th most recent free of a block of the same bytes allocated
//!          and 64 + k the k-th most recent slot of the space's freed list (`Freed`); a free's
//!          k ≥ 1 is zigzag(d) + 1, its block the d-th live block of the space after the one
//!          the space's previous free took, in allocation order (`AddrRefs::free_code`);
//!          each space numbers its own allocations. Version 8: 64 + k for any k-th most
//!          recent slot in 1-4096 (`ANY_SIZE_WINDOW_V8`)
//! sizes    allocations: bytes requested, zigzag (allocated - requested); version 7
//!          reads them before the address, which refers to blocks of the same size
//! stacks   allocations: version 6, the zigzag delta from the stack id of the previous
//!          allocation of its task (from 0); before, the stack id
//! other    kernel events: CPU; kernel allocations: call-site index (new: the site follows),
//!          GFP flags, zigzag node, order byte; GPU allocations: zigzag device; user
//!          allocations with the allocator flag: its index byte; frees: the argument
//!          (version 8: in a stream of its own); task events: parent pid, command, file name
//!          (version 9: a new call site's entry is followed by the slab cache of its
//!          allocations, `struct kmem_cache *`, 0 for none; an entry per site and cache)
//! version 8, after `other` (`Layout`): the times of frees after events that are not,
//!          of events that are not frees after frees, of frees after frees; the deltas
//!          that follow an allocation's address reference of 0; the frees' address codes
//!          (before: in `addrs`, with the allocations', each delta after its code); the
//!          deltas that follow a free's code of 0; the frees' arguments
//! ```
//! On the heavy Python bench the version-5 addresses take ~300 KB where version 4 took 414 KB
//! (deflated); version 6's page counts take 4 % off them, and its stack deltas take the
//! stack stream from 154 KB to 32 KB (ids are numbered as stacks are first met, so a
//! thread walking through new code makes ids one after another). Version 7's references
//! take the address stream from 389 KB to 333 KB there (the file 4.6 % smaller; sqlite's
//! bench recording 3.5 %); on a two-thread malloc/free loop whose frees alternate their
//! order it is 7 % larger than version 6's (0.35 bits an event against 0.23). Version 8
//! takes GCC's cc1 recording (4.6 M events) from 4.8 MB to 3.6 MB and the heavy Python
//! bench's from 1.0 MB to 0.9 MB ([`Layout`], [`ANY_SIZE_WINDOW_V8`]).
//!
//! Timestamps are kept to the recording's resolution (`Meta::time_resolution_ns`, 1 µs by
//! default: below that the digits are noise, and they took most of a recording's bytes);
//! the order of events is the file's, whatever their rounded times.
use std::collections::HashMap;

use memtrace_common::{Kind, TaskEvent};

use super::{
    FormatError,
    codec::{Cursor, Streams, put_signed, put_str, put_varint, unzigzag, zigzag},
};
use crate::event::{Alloc, Event, Free, Task};

const TASK_CODE_BASE: u8 = 48;
const HAS_FLAGS: u8 = 1 << 6;
const SAME_TASK: u8 = 1 << 7;
const CODE_MASK: u8 = 0x3f;
/// In the flags byte of a user allocation: the allocator's index follows the body (no
/// `memtrace_common::flags` bit uses it; a test checks).
pub(super) const ALLOCATOR_FOLLOWS: u8 = 1 << 6;

/// The streams of a chunk, in their order in the payload.
const TAGS: usize = 0;
const TIMES: usize = 1;
const TASKS: usize = 2;
const ADDRS: usize = 3;
const SIZES: usize = 4;
const STACKS: usize = 5;
const OTHER: usize = 6;
/// Version 8's streams after those seven ([`Layout`]).
const TIMES_FREE: usize = 7;
const TIMES_AFTER_FREE: usize = 8;
const TIMES_FREE_AFTER_FREE: usize = 9;
const ALLOC_DELTAS: usize = 10;
const FREE_CODES: usize = 11;
const FREE_DELTAS: usize = 12;
const FREE_ARGS: usize = 13;
const STREAMS: usize = 14;
/// The streams of versions 4 to 7.
const STREAMS_BEFORE_8: usize = 7;
/// Event codes (6 bits): each code's last flags are kept (version 8).
const CODES: usize = 64;

/// Where a layout puts each field. Version 8 gives a stream of its own to fields whose
/// values differ by context, so that each gets deflate codes of its own: the time since the
/// previous event by whether that one and this one are frees (4 streams: a program's
/// allocations and frees keep rhythms of their own), the address references of
/// allocations and of frees apart from the deltas that follow a reference of 0, and the
/// frees' argument (0 for the malloc family: a stream of zeros) apart from the other
/// fields. On GCC's cc1 (4.6 M events) the addresses take 18 % less, the times 13 %; with
/// the flags coded once per change ([`EncodeState::last_flags`]) the recording takes 22 %
/// less than version 7's (25 % with the longer reach of [`ANY_SIZE_WINDOW_V8`]).
#[derive(Clone, Copy, Default)]
struct Layout {
    v8: bool,
    /// Version 9: a kernel call-site table entry also names the slab cache its
    /// allocations came from (0: none, as kmalloc's and the page allocator's).
    caches: bool,
}

impl Layout {
    fn for_version(version: u16) -> Self {
        Self { v8: version >= 8, caches: version >= 9 }
    }

    /// The streams of a chunk of this layout.
    fn streams(self) -> usize {
        if self.v8 { STREAMS } else { STREAMS_BEFORE_8 }
    }

    fn time(self, prev_free: bool, free: bool) -> usize {
        match (self.v8, prev_free, free) {
            (false, _, _) | (true, false, false) => TIMES,
            (true, false, true) => TIMES_FREE,
            (true, true, false) => TIMES_AFTER_FREE,
            (true, true, true) => TIMES_FREE_AFTER_FREE,
        }
    }

    /// The reference (or, version 4, the delta) of an address.
    fn addr_code(self, free: bool) -> usize {
        if self.v8 && free { FREE_CODES } else { ADDRS }
    }

    /// The delta that follows a reference of 0.
    fn addr_delta(self, free: bool) -> usize {
        match (self.v8, free) {
            (false, _) => ADDRS,
            (true, false) => ALLOC_DELTAS,
            (true, true) => FREE_DELTAS,
        }
    }

    fn free_arg(self) -> usize {
        if self.v8 { FREE_ARGS } else { OTHER }
    }
}

/// Whether an event of `code` is a free (the times' context).
fn code_is_free(code: u8) -> bool {
    Kind::from_u8(code).is_some_and(Kind::is_free)
}

/// Address spaces an address delta is kept per (`Kind::space`).
const SPACES: usize = 8;
/// The kernel's page space: its addresses are `struct page` pointers.
const PAGE_SPACE: usize = memtrace_common::Space::Page as usize;
/// log2 of `sizeof(struct page)` on 64-bit kernels: the stride of a page space's addresses.
const PAGE_STRUCT_SHIFT: u32 = 6;

fn space_index(kind: Kind) -> usize {
    kind.space() as usize % SPACES
}

/// Where each field of an event is written: a buffer per stream (version 4), or one buffer
/// for them all (the rows of versions 2–3). Fields go out in the same order either way.
pub(super) trait FieldsOut {
    fn field(&mut self, stream: usize) -> &mut Vec<u8>;
}

impl FieldsOut for [Vec<u8>; STREAMS] {
    fn field(&mut self, stream: usize) -> &mut Vec<u8> {
        &mut self[stream]
    }
}

impl FieldsOut for Vec<u8> {
    fn field(&mut self, _stream: usize) -> &mut Vec<u8> {
        self
    }
}

/// Where each field of an event is read from (as [`FieldsOut`]).
pub(super) trait FieldsIn<'a> {
    fn field(&mut self, stream: usize) -> &mut Cursor<'a>;
}

impl<'a> FieldsIn<'a> for [Cursor<'a>; STREAMS] {
    fn field(&mut self, stream: usize) -> &mut Cursor<'a> {
        &mut self[stream]
    }
}

impl<'a> FieldsIn<'a> for Cursor<'a> {
    fn field(&mut self, _stream: usize) -> &mut Cursor<'a> {
        self
    }
}

/// How far back an allocation looks among the chunk's freed addresses (version 5), and
/// among those of its size (version 7).
const FREED_WINDOW: usize = 64;
const FREED_WINDOW_U64: u64 = FREED_WINDOW as u64;
/// How far back an allocation looks among all the chunk's freed slots from version 8.
/// glibc hands out blocks from its bins long after they were freed, and splits freed
/// blocks of another size: on GCC's cc1 four in five of the allocations not found among
/// the last 64 freed slots lie within the last 4096, and naming such a slot (two bytes)
/// costs less than the address's delta (three): the address references take 14 % less.
/// The encoder finds the slot by its address ([`Freed::by_key`]), the decoder by its
/// rank; either scans no more than this many entries for one event.
const ANY_SIZE_WINDOW_V8: usize = 4096;

/// Counts of live blocks by allocation number, with prefix sums and the k-th live block in
/// O(log n) (a Fenwick tree): a free's rank among the live blocks, and back.
#[derive(Default)]
struct Ranks {
    /// 1-based Fenwick array; `tree[0]` unused.
    tree: Vec<i32>,
    live: i32,
}

impl Ranks {
    fn clear(&mut self) {
        self.tree.clear();
        self.live = 0;
    }

    /// Live blocks among allocation numbers `0..n`.
    fn prefix(&self, mut n: usize) -> i32 {
        let mut sum = 0;
        while n > 0 {
            sum += self.tree[n];
            n &= n - 1;
        }
        sum
    }

    /// A new allocation, live; its number.
    fn push(&mut self) -> usize {
        if self.tree.is_empty() {
            self.tree.push(0);
        }
        let i = self.tree.len();
        let low = i & i.wrapping_neg();
        let node = 1 + self.prefix(i - 1) - self.prefix(i - low);
        self.tree.push(node);
        self.live += 1;
        i - 1
    }

    /// Allocation number `n` is freed.
    fn kill(&mut self, n: usize) {
        let mut i = n + 1;
        while i < self.tree.len() {
            self.tree[i] -= 1;
            i += i & i.wrapping_neg();
        }
        self.live -= 1;
    }

    /// The rank of live block `n`: 1 for the newest live one.
    fn rank(&self, n: usize) -> u64 {
        (self.live - self.prefix(n)) as u64
    }

    /// The number of the live block of `rank` (None: no such block).
    fn at_rank(&self, rank: u64) -> Option<usize> {
        if rank == 0 || rank > self.live as u64 {
            return None;
        }
        // The k-th live block in allocation order.
        let mut k = self.live - rank as i32 + 1;
        let n = self.tree.len() - 1;
        let (mut pos, mut step) = (0, 1usize << (usize::BITS - 1 - n.leading_zeros()));
        while step > 0 {
            if pos + step <= n && self.tree[pos + step] < k {
                pos += step;
                k -= self.tree[pos];
            }
            step >>= 1;
        }
        Some(pos)
    }
}

/// Version 5's address references within a chunk, kept alike by encoder and decoder: the
/// live blocks by allocation number, the addresses freed and not handed out again, the
/// previous allocation and free of each space.
#[derive(Default)]
struct AddrRefs {
    /// Version 6: the page space's addresses are coded as page keys ([`AddrRefs::key`]).
    page_keys: bool,
    /// Version 7: an allocation names a freed block of its own size first ([`Freed`]), and
    /// a free its block by where it lies from the block the space's previous free took
    /// ([`AddrRefs::free_code`]), each space numbering its own allocations.
    v7: bool,
    /// The live blocks by allocation number: one numbering for the chunk before version 7,
    /// then one per space (indexed by [`AddrRefs::tree`]).
    ranks: [Ranks; SPACES],
    /// (address, bytes allocated) of each allocation number.
    blocks: [Vec<(u64, u64)>; SPACES],
    /// Version 7: the allocation number the space's previous free of a live block took.
    prev_freed: [Option<usize>; SPACES],
    freed: [Freed; SPACES],
    alloc_end: [u64; SPACES],
    prev_free: [u64; SPACES],
}

/// The addresses of a space freed and not handed out again, oldest first. Version 7 keeps
/// the bytes each block had (0: allocated before the chunk) and indexes them by size too:
/// allocators hand back the block of the allocation's own size class freed last (glibc's
/// tcache and fastbins, slab caches, the page allocator's per-order lists), so among the
/// blocks of its size an allocation's is nearly always the newest: on the heavy Python
/// bench 88 % of the references, where among all freed blocks it was the newest for 3 %.
/// Version 7 counts an any-size reference in slots, a slot emptied when its block is handed
/// out again, so that no step scans more than [`FREED_WINDOW`] entries whatever the order
/// of reuse (version 8: [`ANY_SIZE_WINDOW_V8`] slots, found by address and, in a size's
/// list, by binary search); versions 5 and 6 counted the blocks still listed.
struct Freed {
    /// Versions 5 and 6: the addresses.
    keys: Vec<u64>,
    /// From version 7: (address, bytes) by slot; `None` once handed out again (trailing
    /// empty slots are dropped).
    slots: Vec<Option<(u64, u64)>>,
    /// From version 7: the slots of the blocks of each size, oldest first (increasing: a
    /// slot leaves its list when emptied, before `trim` can number a new slot like it).
    by_size: crate::FastMap<u64, Vec<usize>>,
    /// How far back an any-size reference reaches, in blocks (versions 5-6) or slots.
    any_window: usize,
    /// A version-8 encoder's index of the slots by address: the newest slot pushed for an
    /// address, until that slot is handed out again (an older slot of the same address, a
    /// block freed twice, is then no longer found: its reuse is coded by delta, as any
    /// address not found). It finds a slot anywhere in [`ANY_SIZE_WINDOW_V8`] without
    /// scanning them.
    by_key: Option<crate::FastMap<u64, usize>>,
}

impl Default for Freed {
    fn default() -> Self {
        Self {
            keys: Vec::new(),
            slots: Vec::new(),
            by_size: Default::default(),
            any_window: FREED_WINDOW,
            by_key: None,
        }
    }
}

impl Freed {
    fn clear(&mut self) {
        self.keys.clear();
        self.slots.clear();
        self.by_size.clear();
        if let Some(by_key) = &mut self.by_key {
            by_key.clear();
        }
    }

    fn push(&mut self, key: u64, bytes: u64, v7: bool) {
        if !v7 {
            return self.keys.push(key);
        }
        if bytes != 0 {
            self.by_size.entry(bytes).or_default().push(self.slots.len());
        }
        if let Some(by_key) = &mut self.by_key {
            by_key.insert(key, self.slots.len());
        }
        self.slots.push(Some((key, bytes)));
    }

    /// Slot `slot`, holding `key`, is handed out again: the index forgets it.
    fn unindex(&mut self, key: u64, slot: usize) {
        if let Some(by_key) = &mut self.by_key
            && by_key.get(&key) == Some(&slot)
        {
            by_key.remove(&key);
        }
    }

    /// Version 7: where `key` is among the newest [`FREED_WINDOW`] blocks of `bytes` (0:
    /// the newest).
    fn rank_by_size(&self, key: u64, bytes: u64) -> Option<usize> {
        let list = self.by_size.get(&bytes)?;
        list.iter().rev().take(FREED_WINDOW).position(|&i| self.slots[i].is_some_and(|(k, _)| k == key))
    }

    /// Where `key` is among the newest `any_window` blocks (versions 5-6) or slots (from
    /// version 7); 0: the newest. A version-8 encoder answers from its index (`by_key`).
    fn rank(&self, key: u64, v7: bool) -> Option<usize> {
        if !v7 {
            return self.keys.iter().rev().take(self.any_window).position(|&k| k == key);
        }
        if let Some(by_key) = &self.by_key {
            // The index holds only slots not handed out again: below the trimmed length.
            let k = self.slots.len().checked_sub(by_key.get(&key)? + 1)?;
            return (k < self.any_window).then_some(k);
        }
        self.slots.iter().rev().take(self.any_window).position(|s| s.is_some_and(|(k, _)| k == key))
    }

    /// Version 7: takes the block of `bytes` of rank `j` (as [`Freed::rank_by_size`]).
    fn take_by_size(&mut self, bytes: u64, j: usize) -> Option<u64> {
        let list = self.by_size.get_mut(&bytes)?;
        let i = list.len().checked_sub(j + 1).filter(|_| j < FREED_WINDOW)?;
        let slot = list.remove(i);
        let (key, _) = self.slots.get_mut(slot)?.take()?;
        self.unindex(key, slot);
        self.trim();
        Some(key)
    }

    /// Takes the block of rank `k` (as [`Freed::rank`]).
    fn take(&mut self, k: usize, v7: bool) -> Option<u64> {
        if !v7 {
            let i = self.keys.len().checked_sub(k + 1).filter(|_| k < self.any_window)?;
            return Some(self.keys.remove(i));
        }
        let slot = self.slots.len().checked_sub(k + 1).filter(|_| k < self.any_window)?;
        let (key, bytes) = self.slots[slot].take()?;
        // The size's list is in slot order.
        if let Some(list) = self.by_size.get_mut(&bytes)
            && let Ok(i) = list.binary_search(&slot)
        {
            list.remove(i);
        }
        self.unindex(key, slot);
        self.trim();
        Some(key)
    }

    fn trim(&mut self) {
        while self.slots.last().is_some_and(Option::is_none) {
            self.slots.pop();
        }
    }
}

impl AddrRefs {
    fn clear(&mut self) {
        self.ranks.iter_mut().for_each(Ranks::clear);
        self.blocks.iter_mut().for_each(Vec::clear);
        self.prev_freed = [None; SPACES];
        self.freed.iter_mut().for_each(Freed::clear);
        self.alloc_end = [0; SPACES];
        self.prev_free = [0; SPACES];
    }

    /// The references of format `version` (none before 5); `encoder`: an encoder's, which
    /// from version 8 indexes the freed slots by address.
    fn for_version(version: u16, encoder: bool) -> Option<Self> {
        (version >= 5).then(|| {
            let mut refs = Self { page_keys: version >= 6, v7: version >= 7, ..Default::default() };
            if version >= 8 {
                for freed in &mut refs.freed {
                    freed.any_window = ANY_SIZE_WINDOW_V8;
                    freed.by_key = encoder.then(Default::default);
                }
            }
            refs
        })
    }

    /// The numbering a space's allocations are in.
    fn tree(&self, space: usize) -> usize {
        if self.v7 { space } else { 0 }
    }

    /// The allocation code of the freed block of any size of rank `k`: version 7 puts the
    /// ranks among blocks of the same size first.
    fn any_size_code(&self, k: usize) -> u64 {
        k as u64 + 1 + if self.v7 { FREED_WINDOW as u64 } else { 0 }
    }

    /// Version 7: live blocks of the space allocated before the block its previous free
    /// took (all of them before its first free).
    fn free_base(&self, space: usize) -> i64 {
        let ranks = &self.ranks[space];
        i64::from(self.prev_freed[space].map_or(ranks.live, |p| ranks.prefix(p)))
    }

    /// How a free of live block `n` of `space` is coded (≥ 1; 0 is a block not live):
    /// before version 7 its rank among the live blocks (1: the newest); from version 7 the
    /// zigzag count of live blocks between it and the block the space's previous free took,
    /// plus 1. Blocks allocated one after the other tend to be freed one after the other
    /// (a container's elements, an interpreter's frames and temporaries), and most blocks
    /// of a chunk die young: on the heavy Python bench 66 % of the user heap's frees take the
    /// live block right after the previous one, where the newest live block was taken by 17 %.
    fn free_code(&self, space: usize, n: usize) -> u64 {
        let t = self.tree(space);
        if !self.v7 {
            return self.ranks[t].rank(n);
        }
        let d = i64::from(self.ranks[t].prefix(n)) - self.free_base(space);
        zigzag(d) + 1
    }

    /// The block freed by a free coded `code` (≥ 1, as [`AddrRefs::free_code`]): its
    /// address and bytes.
    fn kill(&mut self, space: usize, code: u64) -> Option<(u64, u64)> {
        let t = self.tree(space);
        let rank = if self.v7 {
            // The block's position among the space's live blocks, 1-based in allocation order.
            let k = self.free_base(space).checked_add(unzigzag(code - 1))?.checked_add(1)?;
            let live = i64::from(self.ranks[t].live);
            if !(1..=live).contains(&k) {
                return None;
            }
            (live - k + 1) as u64
        } else {
            code
        };
        let n = self.ranks[t].at_rank(rank)?;
        Some(self.killed(space, n))
    }

    /// Live block `n` of `space` is freed: its address and bytes.
    fn killed(&mut self, space: usize, n: usize) -> (u64, u64) {
        let t = self.tree(space);
        self.ranks[t].kill(n);
        if self.v7 {
            self.prev_freed[space] = Some(n);
        }
        self.blocks[t][n]
    }

    /// What an address is coded as. Kernel page events carry the page's `struct page`
    /// pointer: 64 bytes apart per page, so from version 6 the page space's pointers are
    /// rotated right by 6 bits (a bijection: neighbouring pages are 1 apart, and a pointer
    /// off that stride still round-trips) and a block's end is its key plus its pages.
    fn key(&self, space: usize, ptr: u64) -> u64 {
        if self.page_keys && space == PAGE_SPACE { ptr.rotate_right(PAGE_STRUCT_SHIFT) } else { ptr }
    }

    fn address(&self, space: usize, key: u64) -> u64 {
        if self.page_keys && space == PAGE_SPACE { key.rotate_left(PAGE_STRUCT_SHIFT) } else { key }
    }

    /// How far a block of `bytes` at `key` reaches, in keys.
    fn span(&self, space: usize, bytes: u64) -> u64 {
        if self.page_keys && space == PAGE_SPACE { bytes >> 12 } else { bytes }
    }

    fn allocated(&mut self, space: usize, ptr: u64, bytes: u64) -> usize {
        let t = self.tree(space);
        self.blocks[t].push((ptr, bytes));
        self.ranks[t].push()
    }

    /// The allocation at `ptr` has `bytes`: where the next one is expected.
    fn sized(&mut self, space: usize, ptr: u64, bytes: u64) {
        self.alloc_end[space] = ptr.wrapping_add(self.span(space, bytes));
    }

    /// `ptr`, a block of `bytes` (0: not known), is freed.
    fn freed(&mut self, space: usize, ptr: u64, bytes: u64) {
        self.prev_free[space] = ptr;
        self.freed[space].push(ptr, bytes, self.v7);
    }
}

/// Version 6's stack ids: each allocation's as the zigzag delta from the previous
/// allocation's of its task. Ids are numbered as stacks are first seen, and a program
/// walking through new code (an interpreter's successive lines) makes new stacks one after
/// another: on the heavy Python bench most deltas are +1 or 0, and the stream deflates to a
/// fifth of the ids themselves. Earlier versions: the id.
#[derive(Default)]
struct TaskStacks {
    deltas: bool,
    /// By task index (the chunk's task table).
    prev: Vec<u64>,
    /// The current event's task index.
    task: usize,
}

impl TaskStacks {
    fn for_version(version: u16) -> Self {
        Self { deltas: version >= 6, ..Default::default() }
    }

    fn clear(&mut self) {
        self.prev.clear();
        self.task = 0;
    }

    fn task_added(&mut self) {
        self.prev.push(0);
    }

    fn put(&mut self, out: &mut Vec<u8>, stack: u64) {
        if !self.deltas {
            return put_varint(out, stack);
        }
        let prev = &mut self.prev[self.task];
        put_signed(out, stack.wrapping_sub(*prev) as i64);
        *prev = stack;
    }

    fn get(&mut self, c: &mut Cursor<'_>) -> Result<u64, FormatError> {
        if !self.deltas {
            return c.varint();
        }
        let prev = self.prev.get_mut(self.task).ok_or_else(|| c.error("stack of no task"))?;
        *prev = prev.wrapping_add(c.signed()? as u64);
        Ok(*prev)
    }
}

/// What an encoder remembers within a chunk: the previous task, the task and call-site
/// tables, the previous address of each space (version 4) or the address references
/// (version 5, `refs`).
pub(super) struct EncodeState {
    prev_task: Option<(u32, u32)>,
    prev_ptr: [u64; SPACES],
    task_index: HashMap<(u32, u32), u64>,
    /// Version 6: each task's previous stack id, by task index, and the current task's.
    stacks: TaskStacks,
    /// (call site, slab cache) → its index in the chunk's table (the cache from version 9).
    call_site_index: HashMap<(u64, u64), u64>,
    refs: Option<AddrRefs>,
    /// Version 5: the allocation number of each live block of the chunk.
    live: crate::FastMap<(u8, u64), usize>,
    layout: Layout,
    /// Version 8: whether the previous event of the chunk was a free.
    prev_free: bool,
    /// Version 8: the flags byte of the previous event of each code (0 at the chunk's
    /// start); an event's flags are written only when they differ (versions 2 to 7: when
    /// not 0). A program's allocations mostly carry the same flags (usable size exact, a
    /// stack, the allocator's index follows): on GCC's cc1 a flags byte for every
    /// allocation took 0.3 bits an event after deflating.
    last_flags: [u8; CODES],
}

impl Default for EncodeState {
    fn default() -> Self {
        Self::new(3)
    }
}

impl EncodeState {
    /// A state for the layout of format `version` (references from version 5).
    pub(super) fn new(version: u16) -> Self {
        Self {
            prev_task: None,
            prev_ptr: [0; SPACES],
            task_index: HashMap::new(),
            stacks: TaskStacks::for_version(version),
            call_site_index: HashMap::new(),
            refs: AddrRefs::for_version(version, true),
            live: Default::default(),
            layout: Layout::for_version(version),
            prev_free: false,
            last_flags: [0; CODES],
        }
    }

    fn clear(&mut self) {
        self.prev_task = None;
        self.prev_ptr = [0; SPACES];
        self.task_index.clear();
        self.stacks.clear();
        self.call_site_index.clear();
        self.live.clear();
        if let Some(r) = &mut self.refs {
            r.clear();
        }
        self.prev_free = false;
        self.last_flags = [0; CODES];
    }

    fn put_alloc_addr(&mut self, out: &mut impl FieldsOut, space: usize, ptr: u64, bytes: u64) {
        let (codes, deltas) = (self.layout.addr_code(false), self.layout.addr_delta(false));
        let Some(r) = &mut self.refs else {
            put_signed(out.field(deltas), ptr.wrapping_sub(self.prev_ptr[space]) as i64);
            self.prev_ptr[space] = ptr;
            return;
        };
        let ptr = r.key(space, ptr);
        let by_size = if r.v7 { r.freed[space].rank_by_size(ptr, bytes) } else { None };
        if let Some(j) = by_size {
            put_varint(out.field(codes), j as u64 + 1);
            r.freed[space].take_by_size(bytes, j);
        } else if let Some(k) = r.freed[space].rank(ptr, r.v7) {
            put_varint(out.field(codes), r.any_size_code(k));
            r.freed[space].take(k, r.v7);
        } else {
            put_varint(out.field(codes), 0);
            put_signed(out.field(deltas), ptr.wrapping_sub(r.alloc_end[space]) as i64);
        }
        r.sized(space, ptr, bytes);
        let n = r.allocated(space, ptr, bytes);
        self.live.insert((space as u8, ptr), n);
    }

    fn put_free_addr(&mut self, out: &mut impl FieldsOut, space: usize, ptr: u64) {
        let (codes, deltas) = (self.layout.addr_code(true), self.layout.addr_delta(true));
        let Some(r) = &mut self.refs else {
            put_signed(out.field(deltas), ptr.wrapping_sub(self.prev_ptr[space]) as i64);
            self.prev_ptr[space] = ptr;
            return;
        };
        let ptr = r.key(space, ptr);
        let bytes = match self.live.remove(&(space as u8, ptr)) {
            Some(n) => {
                put_varint(out.field(codes), r.free_code(space, n));
                r.killed(space, n).1
            }
            None => {
                put_varint(out.field(codes), 0);
                put_signed(out.field(deltas), ptr.wrapping_sub(r.prev_free[space]) as i64);
                0
            }
        };
        r.freed(space, ptr, bytes);
    }
}

/// Writes one event, its time as `time` (the layout's delta).
pub(super) fn encode_event(out: &mut impl FieldsOut, st: &mut EncodeState, event: &Event, time: i64) {
    let (code, flags, pid, tid) = match event {
        Event::Alloc(a) if a.allocator != 0 && !a.kind.is_kernel() => {
            (a.kind as u8, a.flags | ALLOCATOR_FOLLOWS, a.pid, a.tid)
        }
        Event::Alloc(a) => (a.kind as u8, a.flags, a.pid, a.tid),
        Event::Free(f) => (f.kind as u8, f.flags, f.pid, f.tid),
        Event::Task(t) => (TASK_CODE_BASE + t.event as u8, t.flags, t.pid, t.tid),
    };
    let same_task = st.prev_task == Some((pid, tid));
    let last_flags = &mut st.last_flags[usize::from(code & CODE_MASK)];
    let flags_follow = if st.layout.v8 { flags != *last_flags } else { flags != 0 };
    *last_flags = flags;
    out.field(TAGS).push(code | if flags_follow { HAS_FLAGS } else { 0 } | if same_task { SAME_TASK } else { 0 });
    // As the decoder tells it, from the code alone.
    let free = code_is_free(code & CODE_MASK);
    put_signed(out.field(st.layout.time(st.prev_free, free)), time);
    st.prev_free = free;
    if !same_task {
        let tasks = out.field(TASKS);
        let i = match st.task_index.get(&(pid, tid)) {
            Some(&i) => {
                put_varint(tasks, i);
                i
            }
            None => {
                let i = st.task_index.len() as u64;
                put_varint(tasks, i);
                put_varint(tasks, u64::from(pid));
                put_varint(tasks, u64::from(tid));
                st.task_index.insert((pid, tid), i);
                st.stacks.task_added();
                i
            }
        };
        st.stacks.task = i as usize;
        st.prev_task = Some((pid, tid));
    }
    if flags_follow {
        out.field(TAGS).push(flags);
    }
    match event {
        Event::Alloc(a) => {
            let space = space_index(a.kind);
            if a.kind.is_kernel() {
                put_varint(out.field(OTHER), u64::from(a.cpu));
            }
            st.put_alloc_addr(out, space, a.ptr, a.bytes_alloc);
            put_varint(out.field(SIZES), a.bytes_req);
            put_signed(out.field(SIZES), a.bytes_alloc.wrapping_sub(a.bytes_req) as i64);
            st.stacks.put(out.field(STACKS), a.stack);
            let other = out.field(OTHER);
            if a.kind.is_kernel() {
                let key = (a.call_site, if st.layout.caches { a.cache } else { 0 });
                match st.call_site_index.get(&key) {
                    Some(&i) => put_varint(other, i),
                    None => {
                        let i = st.call_site_index.len() as u64;
                        put_varint(other, i);
                        put_varint(other, a.call_site);
                        if st.layout.caches {
                            put_varint(other, a.cache);
                        }
                        st.call_site_index.insert(key, i);
                    }
                }
                put_varint(other, u64::from(a.gfp_flags));
                put_signed(other, i64::from(a.node));
                other.push(a.order);
            } else {
                if a.kind.is_gpu() {
                    // The device ordinal (-1: not known).
                    put_signed(other, i64::from(a.node));
                }
                if a.allocator != 0 {
                    other.push(a.allocator);
                }
            }
        }
        Event::Free(f) => {
            let space = space_index(f.kind);
            if f.kind.is_kernel() {
                put_varint(out.field(OTHER), u64::from(f.cpu));
            }
            st.put_free_addr(out, space, f.ptr);
            put_varint(out.field(st.layout.free_arg()), u64::from(f.arg));
        }
        Event::Task(t) => {
            let other = out.field(OTHER);
            put_varint(other, u64::from(t.ppid));
            put_str(other, &t.comm);
            put_str(other, &t.filename);
        }
    }
}

/// What a decoder remembers within a chunk (as [`EncodeState`]).
pub(super) struct DecodeState {
    prev_task: Option<(u32, u32)>,
    tasks: Vec<(u32, u32)>,
    stacks: TaskStacks,
    /// The chunk's (call site, slab cache) table.
    call_sites: Vec<(u64, u64)>,
    prev_ptr: [u64; SPACES],
    refs: Option<AddrRefs>,
    layout: Layout,
    prev_free: bool,
    last_flags: [u8; CODES],
}

impl Default for DecodeState {
    fn default() -> Self {
        Self::new(3)
    }
}

impl DecodeState {
    /// A state for the layout of format `version` (references from version 5).
    pub(super) fn new(version: u16) -> Self {
        Self {
            prev_task: None,
            tasks: Vec::new(),
            stacks: TaskStacks::for_version(version),
            call_sites: Vec::new(),
            prev_ptr: [0; SPACES],
            refs: AddrRefs::for_version(version, false),
            layout: Layout::for_version(version),
            prev_free: false,
            last_flags: [0; CODES],
        }
    }

    /// The address of an allocation of `bytes` allocated (`free`: of a free).
    fn addr<'a>(
        &mut self,
        inp: &mut impl FieldsIn<'a>,
        space: usize,
        free: bool,
        bytes: u64,
    ) -> Result<u64, FormatError> {
        let (codes, deltas) = (self.layout.addr_code(free), self.layout.addr_delta(free));
        let Some(r) = &mut self.refs else {
            let ptr = self.prev_ptr[space].wrapping_add(inp.field(deltas).signed()? as u64);
            self.prev_ptr[space] = ptr;
            return Ok(ptr);
        };
        let c = inp.field(codes);
        let k = c.varint()?;
        if free {
            let (ptr, bytes) = if k == 0 {
                (r.prev_free[space].wrapping_add(inp.field(deltas).signed()? as u64), 0)
            } else {
                r.kill(space, k).ok_or_else(|| c.error("free of a block not live"))?
            };
            r.freed(space, ptr, bytes);
            Ok(r.address(space, ptr))
        } else {
            let ptr = match k {
                0 => Some(r.alloc_end[space].wrapping_add(inp.field(deltas).signed()? as u64)),
                1..=FREED_WINDOW_U64 if r.v7 => r.freed[space].take_by_size(bytes, k as usize - 1),
                _ if r.v7 => r.freed[space].take((k - FREED_WINDOW_U64 - 1) as usize, true),
                _ => r.freed[space].take(k as usize - 1, false),
            }
            .ok_or_else(|| inp.field(codes).error("reuse of an address not freed"))?;
            r.allocated(space, ptr, bytes);
            Ok(r.address(space, ptr))
        }
    }
}

/// Reads one event; `time` turns the layout's time delta into the timestamp. `base` is the
/// chunk's offset in the file, for errors.
pub(super) fn decode_event<'a>(
    inp: &mut impl FieldsIn<'a>,
    st: &mut DecodeState,
    base: u64,
    time: impl FnOnce(i64) -> u64,
) -> Result<Event, FormatError> {
    let corrupt = |reason: &str| FormatError::Corrupt { offset: base, reason: reason.to_string() };
    let tag = inp.field(TAGS).u8()?;
    let code = tag & CODE_MASK;
    let free = code_is_free(code);
    let ts = time(inp.field(st.layout.time(st.prev_free, free)).signed()?);
    st.prev_free = free;
    let (pid, tid) = if tag & SAME_TASK != 0 {
        st.prev_task.ok_or_else(|| corrupt("same-task flag on the first event"))?
    } else {
        let tasks = inp.field(TASKS);
        let i = tasks.varint()? as usize;
        if i == st.tasks.len() {
            let pid = tasks.varint_u32()?;
            let tid = tasks.varint_u32()?;
            st.tasks.push((pid, tid));
            st.stacks.task_added();
        }
        st.stacks.task = i;
        *st.tasks.get(i).ok_or_else(|| corrupt("task reference out of range"))?
    };
    st.prev_task = Some((pid, tid));
    let last_flags = st.last_flags[usize::from(code)];
    let flags = if tag & HAS_FLAGS != 0 {
        inp.field(TAGS).u8()?
    } else if st.layout.v8 {
        last_flags
    } else {
        0
    };
    st.last_flags[usize::from(code)] = flags;
    if code >= TASK_CODE_BASE {
        let event = TaskEvent::from_u8(code - TASK_CODE_BASE).ok_or_else(|| corrupt("unknown task event"))?;
        let o = inp.field(OTHER);
        return Ok(Event::Task(Task {
            ts_ns: ts,
            event,
            flags,
            pid,
            tid,
            ppid: o.varint_u32()?,
            comm: o.string()?,
            filename: o.string()?,
        }));
    }
    let kind = Kind::from_u8(code).ok_or_else(|| corrupt("unknown event kind"))?;
    let space = space_index(kind);
    let cpu = if kind.is_kernel() {
        u16::try_from(inp.field(OTHER).varint()?).map_err(|_| corrupt("CPU out of range"))?
    } else {
        0
    };
    let read_sizes = |sizes: &mut Cursor<'a>| -> Result<(u64, u64), FormatError> {
        let bytes_req = sizes.varint()?;
        Ok((bytes_req, bytes_req.wrapping_add(sizes.signed()? as u64)))
    };
    // Version 7 names an allocation's address among the freed blocks of its size: the
    // sizes come first (the rows of versions 2-3 keep the address first).
    let sizes_first = !kind.is_free() && st.refs.as_ref().is_some_and(|r| r.v7);
    let early = if sizes_first { Some(read_sizes(inp.field(SIZES))?) } else { None };
    let ptr = st.addr(inp, space, kind.is_free(), early.map_or(0, |(_, alloc)| alloc))?;
    if kind.is_free() {
        let arg = inp.field(st.layout.free_arg()).varint_u32()?;
        return Ok(Event::Free(Free { ts_ns: ts, pid, tid, cpu, kind, flags, ptr, arg }));
    }
    let (bytes_req, bytes_alloc) = match early {
        Some(sizes) => sizes,
        None => read_sizes(inp.field(SIZES))?,
    };
    if let Some(r) = &mut st.refs {
        r.sized(space, r.key(space, ptr), bytes_alloc);
    }
    let stack = st.stacks.get(inp.field(STACKS))?;
    let o = inp.field(OTHER);
    let ((call_site, cache), gfp_flags, node, order) = if kind.is_kernel() {
        let i = o.varint()? as usize;
        if i == st.call_sites.len() {
            let site = o.varint()?;
            let cache = if st.layout.caches { o.varint()? } else { 0 };
            st.call_sites.push((site, cache));
        }
        let site = *st.call_sites.get(i).ok_or_else(|| corrupt("call-site reference out of range"))?;
        let gfp = o.varint_u32()?;
        let node = i32::try_from(o.signed()?).map_err(|_| corrupt("node out of range"))?;
        (site, gfp, node, o.u8()?)
    } else if kind.is_gpu() {
        let node = i32::try_from(o.signed()?).map_err(|_| corrupt("device out of range"))?;
        ((0, 0), 0, node, 0)
    } else {
        ((0, 0), 0, -1, 0)
    };
    let allocator = if !kind.is_kernel() && flags & ALLOCATOR_FOLLOWS != 0 { o.u8()? } else { 0 };
    let flags = if kind.is_kernel() { flags } else { flags & !ALLOCATOR_FOLLOWS };
    Ok(Event::Alloc(Alloc {
        ts_ns: ts,
        pid,
        tid,
        cpu,
        kind,
        flags,
        ptr,
        bytes_req,
        bytes_alloc,
        stack,
        call_site,
        gfp_flags,
        node,
        order,
        allocator,
        cache,
    }))
}

/// Timestamp in resolution units from the chunk's base (rounded down).
fn ticks(ts: u64, base: u64, resolution: u64) -> i64 {
    (ts.wrapping_sub(base) as i64).div_euclid(resolution as i64)
}

pub struct EventEncoder {
    streams: [Vec<u8>; STREAMS],
    version: u16,
    count: u32,
    base_ts: u64,
    resolution: u64,
    prev_ticks: i64,
    state: EncodeState,
}

impl EventEncoder {
    /// An encoder keeping timestamps to `resolution_ns` (0 or 1: exact).
    pub fn new(resolution_ns: u64) -> Self {
        Self::with_version(resolution_ns, super::VERSION)
    }

    /// An encoder of format `version`'s layout (4 or later; the tests make older
    /// recordings with it).
    pub(super) fn with_version(resolution_ns: u64, version: u16) -> Self {
        Self {
            streams: Default::default(),
            version,
            count: 0,
            base_ts: 0,
            resolution: resolution_ns.max(1),
            prev_ticks: 0,
            state: EncodeState::new(version),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Lets go of what was grown for earlier chunks (kept for the next one otherwise),
    /// when no chunk is being filled.
    pub fn release(&mut self) {
        if self.count == 0 {
            *self = Self::with_version(self.resolution, self.version);
        }
    }

    /// Bytes encoded so far (before deflating).
    pub fn len(&self) -> usize {
        self.streams.iter().map(Vec::len).sum()
    }

    /// Payload of the chunk so far.
    /// Hands over the chunk's payload; the next event starts a chunk from a clean state.
    pub fn take(&mut self) -> Streams {
        let mut head = Vec::with_capacity(24);
        head.extend_from_slice(&self.base_ts.to_le_bytes());
        head.extend_from_slice(&self.count.to_le_bytes());
        put_varint(&mut head, self.resolution);
        self.count = 0;
        let streams = self.state.layout.streams();
        Streams::join(&head, &mut self.streams[..streams])
    }

    pub fn push(&mut self, event: &Event) {
        if self.count == 0 {
            self.base_ts = event.ts_ns();
            self.prev_ticks = 0;
            self.state.clear();
        }
        self.count += 1;
        let t = ticks(event.ts_ns(), self.base_ts, self.resolution);
        encode_event(&mut self.streams, &mut self.state, event, t.wrapping_sub(self.prev_ticks));
        self.prev_ticks = t;
    }
}

/// Decodes a whole version-4 (or later) `Events` chunk payload, calling `sink` per event.
pub fn decode_chunk(payload: &[u8], base: u64, version: u16, sink: &mut dyn FnMut(Event)) -> Result<u32, FormatError> {
    let corrupt = |reason: &str| FormatError::Corrupt { offset: base, reason: reason.to_string() };
    let mut head = Cursor::new(payload, base);
    let base_ts = head.u64_le()?;
    let count = head.u32_le()?;
    let resolution = head.varint()?;
    if resolution == 0 || resolution > 1_000_000_000 {
        return Err(corrupt("time resolution out of range"));
    }
    let mut streams: [Cursor<'_>; STREAMS] = head.first_streams(Layout::for_version(version).streams())?;
    // Each event takes at least its tag byte: a count beyond that is corrupt.
    if count as usize > streams[TAGS].rest().len() {
        return Err(corrupt("more events than tags"));
    }
    let mut st = DecodeState::new(version);
    let mut prev_ticks = 0i64;
    for _ in 0..count {
        let event = decode_event(&mut streams, &mut st, base, |delta| {
            prev_ticks = prev_ticks.wrapping_add(delta);
            base_ts.wrapping_add(prev_ticks.wrapping_mul(resolution as i64) as u64)
        })?;
        sink(event);
    }
    if streams.iter().any(|c| !c.is_empty()) {
        return Err(corrupt("bytes after the last event"));
    }
    Ok(count)
}
