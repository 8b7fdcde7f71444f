//! Pairing and aggregation, pure code with no BPF in it: events go in, in time order;
//! per-group statistics and the blocks still live come out. A free is counted against the
//! group that allocated the block. User blocks live in a per-process address space that
//! ends at exec or exit (so a reused pid is a new space); kernel blocks in one space per
//! machine.
//!
//! Over 500 lines: pairing is one state machine over events; peaks, timelines, sizes, sampling and lifetimes are in their own files.
pub mod diff;
mod forks;
pub mod histogram;
pub mod peak;
mod recent;
mod regions;
mod sampling;
pub mod sizes;
pub mod timeline;
pub mod unmatched;

use std::collections::{BTreeMap, HashSet};

use memtrace_common::{Kind, Space, TaskEvent, flags};
use serde::Serialize;

use self::{forks::Forks, recent::RecentFrees, regions::Regions};
pub use self::{
    histogram::Histogram,
    peak::{Peak, PeakTracker},
    sampling::sample_multiplicity,
    sizes::SizeHistogram,
    timeline::Timeline,
};
use crate::event::{Alloc, Event, Free};

/// User or kernel; and, apart from the user's, the memory the C library and its allocator
/// reserve for themselves (thread stacks, arenas: mmaps made from inside the allocator's
/// own code), which is not what the program asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Domain {
    User,
    Reserved,
    Kernel,
    /// GPU memory from the CUDA driver API: device, managed, pinned host and physical
    /// memory.
    Gpu,
    /// GPU virtual address ranges (reserved, and physical memory mapped into them): counted
    /// apart, so physical memory is not counted twice.
    #[serde(rename = "gpu_va")]
    GpuAddress,
}

impl Domain {
    /// User, kernel or GPU, by kind (reserved mmaps are told apart by their stack).
    pub fn of(kind: Kind) -> Self {
        if kind == Kind::MmapReserved {
            Self::Reserved
        } else if kind.is_kernel() {
            Self::Kernel
        } else if kind.is_gpu_address() {
            Self::GpuAddress
        } else if kind.is_gpu() {
            Self::Gpu
        } else {
            Self::User
        }
    }
}

/// What identifies where an allocation came from, before any grouping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Origin {
    /// Stack id + 1 (0: no stack).
    pub stack: u64,
    /// Kernel call site (0 for user allocations).
    pub call_site: u64,
    pub kind: Kind,
    pub pid: u32,
    /// User allocations: the allocator's index plus one (0: not known).
    pub allocator: u8,
    /// GPU allocations: the device ordinal (-1: not known, and for every other kind).
    pub device: i32,
    /// kmem_cache_alloc: the slab cache (0 for every other kind).
    pub cache: u64,
}

impl Origin {
    pub fn of(a: &Alloc) -> Self {
        let device = if a.kind.is_gpu() { a.node } else { -1 };
        Self {
            stack: a.stack,
            call_site: a.call_site,
            kind: a.kind,
            pid: a.pid,
            allocator: a.allocator,
            device,
            cache: a.cache,
        }
    }
}

/// Figures of one group of allocations.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    pub allocs: u64,
    pub frees: u64,
    pub bytes_req: u64,
    pub bytes_alloc: u64,
    pub live_allocs: u64,
    pub live_bytes_req: u64,
    pub live_bytes_alloc: u64,
    pub peak_live_bytes_req: u64,
    /// Lifetimes (ns) of the blocks freed.
    pub lifetimes: Histogram,
    /// Freed by the allocating thread before it allocated anything else.
    pub temporary: u64,
    /// Kernel blocks freed on another CPU than the one that allocated them.
    pub freed_on_other_cpu: u64,
    /// Blocks still live when their process exec'd or exited.
    pub leaked_at_exit: u64,
    /// Bytes requested and blocks live at the moment of the domain's peak ([`peak`]).
    pub live_bytes_req_at_peak: u64,
    pub live_allocs_at_peak: u64,
    /// Requested sizes.
    pub sizes: SizeHistogram,
    /// GPU allocation calls that failed (out of memory, bad arguments), and the bytes they
    /// asked for: not allocations.
    pub failed: u64,
    pub failed_bytes_req: u64,
}

impl Stats {
    /// `count` allocations of these sizes (more than one when one sampled allocation
    /// stands for several).
    fn on_alloc(&mut self, req: u64, alloc: u64, count: u64) {
        self.allocs += count;
        self.bytes_req += req * count;
        self.bytes_alloc += alloc * count;
        self.live_allocs += count;
        self.live_bytes_req += req * count;
        self.live_bytes_alloc += alloc * count;
        self.peak_live_bytes_req = self.peak_live_bytes_req.max(self.live_bytes_req);
        self.sizes.record(req, alloc, count);
    }

    /// Allocations counted but not followed (the live table is full).
    fn on_untracked_alloc(&mut self, req: u64, alloc: u64, count: u64) {
        self.allocs += count;
        self.bytes_req += req * count;
        self.bytes_alloc += alloc * count;
        self.sizes.record(req, alloc, count);
    }

    fn on_free(&mut self, block: &LiveBlock) {
        self.frees += block.count;
        self.live_allocs -= block.count;
        self.live_bytes_req -= block.bytes_req * block.count;
        self.live_bytes_alloc -= block.bytes_alloc * block.count;
    }

    /// A live block went with its address space (not freed: no free counted).
    fn on_gone(&mut self, block: &LiveBlock) {
        self.live_allocs -= block.count;
        self.live_bytes_req -= block.bytes_req * block.count;
        self.live_bytes_alloc -= block.bytes_alloc * block.count;
    }

    /// Part of a live block's bytes went (a mapping's head, tail or a hole unmapped).
    fn on_cut(&mut self, part: &LiveBlock) {
        self.live_bytes_req -= part.bytes_req * part.count;
        self.live_bytes_alloc -= part.bytes_alloc * part.count;
    }

    /// Adds another group's figures (the peak of a merge is an upper bound).
    pub fn merge(&mut self, o: &Self) {
        self.allocs += o.allocs;
        self.frees += o.frees;
        self.bytes_req += o.bytes_req;
        self.bytes_alloc += o.bytes_alloc;
        self.live_allocs += o.live_allocs;
        self.live_bytes_req += o.live_bytes_req;
        self.live_bytes_alloc += o.live_bytes_alloc;
        self.peak_live_bytes_req += o.peak_live_bytes_req;
        self.lifetimes.merge(&o.lifetimes);
        self.temporary += o.temporary;
        self.freed_on_other_cpu += o.freed_on_other_cpu;
        self.leaked_at_exit += o.leaked_at_exit;
        // Values at the same moment add up exactly.
        self.live_bytes_req_at_peak += o.live_bytes_req_at_peak;
        self.live_allocs_at_peak += o.live_allocs_at_peak;
        self.sizes.merge(&o.sizes);
        self.failed += o.failed;
        self.failed_bytes_req += o.failed_bytes_req;
    }

    /// Internal fragmentation: the share of allocated bytes not asked for.
    pub fn frag_pct(&self) -> f64 {
        if self.bytes_alloc == 0 { 0.0 } else { 100.0 - 100.0 * self.bytes_req as f64 / self.bytes_alloc as f64 }
    }

    pub fn wasted(&self) -> u64 {
        self.bytes_alloc.saturating_sub(self.bytes_req)
    }
}

/// Per-domain totals, with what could not be paired.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Totals {
    pub stats: Stats,
    /// Frees of blocks whose allocation was not seen (allocated before tracing began).
    pub unmatched_frees: u64,
    /// Allocations at an address already live: the earlier block's free was not seen.
    pub missed_frees: u64,
    /// Frees of blocks already freed: the allocator releasing its own caches (glibc's
    /// per-thread cache at thread exit), not the program's frees.
    pub allocator_frees: u64,
    /// Frees in a forked child of blocks its parent allocated before the fork (the child's
    /// copy of the parent's heap): the parent's allocations, not counted again.
    pub inherited_frees: u64,
}

/// A block not yet freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LiveBlock {
    pub group: u32,
    pub ts_ns: u64,
    pub bytes_req: u64,
    pub bytes_alloc: u64,
    pub cpu: u16,
    pub pid: u32,
    pub tid: u32,
    pub stack: u64,
    pub kind: Kind,
    /// The block's process exec'd or exited while it was live.
    pub orphaned: bool,
    /// How many allocations the block stands for (1 unless sampled).
    pub count: u64,
}

/// Address space of a block: the space kind and, for user spaces, the process instance.
type SpaceKey = (Space, u32);

/// Group id of allocations a report filters out: paired, so their frees are recognised,
/// but counted nowhere.
pub const EXCLUDED: u32 = u32::MAX;

/// Pairs and aggregates. `G` maps an allocation's origin to a group id.
pub struct Analyzer<G: FnMut(&Origin) -> u32> {
    group_of: G,
    group_cache: crate::FastMap<Origin, u32>,
    pub groups: Vec<Stats>,
    pub totals: BTreeMap<Domain, Totals>,
    /// User heap blocks, per process instance.
    heap: crate::FastMap<u32, crate::FastMap<u64, LiveBlock>>,
    /// Kernel blocks (slab objects, pages).
    kernel: crate::FastMap<(Space, u64), LiveBlock>,
    /// mmap regions, per process instance; they are freed by range, in part or whole.
    mmaps: Regions,
    /// GPU blocks (device pointers, physical-memory handles, reserved ranges), per process
    /// instance.
    gpu: crate::FastMap<(Space, u32, u64), LiveBlock>,
    /// GPU mappings, per process instance; unmapped by range.
    gpu_maps: Regions,
    /// Blocks whose process exec'd or exited while they were live.
    orphans: Vec<LiveBlock>,
    /// Per process instance: addresses freed lately.
    recent_frees: crate::FastMap<u32, RecentFrees>,
    /// tid → (pid, unmatched heap frees since its last allocation).
    pending_unmatched: crate::FastMap<u32, (u32, u64)>,
    /// pid → frees of heap blocks whose allocation was not seen (per process, for the
    /// report's warnings).
    pub unmatched_by_pid: crate::FastMap<u32, u64>,
    /// pid → current address-space instance.
    instances: crate::FastMap<u32, u32>,
    next_instance: u32,
    /// Forked processes' ancestors, until they exec or exit.
    forks: Forks,
    /// (tid, kernel) → its most recent allocation of the domain, for spotting temporaries:
    /// the kernel allocating on a thread's behalf (the page its first touch of a new block
    /// faults in) does not make the thread's next free of that block any less temporary
    /// (on the sqlite3 bench such faults hid most temporaries).
    last_alloc: crate::FastMap<(u32, bool), (SpaceKey, u64)>,
    pub last_ts: u64,
    pub first_ts: Option<u64>,
    pub events: u64,
    /// While set, frees of unknown blocks are not counted (they belong to filtered-out
    /// processes).
    pub quiet_unmatched: bool,
    /// Most blocks followed at once; allocations beyond are counted but not followed
    /// (their frees then look unmatched, and live figures undercount).
    pub live_limit: usize,
    /// Blocks followed now.
    live_count: usize,
    /// The blocks of an address space that ended (exec, exit) are let go: they no longer
    /// count as live, nor take room in the live table (`top`: "live now"). Unset (`report`),
    /// they stay live to the end as leaked at exit.
    pub forget_ended: bool,
    /// With `forget_ended`, the process whose blocks stay when it ends: the traced
    /// command's or pid's, its leaks at exit (its children's go with them).
    pub keep_ended: Option<u32>,
    /// Allocations not followed because the table was full.
    pub untracked: u64,
    /// The recording sampled user allocations (each byte with probability 1/this): each
    /// sampled one stands for 1/P(sampled) allocations of its size.
    pub sample_bytes: Option<u64>,
    /// Sampling switched on during the recording (rings overflowing): (from, mean bytes).
    /// From then on frees of blocks not sampled are reported too: unknown ones are ignored.
    pub sample_from: Option<(u64, u64)>,
    /// Stacks (id + 1) whose mmaps are reserved memory ([`Domain::Reserved`]), not the
    /// program's own.
    pub reserved_stacks: HashSet<u64>,
    /// Each domain's peak and each group's share of it.
    pub peak: PeakTracker,
    /// Live bytes over time, when asked for.
    pub timeline: Option<Timeline>,
}

impl<G: FnMut(&Origin) -> u32> Analyzer<G> {
    pub fn new(group_of: G) -> Self {
        Self {
            group_of,
            group_cache: Default::default(),
            groups: Vec::new(),
            totals: BTreeMap::new(),
            heap: Default::default(),
            kernel: Default::default(),
            mmaps: Regions::default(),
            gpu: Default::default(),
            gpu_maps: Regions::default(),
            orphans: Vec::new(),
            recent_frees: Default::default(),
            pending_unmatched: Default::default(),
            unmatched_by_pid: Default::default(),
            instances: Default::default(),
            next_instance: 1,
            forks: Forks::default(),
            last_alloc: Default::default(),
            last_ts: 0,
            first_ts: None,
            events: 0,
            quiet_unmatched: false,
            live_limit: usize::MAX,
            live_count: 0,
            forget_ended: false,
            keep_ended: None,
            untracked: 0,
            sample_bytes: None,
            sample_from: None,
            reserved_stacks: Default::default(),
            peak: PeakTracker::default(),
            timeline: None,
        }
    }

    /// A block of a counted group became live (`added`) or stopped being live at `ts_ns`.
    fn live_changed(&mut self, b: &LiveBlock, added: bool, ts_ns: u64) {
        self.live_bytes_changed(b, b.count, added, ts_ns);
    }

    /// As [`Self::live_changed`], for `allocs` of the block's allocations (0: a part of a
    /// mapping unmapped, the mapping still live).
    fn live_bytes_changed(&mut self, b: &LiveBlock, allocs: u64, added: bool, ts_ns: u64) {
        let (domain, bytes) = (self.domain(b.kind, b.stack), b.bytes_req * b.count);
        self.peak.change(b.group, domain, bytes, allocs, added, ts_ns);
        if let Some(t) = &mut self.timeline {
            t.change(b.group, domain, b.pid, bytes, added, ts_ns);
        }
    }

    fn instance(&mut self, pid: u32) -> u32 {
        let next = &mut self.next_instance;
        *self.instances.entry(pid).or_insert_with(|| {
            let id = *next;
            *next += 1;
            id
        })
    }

    fn space(&mut self, kind: Kind, pid: u32) -> SpaceKey {
        let space = kind.space();
        match space {
            Space::Slab | Space::Page => (space, 0),
            _ => (space, self.instance(pid)),
        }
    }

    fn group(&mut self, origin: Origin) -> u32 {
        if let Some(&g) = self.group_cache.get(&origin) {
            return g;
        }
        let g = (self.group_of)(&origin);
        if g != EXCLUDED && self.groups.len() <= g as usize {
            self.groups.resize(g as usize + 1, Stats::default());
        }
        self.group_cache.insert(origin, g);
        g
    }

    pub fn push(&mut self, event: &Event) {
        self.events += 1;
        let ts = event.ts_ns();
        self.first_ts.get_or_insert(ts);
        self.last_ts = self.last_ts.max(ts);
        match event {
            Event::Alloc(a) => self.alloc(a),
            Event::Free(f) => self.free(f),
            Event::Task(t) => {
                // A thread's exit releases glibc's per-thread cache; a process's main
                // thread's does not (glibc frees it only for valgrind's sake): its last
                // frees of blocks allocated before tracing began (a program attached with
                // `--pid` freeing them as it shuts down) are the program's.
                if t.event == TaskEvent::Exit
                    && let Some((pid, n)) = self.pending_unmatched.remove(&t.tid)
                {
                    let totals = self.totals.entry(Domain::User).or_default();
                    if t.tid == t.pid {
                        totals.unmatched_frees += n;
                        *self.unmatched_by_pid.entry(pid).or_default() += n;
                    } else {
                        totals.allocator_frees += n;
                    }
                }
                if t.event == TaskEvent::Fork {
                    let parent_space = self.instance(t.ppid);
                    if t.flags & memtrace_common::flags::SHARED_MEMORY != 0 {
                        // Until it execs, the child's blocks are in its parent's space.
                        self.forks.shared(t.pid);
                        self.instances.insert(t.pid, parent_space);
                    } else {
                        self.forks.forked(t.pid, t.ppid, parent_space, t.ts_ns);
                    }
                }
                if t.ends_address_space() {
                    let shared = self.forks.stops_sharing(t.pid);
                    self.forks.ended(t.pid, t.event == TaskEvent::Exit);
                    if shared {
                        self.instances.remove(&t.pid);
                    } else {
                        self.end_process(t.pid, ts);
                    }
                }
            }
        }
    }

    /// The domain a block of this kind and stack counts in.
    pub fn domain(&self, kind: Kind, stack: u64) -> Domain {
        if kind == Kind::Mmap && self.reserved_stacks.contains(&stack) { Domain::Reserved } else { Domain::of(kind) }
    }

    fn totals(&mut self, kind: Kind, stack: u64) -> &mut Totals {
        let domain = self.domain(kind, stack);
        self.totals.entry(domain).or_default()
    }

    fn alloc(&mut self, a: &Alloc) {
        self.alloc_in(a, None);
    }

    /// Records an allocation the caller filtered out: paired, never counted.
    pub fn push_excluded(&mut self, a: &Alloc) {
        self.events += 1;
        self.alloc_in(a, Some(EXCLUDED));
    }

    fn alloc_in(&mut self, a: &Alloc, forced_group: Option<u32>) {
        if a.kind.space() == Space::Heap
            && let Some((pid, n)) = self.pending_unmatched.remove(&a.tid)
        {
            self.totals.entry(Domain::User).or_default().unmatched_frees += n;
            *self.unmatched_by_pid.entry(pid).or_default() += n;
        }
        let space = self.space(a.kind, a.pid);
        let mean = match (self.sample_bytes, self.sample_from) {
            (Some(mean), _) => Some(mean),
            (None, Some((from, mean))) if a.ts_ns >= from => Some(mean),
            _ => None,
        };
        let count = match mean {
            Some(mean) if !a.kind.is_kernel() && !a.kind.is_gpu() => {
                sample_multiplicity(a.bytes_req, mean, a.ts_ns ^ a.ptr)
            }
            _ => 1,
        };
        let group = match forced_group {
            Some(g) => g,
            None => self.group(Origin::of(a)),
        };
        if a.flags & flags::FAILED != 0 {
            // A failed GPU call: nothing was allocated; its site and size are kept.
            if group != EXCLUDED {
                let g = &mut self.groups[group as usize];
                g.failed += 1;
                g.failed_bytes_req += a.bytes_req;
                let t = &mut self.totals(a.kind, a.stack).stats;
                t.failed += 1;
                t.failed_bytes_req += a.bytes_req;
            }
            return;
        }
        let block = LiveBlock {
            group,
            ts_ns: a.ts_ns,
            bytes_req: a.bytes_req,
            bytes_alloc: a.bytes_alloc,
            cpu: a.cpu,
            pid: a.pid,
            tid: a.tid,
            stack: a.stack,
            kind: a.kind,
            orphaned: false,
            count,
        };
        if self.live_count >= self.live_limit && group != EXCLUDED {
            self.untracked += 1;
            self.groups[group as usize].on_untracked_alloc(a.bytes_req, a.bytes_alloc, count);
            self.totals(a.kind, a.stack).stats.on_untracked_alloc(a.bytes_req, a.bytes_alloc, count);
            return;
        }
        let replaced: Vec<regions::Cut> = match space.0 {
            Space::Mmap => self.mmaps.insert(space.1, a.ptr, a.bytes_alloc, block),
            Space::GpuMap => self.gpu_maps.insert(space.1, a.ptr, a.bytes_alloc, block),
            Space::Heap => {
                if let Some(recent) = self.recent_frees.get_mut(&space.1) {
                    recent.remove(a.ptr);
                }
                self.heap
                    .entry(space.1)
                    .or_default()
                    .insert(a.ptr, block)
                    .map(regions::Cut::whole)
                    .into_iter()
                    .collect()
            }
            Space::Slab | Space::Page => {
                self.kernel.insert((space.0, a.ptr), block).map(regions::Cut::whole).into_iter().collect()
            }
            Space::GpuMemory | Space::GpuHandle | Space::GpuReserve => {
                self.gpu.insert((space.0, space.1, a.ptr), block).map(regions::Cut::whole).into_iter().collect()
            }
        };
        self.live_count += 1;
        for cut in replaced {
            if !cut.gone {
                // A mapping over part of a live one: that part was unmapped.
                self.cut(&cut.block, a.ts_ns);
                continue;
            }
            if matches!(space.0, Space::Mmap | Space::GpuMap) {
                // A mapping replaced whole (`MAP_FIXED`): the kernel unmapped it, a free.
                self.retire(cut.block, a.ts_ns, a.cpu, false);
                continue;
            }
            self.live_count -= 1;
            let old = cut.block;
            if old.group == EXCLUDED {
                continue;
            }
            // The old block's free was never seen: retire it silently as freed.
            self.groups[old.group as usize].on_free(&old);
            self.totals(old.kind, old.stack).stats.on_free(&old);
            self.totals(a.kind, a.stack).missed_frees += 1;
            self.live_changed(&old, false, a.ts_ns);
        }
        self.last_alloc.insert((a.tid, a.kind.is_kernel()), (space, a.ptr));
        if group == EXCLUDED {
            return;
        }
        self.groups[group as usize].on_alloc(a.bytes_req, a.bytes_alloc, count);
        self.totals(a.kind, a.stack).stats.on_alloc(a.bytes_req, a.bytes_alloc, count);
        self.live_changed(&block, true, a.ts_ns);
    }

    /// Part of a live mapping was unmapped: `part` is the mapping's block with the bytes
    /// taken; it stays live.
    fn cut(&mut self, part: &LiveBlock, ts_ns: u64) {
        if part.group == EXCLUDED {
            return;
        }
        self.live_bytes_changed(part, 0, false, ts_ns);
        self.groups[part.group as usize].on_cut(part);
        self.totals(part.kind, part.stack).stats.on_cut(part);
    }

    /// `block` freed at `ts_ns` on `cpu`.
    fn retire(&mut self, block: LiveBlock, ts_ns: u64, cpu: u16, temporary: bool) {
        self.live_count -= 1;
        if block.group == EXCLUDED {
            return;
        }
        self.live_changed(&block, false, ts_ns);
        let g = &mut self.groups[block.group as usize];
        g.on_free(&block);
        g.lifetimes.record_n(ts_ns.saturating_sub(block.ts_ns), block.count);
        if temporary {
            g.temporary += block.count;
        }
        let other_cpu = block.kind.is_kernel() && block.cpu != cpu;
        if other_cpu {
            g.freed_on_other_cpu += 1;
        }
        let t = self.totals(block.kind, block.stack);
        t.stats.on_free(&block);
        t.stats.lifetimes.record_n(ts_ns.saturating_sub(block.ts_ns), block.count);
        if temporary {
            t.stats.temporary += block.count;
        }
        if other_cpu {
            t.stats.freed_on_other_cpu += 1;
        }
    }

    fn free(&mut self, f: &Free) {
        let space = self.space(f.kind, f.pid);
        if matches!(space.0, Space::Mmap | Space::GpuMap) {
            // munmap (cuMemUnmap) frees what it covers of every mapping in [ptr, ptr + len):
            // whole mappings, or their heads, tails or holes. Unmaps of regions never seen
            // mapped are the allocator's own (large chunks) and are ignored.
            let end = f.ptr.saturating_add(u64::from(f.arg.max(1)) * 4096);
            let regions = if space.0 == Space::Mmap { &mut self.mmaps } else { &mut self.gpu_maps };
            for cut in regions.unmap(space.1, f.ptr, end) {
                if cut.gone {
                    self.retire(cut.block, f.ts_ns, f.cpu, false);
                } else {
                    self.cut(&cut.block, f.ts_ns);
                }
            }
            return;
        }
        let found = match space.0 {
            Space::Heap => self.heap.get_mut(&space.1).and_then(|m| m.remove(&f.ptr)),
            Space::GpuMemory | Space::GpuHandle | Space::GpuReserve => self.gpu.remove(&(space.0, space.1, f.ptr)),
            _ => self.kernel.remove(&(space.0, f.ptr)),
        };
        match found {
            Some(block) => {
                if space.0 == Space::Heap {
                    self.recent_frees.entry(space.1).or_default().insert(f.ptr);
                }
                let last = (f.tid, f.kind.is_kernel());
                let temporary = self.last_alloc.get(&last) == Some(&(space, f.ptr));
                if temporary {
                    self.last_alloc.remove(&last);
                }
                self.retire(block, f.ts_ns, f.cpu, temporary);
            }
            None if self.quiet_unmatched => {}
            // After sampling was switched on, frees of blocks never sampled arrive too.
            None if self.sample_from.is_some_and(|(from, _)| f.ts_ns >= from) && !f.kind.is_kernel() => {}
            None if space.0 == Space::Heap && self.recent_frees.get(&space.1).is_some_and(|r| r.contains(f.ptr)) => {
                self.totals(f.kind, 0).allocator_frees += 1;
            }
            None if space.0 == Space::Heap && self.inherited(f.pid, f.ptr) => {
                self.totals(f.kind, 0).inherited_frees += 1;
            }
            // Decided later: at thread exit glibc frees its per-thread cache, chunks the
            // program never saw included; such frees come after the thread's last allocation.
            None if space.0 == Space::Heap => self.pending_unmatched.entry(f.tid).or_insert((f.pid, 0)).1 += 1,
            None => self.totals(f.kind, 0).unmatched_frees += 1,
        }
    }

    /// Whether `ptr`, freed by `pid` without an allocation of its own, is a block of an
    /// address space `pid`'s heap was copied from, allocated before the copy.
    fn inherited(&self, pid: u32, ptr: u64) -> bool {
        let allocated = |space: u32, ptr: u64| self.heap.get(&space).and_then(|m| m.get(&ptr)).map(|b| b.ts_ns);
        let freed = |space: u32, ptr: u64| self.recent_frees.get(&space).is_some_and(|r| r.contains(ptr));
        self.forks.inherited(pid, ptr, allocated, freed)
    }

    /// The process's address space is gone: its live blocks stay counted as live (leaked at
    /// exit) but can no longer be freed; later events of the pid start a new space.
    fn end_process(&mut self, pid: u32, ts_ns: u64) {
        let Some(instance) = self.instances.remove(&pid) else {
            return;
        };
        self.recent_frees.remove(&instance);
        let mut gone: Vec<LiveBlock> = self.heap.remove(&instance).unwrap_or_default().into_values().collect();
        gone.extend(self.mmaps.take_instance(instance));
        gone.extend(self.gpu_maps.take_instance(instance));
        let blocks: Vec<(Space, u32, u64)> = self.gpu.keys().filter(|k| k.1 == instance).copied().collect();
        gone.extend(blocks.iter().filter_map(|k| self.gpu.remove(k)));
        for mut block in gone {
            if block.group == EXCLUDED {
                self.live_count -= 1;
                continue;
            }
            block.orphaned = true;
            self.live_changed(&block, false, ts_ns);
            self.groups[block.group as usize].leaked_at_exit += block.count;
            if self.forget_ended && self.keep_ended != Some(pid) {
                self.live_count -= 1;
                self.groups[block.group as usize].on_gone(&block);
                self.totals(block.kind, block.stack).stats.on_gone(&block);
                continue;
            }
            self.orphans.push(block);
        }
    }

    /// Settles what is still undecided; call once after the last event.
    pub fn finish(&mut self) {
        let mut pending = 0;
        for (_, (pid, n)) in self.pending_unmatched.drain() {
            pending += n;
            *self.unmatched_by_pid.entry(pid).or_default() += n;
        }
        if pending > 0 {
            self.totals.entry(Domain::User).or_default().unmatched_frees += pending;
        }
        self.peak.settle(&mut self.groups, &mut self.totals);
    }

    /// Each origin met so far and its group.
    pub fn origins(&self) -> impl Iterator<Item = (&Origin, u32)> {
        self.group_cache.iter().map(|(o, &g)| (o, g))
    }

    /// Every block still live, user and kernel (orphans included), filtered ones excepted.
    pub fn live_blocks(&self) -> impl Iterator<Item = &LiveBlock> {
        self.heap
            .values()
            .flat_map(|m| m.values())
            .chain(self.kernel.values())
            .chain(self.mmaps.blocks())
            .chain(self.gpu.values())
            .chain(self.gpu_maps.blocks())
            .chain(self.orphans.iter())
            .filter(|b| b.group != EXCLUDED)
    }
}

#[cfg(test)]
mod tests;
