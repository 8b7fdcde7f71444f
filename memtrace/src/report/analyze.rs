//! `analyze`: one pass over a recording's events, paired and aggregated per group (site,
//! stack, function or process) under the report's filters, into a [`Summary`]: the totals,
//! the rows sorted, the blocks still live, and how whole the stacks were. Rendering is
//! elsewhere (`text`, `json`, `export`).
//!
//! Over 500 lines: the one pass over the events that every report figure comes from; rendering, options, sites and warnings are in their own files.
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    path::Path,
};

use anyhow::Result;
use memtrace_common::{Kind, TaskEvent};
use serde::Serialize;

use super::{
    load::{Definitions, for_each_event, read_definitions},
    memory::{MAX_ROW_SERIES, MemoryView},
    options::{ReportOptions, SortKey},
    sites,
    warnings::{ProcessTally, note_task, under_counting},
};
use crate::{
    analysis::{Analyzer, Domain, EXCLUDED, LiveBlock, Origin, Stats, Timeline, Totals},
    event::Event,
    grouping::{Filters, GroupBy, GroupKey, LABEL_FRAMES, domain_of, label, row_label},
    recording::{self, FileFrame, Meta, SymbolKey, TARGET_EXITED},
    stacks::{Frame, StackTable},
};

/// Everything a report shows, computed once; printed as text or JSON, or exported.
pub struct Summary {
    pub meta: Meta,
    pub stats: recording::Stats,
    pub warnings: Vec<String>,
    pub finalized: bool,
    pub totals: BTreeMap<Domain, Totals>,
    pub groups: Vec<GroupRow>,
    /// The rows (processes, by process) before `--top` kept the first.
    pub rows_in_all: usize,
    pub leaks: Vec<LeakRow>,
    pub by: GroupBy,
    pub duration_ns: u64,
    pub events: u64,
    pub comms: HashMap<u32, String>,
    /// Allocations recorded per process, before the filters: what `--pid` and `--comm`
    /// could have asked for.
    pub allocs_by_pid: BTreeMap<u32, u64>,
    pub stacks: StackTable,
    /// Per domain: allocations traced with a stack, and how many of those stacks were cut.
    pub coverage: BTreeMap<Domain, StackCoverage>,
    /// The warnings about under-counting (also in `warnings`): what `record` repeats when
    /// it ends.
    pub under_counting: Vec<String>,
    /// All the blocks still live (`--leaks`), before `--top` keeps the first rows.
    pub leak_totals: LeakTotals,
    /// Live bytes over time and each domain's peak.
    pub memory: MemoryView,
    /// The allocators of the recording with their figures.
    pub allocators: Vec<AllocatorRow>,
    /// Kernel allocations the uprobe machinery made for the probes (under `handle_swbp`,
    /// `install_breakpoint`, …): not the program's, left out of every figure above.
    pub probe_overhead: ProbeOverhead,
    /// The program's own `mmap` calls (not the allocators'): in the user row, on no
    /// allocator's line.
    pub user_mmaps: UserMmaps,
    /// Pages the slab allocators took (new slabs, kmallocs too large for a cache), left
    /// out of the kernel figures where slab objects count: their objects are counted at
    /// their own kmalloc or kmem_cache_alloc.
    pub slab_pages: SlabPages,
}

/// Page allocations that hold slab objects, left out as counted twice.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct SlabPages {
    pub allocs: u64,
    pub bytes_alloc: u64,
}

/// Anonymous and file mappings the traced programs asked for themselves, after the filters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct UserMmaps {
    /// mmap calls, and mremap calls (each a new mapping): the mappings are the sum.
    pub calls: u64,
    pub remaps: u64,
    pub bytes_alloc: u64,
}

/// Kernel allocations made on the probes' behalf, counted apart: those the recording holds
/// (through the uprobe machinery), and those the probes left out as they were made (for
/// their own maps' updates), of which the recording holds only the count.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ProbeOverhead {
    pub allocs: u64,
    pub bytes_alloc: u64,
    pub map_allocs: u64,
    pub map_bytes_alloc: u64,
}

/// What `--leaks` found in all: blocks, bytes and stacks; and the blocks left out as the
/// runtime's own (libstdc++'s emergency pool).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeakTotals {
    pub blocks: u64,
    pub bytes_req: u64,
    pub stacks: usize,
    pub runtime_blocks: u64,
    pub runtime_bytes_req: u64,
}

/// Whether a leak row's blocks are what a language runtime allocates once and keeps for the
/// process's life, freed only when a leak checker asks it to at exit (heaptrack and valgrind
/// call `__gnu_cxx::__freeres`): libstdc++'s emergency pool for exceptions (72,704 bytes in
/// every C++ program), allocated by `pool::pool` of eh_alloc.cc while the library is loaded.
/// Known by that name where libstdc++'s debug information is installed, else by its stack and
/// shape: the allocator's caller in libstdc++, called from libstdc++ alone, by the dynamic
/// loader (its constructors, run by `call_init`, whether the library came with the program or
/// with dlopen), one block of 64 KiB or more per process. (A stack cut at another library's
/// constructor, without frame pointers under `--call-graph fp`, reads the same: the shape
/// keeps its blocks in the list.) Live at the end, not a leak: `--leaks` leaves them out and
/// says so.
fn kept_by_the_runtime(table: &StackTable, row: &LeakRow) -> bool {
    if row.domain == Domain::Kernel {
        return false;
    }
    let Some(s) = table.stack(row.stack) else { return false };
    let file_is = |f: FileFrame, prefix: &str| match f {
        FileFrame::Module { module, .. } => table.modules.get(&module).is_some_and(|m| {
            std::path::Path::new(&m.path).file_name().is_some_and(|n| n.to_string_lossy().starts_with(prefix))
        }),
        FileFrame::Address(_) => false,
    };
    let pool = |f: FileFrame| {
        table
            .symbols
            .get(&SymbolKey::User(f))
            .is_some_and(|chain| chain.iter().any(|sym| sym.name.starts_with("(anonymous namespace)::pool::pool")))
    };
    let mut frames = s.user().peekable();
    let mut in_libstdcxx = 0;
    while let Some(&f) = frames.peek().filter(|&&f| file_is(f, "libstdc++")) {
        if pool(f) {
            return true;
        }
        in_libstdcxx += 1;
        frames.next();
    }
    let shaped = row.blocks as usize <= row.pids.len() && row.bytes_req >= row.blocks * (64 << 10);
    shaped && in_libstdcxx > 0 && frames.next().is_some_and(|f| file_is(f, "ld-linux") || file_is(f, "ld.so"))
}

/// An allocator the recording found, and what went through it (after the filters).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct AllocatorRow {
    pub module: String,
    pub family: String,
    pub prefix: String,
    pub allocs: u64,
    pub frees: u64,
    pub bytes_req: u64,
    pub bytes_alloc: u64,
    /// Probed after a traced process could call it (its program exec'd, or the library
    /// mapped, before it was looked into).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub probed_late: Option<recording::LateProbe>,
}

/// Whether allocator `index` (1-based) of `allocators` is the one `name` names.
pub(crate) fn allocator_matches(allocators: &[recording::AllocatorMeta], index: u8, name: &str) -> bool {
    let Some(a) = index.checked_sub(1).and_then(|i| allocators.get(usize::from(i))) else {
        return name == "unknown";
    };
    a.family == name || (!a.prefix.is_empty() && a.prefix == name) || a.module.contains(name)
}

/// How whole the stacks of a domain's allocations are.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct StackCoverage {
    /// Allocations recorded with a stack.
    pub allocs_with_stack: u64,
    /// Of those, allocations whose user stack walk was cut before the outermost frame.
    pub allocs_truncated: u64,
    /// Distinct truncated stacks among them.
    pub stacks_truncated: u64,
    /// Of the allocations cut short, those cut for want of ring room for a stack copy
    /// (recordings that list those stacks).
    pub allocs_no_room: u64,
    /// Allocations whose stack names a Python function (processes running CPython).
    pub allocs_with_python: u64,
}

/// One group's figures and what names it.
pub struct GroupRow {
    pub domain: Domain,
    /// The stack shown was cut before its outermost frame.
    pub truncated: bool,
    /// The row's name on one line ([`crate::grouping::label`]).
    pub label: String,
    /// Its stack, named; empty when the analysis left rows unnamed
    /// ([`super::ReportOptions::rows_unnamed`]): readers name it with
    /// [`crate::export::row_frames`].
    pub frames: Vec<Frame>,
    pub kinds: Vec<Kind>,
    pub pids: Vec<u32>,
    /// GPU rows: the devices the allocations were made on, where known.
    pub devices: Vec<i32>,
    pub stats: Stats,
    pub stack: u64,
    pub call_site: u64,
    /// The analyzer's group.
    pub group: u32,
    /// Live bytes over time (the first rows, with [`ReportOptions::timeline`]).
    pub timeline: Vec<u64>,
    /// User sites: the family of the allocator that served them (the first allocation's).
    pub allocator: Option<String>,
    /// Kernel rows: the slab caches their kmem_cache_alloc allocations came from, by name
    /// (`0x…` where the recording has none), first met first.
    pub caches: Vec<String>,
}

/// Blocks still live at the end, from one stack.
pub struct LeakRow {
    pub domain: Domain,
    pub frames: Vec<Frame>,
    pub blocks: u64,
    pub bytes_req: u64,
    pub bytes_alloc: u64,
    pub oldest_age_ns: u64,
    pub pids: Vec<u32>,
    pub stack: u64,
    pub call_site: u64,
}

/// A group met while reading: its key and what the report shows of it.
struct GroupInfo {
    key: GroupKey,
    /// A stack of the group, to show.
    stack: u64,
    call_site: u64,
    kinds: Vec<Kind>,
    pids: Vec<u32>,
    allocator: u8,
    devices: Vec<i32>,
    /// Kernel rows: the slab caches of their kmem_cache_alloc allocations, first met first.
    caches: Vec<u64>,
    /// Grouped by site: a (stack, call site) of its allocations per distinct
    /// [`StackTable::prefix_key`], the first included, to name the row by what they share
    /// (`grouping::shared_label`), and those keys.
    stacks: Vec<(u64, u64)>,
    prefixes: HashSet<Vec<u64>>,
}

/// Assigns allocations to groups (the analyzer's grouping function) and remembers each
/// group's key, kinds, processes and the stack to show.
struct Grouper<'a> {
    by: GroupBy,
    split_processes: bool,
    filters: &'a Filters,
    stacks: &'a mut StackTable,
    infos: Vec<GroupInfo>,
    index: HashMap<GroupKey, u32>,
    /// Rows are named by site: keep what names them (`GroupInfo::stacks`); not for a
    /// report that shows no row.
    name_sites: bool,
    /// The (group, stack, call site) triples met so far, when naming sites.
    seen_stacks: HashSet<(u32, u64, u64)>,
}

impl Grouper<'_> {
    /// Most processes listed per group.
    const MAX_PIDS: usize = 64;
    /// Slab caches listed per row at most (a helper such as `mempool_alloc_slab` serves many).
    const MAX_CACHES: usize = 16;

    fn group_of(&mut self, o: &Origin) -> u32 {
        if !self.filters.admits_in(o.kind, domain_of(o, self.stacks)) {
            return EXCLUDED;
        }
        let mut key = GroupKey::of(o, self.by, self.stacks);
        if self.split_processes {
            key = key.per_process(o.pid);
        }
        let next = self.infos.len() as u32;
        let g = *self.index.entry(key.clone()).or_insert(next);
        if g == next {
            self.infos.push(GroupInfo {
                key,
                stack: o.stack,
                call_site: o.call_site,
                kinds: Vec::new(),
                pids: Vec::new(),
                allocator: o.allocator,
                devices: Vec::new(),
                caches: Vec::new(),
                stacks: Vec::new(),
                prefixes: HashSet::new(),
            });
        }
        let info = &mut self.infos[g as usize];
        if self.name_sites
            && (info.stacks.is_empty() || info.stack != o.stack || info.call_site != o.call_site)
            && self.seen_stacks.insert((g, o.stack, o.call_site))
        {
            let kernel = info.key.domain() == Domain::Kernel;
            if info.prefixes.insert(self.stacks.prefix_key(o.stack, o.call_site, LABEL_FRAMES + 1, kernel)) {
                info.stacks.push((o.stack, o.call_site));
            }
        }
        // The stack a group shows: a whole one if any of its allocations has one.
        if info.stack != o.stack
            && self.stacks.is_truncated(info.stack)
            && !self.stacks.is_truncated(o.stack)
            && o.stack != 0
        {
            info.stack = o.stack;
        }
        if !info.kinds.contains(&o.kind) {
            info.kinds.push(o.kind);
        }
        if info.pids.len() < Self::MAX_PIDS && !info.pids.contains(&o.pid) {
            info.pids.push(o.pid);
        }
        if o.device >= 0 && !info.devices.contains(&o.device) {
            info.devices.push(o.device);
        }
        if o.cache != 0 && info.caches.len() < Self::MAX_CACHES && !info.caches.contains(&o.cache) {
            info.caches.push(o.cache);
        }
        g
    }
}

/// Counts, per domain, the allocations with a stack and those whose stack was cut.
struct CoverageCounter {
    truncated_ids: crate::FastSet<u64>,
    no_room_ids: crate::FastSet<u64>,
    python_ids: crate::FastSet<u64>,
    seen: crate::FastSet<u64>,
    coverage: BTreeMap<Domain, StackCoverage>,
}

impl CoverageCounter {
    fn count(&mut self, domain: Domain, stack: u64) {
        let c = self.coverage.entry(domain).or_default();
        c.allocs_with_stack += 1;
        c.allocs_with_python += u64::from(self.python_ids.contains(&stack));
        if self.truncated_ids.contains(&stack) {
            c.allocs_truncated += 1;
            c.allocs_no_room += u64::from(self.no_room_ids.contains(&stack));
            if self.seen.insert(stack) {
                c.stacks_truncated += 1;
            }
        }
    }
}

/// Reads the recording at `path` and adds it up as `opts` asks.
pub fn analyze(path: &Path, opts: &ReportOptions) -> Result<Summary> {
    let Definitions { meta, stacks: mut table, stats, finalized, mut warnings, damaged_at, skipped } =
        read_definitions(path)?;
    // No chunk skipped or cut: what the file lacks, the program did not do.
    let intact = finalized && warnings.is_empty();
    if !finalized {
        let named = table.fill_missing_symbols();
        if named > 0 {
            warnings.push(format!("{named} addresses were symbolized from this machine's files, not the recording"));
        }
    }
    table.set_allocator(meta.allocator.as_deref());
    table.set_alloc_fns(opts.alloc_fns.clone());
    let reserved_stacks = table.reserved_stacks();
    // Looked up per event: with the fast hasher (SipHash took a fifth of a report's time).
    let uprobe_stacks: crate::FastSet<u64> = table.uprobe_stacks().into_iter().collect();
    // Only where pages and every slab object (kmalloc and kmem_cache_alloc: which a page's
    // slab holds is not told) count: a view of pages (`--kind page`, or beside one kind of
    // object) counts them all, as `perf kmem --page` does.
    let filters = &opts.filters;
    let slab_page_stacks: crate::FastSet<u64> = if filters.admits_kind(Kind::PageAlloc)
        && filters.admits_kind(Kind::Kmalloc)
        && filters.admits_kind(Kind::KmemCacheAlloc)
    {
        table.slab_page_stacks().into_iter().collect()
    } else {
        Default::default()
    };
    let mut slab_pages = SlabPages::default();
    // Not told by process: shown only where every process counts.
    let mut probe_overhead = ProbeOverhead::default();
    if filters.pid.is_none() && filters.comm.is_none() {
        probe_overhead.map_allocs = stats.probe_map_allocs;
        probe_overhead.map_bytes_alloc = stats.probe_map_bytes;
    }
    let mut user_mmaps = UserMmaps::default();

    let duplicates: crate::FastMap<u64, u64> = table.duplicates().into_iter().collect();
    let no_room = super::warnings::no_room_stacks(&stats);
    let unplaced = super::warnings::unplaced_stacks(&stats);
    let mut comms: HashMap<u32, String> = HashMap::new();
    let mut task_order = crate::lifecycle::Lifecycles::new();
    let mut coverage = CoverageCounter {
        truncated_ids: table.truncated_stacks().into_iter().collect(),
        no_room_ids: no_room.clone(),
        python_ids: table.python_stacks().into_iter().collect(),
        seen: Default::default(),
        coverage: BTreeMap::new(),
    };
    let mut grouper = Grouper {
        by: opts.by,
        split_processes: opts.split_processes,
        filters,
        stacks: &mut table,
        infos: Vec::new(),
        index: HashMap::new(),
        name_sites: opts.by == GroupBy::Site && opts.top != Some(0),
        seen_stacks: HashSet::new(),
    };

    let mut tallies: BTreeMap<u32, ProcessTally> = BTreeMap::new();
    let mut user_allocs_seen = false;
    let mut allocs_by_pid: crate::FastMap<u32, u64> = Default::default();
    let recorded_allocators = stats.allocators.clone();
    let allocators_found: Vec<bool> = recorded_allocators.iter().map(|a| a.found).collect();
    let mut allocators: Vec<AllocatorRow> = recorded_allocators
        .iter()
        .map(|a| AllocatorRow {
            module: a.module.clone(),
            family: a.family.clone(),
            prefix: a.prefix.clone(),
            probed_late: a.probed_late.clone(),
            ..Default::default()
        })
        .collect();
    // Live heap blocks by (pid, address): the allocator that served them, for its frees.
    let mut served_by: crate::FastMap<(u32, u64), u8> = Default::default();
    // vfork children → the process whose heap they use until they exec or exit.
    let mut heap_of: crate::FastMap<u32, u32> = Default::default();
    let allocator_filter = filters.allocator.clone();
    let mut analyzer = Analyzer::new(|o: &Origin| grouper.group_of(o));
    analyzer.sample_bytes = meta.sample_bytes;
    analyzer.sample_from = stats.sampled_from;
    let expected_ns = stats.end_monotonic_ns.saturating_sub(meta.start_monotonic_ns);
    analyzer.timeline = Some(Timeline::new(meta.start_monotonic_ns, expected_ns, opts.timeline));
    analyzer.reserved_stacks = reserved_stacks;
    // The time of the recording's last event, whatever the filters take.
    let mut latest = 0;
    for_each_event(path, damaged_at, &mut |mut event| {
        latest = event.ts_ns().max(latest);
        if let Event::Alloc(a) = &mut event
            && let Some(&canonical) = duplicates.get(&a.stack)
        {
            a.stack = canonical;
        }
        if let Event::Task(t) = &event {
            note_task(t, &mut comms, &mut tallies, &mut task_order);
            if t.event == TaskEvent::Fork && t.flags & memtrace_common::flags::SHARED_MEMORY != 0 {
                heap_of.insert(t.pid, heap_of.get(&t.ppid).copied().unwrap_or(t.ppid));
            } else if t.ends_address_space() {
                heap_of.remove(&t.pid);
            }
        }
        let heap_pid = |pid: u32| heap_of.get(&pid).copied().unwrap_or(pid);
        let pid = match &event {
            Event::Alloc(a) => a.pid,
            Event::Free(f) => f.pid,
            Event::Task(t) => t.pid,
        };
        let process_ok = filters.admits_process(pid, &comms);
        if let Event::Alloc(a) = &event {
            user_allocs_seen |= !a.kind.is_kernel();
            *allocs_by_pid.entry(a.pid).or_default() += 1;
        }
        let user_heap = |k: Kind| k.space() == memtrace_common::Space::Heap;
        let other_allocator = |a: &crate::event::Alloc| {
            allocator_filter
                .as_deref()
                .is_some_and(|name| !user_heap(a.kind) || !allocator_matches(&recorded_allocators, a.allocator, name))
        };
        if let Event::Alloc(a) = &event
            && a.stack != 0
            && process_ok
            && filters.domain.admits(analyzer.domain(a.kind, a.stack))
            && !(a.kind.is_kernel() && uprobe_stacks.contains(&a.stack))
            && !(a.kind == Kind::PageAlloc && slab_page_stacks.contains(&a.stack))
        {
            // The summary's stack line counts what the report counts (`--kind`,
            // `--min-size`, `--allocator`); the per-process warnings, whole processes.
            // An allocator's page mappings count as reserved, as in the totals (and `--kind
            // reserved` takes them, `--kind user` leaves them out).
            let domain = analyzer.domain(a.kind, a.stack);
            if filters.admits_in(a.kind, domain) && filters.admits_size(a.bytes_req) && !other_allocator(a) {
                coverage.count(domain, a.stack);
            }
            let t = tallies.entry(a.pid).or_default();
            let domain = if a.kind.is_kernel() { &mut t.kernel } else { &mut t.user };
            domain.count(a.stack, coverage.truncated_ids.contains(&a.stack), &no_room, &unplaced);
        }
        if let Event::Free(f) = &event
            && process_ok
            && f.kind.space() == memtrace_common::Space::Heap
        {
            tallies.entry(f.pid).or_default().frees += 1;
        }
        if process_ok {
            match &event {
                // The allocators' lines count what the report counts, as the summary does.
                Event::Alloc(a)
                    if user_heap(a.kind)
                        && a.allocator != 0
                        && filters.admits_kind(a.kind)
                        && filters.admits_size(a.bytes_req) =>
                {
                    served_by.insert((heap_pid(a.pid), a.ptr), a.allocator);
                    if let Some(row) = allocators.get_mut(usize::from(a.allocator - 1)) {
                        row.allocs += 1;
                        row.bytes_req += a.bytes_req;
                        row.bytes_alloc += a.bytes_alloc;
                    }
                }
                Event::Alloc(a)
                    if a.kind == Kind::Mmap
                        && !analyzer.reserved_stacks.contains(&a.stack)
                        && filters.domain.admits(Domain::User)
                        && filters.admits_kind(a.kind)
                        && filters.admits_size(a.bytes_req)
                        && !other_allocator(a) =>
                {
                    if a.flags & memtrace_common::flags::BY_REALLOC != 0 {
                        user_mmaps.remaps += 1;
                    } else {
                        user_mmaps.calls += 1;
                    }
                    user_mmaps.bytes_alloc += a.bytes_alloc;
                }
                Event::Free(f) if user_heap(f.kind) => {
                    if let Some(i) = served_by.remove(&(heap_pid(f.pid), f.ptr))
                        && let Some(row) = allocators.get_mut(usize::from(i - 1))
                    {
                        row.frees += 1;
                    }
                }
                _ => {}
            }
        }
        match &event {
            // Kept for pairing (their frees are not "frees without allocation"), not counted.
            Event::Alloc(a) if a.kind.is_kernel() && a.stack != 0 && uprobe_stacks.contains(&a.stack) => {
                if process_ok {
                    probe_overhead.allocs += 1;
                    probe_overhead.bytes_alloc += a.bytes_alloc;
                }
                analyzer.push_excluded(a)
            }
            // Kept for pairing too; counted on a line of their own.
            Event::Alloc(a) if a.kind == Kind::PageAlloc && a.stack != 0 && slab_page_stacks.contains(&a.stack) => {
                if process_ok && filters.admits_size(a.bytes_req) {
                    slab_pages.allocs += 1;
                    slab_pages.bytes_alloc += a.bytes_alloc;
                }
                analyzer.push_excluded(a)
            }
            Event::Alloc(a) if !process_ok || !filters.admits_size(a.bytes_req) || other_allocator(a) => {
                analyzer.push_excluded(a)
            }
            Event::Free(_) if !process_ok => {
                analyzer.quiet_unmatched = true;
                analyzer.push(&event);
                analyzer.quiet_unmatched = false;
            }
            _ => analyzer.push(&event),
        }
    })?;
    analyzer.finish();
    for (pid, n) in &analyzer.unmatched_by_pid {
        tallies.entry(*pid).or_default().unmatched_frees = *n;
    }
    let live: Vec<LiveBlock> = analyzer.live_blocks().copied().collect();
    let peaks = analyzer.peak.peaks();
    let mut timeline = analyzer.timeline.take().expect("set above");
    let (groups, totals, first_ts, last_ts, events) =
        (analyzer.groups, analyzer.totals, analyzer.first_ts, analyzer.last_ts, analyzer.events);
    let infos = grouper.infos;

    // The groups with something to show, in the order `--sort` asks.
    let mut groups = groups;
    let mut candidates: Vec<usize> =
        (0..groups.len()).filter(|&g| groups[g].allocs != 0 || groups[g].failed != 0).collect();
    // How many rows there are before `--top` keeps the first (processes, for a report by
    // process: one row per process and domain).
    let rows_in_all = if opts.by == GroupBy::Process {
        candidates.iter().flat_map(|&g| &infos[g].pids).collect::<std::collections::HashSet<_>>().len()
    } else {
        candidates.len()
    };
    let cache_names: HashMap<u64, String> = stats.slab_caches.iter().cloned().collect();
    let row_of = |group: usize, stats: Stats, frames: Vec<Frame>, label: String| {
        let info = &infos[group];
        GroupRow {
            domain: info.key.domain(),
            truncated: table.is_truncated(info.stack),
            label,
            frames,
            kinds: info.kinds.clone(),
            pids: info.pids.clone(),
            devices: info.devices.clone(),
            stats,
            stack: info.stack,
            call_site: info.call_site,
            group: group as u32,
            timeline: Vec::new(),
            allocator: info
                .allocator
                .checked_sub(1)
                .and_then(|i| recorded_allocators.get(usize::from(i)))
                .map(|a| a.family.clone()),
            caches: info
                .caches
                .iter()
                .map(|c| cache_names.get(c).cloned().unwrap_or_else(|| format!("0x{c:x}")))
                .collect(),
        }
    };
    let mut rows: Vec<GroupRow> = if opts.by == GroupBy::Site && opts.top != Some(0) {
        // Call sites are named before they are sorted: two rows of one name are told apart
        // by what they show (`sites::disambiguate`). A label's frames now; the whole stack
        // only for the rows shown (below).
        let mut rows: Vec<GroupRow> = candidates
            .into_iter()
            .map(|group| {
                let info = &infos[group];
                let frames = table.frames_prefix(info.stack, info.call_site, LABEL_FRAMES + 1);
                let name = row_label(&info.key, &frames, (info.stack, info.call_site), &info.stacks, &table, &comms);
                row_of(group, std::mem::take(&mut groups[group]), frames, name)
            })
            .collect();
        if !opts.labels_without_addresses {
            sites::disambiguate(&mut rows, opts.by);
        }
        rows.sort_by(|a, b| row_order(opts.sort, &a.stats, &b.stats));
        rows.truncate(opts.top.unwrap_or(usize::MAX));
        rows
    } else {
        // Other rows are made and named once sorted, only those shown: a report by stack of
        // a million stacks named them all (gigabytes). The warnings after `record` show none.
        candidates.sort_by(|&a, &b| row_order(opts.sort, &groups[a], &groups[b]));
        if opts.by == GroupBy::Process {
            // A process's rows (one per domain) together, where its first one ranks: cc1's
            // kernel row no longer sits between other processes' rows and its user row.
            let mut rank: HashMap<&[u32], usize> = HashMap::new();
            for &g in &candidates {
                let next = rank.len();
                rank.entry(infos[g].pids.as_slice()).or_insert(next);
            }
            candidates.sort_by_key(|&g| rank[infos[g].pids.as_slice()]);
        }
        match (opts.by, opts.top) {
            // `--top N` by process keeps N processes, each with all its rows (one per
            // domain), as the header counts them.
            (GroupBy::Process, Some(n)) => {
                let mut kept: HashSet<&[u32]> = HashSet::new();
                candidates.retain(|&g| {
                    let pids = infos[g].pids.as_slice();
                    kept.contains(pids) || (kept.len() < n && kept.insert(pids))
                });
            }
            _ => candidates.truncate(opts.top.unwrap_or(usize::MAX)),
        }
        candidates
            .into_iter()
            .map(|group| {
                let info = &infos[group];
                let frames = table.frames_prefix(info.stack, info.call_site, LABEL_FRAMES + 1);
                let name = label(&info.key, &frames, &comms);
                row_of(group, std::mem::take(&mut groups[group]), Vec::new(), name)
            })
            .collect()
    };
    for row in &mut rows {
        // Unnamed: empty, not a site's label frames (the caller names each row whole).
        row.frames = if opts.rows_unnamed { Vec::new() } else { table.frames_once(row.stack, row.call_site) };
    }

    // A target that exited ended the session with its last events (its exit, then the
    // kernel freeing its memory), not when memtrace had drained and detached, tens of ms
    // later (100 ms on a cold start): leaks are as old as they were at the exit, as
    // heaptrack tells them, and `--older-than` judges them so (helper-49: a block
    // allocated 0.1 ms before a program's exit read 95.8 ms old).
    let target_exited = (meta.mode == "command" && stats.exit_code.is_some()) || stats.end_reason == TARGET_EXITED;
    let end_ts = last_ts.max(if target_exited && latest > 0 { latest } else { stats.end_monotonic_ns });
    let memory = MemoryView::new(&mut timeline, end_ts, peaks);
    for row in rows.iter_mut().take(MAX_ROW_SERIES) {
        if let Some(series) = timeline.group(row.group) {
            row.timeline = series.dense(memory.intervals());
        }
    }
    let (leaks, leak_totals) =
        if opts.leaks { leak_rows(&live, &infos, &mut table, end_ts, opts) } else { Default::default() };
    // A session of the whole machine or of running processes spans from its start (`-a -d
    // 4s` is 4 s), not from its first event (`--no-kernel`: the first allocation of a
    // program started later, which read "1.6s of events", helper-44).
    let began = match first_ts {
        Some(first) if meta.mode != "command" && meta.start_monotonic_ns > 0 => {
            Some(first.min(meta.start_monotonic_ns))
        }
        first => first,
    };
    let duration_ns = began.map_or(0, |f| end_ts.saturating_sub(f));
    let reading = super::warnings::Reading { skipped: skipped > 0, filtered: !opts.filters.is_empty() };
    let mut under_counting = under_counting(&tallies, &comms, &meta, &stats, reading);
    if meta.user && meta.mode == "command" && !user_allocs_seen && intact {
        under_counting.push(super::warnings::nothing_seen(&meta));
    }
    warnings.extend(under_counting.iter().cloned());
    if totals.get(&Domain::Gpu).is_some_and(|t| t.stats.allocs + t.stats.failed > 0)
        && let Some(what) =
            table.modules.values().find_map(|m| crate::probes::cuda::caching_allocator(std::path::Path::new(&m.path)))
    {
        warnings.push(format!(
            "GPU memory is handed out by {what}: the gpu domain shows the segments it takes from the driver, not each tensor"
        ));
    }
    for p in stats.python.iter().filter(|p| !p.walked) {
        warnings.push(format!("Python {} ({}): no Python frames: {}", p.version, p.path, p.note));
    }
    Ok(Summary {
        meta,
        stats,
        warnings,
        finalized,
        totals,
        groups: rows,
        rows_in_all,
        leaks,
        by: opts.by,
        duration_ns,
        events,
        comms,
        allocs_by_pid: allocs_by_pid.into_iter().collect(),
        stacks: table,
        coverage: coverage.coverage,
        under_counting,
        leak_totals,
        memory,
        // Installed libraries probed ahead of time that no traced program used: not shown;
        // nor any in a view that leaves user space out (`--domain kernel` read "0 allocs").
        allocators: allocators
            .into_iter()
            .zip(allocators_found)
            .filter(|(row, found)| filters.domain.admits(Domain::User) && (*found || row.allocs > 0 || row.frees > 0))
            .map(|(row, _)| row)
            .collect(),
        probe_overhead,
        user_mmaps,
        slab_pages,
    })
}

/// The figure rows are sorted by.
pub fn sort_value(key: SortKey, s: &Stats) -> f64 {
    match key {
        SortKey::Allocs => s.allocs as f64,
        SortKey::Frees => s.frees as f64,
        SortKey::Req => s.bytes_req as f64,
        SortKey::Alloc => s.bytes_alloc as f64,
        SortKey::Wasted => s.wasted() as f64,
        SortKey::Frag => s.frag_pct(),
        SortKey::Live => s.live_bytes_req as f64,
        SortKey::LiveAllocs => s.live_allocs as f64,
        SortKey::Peak => s.live_bytes_req_at_peak as f64,
        SortKey::MaxLive => s.peak_live_bytes_req as f64,
        SortKey::P50 => s.lifetimes.quantile(0.5).unwrap_or(0) as f64,
        SortKey::P99 => s.lifetimes.quantile(0.99).unwrap_or(0) as f64,
        SortKey::Temp => s.temporary as f64,
        SortKey::OtherCpu => s.freed_on_other_cpu as f64,
        SortKey::Unmatched | SortKey::Age => 0.0,
    }
}

/// The order of rows: largest first; ties by bytes allocated (a stable sort keeps the
/// order groups were met in after that).
fn row_order(key: SortKey, a: &Stats, b: &Stats) -> std::cmp::Ordering {
    sort_value(key, b).total_cmp(&sort_value(key, a)).then(b.bytes_alloc.cmp(&a.bytes_alloc))
}

/// The figure leak rows are sorted by, as `--sort` names it for groups: blocks, bytes
/// requested or allocated, or age.
fn leak_value(key: SortKey, l: &LeakRow) -> f64 {
    match key {
        SortKey::Allocs | SortKey::LiveAllocs | SortKey::Frees | SortKey::Temp => l.blocks as f64,
        SortKey::Req | SortKey::Live | SortKey::Peak | SortKey::MaxLive => l.bytes_req as f64,
        SortKey::Wasted => l.bytes_alloc.saturating_sub(l.bytes_req) as f64,
        SortKey::Frag if l.bytes_alloc > 0 => 100.0 - 100.0 * l.bytes_req as f64 / l.bytes_alloc as f64,
        SortKey::Frag => 0.0,
        SortKey::Age | SortKey::P50 | SortKey::P99 => l.oldest_age_ns as f64,
        SortKey::Alloc | SortKey::OtherCpu | SortKey::Unmatched => l.bytes_alloc as f64,
    }
}

/// The live blocks at least `--older-than` old, per stack, sorted as `--sort` says
/// (largest first by default), and what they add up to before `--top`.
fn leak_rows(
    live: &[LiveBlock],
    infos: &[GroupInfo],
    table: &mut StackTable,
    end_ts: u64,
    opts: &ReportOptions,
) -> (Vec<LeakRow>, LeakTotals) {
    let min_age = opts.older_than.map_or(0, |d| d.as_nanos() as u64);
    let mut by_stack: HashMap<(Domain, u64, u64), LeakRow> = HashMap::new();
    for b in live {
        let age = end_ts.saturating_sub(b.ts_ns);
        if age < min_age {
            continue;
        }
        let info = &infos[b.group as usize];
        let domain = info.key.domain();
        let call_site = if domain == Domain::Kernel { info.call_site } else { 0 };
        let row = by_stack.entry((domain, b.stack, call_site)).or_insert_with(|| LeakRow {
            domain,
            frames: Vec::new(),
            blocks: 0,
            bytes_req: 0,
            bytes_alloc: 0,
            oldest_age_ns: 0,
            pids: Vec::new(),
            stack: b.stack,
            call_site,
        });
        row.blocks += b.count;
        row.bytes_req += b.bytes_req * b.count;
        row.bytes_alloc += b.bytes_alloc * b.count;
        row.oldest_age_ns = row.oldest_age_ns.max(age);
        if !row.pids.contains(&b.pid) && row.pids.len() < Grouper::MAX_PIDS {
            row.pids.push(b.pid);
        }
    }
    let (runtime, mut rows): (Vec<LeakRow>, Vec<LeakRow>) =
        by_stack.into_values().partition(|r| kept_by_the_runtime(table, r));
    let totals = LeakTotals {
        blocks: rows.iter().map(|r| r.blocks).sum(),
        bytes_req: rows.iter().map(|r| r.bytes_req).sum(),
        stacks: rows.len(),
        runtime_blocks: runtime.iter().map(|r| r.blocks).sum(),
        runtime_bytes_req: runtime.iter().map(|r| r.bytes_req).sum(),
    };
    rows.sort_by(|a, b| {
        leak_value(opts.sort, b)
            .total_cmp(&leak_value(opts.sort, a))
            .then(b.bytes_req.cmp(&a.bytes_req))
            .then(b.oldest_age_ns.cmp(&a.oldest_age_ns))
    });
    if let Some(n) = opts.top {
        rows.truncate(n);
    }
    for r in &mut rows {
        r.frames = table.frames_once(r.stack, r.call_site);
    }
    (rows, totals)
}
