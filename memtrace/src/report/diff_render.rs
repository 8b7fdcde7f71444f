//! `memtrace diff` printed: the totals per domain and one row per changed site (text,
//! fitted to the terminal like the report), or everything as JSON: `totals`, and `sites`
//! with their `frames` (as in `report`), a `*_delta` per figure and both runs' figures.
use std::{collections::BTreeMap, fmt::Write as _};

use anyhow::Result;
use serde::Serialize;
use serde_json::json;

use super::{
    analyze::Summary,
    diff::{DiffRow, DiffSummary, Status},
};
use crate::{
    analysis::{Stats, diff::Delta},
    columns::{TextColumn, TextTable, Width},
    grouping::domain_name,
    stacks::Frame,
    units::{count, duration, signed_bytes},
};

/// `+1,234`, `-5`, `0`.
pub fn signed_count(v: i64) -> String {
    match v {
        0 => "0".into(),
        v if v < 0 => format!("-{}", count(v.unsigned_abs())),
        v => format!("+{}", count(v as u64)),
    }
}

fn bytes_delta(v: i64) -> String {
    if v == 0 { "0".into() } else { signed_bytes(v) }
}

/// The recording, on one line.
fn describe(a: &Summary) -> String {
    let m = &a.meta;
    let what = match m.mode.as_str() {
        "command" => format!("`{}`", m.target_command.join(" ")),
        "pid" => format!("pid {}", m.target_pids.first().copied().unwrap_or(0)),
        _ => "the whole machine".into(),
    };
    format!("{what}, {} of events", duration(a.duration_ns))
}

/// The figures of a delta, as columns: (header, rank, cell).
type Figure = (&'static str, usize, fn(&Delta) -> String);
const FIGURES: [Figure; 6] = [
    ("Δ ALLOCS", 2, |d| signed_count(d.allocs)),
    ("Δ REQUESTED", 3, |d| bytes_delta(d.bytes_req)),
    ("Δ ALLOCATED", 6, |d| bytes_delta(d.bytes_alloc)),
    ("Δ LIVE", 4, |d| signed_count(d.live_allocs)),
    ("Δ LIVE BYTES", 1, |d| bytes_delta(d.live_bytes_req)),
    ("Δ PEAK", 5, |d| bytes_delta(d.live_bytes_req_at_peak)),
];

fn table(deltas: &[Delta], first: TextColumn, names: Option<(String, Vec<String>)>) -> TextTable {
    let mut columns = vec![first];
    for (header, rank, cell) in FIGURES {
        columns.push(TextColumn::new(header, rank, deltas.iter().map(cell).collect()));
    }
    TextTable { columns, names, keep_all: false }
}

pub fn render_diff_text(d: &DiffSummary, width: Width) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "memtrace diff: old {}", describe(&d.old));
    let _ = writeln!(out, "           new {}", describe(&d.new));
    out.push('\n');
    let deltas: Vec<Delta> = d.totals.values().map(|(o, n)| Delta::between(o, n)).collect();
    let domains = d.totals.keys().map(|k| domain_name(*k).to_string()).collect();
    out.push_str(&table(&deltas, TextColumn::new("", 0, domains), None).render(width));
    out.push('\n');

    let changed = d.rows.iter().filter(|r| r.status != Status::Unchanged).count();
    let shown: Vec<&DiffRow> = d.changed().collect();
    let first = if shown.len() < changed { format!("the first {} of ", shown.len()) } else { String::new() };
    let _ = writeln!(
        out,
        "{first}{changed} {} changed ({} unchanged), by {}:",
        d.by.plural(),
        d.rows.len() - changed,
        d.sort.describe()
    );
    if shown.is_empty() {
        return out;
    }
    let letters = shown.iter().map(|r| crate::grouping::domain_letter(r.domain).to_string());
    let names = shown.iter().map(|r| match r.status {
        Status::New => format!("[new] {}", r.label),
        Status::Gone => format!("[gone] {}", r.label),
        _ => r.label.clone(),
    });
    let deltas: Vec<Delta> = shown.iter().map(|r| r.delta).collect();
    let header = match d.by {
        crate::grouping::GroupBy::Site => "SITE",
        crate::grouping::GroupBy::Stack => "STACK",
        crate::grouping::GroupBy::Function => "FUNCTION",
        crate::grouping::GroupBy::Process => "PROCESS",
    };
    let t = table(&deltas, TextColumn::new("", 0, letters.collect()), Some((header.into(), names.collect())));
    out.push_str(&t.render(width));
    out
}

#[derive(Serialize)]
struct Figures {
    allocs: u64,
    frees: u64,
    bytes_req: u64,
    bytes_alloc: u64,
    live_allocs: u64,
    live_bytes_req: u64,
    live_bytes_req_at_peak: u64,
    peak_live_bytes_req: u64,
}

impl Figures {
    fn of(s: &Stats) -> Self {
        Self {
            allocs: s.allocs,
            frees: s.frees,
            bytes_req: s.bytes_req,
            bytes_alloc: s.bytes_alloc,
            live_allocs: s.live_allocs,
            live_bytes_req: s.live_bytes_req,
            live_bytes_req_at_peak: s.live_bytes_req_at_peak,
            peak_live_bytes_req: s.peak_live_bytes_req,
        }
    }
}

#[derive(Serialize)]
struct Deltas {
    allocs_delta: i64,
    frees_delta: i64,
    bytes_req_delta: i64,
    bytes_alloc_delta: i64,
    live_allocs_delta: i64,
    live_bytes_req_delta: i64,
    live_bytes_req_at_peak_delta: i64,
    peak_live_bytes_req_delta: i64,
    old: Figures,
    new: Figures,
}

impl Deltas {
    fn of(old: &Stats, new: &Stats) -> Self {
        let d = Delta::between(old, new);
        Self {
            allocs_delta: d.allocs,
            frees_delta: d.frees,
            bytes_req_delta: d.bytes_req,
            bytes_alloc_delta: d.bytes_alloc,
            live_allocs_delta: d.live_allocs,
            live_bytes_req_delta: d.live_bytes_req,
            live_bytes_req_at_peak_delta: d.live_bytes_req_at_peak,
            peak_live_bytes_req_delta: d.peak_live_bytes_req,
            old: Figures::of(old),
            new: Figures::of(new),
        }
    }
}

#[derive(Serialize)]
struct JsonRow<'a> {
    domain: crate::analysis::Domain,
    status: Status,
    label: &'a str,
    frames: &'a [Frame],
    #[serde(flatten)]
    deltas: Deltas,
}

pub fn render_diff_json(d: &DiffSummary) -> Result<String> {
    let mut out = Vec::new();
    write_diff_json(d, &mut out)?;
    Ok(String::from_utf8(out)?)
}

/// The rows of `sites`, each named as it is written (all of them, compared by stack, made
/// into one value took 12.8 GB for a deep Python recording against itself).
struct Rows<'a>(&'a DiffSummary);

impl Serialize for Rows<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq as _;
        let d = self.0;
        // Every row, unchanged ones included; with --top, the first rows that changed.
        let rows: Vec<&DiffRow> = if d.top.is_some() { d.changed().collect() } else { d.rows.iter().collect() };
        let mut seq = serializer.serialize_seq(Some(rows.len()))?;
        for r in rows {
            let frames = d.frames(r);
            let row = JsonRow {
                domain: r.domain,
                status: r.status,
                label: &r.label,
                frames: &frames,
                deltas: Deltas::of(&r.old, &r.new),
            };
            // Through a value, one row at a time: fields in the order of their names, as
            // the comparison has always written them.
            seq.serialize_element(&serde_json::to_value(row).map_err(serde::ser::Error::custom)?)?;
        }
        seq.end()
    }
}

/// The comparison as JSON, written to `w` as it is made (a failed write keeps its kind).
pub fn write_diff_json(d: &DiffSummary, w: &mut dyn std::io::Write) -> std::io::Result<()> {
    let totals: BTreeMap<&str, Deltas> =
        d.totals.iter().map(|(k, (o, n))| (domain_name(*k), Deltas::of(o, n))).collect();
    let side = |a: &Summary| json!({"recording": a.meta, "duration_ns": a.duration_ns, "events": a.events, "warnings": a.warnings});
    let value = json!({
        "old": side(&d.old),
        "new": side(&d.new),
        "group_by": d.by,
        "totals": totals,
        // Written by `Rows` in its place.
        "sites": serde_json::Value::Null,
    });
    let serde_json::Value::Object(value) = value else { unreachable!("the comparison is an object") };
    let document = super::json::Spliced { value, first: ("sites", Rows(d)), second: None::<(&str, ())> };
    serde_json::to_writer_pretty(&mut *w, &document)?;
    w.write_all(b"\n")
}
