//! `memtrace export`: the per-stack figures of a recording as perf-style folded stacks
//! (flamegraph.pl, inferno, speedscope), an SVG flame graph (inferno), or a gzipped pprof
//! profile (go tool pprof, Pyroscope, Parca). Stacks are root first in folded output: the
//! process name, the user frames, then the kernel frames of allocations made in the kernel
//! on the process's behalf.
//!
//! The rows come from [`crate::report::analyze`] grouped by stack, each process apart;
//! [`pprof`] encodes the profile.
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
}

impl Weight {
    pub fn of(self, s: &Stats) -> u64 {
        match self {
            Self::Allocs => s.allocs,
            Self::Bytes => s.bytes_req,
            Self::BytesAlloc => s.bytes_alloc,
            Self::Wasted => s.wasted(),
            Self::Live => s.live_bytes_req,
        }
    }

    fn describe(self) -> (&'static str, &'static str) {
        match self {
            Self::Allocs => ("allocations", "allocations"),
            Self::Bytes => ("bytes requested", "bytes"),
            Self::BytesAlloc => ("bytes allocated", "bytes"),
            Self::Wasted => ("bytes wasted to internal fragmentation", "bytes"),
            Self::Live => ("bytes still live at the end", "bytes"),
        }
    }
}

/// A frame as a folded-stack element: no `;` (the separator), kernel frames marked `_[k]`
/// as perf and flamegraph.pl do.
fn folded_name(f: &Frame) -> String {
    let mut name: String = f.function.chars().map(|c| if c == ';' { ':' } else { c }).collect();
    if f.kernel {
        name.push_str("_[k]");
    }
    name
}

pub(crate) fn process_name(a: &Summary, row: &GroupRow) -> String {
    match row.pids.first() {
        Some(0) | None => "[kernel]".into(),
        Some(pid) => a.comms.get(pid).cloned().unwrap_or_else(|| format!("pid {pid}")),
    }
}

/// Folded stacks and their weights, merged when they name the same frames.
pub fn folded(a: &Summary, weight: Weight) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for row in &a.groups {
        let value = weight.of(&row.stats);
        if value == 0 {
            continue;
        }
        let mut line = process_name(a, row);
        for f in row.frames.iter().rev() {
            line.push(';');
            line.push_str(&folded_name(f));
        }
        *out.entry(line).or_insert(0) += value;
    }
    out
}

pub fn write_folded(a: &Summary, weight: Weight, out: &mut dyn Write) -> Result<()> {
    for (stack, value) in folded(a, weight) {
        writeln!(out, "{stack} {value}")?;
    }
    Ok(())
}

pub fn write_svg(a: &Summary, weight: Weight, out: &mut dyn Write) -> Result<()> {
    use inferno::flamegraph::{
        Options,
        color::{BasicPalette, Palette},
        from_lines,
    };
    let lines: Vec<String> = folded(a, weight).into_iter().map(|(s, v)| format!("{s} {v}")).collect();
    let (what, unit) = weight.describe();
    let mut opts = Options::default();
    opts.title = format!("memtrace: {what}");
    opts.count_name = unit.into();
    opts.colors = Palette::Basic(BasicPalette::Mem);
    if lines.is_empty() {
        anyhow::bail!("nothing to draw: no stack has any {what}");
    }
    from_lines(&mut opts, lines.iter().map(String::as_str), out)?;
    Ok(())
}

pub use self::pprof::{pprof_bytes, write_pprof};
