//! `serve`'s live aggregation: the session sink that pairs allocations with frees and keeps,
//! per allocation site of each process (stack, kernel call site, kind), what was allocated
//! so far and what is still live — with sampled allocations scaled back — and hands out
//! [`Snapshot`]s of it for the endpoints.
//!
//! Built to run for weeks, unlike the analyzer a report uses: every table is bounded. Live
//! blocks up to [`Limits::max_live_blocks`] (beyond, allocations are counted, not
//! followed); interned stacks up to [`Limits::max_stacks`], each referenced by the sites
//! using it and evicted once none does; a process that exits keeps its figures until every
//! endpoint scraped lately has seen it dead (or [`EXITED_MAX_AGE`] passes, or more than
//! [`MAX_EXITED`] wait), then it goes with its sites, stacks and kernel blocks.
//!
//! Naming is not done here (the tracer waits while this code runs): new stacks, modules
//! and kernel call sites wait in [`Pending`] for the namer (`names`).
//!
//! Over 500 lines: the agent's aggregation keeps its bounds (blocks, stacks, processes) in one place so they can be reasoned about together.
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    path::Path,
    sync::Arc,
    time::{Duration, Instant},
};

use memtrace_common::{Kind, Space, TaskEvent, flags};

use super::cgroup::{Cgroup, CgroupCache};
use crate::{
    analysis::{Domain, sample_multiplicity},
    event::{Alloc, Event, Free, StackRecord, Task},
    modules::ModuleTable,
    overhead::SetAside,
    recording::{FileStack, Module},
    session::Sink,
};

/// What bounds the model's memory, and how allocations were sampled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    pub max_live_blocks: usize,
    pub max_stacks: usize,
    /// The probes sample user allocations, each byte with probability 1/this.
    pub sample_bytes: Option<u64>,
}

/// A process that exited is dropped this long after at the latest (a scraper that scrapes
/// every 5 minutes, or a delta profile of 300 s, still sees what it did before it exited).
pub const EXITED_MAX_AGE: Duration = Duration::from_secs(600);
/// At most this many exited processes wait for their last scrape (the oldest go first).
pub const MAX_EXITED: usize = 4096;
/// Names told by task records and not taken yet, at most.
const MAX_TOLD: usize = 65_536;
/// A scraper not heard from for this long is not waited for.
const SCRAPER_MEMORY: Duration = Duration::from_secs(600);
/// Stacks no site refers to are evicted once this old (their event may still come).
const UNREFERENCED_STACK_AGE: Duration = Duration::from_secs(30);
/// How long the kernel's allocations for a process that exited are taken for its teardown.
const EXIT_TEARDOWN: Duration = Duration::from_secs(10);
/// How often unreferenced stacks are looked for, and processes checked for being alive.
const SWEEP_INTERVAL: Duration = Duration::from_secs(30);

/// A reference to an interned stack: its id + 1, [`StackRef::NONE`] for an allocation
/// without a stack, [`StackRef::OVERFLOW`] when the stack table was full.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StackRef(pub u32);

impl StackRef {
    pub const NONE: Self = Self(0);
    pub const OVERFLOW: Self = Self(u32::MAX);

    /// The interned stack's id, if it is one.
    pub fn id(self) -> Option<u32> {
        (self != Self::NONE && self != Self::OVERFLOW).then(|| self.0 - 1)
    }
}

/// Where allocations of one process came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SiteKey {
    pub stack: StackRef,
    /// Kernel allocations: the requesting function's address.
    pub call_site: u64,
    pub kind: Kind,
}

impl SiteKey {
    pub fn domain(&self) -> Domain {
        Domain::of(self.kind)
    }
}

/// A site's figures, sampled allocations scaled back (estimates when sampling).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SiteStats {
    pub allocs: u64,
    pub bytes_req: u64,
    pub bytes_alloc: u64,
    pub live_allocs: u64,
    pub live_bytes_req: u64,
    pub live_bytes_alloc: u64,
}

impl SiteStats {
    /// Bytes allocated beyond the requests (internal fragmentation), so far.
    pub fn wasted(&self) -> u64 {
        self.bytes_alloc.saturating_sub(self.bytes_req)
    }

    fn on_alloc(&mut self, req: u64, alloc: u64, count: u64) {
        self.allocs += count;
        self.bytes_req += req * count;
        self.bytes_alloc += alloc * count;
    }

    fn on_live(&mut self, b: &Block, sign: Sign) {
        let count = u64::from(b.count);
        let (allocs, req, alloc) = (count, b.bytes_req * count, b.bytes_alloc * count);
        match sign {
            Sign::Add => {
                self.live_allocs += allocs;
                self.live_bytes_req += req;
                self.live_bytes_alloc += alloc;
            }
            Sign::Remove => {
                self.live_allocs = self.live_allocs.saturating_sub(allocs);
                self.live_bytes_req = self.live_bytes_req.saturating_sub(req);
                self.live_bytes_alloc = self.live_bytes_alloc.saturating_sub(alloc);
            }
        }
    }
}

#[derive(Clone, Copy)]
enum Sign {
    Add,
    Remove,
}

/// A block followed until its free: 24 bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Block {
    /// Index of the site in its process.
    site: u32,
    /// How many allocations it stands for (1 unless sampled).
    count: u32,
    bytes_req: u64,
    bytes_alloc: u64,
}

struct Process {
    pid: u32,
    comm: String,
    cgroup: Arc<Cgroup>,
    sites: Vec<(SiteKey, SiteStats)>,
    site_index: HashMap<SiteKey, u32>,
    heap: HashMap<u64, Block>,
    /// Regions by start: (length, block).
    mmaps: BTreeMap<u64, (u64, Block)>,
    exited: Option<Instant>,
    maps_read: bool,
}

impl Process {
    fn site(&mut self, key: SiteKey) -> (u32, bool) {
        if let Some(&i) = self.site_index.get(&key) {
            return (i, false);
        }
        let i = self.sites.len() as u32;
        self.sites.push((key, SiteStats::default()));
        self.site_index.insert(key, i);
        (i, true)
    }

    fn retire(&mut self, b: &Block) {
        if let Some((_, stats)) = self.sites.get_mut(b.site as usize) {
            stats.on_live(b, Sign::Remove);
        }
    }
}

struct StackEntry {
    hash: u64,
    /// Sites referring to it.
    refs: u32,
    /// Its frames were handed to the namer.
    defined: bool,
    born: Instant,
}

/// Probe stack hashes interned as small ids, referenced by sites.
#[derive(Default)]
struct Stacks {
    by_hash: HashMap<u64, u32>,
    entries: HashMap<u32, StackEntry>,
    next_id: u32,
}

impl Stacks {
    /// The id of `hash`, interning it if there is room.
    fn intern(&mut self, hash: u64, limit: usize) -> Option<u32> {
        if let Some(&id) = self.by_hash.get(&hash) {
            return Some(id);
        }
        if self.entries.len() >= limit || self.next_id >= u32::MAX - 2 {
            return None;
        }
        let id = self.next_id;
        self.next_id += 1;
        self.by_hash.insert(hash, id);
        self.entries.insert(id, StackEntry { hash, refs: 0, defined: false, born: Instant::now() });
        Some(id)
    }

    fn add_ref(&mut self, id: u32) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.refs += 1;
        }
    }

    fn release(&mut self, id: u32) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.refs = e.refs.saturating_sub(1);
        }
    }

    /// Evicts the stacks no site refers to, older than `age`; returns the ids of those
    /// the namer knows.
    fn evict_unreferenced(&mut self, now: Instant, age: Duration) -> Vec<u32> {
        let gone: Vec<u32> = self
            .entries
            .iter()
            .filter(|(_, e)| e.refs == 0 && now.duration_since(e.born) >= age)
            .map(|(&id, _)| id)
            .collect();
        let mut defined = Vec::new();
        for id in gone {
            if let Some(e) = self.entries.remove(&id) {
                self.by_hash.remove(&e.hash);
                if e.defined {
                    defined.push(id);
                }
            }
        }
        defined
    }
}

/// What the namer has not taken yet.
#[derive(Debug, Default)]
pub struct Pending {
    pub stacks: Vec<FileStack>,
    pub modules: Vec<Module>,
    /// Stacks gone (ids are never reused).
    pub evicted: Vec<u32>,
    /// Kernel call sites of new sites (named even when the stack does not hold them).
    pub call_sites: Vec<u64>,
}

impl Pending {
    pub fn is_empty(&self) -> bool {
        self.stacks.is_empty() && self.modules.is_empty() && self.evicted.is_empty() && self.call_sites.is_empty()
    }
}

/// Which endpoint a snapshot is for (exited processes wait for each one scraped lately).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scraper {
    Metrics,
    Heap,
    Allocs,
}

/// The model's own figures.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Events received (allocations, frees, task events).
    pub events: u64,
    /// Allocation events received.
    pub allocations: u64,
    /// User allocation events received (the sampled ones, when sampling).
    pub user_allocations: u64,
    /// Allocations counted but not followed: the live-block table was full.
    pub untracked: u64,
    /// Frees of blocks not followed (allocated before tracing, or not followed).
    pub unmatched_frees: u64,
    /// Frees in a forked child of blocks of its parent (its copy of the parent's heap):
    /// the parent's, neither counted again nor unmatched.
    pub inherited_frees: u64,
    /// Allocations whose stack was not interned: the stack table was full.
    pub stacks_dropped: u64,
    /// Kernel allocations the probes caused (`crate::overhead`): not in any site.
    pub probe_allocations: u64,
    /// Page allocations of new slabs (`crate::overhead`): their objects count in their
    /// own sites, the pages in none.
    pub slab_page_allocations: u64,
    pub processes_dropped: u64,
}

/// How full the model's tables are.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub live_blocks: usize,
    pub stacks: usize,
    pub processes: usize,
    pub exited: usize,
    pub sites: usize,
}

/// A process as snapshots show it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessView {
    /// Unique for the model's lifetime (a pid reused, or exec'd, is a new instance).
    pub instance: u32,
    pub pid: u32,
    pub comm: String,
    pub cgroup: Arc<Cgroup>,
    pub alive: bool,
}

/// One site of one process, with its figures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SiteView {
    /// Index in [`Snapshot::processes`].
    pub process: usize,
    pub key: SiteKey,
    pub stats: SiteStats,
}

/// The figures at one moment, copied out so the tracer goes on.
#[derive(Debug, Clone)]
pub struct Snapshot {
    pub taken: Instant,
    /// Wall-clock time, ns since the epoch.
    pub unix_ns: u64,
    pub sample_bytes: Option<u64>,
    pub processes: Vec<ProcessView>,
    pub sites: Vec<SiteView>,
}

pub struct Model {
    limits: Limits,
    /// By instance.
    processes: HashMap<u32, Process>,
    /// pid → its live instance.
    current: HashMap<u32, u32>,
    /// Forked processes, until they exec or exit: the instance of the parent whose heap
    /// they started with a copy of.
    forked_from: HashMap<u32, u32>,
    /// vfork children using their parent's instance (its heap) until they exec or exit.
    sharing: HashSet<u32>,
    /// What the task records told of a process with no instance yet: its command name (a
    /// fork's is its parent's, an exec's the new program's) and its parent's or its own
    /// earlier cgroup. A process gone before its first event is handled has no `/proc` to
    /// name it from; a forked child read after its exec would take the new program's name.
    told: HashMap<u32, (String, Option<Arc<Cgroup>>)>,
    /// Forked processes whose maps are their parent's (`ModuleTable::learn_fork`), until
    /// they exec or exit: their `/proc` maps, read later, may be another program's.
    maps_from_fork: HashSet<u32>,
    /// Processes that exited lately: the kernel still allocates on their behalf while
    /// tearing them down; that is not a new process (a new one with the pid forks first).
    exited: HashMap<u32, Instant>,
    /// Which task records are news: a fork written after its child's exec (read from its
    /// parent's CPU's ring a drain late) must not end the program the child runs now.
    task_order: crate::lifecycle::Lifecycles,
    next_instance: u32,
    /// Kernel blocks, one space for the machine: (instance that allocated, block).
    kernel: HashMap<(Space, u64), (u32, Block)>,
    live_blocks: usize,
    stacks: Stacks,
    modules: ModuleTable,
    cgroups: CgroupCache,
    pending: Pending,
    scrapes: HashMap<Scraper, Instant>,
    last_sweep: Instant,
    /// Sampling switched on by the session while running (rings overflowing).
    pub sample_from: Option<(u64, u64)>,
    pub counters: Counters,
    /// Tells apart the kernel allocations set aside (the probes' own, slab pages): their
    /// stacks' hashes, and their live blocks (whose frees are theirs too, not unmatched),
    /// both bounded.
    overhead: crate::overhead::ProbeOverhead,
    set_aside: HashMap<u64, SetAside>,
    set_aside_blocks: HashSet<(Space, u64)>,
}

/// Set-aside stacks remembered at most (~16 MB). Past it new ones are not remembered, and
/// none is forgotten: the probes send a stack once, so a forgotten one would count as the
/// program's from then on (on kernels before 6.13, which allocate a return instance per
/// hit, each return probe's user stack makes one).
const MAX_SET_ASIDE_STACKS: usize = 1 << 20;
/// Live set-aside blocks remembered at most; past this the memory starts over (their frees
/// then count as unmatched).
const MAX_SET_ASIDE_BLOCKS: usize = 1 << 16;

pub fn unix_now_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
}

impl Model {
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            processes: HashMap::new(),
            current: HashMap::new(),
            forked_from: HashMap::new(),
            sharing: HashSet::new(),
            told: HashMap::new(),
            maps_from_fork: HashSet::new(),
            exited: HashMap::new(),
            task_order: Default::default(),
            next_instance: 1,
            kernel: HashMap::new(),
            live_blocks: 0,
            stacks: Stacks::default(),
            modules: ModuleTable::new(),
            cgroups: CgroupCache::default(),
            pending: Pending::default(),
            scrapes: HashMap::new(),
            last_sweep: Instant::now(),
            sample_from: None,
            counters: Counters::default(),
            overhead: Default::default(),
            set_aside: HashMap::new(),
            set_aside_blocks: HashSet::new(),
        }
    }

    pub fn limits(&self) -> Limits {
        self.limits
    }

    pub fn usage(&self) -> Usage {
        let exited = self.processes.values().filter(|p| p.exited.is_some()).count();
        Usage {
            live_blocks: self.live_blocks,
            stacks: self.stacks.entries.len(),
            processes: self.processes.len() - exited,
            exited,
            sites: self.processes.values().map(|p| p.sites.len()).sum(),
        }
    }

    /// The pids of the processes alive now.
    pub fn live_pids(&self) -> HashSet<u32> {
        self.current.keys().copied().collect()
    }

    /// What the namer has to do; empties it.
    pub fn take_pending(&mut self) -> Pending {
        std::mem::take(&mut self.pending)
    }

    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// The live instance of `pid`, created (named from /proc) if it has none.
    fn instance_of(&mut self, pid: u32) -> u32 {
        if let Some(&i) = self.current.get(&pid) {
            return i;
        }
        let instance = self.next_instance;
        self.next_instance = self.next_instance.wrapping_add(1).max(1);
        let (comm, cgroup) = if pid == 0 {
            ("[kernel]".to_string(), self.cgroups.intern(""))
        } else if let Some((comm, told)) = self.told.remove(&pid) {
            // The cgroup from /proc while it can be read (a runtime moves its child into the
            // container's cgroup between fork and exec); the parent's once the process is gone.
            let now = self.cgroups.of_process(pid);
            let cgroup = match told {
                Some(told) if now.path.is_empty() => told,
                _ => now,
            };
            (comm, cgroup)
        } else {
            (crate::procfs::comm(pid, pid).unwrap_or_else(|| format!("pid {pid}")), self.cgroups.of_process(pid))
        };
        self.processes.insert(
            instance,
            Process {
                pid,
                comm,
                cgroup,
                sites: Vec::new(),
                site_index: HashMap::new(),
                heap: HashMap::new(),
                mmaps: BTreeMap::new(),
                exited: None,
                maps_read: false,
            },
        );
        self.current.insert(pid, instance);
        instance
    }

    fn multiplicity(&self, a: &Alloc) -> u32 {
        if a.kind.is_kernel() {
            return 1;
        }
        let mean = match (self.limits.sample_bytes, self.sample_from) {
            (Some(mean), _) => mean,
            (None, Some((from, mean))) if a.ts_ns >= from => mean,
            _ => return 1,
        };
        sample_multiplicity(a.bytes_req, mean, a.ts_ns ^ a.ptr).min(u64::from(u32::MAX)) as u32
    }

    fn alloc(&mut self, a: &Alloc) {
        self.counters.allocations += 1;
        if !a.kind.is_kernel() {
            self.counters.user_allocations += 1;
        }
        if self.exited.contains_key(&a.pid) {
            return; // its teardown
        }
        if a.kind.is_kernel()
            && let Some(&class) = self.set_aside.get(&a.stack)
        {
            match class {
                SetAside::Probes => self.counters.probe_allocations += 1,
                SetAside::SlabPages if a.kind == Kind::PageAlloc => self.counters.slab_page_allocations += 1,
                SetAside::SlabPages => return self.alloc_in_site(a),
            }
            if self.set_aside_blocks.len() >= MAX_SET_ASIDE_BLOCKS {
                self.set_aside_blocks.clear();
            }
            self.set_aside_blocks.insert((a.kind.space(), a.ptr));
            return;
        }
        self.alloc_in_site(a);
    }

    /// Counts `a` in its process's site.
    fn alloc_in_site(&mut self, a: &Alloc) {
        let instance = self.instance_of(a.pid);
        let stack = match a.stack {
            0 => StackRef::NONE,
            hash => match self.stacks.intern(hash, self.limits.max_stacks) {
                Some(id) => StackRef(id + 1),
                None => {
                    self.counters.stacks_dropped += 1;
                    StackRef::OVERFLOW
                }
            },
        };
        let key = SiteKey { stack, call_site: a.call_site, kind: a.kind };
        let count = self.multiplicity(a);
        let p = self.processes.get_mut(&instance).expect("instance just looked up");
        let (site, new) = p.site(key);
        if new {
            if let Some(id) = stack.id() {
                self.stacks.add_ref(id);
            }
            if a.call_site != 0 {
                self.pending.call_sites.push(a.call_site);
            }
        }
        p.sites[site as usize].1.on_alloc(a.bytes_req, a.bytes_alloc, u64::from(count));
        if self.live_blocks >= self.limits.max_live_blocks {
            self.counters.untracked += 1;
            return;
        }
        let block = Block { site, count, bytes_req: a.bytes_req, bytes_alloc: a.bytes_alloc };
        p.sites[site as usize].1.on_live(&block, Sign::Add);
        let space = a.kind.space();
        let replaced = match space {
            // GPU blocks share the process's maps: device addresses are unified with the
            // host's (handles and reserved ranges are told apart by kind only here).
            Space::Heap | Space::GpuMemory | Space::GpuHandle | Space::GpuReserve => {
                p.heap.insert(a.ptr, block).map(|b| (instance, b))
            }
            Space::Mmap | Space::GpuMap => {
                p.mmaps.insert(a.ptr, (a.bytes_alloc.max(1), block)).map(|(_, b)| (instance, b))
            }
            Space::Slab | Space::Page => self.kernel.insert((space, a.ptr), (instance, block)),
        };
        match replaced {
            // The earlier block's free was not seen: it is gone.
            Some((owner, old)) => {
                if let Some(p) = self.processes.get_mut(&owner) {
                    p.retire(&old);
                }
            }
            None => self.live_blocks += 1,
        }
    }

    fn free(&mut self, f: &Free) {
        let space = f.kind.space();
        if matches!(space, Space::Slab | Space::Page) {
            match self.kernel.remove(&(space, f.ptr)) {
                Some((owner, block)) => {
                    self.live_blocks -= 1;
                    if let Some(p) = self.processes.get_mut(&owner) {
                        p.retire(&block);
                    }
                }
                None if self.set_aside_blocks.remove(&(space, f.ptr)) => {}
                None => self.counters.unmatched_frees += 1,
            }
            return;
        }
        let Some(p) = self.current.get(&f.pid).and_then(|i| self.processes.get_mut(i)) else {
            self.count_unmatched(f);
            return;
        };
        if matches!(space, Space::Heap | Space::GpuMemory | Space::GpuHandle | Space::GpuReserve) {
            match p.heap.remove(&f.ptr) {
                Some(block) => {
                    p.retire(&block);
                    self.live_blocks -= 1;
                }
                None => self.count_unmatched(f),
            }
            return;
        }
        // munmap frees every region starting inside [ptr, ptr + len).
        let end = f.ptr.saturating_add(u64::from(f.arg.max(1)) * 4096);
        let starts: Vec<u64> = p.mmaps.range(f.ptr..end).map(|(&s, _)| s).collect();
        for start in starts {
            if let Some((_, block)) = p.mmaps.remove(&start) {
                p.retire(&block);
                self.live_blocks -= 1;
            }
        }
    }

    /// A free of a block the process was not seen allocating: its parent's, when it was
    /// forked from a process whose heap holds the address; else unmatched.
    fn count_unmatched(&mut self, f: &Free) {
        let parent = self.forked_from.get(&f.pid).and_then(|i| self.processes.get(i));
        if f.kind.space() == Space::Heap && parent.is_some_and(|p| p.heap.contains_key(&f.ptr)) {
            self.counters.inherited_frees += 1;
        } else {
            self.counters.unmatched_frees += 1;
        }
    }

    fn task(&mut self, t: &Task) {
        let news = match t.event {
            TaskEvent::Fork | TaskEvent::Exec => self.task_order.began(t.pid, t.ts_ns),
            TaskEvent::Exit if t.flags & flags::GROUP_DEAD != 0 => self.task_order.ended(t.pid, t.ts_ns),
            _ => self.task_order.is_news(t.pid, t.ts_ns),
        };
        if !news {
            return;
        }
        match t.event {
            // A new address space: the old program's blocks are gone with it.
            TaskEvent::Exec => {
                self.maps_from_fork.remove(&t.pid);
                let cgroup = self
                    .current_process(t.pid)
                    .map(|p| Arc::clone(&p.cgroup))
                    .or_else(|| self.told.get(&t.pid).and_then(|(_, c)| c.clone()));
                self.end(t.pid);
                self.tell(t.pid, t.comm.clone(), cgroup);
            }
            TaskEvent::Exit if t.flags & flags::GROUP_DEAD != 0 => {
                self.maps_from_fork.remove(&t.pid);
                self.end(t.pid);
                self.told.remove(&t.pid);
                self.exited.insert(t.pid, Instant::now());
            }
            // A reused pid: whatever had it is gone.
            TaskEvent::Fork => {
                self.end(t.pid);
                self.exited.remove(&t.pid);
                if let Some(&parent) = self.current.get(&t.ppid) {
                    if t.flags & flags::SHARED_MEMORY != 0 {
                        // Its blocks are its parent's heap (the parent frees them).
                        self.sharing.insert(t.pid);
                        self.current.insert(t.pid, parent);
                    } else {
                        self.forked_from.insert(t.pid, parent);
                    }
                }
                let cgroup = self.current_process(t.ppid).map(|p| Arc::clone(&p.cgroup));
                self.tell(t.pid, t.comm.clone(), cgroup);
            }
            TaskEvent::Rename if t.tid == t.pid => {
                if let Some(p) = self.current.get(&t.pid).and_then(|i| self.processes.get_mut(i)) {
                    p.comm.clone_from(&t.comm);
                } else if let Some(told) = self.told.get_mut(&t.pid) {
                    told.0.clone_from(&t.comm);
                }
            }
            _ => {}
        }
    }

    fn current_process(&self, pid: u32) -> Option<&Process> {
        self.current.get(&pid).and_then(|i| self.processes.get(i))
    }

    /// Keeps what a task record told of `pid` for its instance to come (bounded: processes
    /// whose exit was lost leave theirs behind).
    fn tell(&mut self, pid: u32, comm: String, cgroup: Option<Arc<Cgroup>>) {
        if self.told.len() >= MAX_TOLD {
            self.told.clear();
        }
        self.told.insert(pid, (comm, cgroup));
    }

    /// The live instance of `pid` ended (exit, exec): its user blocks are freed with its
    /// address space; its figures stay until it is dropped.
    fn end(&mut self, pid: u32) {
        self.forked_from.remove(&pid);
        if self.sharing.remove(&pid) {
            // The parent's instance lives on: only this process's use of it ends.
            self.current.remove(&pid);
            return;
        }
        let Some(instance) = self.current.remove(&pid) else { return };
        let Some(p) = self.processes.get_mut(&instance) else { return };
        p.exited = Some(Instant::now());
        self.live_blocks -= p.heap.len() + p.mmaps.len();
        p.heap = HashMap::new();
        p.mmaps = BTreeMap::new();
    }

    /// Marks a scrape by `scraper` (exited processes it now saw may go).
    fn scraped(&mut self, scraper: Scraper) {
        self.scrapes.insert(scraper, Instant::now());
    }

    /// Whether an exited process may go: every scraper heard from lately has seen it dead
    /// (none heard from: it waits its full time), or it waited long enough.
    fn droppable(&self, exited: Instant, now: Instant) -> bool {
        if now.duration_since(exited) >= EXITED_MAX_AGE {
            return true;
        }
        let mut recent = self.scrapes.values().filter(|&&at| now.duration_since(at) < SCRAPER_MEMORY).peekable();
        recent.peek().is_some() && recent.all(|&at| at > exited)
    }

    /// Between drains: drops the exited processes whose time has come, and now and then
    /// evicts unreferenced stacks and notices processes that died unseen.
    pub fn housekeep(&mut self, now: Instant) {
        let mut exited: Vec<(Instant, u32)> =
            self.processes.iter().filter_map(|(&i, p)| p.exited.map(|at| (at, i))).collect();
        exited.sort_unstable();
        let excess = exited.len().saturating_sub(MAX_EXITED);
        let gone: HashSet<u32> = exited
            .iter()
            .enumerate()
            .filter(|&(n, &(at, _))| n < excess || self.droppable(at, now))
            .map(|(_, &(_, i))| i)
            .collect();
        if !gone.is_empty() {
            self.drop_instances(&gone);
        }
        self.exited.retain(|_, at| now.duration_since(*at) < EXIT_TEARDOWN);
        if now.duration_since(self.last_sweep) >= SWEEP_INTERVAL {
            self.last_sweep = now;
            self.sweep(now);
        }
    }

    fn drop_instances(&mut self, gone: &HashSet<u32>) {
        let mut pids = HashSet::new();
        for instance in gone {
            let Some(p) = self.processes.remove(instance) else { continue };
            self.counters.processes_dropped += 1;
            if !self.current.contains_key(&p.pid) {
                pids.insert(p.pid);
            }
            for (key, _) in &p.sites {
                if let Some(id) = key.stack.id() {
                    self.stacks.release(id);
                }
            }
            self.live_blocks -= p.heap.len() + p.mmaps.len();
        }
        let before = self.kernel.len();
        self.kernel.retain(|_, (owner, _)| !gone.contains(owner));
        self.live_blocks -= before - self.kernel.len();
        self.modules.forget_processes(&pids);
    }

    fn sweep(&mut self, now: Instant) {
        // Processes whose exit was not seen (an event lost).
        let dead: Vec<u32> = self
            .current
            .keys()
            .copied()
            // SAFETY: kill with signal 0 only checks that the process exists.
            .filter(|&pid| pid != 0 && unsafe { libc::kill(pid as i32, 0) } != 0 && errno() == libc::ESRCH)
            .collect();
        for pid in dead {
            self.end(pid);
        }
        let evicted = self.stacks.evict_unreferenced(now, UNREFERENCED_STACK_AGE);
        if !evicted.is_empty() {
            // Stacks the namer has not taken yet need not reach it at all.
            let set: HashSet<u32> = evicted.iter().copied().collect();
            let unseen: HashSet<u32> = self.pending.stacks.iter().map(|s| s.id).filter(|id| set.contains(id)).collect();
            self.pending.stacks.retain(|s| !set.contains(&s.id));
            self.pending.evicted.extend(evicted.into_iter().filter(|id| !unseen.contains(id)));
        }
    }

    /// The figures now, for `scraper`.
    pub fn snapshot(&mut self, scraper: Scraper) -> Snapshot {
        self.scraped(scraper);
        let mut processes = Vec::with_capacity(self.processes.len());
        let mut sites = Vec::new();
        let mut instances: Vec<&u32> = self.processes.keys().collect();
        instances.sort_unstable();
        for &instance in instances {
            let p = &self.processes[&instance];
            let index = processes.len();
            processes.push(ProcessView {
                instance,
                pid: p.pid,
                comm: p.comm.clone(),
                cgroup: Arc::clone(&p.cgroup),
                alive: p.exited.is_none(),
            });
            sites.extend(p.sites.iter().map(|&(key, stats)| SiteView { process: index, key, stats }));
        }
        Snapshot {
            taken: Instant::now(),
            unix_ns: unix_now_ns(),
            sample_bytes: self.limits.sample_bytes.or(self.sample_from.map(|(_, mean)| mean)),
            processes,
            sites,
        }
    }
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

impl Sink for Model {
    fn stack(&mut self, s: StackRecord) {
        if !s.kernel.is_empty()
            && let Some(class) = self.overhead.classify(&s)
        {
            if self.set_aside.len() < MAX_SET_ASIDE_STACKS {
                self.set_aside.insert(s.hash, class);
                // Its allocations are counted apart, in no site: the stack is not kept
                // (a slab's pages' is, for the kmallocs a new slab makes for itself).
                if class == SetAside::Probes {
                    return;
                }
            } else if self.set_aside.len() == MAX_SET_ASIDE_STACKS {
                log::warn!(
                    "{MAX_SET_ASIDE_STACKS} stacks of the probes' own and slab pages remembered: those of more count in sites"
                );
                self.set_aside.insert(s.hash, class); // once over: said once
            }
        }
        let Some(id) = self.stacks.intern(s.hash, self.limits.max_stacks) else {
            return; // counted when an allocation uses it
        };
        let entry = self.stacks.entries.get_mut(&id).expect("just interned");
        if entry.defined {
            return;
        }
        entry.defined = true;
        // The stack's process, named and its maps read, unless it is being torn down.
        if !self.exited.contains_key(&s.pid) {
            let instance = self.instance_of(s.pid);
            let p = self.processes.get_mut(&instance).expect("instance just looked up");
            if !p.maps_read {
                p.maps_read = true;
                if !self.maps_from_fork.contains(&s.pid) {
                    self.modules.learn_process(s.pid);
                }
            }
        }
        let (user, truncated) = self.modules.resolve_record(&s);
        self.pending.modules.extend(self.modules.take_new());
        self.pending.stacks.push(FileStack { id, pid: s.pid, kernel: s.kernel, user, truncated });
    }

    fn event(&mut self, event: Event) {
        self.counters.events += 1;
        match &event {
            Event::Alloc(a) => self.alloc(a),
            Event::Free(f) => self.free(f),
            Event::Task(t) => self.task(t),
        }
    }

    fn exec_seen(&mut self, pid: u32, filename: &Path) {
        self.modules.learn_exec(pid, filename);
        self.pending.modules.extend(self.modules.take_new());
    }

    fn processes_at_start(&mut self, snapshot: std::sync::Arc<crate::at_start::Snapshot>) {
        self.modules.set_at_start(snapshot);
    }

    fn fork_seen(&mut self, child: u32, parent: u32) {
        if self.modules.learn_fork(child, parent) {
            self.maps_from_fork.insert(child);
        } else {
            self.maps_from_fork.remove(&child);
        }
    }

    fn maps_seen(&mut self, pid: u32, maps: crate::procfs::Maps) {
        self.modules.learn_maps(pid, maps);
    }

    fn file_seen(&mut self, path: &Path) {
        self.modules.learn_file(path);
        self.pending.modules.extend(self.modules.take_new());
    }
}
