//! `top`'s model: a session sink that pairs and aggregates events as they come (with a
//! bounded table of live blocks) and names stacks on demand, and the snapshots the views
//! show — per site, function, process or stack (the grouping vocabulary of
//! [`crate::grouping`]), filtered, sorted, with rates over the last interval and live-bytes
//! growth since the row first appeared. No drawing here: see `tui` and `batch`.
use std::{
    collections::{BTreeMap, HashMap},
    path::Path,
    time::Duration,
};

use crate::{
    analysis::{Analyzer, Domain, Origin, Stats},
    event::{Event, StackRecord},
    grouping::{DomainFilter, GroupBy, GroupKey, LABEL_FRAMES, matches_text, row_label},
    naming::Namer,
    session::Sink,
    stacks::{Frame, StackTable},
};
use memtrace_common::{TaskEvent, flags};

type Grouping = Box<dyn FnMut(&Origin) -> u32>;

/// Allocations, frees and bytes requested.
type Activity = (u64, u64, u64);

/// A site row's distinct label prefixes (`StackTable::prefix_key`), and a (stack, call
/// site) of each, the row's first origin's first.
#[derive(Default)]
struct Prefixes {
    keys: std::collections::HashSet<Vec<u64>>,
    stacks: Vec<(u64, u64)>,
}

pub struct LiveView {
    analyzer: Analyzer<Grouping>,
    /// Stacks, modules and process names, as `record` names them.
    namer: Namer,
    table: StackTable,
    /// New stacks since the last naming pass.
    unnamed: bool,
    pub comms: HashMap<u32, String>,
    /// Which task records are news for the names (a fork written after its child's exec
    /// does not name the child after its parent).
    task_order: crate::lifecycle::Lifecycles,
    pub events: u64,
    /// Per origin (the analyzer's group): allocations, frees and bytes requested at the
    /// previous snapshot. Rates are the growth of these, whatever the grouping, so rows
    /// add up to the summary's rates even when a row's name changes (its stack arrived).
    previous: HashMap<u32, Activity>,
    /// Per display key: live bytes when the row first appeared.
    first_live: HashMap<GroupKey, u64>,
    /// Sampling switched on while running (rings overflowing): (from, mean bytes).
    pub sample_from: Option<(u64, u64)>,
    /// The session's allocators' families, by index - 1 (the tracer's list).
    pub allocator_families: Vec<&'static str>,
    /// Tells apart the kernel allocations set aside (the probes' own, slab pages).
    overhead: crate::overhead::ProbeOverhead,
    /// Stacks (id + 1) whose allocations are set aside: the probes' own, and a slab's pages.
    set_aside: std::collections::HashMap<u64, crate::overhead::SetAside>,
}

/// One row of the view.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub key: GroupKey,
    pub domain: Domain,
    pub label: String,
    pub frames: Vec<Frame>,
    pub stats: Stats,
    pub allocs_per_sec: f64,
    pub bytes_per_sec: f64,
    /// Live bytes now minus when the row first appeared.
    pub growth: i64,
    /// User rows: the family of the allocator that served them (shown in the detail view).
    pub allocator: Option<&'static str>,
}

/// Figures of one domain.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DomainTotals {
    pub stats: Stats,
    pub unmatched_frees: u64,
}

/// What the view shows at one refresh.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    pub interval: Duration,
    pub totals: BTreeMap<Domain, DomainTotals>,
    pub allocs_per_sec: f64,
    pub frees_per_sec: f64,
    pub bytes_per_sec: f64,
    pub lost_events: u64,
    /// Allocations counted but not followed (live table full).
    pub untracked: u64,
    pub live_limit: usize,
    pub rows: Vec<Row>,
}

/// The figures of a row: what the view sorts by (`--sort`, `s`) and shows (`--fields`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, clap::ValueEnum)]
pub enum Column {
    /// ALLOCS/s: allocations per second.
    AllocsPerSec,
    /// BYTES/s: bytes requested per second.
    #[default]
    BytesPerSec,
    /// LIVE BYTES: bytes live now.
    Live,
    /// LIVE: blocks live now.
    LiveAllocs,
    /// FRAG: internal fragmentation, percent.
    Frag,
    /// GROWTH: live bytes now minus when the row appeared.
    Growth,
    /// ALLOCS: allocations so far.
    Allocs,
}

impl Column {
    /// The order `s` steps through.
    pub const ALL: [Column; 7] =
        [Self::AllocsPerSec, Self::BytesPerSec, Self::Live, Self::LiveAllocs, Self::Frag, Self::Growth, Self::Allocs];

    pub fn name(self) -> &'static str {
        match self {
            Self::AllocsPerSec => "allocs/s",
            Self::BytesPerSec => "bytes/s",
            Self::Live => "live bytes",
            Self::LiveAllocs => "live blocks",
            Self::Frag => "frag %",
            Self::Growth => "growth",
            Self::Allocs => "allocs",
        }
    }

    pub fn value(self, r: &Row) -> f64 {
        match self {
            Self::AllocsPerSec => r.allocs_per_sec,
            Self::BytesPerSec => r.bytes_per_sec,
            Self::Live => r.stats.live_bytes_req as f64,
            Self::LiveAllocs => r.stats.live_allocs as f64,
            Self::Frag => r.stats.frag_pct(),
            Self::Growth => r.growth as f64,
            Self::Allocs => r.stats.allocs as f64,
        }
    }
}

/// How rows are chosen and ordered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ViewOptions {
    pub by: GroupBy,
    pub domain: DomainFilter,
    pub sort: Column,
    /// Case-insensitive text a row's name or frames must contain.
    pub filter: String,
}

impl LiveView {
    /// A process's blocks go with it (its exit, or its exec): on a busy host (`-a`), or
    /// under a command that runs many (`make`), they would otherwise stay live without end.
    /// But `keep`'s, the traced command's or pid's, stay: its leaks at exit, as `report`
    /// shows them.
    pub fn new(live_limit: usize, sample_bytes: Option<u64>, keep: Option<u32>) -> Self {
        let mut next = 0u32;
        let grouping: Grouping = Box::new(move |_| {
            next += 1;
            next - 1
        });
        let mut analyzer = Analyzer::new(grouping);
        analyzer.live_limit = live_limit;
        analyzer.sample_bytes = sample_bytes;
        analyzer.forget_ended = true;
        analyzer.keep_ended = keep;
        Self {
            analyzer,
            namer: Namer::new(),
            table: StackTable::default(),
            unnamed: false,
            comms: HashMap::new(),
            task_order: Default::default(),
            events: 0,
            previous: HashMap::new(),
            first_live: HashMap::new(),
            sample_from: None,
            allocator_families: Vec::new(),
            overhead: Default::default(),
            set_aside: Default::default(),
        }
    }

    /// The allocation wrappers a site is named past (`--alloc-fn`).
    pub fn set_alloc_fns(&mut self, fns: crate::wrappers::AllocFns) {
        self.table.set_alloc_fns(fns);
    }

    /// Computes what to show; `interval` is the time since the previous snapshot.
    pub fn snapshot(&mut self, view: &ViewOptions, interval: Duration, lost_events: u64) -> Snapshot {
        if self.unnamed {
            self.namer.modules.find_missing_files();
            for m in self.namer.modules.take_new() {
                self.table.modules.insert(m.id, m);
            }
            self.table.fill_missing_symbols();
            self.unnamed = false;
        }
        let secs = interval.as_secs_f64().max(1e-3);
        let origins: Vec<(Origin, u32)> = self.analyzer.origins().map(|(o, g)| (*o, g)).collect();
        // Per key: figures, an origin to name it by, and what happened since the last
        // snapshot (allocations, frees, bytes requested).
        // Grouped by site, also a (stack, call site) of the key's origins per distinct
        // `StackTable::prefix_key`, to name the row by what they share
        // (`grouping::shared_label`): named once per key, not once per stack.
        let mut groups: HashMap<GroupKey, (Stats, Origin, Activity, Prefixes)> = HashMap::new();
        let mut since: Activity = (0, 0, 0);
        for (origin, g) in origins {
            let stats = &self.analyzer.groups[g as usize];
            let now = (stats.allocs, stats.frees, stats.bytes_req);
            // An origin met since the last snapshot: all it did is new.
            let before = self.previous.insert(g, now).unwrap_or_default();
            let delta = (now.0 - before.0.min(now.0), now.1 - before.1.min(now.1), now.2 - before.2.min(now.2));
            if !view.domain.admits(Domain::of(origin.kind)) {
                continue;
            }
            since = (since.0 + delta.0, since.1 + delta.1, since.2 + delta.2);
            let key = GroupKey::of(&origin, view.by, &mut self.table);
            let kernel = key.domain() == Domain::Kernel;
            let entry = groups.entry(key).or_insert_with(|| (Stats::default(), origin, (0, 0, 0), Prefixes::default()));
            entry.0.merge(stats);
            entry.2 = (entry.2.0 + delta.0, entry.2.1 + delta.1, entry.2.2 + delta.2);
            if view.by == GroupBy::Site
                && entry.3.keys.insert(self.table.prefix_key(origin.stack, origin.call_site, LABEL_FRAMES + 1, kernel))
            {
                entry.3.stacks.push((origin.stack, origin.call_site));
            }
        }
        let filter = view.filter.to_lowercase();
        let mut rows = Vec::with_capacity(groups.len());
        for (key, (stats, origin, delta, Prefixes { stacks, .. })) in groups {
            let frames = self.table.frames(origin.stack, origin.call_site);
            let label = row_label(&key, &frames, (origin.stack, origin.call_site), &stacks, &self.table, &self.comms);
            if !matches_text(&filter, &label, &frames) {
                continue;
            }
            let first_live = *self.first_live.entry(key.clone()).or_insert(stats.live_bytes_req);
            rows.push(Row {
                domain: key.domain(),
                label,
                frames,
                allocs_per_sec: delta.0 as f64 / secs,
                bytes_per_sec: delta.2 as f64 / secs,
                growth: stats.live_bytes_req as i64 - first_live as i64,
                allocator: origin
                    .allocator
                    .checked_sub(1)
                    .and_then(|i| self.allocator_families.get(usize::from(i)).copied()),
                stats,
                key,
            });
        }
        rows.sort_by(|a, b| {
            view.sort.value(b).total_cmp(&view.sort.value(a)).then(b.stats.bytes_req.cmp(&a.stats.bytes_req))
        });

        let mut totals: BTreeMap<Domain, DomainTotals> = BTreeMap::new();
        for (domain, t) in &self.analyzer.totals {
            if view.domain.admits(*domain) {
                totals.insert(*domain, DomainTotals { stats: t.stats.clone(), unmatched_frees: t.unmatched_frees });
            }
        }
        Snapshot {
            interval,
            allocs_per_sec: since.0 as f64 / secs,
            frees_per_sec: since.1 as f64 / secs,
            bytes_per_sec: since.2 as f64 / secs,
            totals,
            lost_events,
            untracked: self.analyzer.untracked,
            live_limit: self.analyzer.live_limit,
            rows,
        }
    }

    /// Forgets the growth's reference points (after the grouping changes: the rows are
    /// new ones).
    pub fn reset_reference(&mut self) {
        self.first_live.clear();
    }
}

impl LiveView {
    fn sets_aside(&self, a: &crate::event::Alloc) -> bool {
        match self.set_aside.get(&a.stack) {
            Some(crate::overhead::SetAside::Probes) => true,
            Some(crate::overhead::SetAside::SlabPages) => a.kind == memtrace_common::Kind::PageAlloc,
            None => false,
        }
    }
}

impl Sink for LiveView {
    fn stack(&mut self, s: StackRecord) {
        let class = self.overhead.classify(&s);
        let Some(stack) = self.namer.stack(s) else { return };
        if let Some(class) = class {
            self.set_aside.insert(u64::from(stack.id) + 1, class);
        }
        for m in self.namer.modules.take_new() {
            self.table.modules.insert(m.id, m);
        }
        self.table.insert_stack(stack);
        self.unnamed = true;
    }

    fn event(&mut self, mut event: Event) {
        self.events += 1;
        if let Some(Event::Task(t)) = self.namer.event(&mut event) {
            self.comms.insert(t.pid, t.comm);
        }
        if let Event::Task(t) = &event
            && t.tid == t.pid
        {
            let news = match t.event {
                TaskEvent::Fork | TaskEvent::Exec => self.task_order.began(t.pid, t.ts_ns),
                TaskEvent::Exit => {
                    if t.flags & flags::GROUP_DEAD != 0 {
                        self.task_order.ended(t.pid, t.ts_ns);
                    }
                    false
                }
                _ => self.task_order.is_news(t.pid, t.ts_ns),
            };
            match t.event {
                TaskEvent::Exit => {
                    // A process never named otherwise: its name as it exits.
                    self.comms.entry(t.pid).or_insert_with(|| t.comm.clone());
                }
                _ if news => {
                    self.comms.insert(t.pid, t.comm.clone());
                }
                _ => {}
            }
        }
        self.analyzer.sample_from = self.sample_from;
        match &event {
            // The probes' own, and a slab's pages, as `report` leaves them out (`overhead`):
            // paired, not counted.
            Event::Alloc(a) if a.kind.is_kernel() && self.sets_aside(a) => self.analyzer.push_excluded(a),
            _ => self.analyzer.push(&event),
        }
    }

    fn exec_seen(&mut self, pid: u32, filename: &Path) {
        self.namer.exec_seen(pid, filename);
    }

    fn processes_at_start(&mut self, snapshot: std::sync::Arc<crate::at_start::Snapshot>) {
        self.namer.set_at_start(snapshot);
    }

    fn fork_seen(&mut self, child: u32, parent: u32) {
        self.namer.fork_seen(child, parent);
    }

    fn maps_seen(&mut self, pid: u32, maps: crate::procfs::Maps) {
        self.namer.maps_seen(pid, maps);
    }

    fn file_seen(&mut self, path: &Path) {
        self.namer.file_seen(path);
    }
}
