//! `memtrace diff OLD NEW` (heaptrack_print -d, pprof -diff_base): both recordings added up
//! with the same grouping and filters, their rows matched by what their symbolized frames
//! say (never by address: addresses move between builds and boots), and the change in each
//! figure, largest growth first. Printing is in [`super::diff_render`].
use std::{collections::BTreeMap, path::Path};

use anyhow::{Context as _, Result};
use clap::ValueEnum;

use super::{
    analyze::{GroupRow, Summary, analyze},
    options::ReportOptions,
};
use crate::{
    analysis::{
        Domain, Stats,
        diff::{Delta, match_rows},
    },
    columns::Width,
    grouping::{Filters, GroupBy, domain_name, first_frame},
    stacks::Frame,
};

/// The change rows are sorted by (largest growth first).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum DiffSort {
    /// Bytes live at the end (what leaks).
    #[default]
    Live,
    /// Blocks live at the end.
    LiveAllocs,
    Allocs,
    /// Bytes requested.
    Req,
    /// Bytes allocated.
    Alloc,
    /// Bytes live at the domain's peak.
    Peak,
}

impl DiffSort {
    pub fn of(self, d: &Delta) -> i64 {
        match self {
            Self::Live => d.live_bytes_req,
            Self::LiveAllocs => d.live_allocs,
            Self::Allocs => d.allocs,
            Self::Req => d.bytes_req,
            Self::Alloc => d.bytes_alloc,
            Self::Peak => d.live_bytes_req_at_peak,
        }
    }

    /// How the order is described.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Live => "growth of live bytes",
            Self::LiveAllocs => "growth of live blocks",
            Self::Allocs => "growth of allocations",
            Self::Req => "growth of bytes requested",
            Self::Alloc => "growth of bytes allocated",
            Self::Peak => "growth of bytes live at the peak",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum DiffFormat {
    #[default]
    Text,
    Json,
}

#[derive(Debug, Clone)]
pub struct DiffOptions {
    pub format: DiffFormat,
    pub by: GroupBy,
    pub filters: Filters,
    pub sort: DiffSort,
    pub top: Option<usize>,
    pub width: Width,
    /// The allocation wrappers a site is named past (`--alloc-fn`).
    pub alloc_fns: crate::wrappers::AllocFns,
}

/// Whether a row is in both runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Status {
    Changed,
    Unchanged,
    /// Only in the new run.
    New,
    /// Only in the old run.
    Gone,
}

/// Which recording's row shows a row of the comparison (the new one's where both have
/// it), by its index among that summary's groups: its frames are named when written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shown {
    pub new: bool,
    pub group: usize,
}

/// One row of the comparison.
#[derive(Debug, Clone)]
pub struct DiffRow {
    pub domain: Domain,
    pub label: String,
    pub shown: Shown,
    pub status: Status,
    pub old: Stats,
    pub new: Stats,
    pub delta: Delta,
}

/// Both runs and their rows compared.
pub struct DiffSummary {
    pub old: Summary,
    pub new: Summary,
    pub by: GroupBy,
    pub sort: DiffSort,
    /// Every row of either run, sorted.
    pub rows: Vec<DiffRow>,
    /// `--top`: how many of the rows that changed to show.
    pub top: Option<usize>,
    /// Per domain: (old, new) totals.
    pub totals: BTreeMap<Domain, (Stats, Stats)>,
}

/// What a frame says, without its address.
fn frame_name(f: &Frame) -> String {
    if f.kernel { format!("{f} [k]") } else { f.to_string() }
}

/// The key two runs' rows are matched by: the domain and the names that identify the row.
pub fn row_key(g: &GroupRow, by: GroupBy, a: &Summary) -> String {
    let name = match by {
        GroupBy::Site => {
            first_frame(g.domain, &crate::export::row_frames(a, g)).map_or_else(|| g.label.clone(), frame_name)
        }
        GroupBy::Function => g.label.clone(),
        GroupBy::Process => g.pids.first().and_then(|p| a.comms.get(p)).cloned().unwrap_or_else(|| g.label.clone()),
        GroupBy::Stack => crate::export::row_frames(a, g).iter().map(frame_name).collect::<Vec<_>>().join(";"),
    };
    format!("{}:{name}", domain_name(g.domain))
}

/// [`row_key`] as the rows are matched by: 128 bits of it (a key by stack is every frame's
/// name: a deep Python recording's took 0.9 GB a side).
fn key_hash(key: &str) -> u128 {
    use std::hash::BuildHasher as _;
    let half = |seed| foldhash::quality::FixedState::with_seed(seed).hash_one(key);
    u128::from(half(0x6d656d7472616365)) << 64 | u128::from(half(0x64696666))
}

/// A recording's rows unnamed: each is named when its key is made, and again only if it is
/// written ([`DiffSummary::frames`]).
fn read(path: &Path, opts: &DiffOptions) -> Result<Summary> {
    let report = ReportOptions {
        by: opts.by,
        filters: opts.filters.clone(),
        alloc_fns: opts.alloc_fns.clone(),
        rows_unnamed: true,
        labels_without_addresses: true,
        ..Default::default()
    };
    analyze(path, &report).with_context(|| format!("reading {}", path.display()))
}

fn keyed(a: &Summary, by: GroupBy, new: bool) -> Vec<(u128, Stats, (Domain, String, Shown))> {
    a.groups
        .iter()
        .enumerate()
        .map(|(group, g)| {
            let shown = Shown { new, group };
            (key_hash(&row_key(g, by, a)), g.stats.clone(), (g.domain, g.label.clone(), shown))
        })
        .collect()
}

impl DiffSummary {
    /// The rows that changed, the first `--top` of them.
    pub fn changed(&self) -> impl Iterator<Item = &DiffRow> {
        self.rows.iter().filter(|r| r.status != Status::Unchanged).take(self.top.unwrap_or(usize::MAX))
    }

    /// A row's frames, named now.
    pub fn frames(&self, row: &DiffRow) -> std::borrow::Cow<'_, [Frame]> {
        let a = if row.shown.new { &self.new } else { &self.old };
        crate::export::row_frames(a, &a.groups[row.shown.group])
    }
}

/// Compares the recordings at `old` and `new`.
pub fn diff(old: &Path, new: &Path, opts: &DiffOptions) -> Result<DiffSummary> {
    let (old_path, new_path) = (old, new);
    let (old, new) = (read(old, opts)?, read(new, opts)?);
    // A --pid, --comm or --allocator that one recording has is a comparison (all gone, or
    // all new); one that neither has is a mistake, said as `report` says it.
    if let (Err(e), Err(_)) =
        (super::check_filters(&old, &opts.filters, old_path), super::check_filters(&new, &opts.filters, new_path))
    {
        return Err(e);
    }
    let mut rows: Vec<DiffRow> = match_rows(keyed(&old, opts.by, false), keyed(&new, opts.by, true))
        .into_iter()
        .map(|m| {
            let delta = m.delta();
            let (domain, label, shown) = m.shown().clone();
            let status = match (&m.old, &m.new) {
                (None, _) => Status::New,
                (_, None) => Status::Gone,
                _ if delta.is_zero() => Status::Unchanged,
                _ => Status::Changed,
            };
            let (old, new) = (m.old.map(|o| o.0).unwrap_or_default(), m.new.map(|n| n.0).unwrap_or_default());
            DiffRow { domain, label, shown, status, old, new, delta }
        })
        .collect();
    rows.sort_by(|a, b| {
        opts.sort
            .of(&b.delta)
            .cmp(&opts.sort.of(&a.delta))
            .then(b.delta.bytes_req.cmp(&a.delta.bytes_req))
            .then(a.label.cmp(&b.label))
            .then(domain_name(a.domain).cmp(domain_name(b.domain)))
            // Then as each recording's own report lists them (the new one's first): rows
            // are matched in the order of their keys' hashes, no order for a reader.
            .then((!a.shown.new, a.shown.group).cmp(&(!b.shown.new, b.shown.group)))
    });
    let mut totals: BTreeMap<Domain, (Stats, Stats)> = BTreeMap::new();
    for (domain, t) in &old.totals {
        totals.entry(*domain).or_default().0 = t.stats.clone();
    }
    for (domain, t) in &new.totals {
        totals.entry(*domain).or_default().1 = t.stats.clone();
    }
    totals.retain(|d, _| opts.filters.domain.admits(*d));
    Ok(DiffSummary { old, new, by: opts.by, sort: opts.sort, rows, top: opts.top, totals })
}
