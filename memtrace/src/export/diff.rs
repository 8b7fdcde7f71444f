//! `export --diff-base OLD`: the change from a base recording to this one. Folded output
//! has two counts per stack (`stack old new`, what flamegraph.pl's difffolded.pl writes and
//! inferno and flamegraph.pl draw as a differential flame graph: red grew, blue shrank);
//! the SVG is that graph; the pprof profile holds the base's samples negated, as `pprof
//! -diff_base` does, so any pprof viewer shows the difference.
use std::{collections::BTreeMap, io::Write};

use anyhow::Result;

use super::{Weight, draw_svg, folded, pprof};
use crate::report::Summary;

/// Per folded stack of either recording: (base, this) weights.
pub fn folded_diff(base: &Summary, a: &Summary, weight: Weight) -> BTreeMap<String, (u64, u64)> {
    let mut out: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for (stack, v) in folded(base, weight) {
        out.entry(stack).or_default().0 = v;
    }
    for (stack, v) in folded(a, weight) {
        out.entry(stack).or_default().1 = v;
    }
    out
}

pub fn write_folded_diff(base: &Summary, a: &Summary, weight: Weight, out: &mut dyn Write) -> Result<()> {
    for (stack, (old, new)) in folded_diff(base, a, weight) {
        writeln!(out, "{stack} {old} {new}")?;
    }
    Ok(())
}

pub fn write_svg_diff(base: &Summary, a: &Summary, weight: Weight, out: &mut dyn Write) -> Result<()> {
    let lines: Vec<String> =
        folded_diff(base, a, weight).into_iter().map(|(s, (old, new))| format!("{s} {old} {new}")).collect();
    let (what, _) = weight.describe();
    let title = format!("memtrace: change in {what}");
    if lines.is_empty() {
        return super::empty_svg(&title, &format!("nothing to draw: no stack has any {what} in either recording"), out);
    }
    let subtitle = "widths: this recording; red grew since the base, blue shrank".to_string();
    draw_svg(lines.iter().map(String::as_str), weight, &title, Some(subtitle), out)
}

pub fn write_pprof_diff(base: &Summary, a: &Summary, out: &mut dyn Write) -> Result<()> {
    pprof::write_gzipped(&pprof::pprof_bytes_of(a, Some(base)), out)
}
