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
    grouping::{DomainFilter, GroupBy, GroupKey, label, matches_text},
    modules::ModuleTable,
    recording::FileStack,
    session::Sink,
    stacks::{Frame, StackTable},
};
use memtrace_common::{TaskEvent, flags};

type Grouping = Box<dyn FnMut(&Origin) -> u32>;

pub struct LiveView {
    analyzer: Analyzer<Grouping>,
    modules: ModuleTable,
    stack_ids: HashMap<u64, u32>,
    table: StackTable,
    /// New stacks since the last naming pass.
    unnamed: bool,
    /// Processes whose maps were read.
    learned: std::collections::HashSet<u32>,
    pub comms: HashMap<u32, String>,
    pub events: u64,
    /// Per display key: allocations and bytes at the previous snapshot, and live bytes when
    /// the row first appeared.
    previous: HashMap<GroupKey, (u64, u64)>,
    first_live: HashMap<GroupKey, u64>,
    last_totals: (u64, u64, u64),
    /// Sampling switched on while running (rings overflowing): (from, mean bytes).
    pub sample_from: Option<(u64, u64)>,
    /// Rows first seen after a reset start from their current figures (no rate spike);
    /// otherwise a new row's activity all happened during the last interval.
    just_reset: bool,
    /// The session's allocators' families, by index - 1 (the tracer's list).
    pub allocator_families: Vec<&'static str>,
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
    pub fn new(live_limit: usize, sample_bytes: Option<u64>) -> Self {
        let mut next = 0u32;
        let grouping: Grouping = Box::new(move |_| {
            next += 1;
            next - 1
        });
        let mut analyzer = Analyzer::new(grouping);
        analyzer.live_limit = live_limit;
        analyzer.sample_bytes = sample_bytes;
        Self {
            analyzer,
            modules: ModuleTable::new(),
            stack_ids: HashMap::new(),
            table: StackTable::default(),
            unnamed: false,
            learned: Default::default(),
            comms: HashMap::new(),
            events: 0,
            previous: HashMap::new(),
            first_live: HashMap::new(),
            last_totals: (0, 0, 0),
            just_reset: false,
            sample_from: None,
            allocator_families: Vec::new(),
        }
    }

    fn stack_id(&mut self, hash: u64) -> u32 {
        let next = self.stack_ids.len() as u32;
        *self.stack_ids.entry(hash).or_insert(next)
    }

    /// Computes what to show; `interval` is the time since the previous snapshot.
    pub fn snapshot(&mut self, view: &ViewOptions, interval: Duration, lost_events: u64) -> Snapshot {
        if self.unnamed {
            self.modules.find_missing_files();
            for m in self.modules.take_new() {
                self.table.modules.insert(m.id, m);
            }
            self.table.fill_missing_symbols();
            self.unnamed = false;
        }
        let secs = interval.as_secs_f64().max(1e-3);
        let origins: Vec<(Origin, u32)> = self.analyzer.origins().map(|(o, g)| (*o, g)).collect();
        let mut groups: HashMap<GroupKey, (Stats, Origin)> = HashMap::new();
        for (origin, g) in origins {
            if !view.domain.admits(Domain::of(origin.kind)) {
                continue;
            }
            let key = GroupKey::of(&origin, view.by, &mut self.table);
            let stats = &self.analyzer.groups[g as usize];
            let entry = groups.entry(key).or_insert_with(|| (Stats::default(), origin));
            entry.0.merge(stats);
        }
        let filter = view.filter.to_lowercase();
        let mut rows = Vec::with_capacity(groups.len());
        for (key, (stats, origin)) in groups {
            let frames = self.table.frames(origin.stack, origin.call_site);
            let label = label(&key, &frames, &self.comms);
            if !matches_text(&filter, &label, &frames) {
                continue;
            }
            let baseline = if self.just_reset { (stats.allocs, stats.bytes_req) } else { (0, 0) };
            let (prev_allocs, prev_bytes) = self.previous.get(&key).copied().unwrap_or(baseline);
            let first_live = *self.first_live.entry(key.clone()).or_insert(stats.live_bytes_req);
            rows.push(Row {
                domain: Domain::of(origin.kind),
                label,
                frames,
                allocs_per_sec: (stats.allocs - prev_allocs.min(stats.allocs)) as f64 / secs,
                bytes_per_sec: (stats.bytes_req - prev_bytes.min(stats.bytes_req)) as f64 / secs,
                growth: stats.live_bytes_req as i64 - first_live as i64,
                allocator: origin
                    .allocator
                    .checked_sub(1)
                    .and_then(|i| self.allocator_families.get(usize::from(i)).copied()),
                stats,
                key,
            });
        }
        for r in &rows {
            self.previous.insert(r.key.clone(), (r.stats.allocs, r.stats.bytes_req));
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
        let sum = |f: fn(&Stats) -> u64| -> u64 { totals.values().map(|t| f(&t.stats)).sum() };
        let now = (sum(|s| s.allocs), sum(|s| s.frees), sum(|s| s.bytes_req));
        let (a0, f0, b0) = if self.just_reset { now } else { self.last_totals };
        self.last_totals = now;
        self.just_reset = false;
        Snapshot {
            interval,
            allocs_per_sec: now.0.saturating_sub(a0) as f64 / secs,
            frees_per_sec: now.1.saturating_sub(f0) as f64 / secs,
            bytes_per_sec: now.2.saturating_sub(b0) as f64 / secs,
            totals,
            lost_events,
            untracked: self.analyzer.untracked,
            live_limit: self.analyzer.live_limit,
            rows,
        }
    }

    /// Forgets the rates' and growth's reference points (after the grouping changes).
    pub fn reset_reference(&mut self) {
        self.previous.clear();
        self.first_live.clear();
        self.just_reset = true;
    }
}

impl Sink for LiveView {
    fn stack(&mut self, s: StackRecord) {
        let id = self.stack_id(s.hash);
        if self.table.stacks.contains_key(&id) {
            return;
        }
        if self.learned.insert(s.pid) {
            self.modules.learn_process(s.pid);
        }
        let (user, cut) = self.modules.resolve_stack(s.pid, &s.user, s.walk);
        let truncated = s.truncated || cut;
        for m in self.modules.take_new() {
            self.table.modules.insert(m.id, m);
        }
        self.table.stacks.insert(id, FileStack { id, pid: s.pid, kernel: s.kernel, user, truncated });
        self.unnamed = true;
    }

    fn event(&mut self, mut event: Event) {
        self.events += 1;
        match &mut event {
            Event::Alloc(a) => {
                if a.stack != 0 {
                    a.stack = u64::from(self.stack_id(a.stack)) + 1;
                }
                a.flags &= !flags::HAS_STACK;
                if !self.comms.contains_key(&a.pid)
                    && let Some(comm) = crate::procfs::comm(a.pid, a.pid)
                {
                    self.comms.insert(a.pid, comm);
                }
            }
            Event::Task(t) if t.tid == t.pid && t.event != TaskEvent::Exit => {
                self.comms.insert(t.pid, t.comm.clone());
            }
            _ => {}
        }
        self.analyzer.sample_from = self.sample_from;
        self.analyzer.push(&event);
    }

    fn exec_seen(&mut self, pid: u32, filename: &Path) {
        self.learned.insert(pid);
        self.modules.learn_exec(pid, filename);
    }

    fn fork_seen(&mut self, child: u32, parent: u32) {
        self.modules.learn_fork(child, parent);
    }

    fn file_seen(&mut self, path: &Path) {
        self.modules.learn_file(path);
    }
}
