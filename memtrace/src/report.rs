//! `memtrace report`: reads a recording (definitions first, then the events, streaming),
//! pairs and aggregates per call site / stack / function / process, and prints the table
//! users read — or JSON for scripts, or the blocks still live (`--leaks`).
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    fmt::Write as _,
    fs::File,
    io::BufReader,
    path::Path,
    time::Duration,
};

use anyhow::{Context as _, Result};
use clap::ValueEnum;
use memtrace_common::{Kind, TaskEvent};
use serde::Serialize;

use crate::{
    analysis::{Analyzer, Domain, EXCLUDED, LiveBlock, Origin, Stats, Totals},
    event::Event,
    recording::{self, FileStack, FormatError, Meta, Module, Reader, Symbol, SymbolKey},
    stacks::{Frame, StackTable},
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum Format {
    #[default]
    Text,
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum GroupBy {
    /// The code that called the allocator (first user frame; kernel: the call site).
    #[default]
    Site,
    /// The whole stack.
    Stack,
    /// The function containing the call site.
    Function,
    /// The process (command name and pid).
    Process,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum DomainFilter {
    User,
    Kernel,
    #[default]
    Both,
}

impl DomainFilter {
    pub fn admits(self, d: Domain) -> bool {
        matches!((self, d), (Self::Both, _) | (Self::User, Domain::User) | (Self::Kernel, Domain::Kernel))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum SortKey {
    Allocs,
    Frees,
    /// Bytes requested.
    Req,
    /// Bytes allocated.
    #[default]
    Alloc,
    /// Bytes lost to internal fragmentation (allocated − requested).
    Wasted,
    /// Fragmentation percentage.
    Frag,
    /// Live bytes at the end.
    Live,
    LiveAllocs,
    Peak,
    /// Median lifetime of freed blocks.
    P50,
    P99,
    /// Temporary allocations.
    Temp,
    /// Kernel blocks freed on another CPU.
    OtherCpu,
    /// Frees seen without their allocation (counted in the summary only).
    Unmatched,
}

/// Allocation kinds a report can select.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KindFilter {
    /// Every user heap allocation (malloc family).
    Malloc,
    Calloc,
    Realloc,
    Memalign,
    Mmap,
    Kmalloc,
    /// kmem_cache_alloc.
    Cache,
    Page,
    User,
    Kernel,
}

impl KindFilter {
    fn admits(self, k: Kind) -> bool {
        match self {
            Self::Malloc => k.space() == memtrace_common::Space::Heap,
            Self::Calloc => k == Kind::Calloc,
            Self::Realloc => matches!(k, Kind::Realloc | Kind::ReallocArray),
            Self::Memalign => {
                matches!(k, Kind::Memalign | Kind::AlignedAlloc | Kind::PosixMemalign | Kind::Valloc | Kind::Pvalloc)
            }
            Self::Mmap => k == Kind::Mmap,
            Self::Kmalloc => k == Kind::Kmalloc,
            Self::Cache => k == Kind::KmemCacheAlloc,
            Self::Page => k == Kind::PageAlloc,
            Self::User => !k.is_kernel(),
            Self::Kernel => k.is_kernel(),
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct ReportOptions {
    pub format: Format,
    pub by: GroupBy,
    pub domain: DomainFilter,
    pub sort: SortKey,
    pub top: Option<usize>,
    pub pid: Option<u32>,
    pub comm: Option<String>,
    pub min_size: Option<u64>,
    pub kinds: Vec<KindFilter>,
    pub leaks: bool,
    pub older_than: Option<Duration>,
    /// With `GroupBy::Stack`: keep each process's share of a stack apart (exports put
    /// the process name at the root of every stack).
    pub split_processes: bool,
}

/// What a group is made of.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum GroupKey {
    /// (module, address) of the first frame; for unknown stacks, the kind.
    Site(Domain, String, u64),
    Stack(Domain, u64, u64, u32),
    Function(Domain, String),
    Process(Domain, u32),
}

struct GroupInfo {
    key: GroupKey,
    domain: Domain,
    /// A stack of the group, to show.
    stack: u64,
    call_site: u64,
    kinds: Vec<Kind>,
    pids: Vec<u32>,
}

/// Everything a report shows, computed once; printed as text or JSON.
pub struct Analysis {
    pub meta: Meta,
    pub stats: recording::Stats,
    pub warnings: Vec<String>,
    pub finalized: bool,
    pub totals: BTreeMap<Domain, Totals>,
    pub groups: Vec<GroupRow>,
    pub leaks: Vec<LeakRow>,
    pub by: GroupBy,
    pub duration_ns: u64,
    pub events: u64,
    pub comms: HashMap<u32, String>,
    pub stacks: StackTable,
    /// Per domain: allocations traced with a stack, and how many of those stacks were cut.
    pub coverage: BTreeMap<Domain, StackCoverage>,
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
}

pub struct GroupRow {
    pub domain: Domain,
    /// The stack shown was cut before its outermost frame.
    pub truncated: bool,
    pub label: String,
    pub frames: Vec<Frame>,
    pub kinds: Vec<Kind>,
    pub pids: Vec<u32>,
    pub stats: Stats,
    pub stack: u64,
    pub call_site: u64,
}

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

/// Reads the definitions of a recording (everything but the events).
pub fn read_definitions(path: &Path) -> Result<(Meta, StackTable, recording::Stats, bool, Vec<String>)> {
    let mut reader = Reader::open(path).with_context(|| format!("reading {}", path.display()))?;
    let meta = reader.meta.clone();
    let mut stacks: BTreeMap<u32, FileStack> = BTreeMap::new();
    let mut modules: BTreeMap<u32, Module> = BTreeMap::new();
    let mut symbols: Vec<(SymbolKey, Vec<Symbol>)> = Vec::new();
    let mut stats = recording::Stats::default();
    let mut finalized = false;
    let mut warnings = Vec::new();
    loop {
        match reader.next_chunk() {
            Ok(None) => break,
            Ok(Some(chunk)) => match chunk {
                recording::Chunk::Stacks(s) => stacks.extend(s.into_iter().map(|s| (s.id, s))),
                recording::Chunk::Modules(m) => modules.extend(m.into_iter().map(|m| (m.id, m))),
                recording::Chunk::Symbols(s) => symbols.extend(s),
                recording::Chunk::Stats(s) => stats = s,
                recording::Chunk::End => finalized = true,
                recording::Chunk::Events { .. } => {}
            },
            Err(e) => {
                warnings.push(format!("{e}; the report covers the complete part before it"));
                break;
            }
        }
    }
    if !finalized && warnings.is_empty() {
        warnings.push(
            "the recording was not finalized (memtrace stopped abruptly); the report covers what was written".into(),
        );
    }
    Ok((meta, StackTable::new(stacks, modules, symbols), stats, finalized, warnings))
}

/// Streams every event of a recording to `sink`; stops quietly at the first damaged chunk
/// (already reported by `read_definitions`).
pub fn for_each_event(path: &Path, sink: &mut dyn FnMut(Event)) -> Result<(), FormatError> {
    let mut reader = Reader::new(BufReader::with_capacity(1 << 20, File::open(path)?))?;
    while let Ok(Some(chunk)) = reader.next_chunk() {
        if let recording::Chunk::Events { payload, offset } = chunk
            && Reader::<BufReader<File>>::decode_events(&payload, offset, sink).is_err()
        {
            break;
        }
    }
    Ok(())
}

fn domain_of_stack_frames(domain: Domain, frames: &[Frame]) -> Option<&Frame> {
    match domain {
        Domain::User => frames.iter().find(|f| !f.kernel),
        Domain::Kernel => frames.first(),
    }
}

pub fn analyze(path: &Path, opts: &ReportOptions) -> Result<Analysis> {
    let (meta, mut table, stats, finalized, mut warnings) = read_definitions(path)?;
    if !finalized {
        let named = table.fill_missing_symbols();
        if named > 0 {
            warnings.push(format!("{named} addresses were symbolized from this machine's files, not the recording"));
        }
    }

    let mut comms: HashMap<u32, String> = HashMap::new();
    let truncated_ids = table.truncated_stacks();
    let mut coverage: BTreeMap<Domain, StackCoverage> = BTreeMap::new();
    let mut truncated_seen: HashSet<u64> = HashSet::new();
    let mut infos: Vec<GroupInfo> = Vec::new();
    let mut index: HashMap<GroupKey, u32> = HashMap::new();
    let by = opts.by;
    let domain_filter = opts.domain;
    let kinds = opts.kinds.clone();
    let pid_filter = opts.pid;
    let split = opts.split_processes;

    let (groups, totals, live, first_ts, last_ts, events) = {
        let table = &mut table;
        let infos = &mut infos;
        let index = &mut index;
        let group_of = |o: &Origin| -> u32 {
            let domain = Domain::of(o.kind);
            if !domain_filter.admits(domain) || (!kinds.is_empty() && !kinds.iter().any(|k| k.admits(o.kind))) {
                return EXCLUDED;
            }
            let key = match by {
                GroupBy::Stack => GroupKey::Stack(domain, o.stack, o.call_site, if split { o.pid } else { 0 }),
                GroupBy::Process => GroupKey::Process(domain, o.pid),
                GroupBy::Site | GroupBy::Function => {
                    let frames = table.frames(o.stack, o.call_site);
                    match (domain_of_stack_frames(domain, &frames), by) {
                        (Some(f), GroupBy::Site) => GroupKey::Site(domain, f.module.clone(), f.address),
                        (Some(f), _) => GroupKey::Function(domain, f.function.clone()),
                        (None, _) => GroupKey::Site(domain, format!("[no stack: {}]", o.kind.name()), 0),
                    }
                }
            };
            let next = infos.len() as u32;
            let g = *index.entry(key.clone()).or_insert(next);
            if g == next {
                infos.push(GroupInfo {
                    key,
                    domain,
                    stack: o.stack,
                    call_site: o.call_site,
                    kinds: Vec::new(),
                    pids: Vec::new(),
                });
            }
            let info = &mut infos[g as usize];
            // The stack a group shows: a whole one if any of its allocations has one.
            if info.stack != o.stack && table.is_truncated(info.stack) && !table.is_truncated(o.stack) && o.stack != 0 {
                info.stack = o.stack;
            }
            if !info.kinds.contains(&o.kind) {
                info.kinds.push(o.kind);
            }
            if info.pids.len() < 64 && !info.pids.contains(&o.pid) {
                info.pids.push(o.pid);
            }
            g
        };
        let mut analyzer = Analyzer::new(group_of);
        analyzer.sample_bytes = meta.sample_bytes;
        analyzer.sample_from = stats.sampled_from;
        for_each_event(path, &mut |event| {
            if let Event::Task(t) = &event
                && matches!(t.event, TaskEvent::Exec | TaskEvent::Rename | TaskEvent::Fork)
                && t.tid == t.pid
            {
                comms.insert(t.pid, t.comm.clone());
            }
            let pid = match &event {
                Event::Alloc(a) => a.pid,
                Event::Free(f) => f.pid,
                Event::Task(t) => t.pid,
            };
            let process_ok = pid_filter.is_none_or(|p| p == pid)
                && opts.comm.as_ref().is_none_or(|c| comms.get(&pid).is_some_and(|n| n == c));
            if let Event::Alloc(a) = &event
                && a.stack != 0
                && process_ok
                && domain_filter.admits(Domain::of(a.kind))
            {
                let c = coverage.entry(Domain::of(a.kind)).or_default();
                c.allocs_with_stack += 1;
                if truncated_ids.contains(&a.stack) {
                    c.allocs_truncated += 1;
                    if truncated_seen.insert(a.stack) {
                        c.stacks_truncated += 1;
                    }
                }
            }
            match &event {
                Event::Alloc(a) if !process_ok || opts.min_size.is_some_and(|m| a.bytes_req < m) => {
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
        let live: Vec<LiveBlock> = analyzer.live_blocks().copied().collect();
        (analyzer.groups, analyzer.totals, live, analyzer.first_ts, analyzer.last_ts, analyzer.events)
    };

    let mut rows: Vec<GroupRow> = Vec::with_capacity(infos.len());
    for (info, stats) in infos.iter().zip(groups) {
        if stats.allocs == 0 {
            continue;
        }
        let frames = table.frames(info.stack, info.call_site);
        let label = match &info.key {
            GroupKey::Process(_, pid) => format!("{} [{pid}]", comms.get(pid).map(String::as_str).unwrap_or("?")),
            GroupKey::Function(_, name) => name.clone(),
            GroupKey::Site(_, module, _) if frames.is_empty() => module.clone(),
            _ => String::new(),
        };
        rows.push(GroupRow {
            domain: info.domain,
            truncated: table.is_truncated(info.stack),
            label,
            frames,
            kinds: info.kinds.clone(),
            pids: info.pids.clone(),
            stats,
            stack: info.stack,
            call_site: info.call_site,
        });
    }
    sort_rows(&mut rows, opts.sort);
    if let Some(n) = opts.top {
        rows.truncate(n);
    }

    let end_ts = last_ts.max(stats.end_monotonic_ns);
    let leaks = if opts.leaks { leak_rows(&live, &infos, &mut table, end_ts, opts) } else { Vec::new() };
    let duration_ns = first_ts.map_or(0, |f| end_ts.saturating_sub(f));
    Ok(Analysis {
        meta,
        stats,
        warnings,
        finalized,
        totals,
        groups: rows,
        leaks,
        by,
        duration_ns,
        events,
        comms,
        stacks: table,
        coverage,
    })
}

fn sort_rows(rows: &mut [GroupRow], key: SortKey) {
    let value = |s: &Stats| -> f64 {
        match key {
            SortKey::Allocs => s.allocs as f64,
            SortKey::Frees => s.frees as f64,
            SortKey::Req => s.bytes_req as f64,
            SortKey::Alloc => s.bytes_alloc as f64,
            SortKey::Wasted => s.wasted() as f64,
            SortKey::Frag => s.frag_pct(),
            SortKey::Live => s.live_bytes_req as f64,
            SortKey::LiveAllocs => s.live_allocs as f64,
            SortKey::Peak => s.peak_live_bytes_req as f64,
            SortKey::P50 => s.lifetimes.quantile(0.5).unwrap_or(0) as f64,
            SortKey::P99 => s.lifetimes.quantile(0.99).unwrap_or(0) as f64,
            SortKey::Temp => s.temporary as f64,
            SortKey::OtherCpu => s.freed_on_other_cpu as f64,
            SortKey::Unmatched => 0.0,
        }
    };
    rows.sort_by(|a, b| {
        value(&b.stats).total_cmp(&value(&a.stats)).then(b.stats.bytes_alloc.cmp(&a.stats.bytes_alloc))
    });
}

fn leak_rows(
    live: &[LiveBlock],
    infos: &[GroupInfo],
    table: &mut StackTable,
    end_ts: u64,
    opts: &ReportOptions,
) -> Vec<LeakRow> {
    let min_age = opts.older_than.map_or(0, |d| d.as_nanos() as u64);
    let mut by_stack: HashMap<(Domain, u64, u64), LeakRow> = HashMap::new();
    for b in live {
        let age = end_ts.saturating_sub(b.ts_ns);
        if age < min_age {
            continue;
        }
        let info = &infos[b.group as usize];
        let domain = Domain::of(b.kind);
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
        row.blocks += 1;
        row.bytes_req += b.bytes_req;
        row.bytes_alloc += b.bytes_alloc;
        row.oldest_age_ns = row.oldest_age_ns.max(age);
        if !row.pids.contains(&b.pid) && row.pids.len() < 64 {
            row.pids.push(b.pid);
        }
    }
    let mut rows: Vec<LeakRow> = by_stack.into_values().collect();
    for r in &mut rows {
        r.frames = table.frames(r.stack, r.call_site);
    }
    // Oldest first; among equally old, largest first.
    rows.sort_by(|a, b| b.oldest_age_ns.cmp(&a.oldest_age_ns).then(b.bytes_req.cmp(&a.bytes_req)));
    if let Some(n) = opts.top {
        rows.truncate(n);
    }
    rows
}

// ---------------------------------------------------------------------------------------
// Output.
// ---------------------------------------------------------------------------------------

pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 { format!("{n} B") } else { format!("{v:.1} {}", UNITS[unit]) }
}

pub fn duration(ns: u64) -> String {
    let v = ns as f64;
    if ns < 1_000 {
        format!("{ns}ns")
    } else if ns < 1_000_000 {
        format!("{:.1}µs", v / 1e3)
    } else if ns < 1_000_000_000 {
        format!("{:.1}ms", v / 1e6)
    } else {
        format!("{:.1}s", v / 1e9)
    }
}

pub fn count(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::with_capacity(s.len() + s.len() / 3);
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

fn domain_name(d: Domain) -> &'static str {
    match d {
        Domain::User => "user",
        Domain::Kernel => "kernel",
    }
}

/// Aligned columns: right-aligned numbers, the last column left-aligned.
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate().take(widths.len() - 1) {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let line = |cells: &[String], out: &mut String| {
        for (i, cell) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                out.push_str(cell);
            } else {
                let pad = widths[i].saturating_sub(cell.chars().count());
                out.push_str(&" ".repeat(pad));
                out.push_str(cell);
                out.push_str("  ");
            }
        }
        out.push('\n');
    };
    line(&header.iter().map(|h| h.to_string()).collect::<Vec<_>>(), &mut out);
    for row in rows {
        line(row, &mut out);
    }
    out
}

fn describe_target(a: &Analysis) -> String {
    let m = &a.meta;
    let target = match m.mode.as_str() {
        "command" => {
            format!("command `{}` (pid {})", m.target_command.join(" "), m.target_pids.first().copied().unwrap_or(0))
        }
        "pid" => {
            let pid = m.target_pids.first().copied().unwrap_or(0);
            format!("pid {pid} ({})", a.comms.get(&pid).map(String::as_str).unwrap_or("?"))
        }
        _ => "the whole machine".into(),
    };
    format!("{target} on {}, kernel {}, {} of events", m.hostname, m.kernel_release, duration(a.duration_ns))
}

fn site_text(row: &GroupRow, by: GroupBy) -> String {
    if !row.label.is_empty() {
        return row.label.clone();
    }
    let first = match row.domain {
        Domain::User => row.frames.iter().position(|f| !f.kernel).unwrap_or(0),
        Domain::Kernel => 0,
    };
    let frames = &row.frames[first.min(row.frames.len())..];
    let mut parts: Vec<String> = Vec::new();
    let context = if by == GroupBy::Stack { 1 } else { 3 };
    for f in frames.iter().take(context) {
        parts.push(f.to_string());
    }
    let mut s = parts.join(" ← ");
    if row.domain == Domain::User && frames.len() > context && by != GroupBy::Stack {
        s.push_str(" ← …");
    }
    s
}

pub fn render_text(a: &Analysis, opts: &ReportOptions) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "memtrace report: {}", describe_target(a));
    if let Some(alloc) = &a.meta.allocator {
        let how = if a.meta.allocator_is_glibc {
            "allocated = malloc_usable_size, read from glibc's chunk headers"
        } else {
            "allocator unknown to memtrace: allocated = requested"
        };
        let _ = writeln!(out, "allocator: {alloc} ({how})");
    }
    if let Some((from, n)) = a.stats.sampled_from {
        let after = duration(from.saturating_sub(a.meta.start_monotonic_ns));
        let _ = writeln!(
            out,
            "warning: the rings overflowed {after} into the recording; from then on user allocations were sampled (each byte with probability 1/{n}): figures are estimates"
        );
    }
    if let Some(n) = a.meta.sample_bytes {
        let _ = writeln!(
            out,
            "sampled: each byte of user allocations with probability 1/{n}; user figures are estimates (kernel figures exact)"
        );
    }
    for w in &a.warnings {
        let _ = writeln!(out, "warning: {w}");
    }
    out.push('\n');

    let mut rows = Vec::new();
    for (domain, t) in &a.totals {
        if !opts.domain.admits(*domain) {
            continue;
        }
        let s = &t.stats;
        rows.push(vec![
            domain_name(*domain).to_string(),
            count(s.allocs),
            count(s.frees),
            bytes(s.bytes_req),
            bytes(s.bytes_alloc),
            bytes(s.wasted()),
            format!("{:.1}%", s.frag_pct()),
            count(s.live_allocs),
            bytes(s.live_bytes_req),
            bytes(s.peak_live_bytes_req),
            count(t.unmatched_frees),
        ]);
    }
    out.push_str(&table(
        &[
            "",
            "ALLOCS",
            "FREES",
            "REQUESTED",
            "ALLOCATED",
            "WASTED",
            "FRAG",
            "LIVE",
            "LIVE BYTES",
            "PEAK LIVE",
            "FREES W/O ALLOC",
        ],
        &rows,
    ));
    let s = &a.stats;
    let _ = writeln!(
        out,
        "lost events: {}{}",
        count(s.lost_events),
        if s.lost_stacks + s.lost_inflight + s.lost_kernel_live > 0 {
            format!(
                " (also: {} stacks, {} untracked calls, {} untracked kernel blocks)",
                s.lost_stacks, s.lost_inflight, s.lost_kernel_live
            )
        } else {
            String::new()
        }
    );
    for (domain, c) in &a.coverage {
        if c.allocs_with_stack == 0 {
            continue;
        }
        let _ = writeln!(
            out,
            "{} stacks: {} of {} allocations cut short ({:.1}%, {} distinct stacks; walked by {})",
            domain_name(*domain),
            count(c.allocs_truncated),
            count(c.allocs_with_stack),
            100.0 * c.allocs_truncated as f64 / c.allocs_with_stack as f64,
            count(c.stacks_truncated),
            if a.meta.call_graph == "dwarf" { "call-frame information" } else { "frame pointers" },
        );
    }
    if let Some(code) = s.exit_code {
        let _ = writeln!(out, "command exit status: {code}");
    }
    out.push('\n');

    if opts.leaks {
        render_leaks(a, &mut out);
        return out;
    }
    let what = match a.by {
        GroupBy::Site => "call sites",
        GroupBy::Stack => "stacks",
        GroupBy::Function => "functions",
        GroupBy::Process => "processes",
    };
    let _ = writeln!(out, "{} {what}, by {:?}:", a.groups.len(), opts.sort);
    let mut rows = Vec::new();
    for g in &a.groups {
        let s = &g.stats;
        let per_call = |v: u64| v.checked_div(s.allocs).map_or_else(|| "-".into(), bytes);
        rows.push(vec![
            if g.domain == Domain::User { "U" } else { "K" }.to_string(),
            count(s.allocs),
            count(s.frees),
            bytes(s.bytes_req),
            bytes(s.bytes_alloc),
            per_call(s.bytes_req),
            per_call(s.bytes_alloc),
            format!("{:.1}%", s.frag_pct()),
            bytes(s.wasted()),
            count(s.live_allocs),
            bytes(s.live_bytes_req),
            bytes(s.peak_live_bytes_req),
            s.lifetimes.quantile(0.5).map_or("-".into(), duration),
            s.lifetimes.quantile(0.99).map_or("-".into(), duration),
            count(s.temporary),
            if g.domain == Domain::Kernel { count(s.freed_on_other_cpu) } else { "-".into() },
            site_text(g, a.by),
        ]);
    }
    let table_text = table(
        &[
            "",
            "ALLOCS",
            "FREES",
            "REQUESTED",
            "ALLOCATED",
            "REQ/CALL",
            "ALLOC/CALL",
            "FRAG",
            "WASTED",
            "LIVE",
            "LIVE BYTES",
            "PEAK",
            "LIFE p50",
            "LIFE p99",
            "TEMP",
            "OTHER CPU",
            "SITE",
        ],
        &rows,
    );
    if a.by == GroupBy::Stack {
        // Each row, then its whole stack.
        let mut lines = table_text.lines();
        if let Some(h) = lines.next() {
            let _ = writeln!(out, "{h}");
        }
        for (line, g) in lines.zip(&a.groups) {
            let _ = writeln!(out, "{line}");
            for f in g.frames.iter().skip(1) {
                let _ = writeln!(out, "      {}{f}", if f.kernel { "[k] " } else { "" });
            }
        }
    } else {
        out.push_str(&table_text);
    }
    out
}

fn render_leaks(a: &Analysis, out: &mut String) {
    let blocks: u64 = a.leaks.iter().map(|l| l.blocks).sum();
    let total: u64 = a.leaks.iter().map(|l| l.bytes_req).sum();
    let _ = writeln!(
        out,
        "{} blocks ({}) still live at the end, from {} stacks, oldest first:",
        count(blocks),
        bytes(total),
        a.leaks.len()
    );
    for l in &a.leaks {
        let _ = writeln!(
            out,
            "\n{} blocks, {} requested ({} allocated), oldest {} old, {} pid {}",
            count(l.blocks),
            bytes(l.bytes_req),
            bytes(l.bytes_alloc),
            duration(l.oldest_age_ns),
            domain_name(l.domain),
            l.pids.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(",")
        );
        for f in &l.frames {
            let _ = writeln!(out, "    {}{f}", if f.kernel { "[k] " } else { "" });
        }
    }
}

#[derive(Serialize)]
struct JsonTotals {
    allocs: u64,
    frees: u64,
    bytes_req: u64,
    bytes_alloc: u64,
    live_allocs: u64,
    live_bytes_req: u64,
    live_bytes_alloc: u64,
    frag_pct: f64,
    wasted: u64,
    peak_live_bytes_req: u64,
    unmatched_frees: u64,
    missed_frees: u64,
    allocator_frees: u64,
    temporary: u64,
    freed_on_other_cpu: u64,
    lifetime_p50_ns: Option<u64>,
    lifetime_p99_ns: Option<u64>,
}

impl JsonTotals {
    fn of(t: &Totals) -> Self {
        let s = &t.stats;
        Self {
            allocs: s.allocs,
            frees: s.frees,
            bytes_req: s.bytes_req,
            bytes_alloc: s.bytes_alloc,
            live_allocs: s.live_allocs,
            live_bytes_req: s.live_bytes_req,
            live_bytes_alloc: s.live_bytes_alloc,
            frag_pct: round2(s.frag_pct()),
            wasted: s.wasted(),
            peak_live_bytes_req: s.peak_live_bytes_req,
            unmatched_frees: t.unmatched_frees,
            missed_frees: t.missed_frees,
            allocator_frees: t.allocator_frees,
            temporary: s.temporary,
            freed_on_other_cpu: s.freed_on_other_cpu,
            lifetime_p50_ns: s.lifetimes.quantile(0.5),
            lifetime_p99_ns: s.lifetimes.quantile(0.99),
        }
    }
}

fn round2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

#[derive(Serialize)]
struct JsonSite<'a> {
    domain: Domain,
    /// The stack in `frames` was cut before its outermost frame.
    truncated: bool,
    kinds: Vec<&'static str>,
    pids: &'a [u32],
    frames: &'a [Frame],
    allocs: u64,
    frees: u64,
    bytes_req: u64,
    bytes_alloc: u64,
    req_per_call: f64,
    alloc_per_call: f64,
    frag_pct: f64,
    wasted: u64,
    live_allocs: u64,
    live_bytes_req: u64,
    live_bytes_alloc: u64,
    peak_live_bytes_req: u64,
    lifetime_p50_ns: Option<u64>,
    lifetime_p99_ns: Option<u64>,
    temporary: u64,
    freed_on_other_cpu: u64,
    leaked_at_exit: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    process: Option<String>,
}

#[derive(Serialize)]
struct JsonLeak<'a> {
    domain: Domain,
    frames: &'a [Frame],
    blocks: u64,
    bytes_req: u64,
    bytes_alloc: u64,
    oldest_age_ns: u64,
    pids: &'a [u32],
}

pub fn render_json(a: &Analysis, opts: &ReportOptions) -> Result<String> {
    let totals: BTreeMap<&str, JsonTotals> = a
        .totals
        .iter()
        .filter(|(d, _)| opts.domain.admits(**d))
        .map(|(d, t)| (domain_name(*d), JsonTotals::of(t)))
        .collect();
    let sites: Vec<JsonSite<'_>> = a
        .groups
        .iter()
        .map(|g| {
            let s = &g.stats;
            let per_call = |v: u64| {
                if s.allocs == 0 { 0.0 } else { round2(v as f64 / s.allocs as f64) }
            };
            JsonSite {
                domain: g.domain,
                truncated: g.truncated,
                kinds: g.kinds.iter().map(|k| k.name()).collect(),
                pids: &g.pids,
                frames: &g.frames,
                allocs: s.allocs,
                frees: s.frees,
                bytes_req: s.bytes_req,
                bytes_alloc: s.bytes_alloc,
                req_per_call: per_call(s.bytes_req),
                alloc_per_call: per_call(s.bytes_alloc),
                frag_pct: round2(s.frag_pct()),
                wasted: s.wasted(),
                live_allocs: s.live_allocs,
                live_bytes_req: s.live_bytes_req,
                live_bytes_alloc: s.live_bytes_alloc,
                peak_live_bytes_req: s.peak_live_bytes_req,
                lifetime_p50_ns: s.lifetimes.quantile(0.5),
                lifetime_p99_ns: s.lifetimes.quantile(0.99),
                temporary: s.temporary,
                freed_on_other_cpu: s.freed_on_other_cpu,
                leaked_at_exit: s.leaked_at_exit,
                process: (a.by == GroupBy::Process).then(|| g.label.clone()),
            }
        })
        .collect();
    let leaks: Vec<JsonLeak<'_>> = a
        .leaks
        .iter()
        .map(|l| JsonLeak {
            domain: l.domain,
            frames: &l.frames,
            blocks: l.blocks,
            bytes_req: l.bytes_req,
            bytes_alloc: l.bytes_alloc,
            oldest_age_ns: l.oldest_age_ns,
            pids: &l.pids,
        })
        .collect();
    let value = serde_json::json!({
        "totals": totals,
        "lost_events": a.stats.lost_events,
        "lost_events_per_cpu": a.stats.lost_events_per_cpu,
        "lost_stacks": a.stats.lost_stacks,
        "lost_inflight": a.stats.lost_inflight,
        "lost_kernel_live": a.stats.lost_kernel_live,
        "events": a.events,
        "duration_ns": a.duration_ns,
        "finalized": a.finalized,
        "warnings": a.warnings,
        "exit_code": a.stats.exit_code,
        "sampled_from": a.stats.sampled_from,
        "recorder": {
            "cpu_ns": a.stats.recorder_cpu_ns,
            "peak_rss_bytes": a.stats.recorder_peak_rss_bytes,
            "lost_sampled_live": a.stats.lost_sampled_live,
            "unwind_copies": a.stats.unwind_copies,
            "unwind_rules": a.stats.unwind_rules,
            "unwind_budget_truncated": a.stats.unwind_budget_truncated,
        },
        "stacks": a.coverage.iter().map(|(d, c)| (domain_name(*d), c)).collect::<BTreeMap<_, _>>(),
        "recording": a.meta,
        "group_by": a.by,
        "sites": sites,
        "leaks": if opts.leaks { Some(leaks) } else { None },
    });
    Ok(serde_json::to_string_pretty(&value)?)
}
