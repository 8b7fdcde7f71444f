//! `memtrace export`: the per-stack figures of a recording as perf-style folded stacks
//! (flamegraph.pl, inferno, speedscope), an SVG flame graph (inferno), or a gzipped pprof
//! profile (go tool pprof, Pyroscope, Parca). Stacks are root first in folded output: the
//! process name, the user frames, then the kernel frames of allocations made in the kernel
//! on the process's behalf.
//!
//! The rows come from [`crate::report::analyze`] grouped by stack, each process apart;
//! [`pprof`] encodes the profile; [`diff`] compares with a base recording (`--diff-base`).
pub mod diff;
pub mod existing;
pub mod pprof;
#[cfg(test)]
mod tests;

use std::{collections::BTreeMap, io::Write};

use anyhow::Result;
use clap::ValueEnum;

use crate::{
    analysis::Stats,
    report::{GroupRow, Summary},
    stacks::Frame,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum ExportFormat {
    /// `frame;frame;frame value` lines, root first.
    #[default]
    Folded,
    /// An SVG flame graph.
    Svg,
    /// gzipped profile.proto with alloc_objects/alloc_space/inuse_objects/inuse_space.
    Pprof,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum Weight {
    /// Number of allocations.
    Allocs,
    /// Bytes requested.
    #[default]
    Bytes,
    /// Bytes the allocator handed out.
    BytesAlloc,
    /// Bytes lost to internal fragmentation (allocated − requested).
    Wasted,
    /// Bytes requested still live at the end.
    Live,
    /// Bytes requested live at the moment of the domain's peak.
    Peak,
}

impl Weight {
    pub fn of(self, s: &Stats) -> u64 {
        match self {
            Self::Allocs => s.allocs,
            Self::Bytes => s.bytes_req,
            Self::BytesAlloc => s.bytes_alloc,
            Self::Wasted => s.wasted(),
            Self::Live => s.live_bytes_req,
            Self::Peak => s.live_bytes_req_at_peak,
        }
    }

    pub fn describe(self) -> (&'static str, &'static str) {
        match self {
            Self::Allocs => ("allocations", "allocations"),
            Self::Bytes => ("bytes requested", "bytes"),
            Self::BytesAlloc => ("bytes allocated", "bytes"),
            Self::Wasted => ("bytes wasted to internal fragmentation", "bytes"),
            Self::Live => ("bytes still live at the end", "bytes"),
            Self::Peak => ("bytes live at the peak", "bytes"),
        }
    }
}

/// A frame as a folded-stack element: no `;` (the separator), kernel frames marked `_[k]`
/// as perf and flamegraph.pl do, Python frames with their file and line as py-spy writes
/// them (`f (app.py:12)`).
fn folded_name(f: &Frame) -> String {
    let full = if f.python { f.to_string() } else { f.function.to_string() };
    let mut name = folded_element(&full);
    if f.kernel {
        name.push_str("_[k]");
    }
    name
}

/// A name made safe for a folded line: no `;` (the separator) and no line break (a process
/// may call itself `run;1` or anything).
fn folded_element(s: &str) -> String {
    s.trim()
        .chars()
        .map(|c| {
            if c == ';' {
                ':'
            } else if c.is_control() {
                ' '
            } else {
                c
            }
        })
        .collect()
}

pub(crate) fn process_name(a: &Summary, row: &GroupRow) -> String {
    match row.pids.first() {
        Some(0) | None => "[kernel]".into(),
        Some(pid) => a.comms.get(pid).cloned().unwrap_or_else(|| format!("pid {pid}")),
    }
}

/// Folded stacks and their weights, merged when they name the same frames.
pub fn folded(a: &Summary, weight: Weight) -> BTreeMap<String, u64> {
    folded_rows(a, weight, |_| true)
}

/// [`folded`] of the rows `keep` accepts.
pub fn folded_rows(a: &Summary, weight: Weight, keep: impl Fn(&GroupRow) -> bool) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for row in a.groups.iter().filter(|r| keep(r)) {
        let value = weight.of(&row.stats);
        if value == 0 {
            continue;
        }
        *out.entry(folded_line(a, row)).or_insert(0) += value;
    }
    out
}

/// A row's frames: those the analysis named, else named now (rows left unnamed,
/// [`crate::report::ReportOptions::rows_unnamed`], are named one at a time by the export).
pub(crate) fn row_frames<'a>(a: &Summary, row: &'a GroupRow) -> std::borrow::Cow<'a, [Frame]> {
    if row.frames.is_empty() {
        std::borrow::Cow::Owned(a.stacks.frames_once(row.stack, row.call_site))
    } else {
        std::borrow::Cow::Borrowed(&row.frames)
    }
}

/// A row's folded stack, its process at the root.
pub fn folded_line(a: &Summary, row: &GroupRow) -> String {
    let mut line = folded_element(&process_name(a, row));
    for f in row_frames(a, row).iter().rev() {
        line.push(';');
        line.push_str(&folded_name(f));
    }
    // A line ending in a number before its weight reads as a differential line (before
    // and after counts) to flame graph tools: `job 42` with no frames.
    if let Some(space) = line.rfind(' ')
        && space + 1 < line.len()
        && line[space + 1..].chars().all(|c| c.is_ascii_digit())
    {
        line.replace_range(space..=space, "_");
    }
    line
}

/// [`folded`], taking the rows: each one's frames are let go once its line is made (a
/// big recording's named frames and its folded lines both held at once took twice the
/// memory). Rows left unnamed ([`crate::report::ReportOptions::rows_unnamed`]) are named
/// here, one at a time.
fn folded_taking(mut a: Summary, weight: Weight) -> BTreeMap<String, u64> {
    let rows = std::mem::take(&mut a.groups);
    let mut out = BTreeMap::new();
    for row in rows {
        let value = weight.of(&row.stats);
        if value > 0 {
            *out.entry(folded_line(&a, &row)).or_insert(0) += value;
        }
    }
    out
}

/// Folded stacks as lines, `stack value` (each line's own string, its value appended).
fn lines_of(folded: BTreeMap<String, u64>) -> Vec<String> {
    use std::fmt::Write as _;
    folded
        .into_iter()
        .map(|(mut line, value)| {
            let _ = write!(line, " {value}");
            line
        })
        .collect()
}

pub fn write_folded(a: &Summary, weight: Weight, out: &mut dyn Write) -> Result<()> {
    write_lines(&lines_of(folded(a, weight)), out)
}

fn write_lines(lines: &[String], out: &mut dyn Write) -> Result<()> {
    for line in lines {
        writeln!(out, "{line}")?;
    }
    Ok(())
}

pub fn write_svg(a: &Summary, weight: Weight, out: &mut dyn Write) -> Result<()> {
    svg_of_lines(&lines_of(folded(a, weight)), weight, out)
}

fn svg_of_lines(lines: &[String], weight: Weight, out: &mut dyn Write) -> Result<()> {
    let (what, _) = weight.describe();
    let title = format!("memtrace: {what}");
    if lines.is_empty() {
        return empty_svg(&title, &format!("nothing to draw: no stack has any {what}"), out);
    }
    draw_svg(lines.iter().map(String::as_str), weight, &title, None, out)
}

/// The flame graph of nothing (a filter that matched no stack, a process that allocated
/// nothing): a page that says so under its title, as the folded and pprof exports of
/// nothing are an empty file and an empty profile, not a failure (inferno refuses empty
/// input).
fn empty_svg(title: &str, message: &str, out: &mut dyn Write) -> Result<()> {
    let escape = |t: &str| t.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;");
    write!(
        out,
        "<?xml version=\"1.0\" standalone=\"no\"?>\n\
         <svg version=\"1.1\" width=\"1200\" height=\"90\" xmlns=\"http://www.w3.org/2000/svg\">\n\
         <text x=\"600\" y=\"24\" text-anchor=\"middle\" font-size=\"17\" font-family=\"Verdana\">{}</text>\n\
         <text x=\"600\" y=\"60\" text-anchor=\"middle\" font-size=\"12\" font-family=\"Verdana\">{}</text>\n\
         </svg>\n",
        escape(title),
        escape(message)
    )?;
    Ok(())
}

/// An inferno flame graph of folded `lines` (`stack value`, or `stack old new` for a
/// differential one); fluid width, the memory palette.
pub fn draw_svg<'a>(
    lines: impl IntoIterator<Item = &'a str>,
    weight: Weight,
    title: &str,
    subtitle: Option<String>,
    out: &mut dyn Write,
) -> Result<()> {
    use inferno::flamegraph::{
        Options,
        color::{BasicPalette, Palette},
        from_lines,
    };
    let mut opts = Options::default();
    opts.title = title.into();
    opts.subtitle = subtitle;
    opts.count_name = weight.describe().1.into();
    opts.colors = Palette::Basic(BasicPalette::Mem);
    from_lines(&mut opts, lines, out)?;
    Ok(())
}

/// Writes the export `format` asks for; with a `base`, the change from it.
pub fn write(
    format: ExportFormat,
    a: Summary,
    base: Option<&Summary>,
    weight: Weight,
    out: &mut dyn Write,
) -> Result<()> {
    match (format, base) {
        (ExportFormat::Folded, None) => write_lines(&lines_of(folded_taking(a, weight)), out),
        (ExportFormat::Svg, None) => svg_of_lines(&lines_of(folded_taking(a, weight)), weight, out),
        (ExportFormat::Pprof, None) => write_pprof(&a, out),
        (ExportFormat::Folded, Some(b)) => diff::write_folded_diff(b, &a, weight, out),
        (ExportFormat::Svg, Some(b)) => diff::write_svg_diff(b, &a, weight, out),
        (ExportFormat::Pprof, Some(b)) => diff::write_pprof_diff(b, &a, out),
    }
}

pub use self::pprof::{pprof_bytes, write_pprof};
