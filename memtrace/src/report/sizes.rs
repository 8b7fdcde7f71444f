//! `report --histogram` in the terminal: the requested sizes of each domain in
//! power-of-two buckets (allocations, bytes requested and allocated, fragmentation, a bar),
//! then the buckets of the first rows, one line each — where each Frag % comes from.
use std::fmt::Write as _;

use super::{analyze::Summary, options::ReportOptions};
use crate::{
    analysis::sizes::{SizeBin, SizeHistogram},
    columns::{TextColumn, TextTable, Width, flow},
    grouping::domain_name,
    units::{bytes, count, percent},
};

/// Rows whose buckets are listed, at most.
pub const SITE_ROWS: usize = 10;

/// Width of the longest bar.
const BAR: usize = 30;

/// A power of two of bytes, exactly: `64 B`, `4 KiB`, `2 MiB`.
fn power_of_two(v: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut unit = 0;
    let mut v = v;
    while v >= 1024 && v.is_multiple_of(1024) && unit + 1 < UNITS.len() {
        v /= 1024;
        unit += 1;
    }
    format!("{v} {}", UNITS[unit])
}

/// A bucket's name: the largest size it holds, `≤ 64 B` (it holds the sizes above the
/// previous power of two).
pub fn size_class(bin: &SizeBin) -> String {
    if bin.max_size == u64::MAX {
        format!("> {}", power_of_two(1 << 63))
    } else {
        format!("≤ {}", power_of_two(bin.max_size))
    }
}

/// A bar of `v` out of `max`, [`BAR`] wide at most.
fn bar(v: u64, max: u64) -> String {
    if max == 0 || v == 0 {
        return String::new();
    }
    "█".repeat(((v as f64 / max as f64 * BAR as f64).round() as usize).max(1))
}

/// One domain's histogram as a table.
fn table(h: &SizeHistogram) -> TextTable {
    let bins: Vec<&SizeBin> = h.bins().collect();
    let max = bins.iter().map(|b| b.allocs).max().unwrap_or(0);
    let column = |header: &str, rank: usize, cell: &dyn Fn(&SizeBin) -> String| {
        TextColumn::new(header, rank, bins.iter().map(|b| cell(b)).collect())
    };
    TextTable {
        columns: vec![
            column("SIZE", 0, &|b| size_class(b)),
            column("ALLOCS", 1, &|b| count(b.allocs)),
            column("REQUESTED", 3, &|b| bytes(b.bytes_req)),
            column("ALLOCATED", 4, &|b| bytes(b.bytes_alloc)),
            column("FRAG", 2, &|b| percent(b.frag_pct())),
        ],
        names: Some(("".into(), bins.iter().map(|b| bar(b.allocs, max)).collect())),
        keep_all: false,
    }
}

/// The histogram section of the text report, ending in a blank line.
pub fn render_histogram(a: &Summary, opts: &ReportOptions) -> String {
    let mut out = String::new();
    for (domain, t) in a.totals.iter().filter(|(d, _)| opts.filters.domain.admits(**d)) {
        if t.stats.sizes.is_empty() {
            continue;
        }
        let _ = writeln!(out, "requested sizes, {}:", domain_name(*domain));
        out.push_str(&table(&t.stats.sizes).render(opts.layout.width));
        out.push('\n');
    }
    let rows: Vec<_> = a.groups.iter().take(SITE_ROWS).collect();
    // A process has a row per domain: rows are counted, each named with its domain.
    let by_process = a.by == crate::grouping::GroupBy::Process;
    if !rows.is_empty() {
        let what = if by_process { "rows (a process in a domain each)" } else { a.by.plural() };
        let _ = writeln!(out, "requested sizes of the first {} {what}:", rows.len());
    }
    for g in rows {
        if by_process {
            let _ = writeln!(out, "{}, {}", g.label, domain_name(g.domain));
        } else {
            let _ = writeln!(out, "{}", g.label);
        }
        let items: Vec<String> = g
            .stats
            .sizes
            .bins()
            .map(|b| format!("{}: {} ({} frag)", size_class(b), count(b.allocs), percent(b.frag_pct())))
            .collect();
        let width = match opts.layout.width {
            Width::Columns(w) => Width::Columns(w.saturating_sub(4)),
            w => w,
        };
        for line in flow(&items, width) {
            let _ = writeln!(out, "    {line}");
        }
    }
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::analysis::sizes::{bounds, bucket};

    fn class(size: u64) -> String {
        let (min_size, max_size) = bounds(bucket(size));
        size_class(&SizeBin { min_size, max_size, ..Default::default() })
    }

    #[test]
    fn classes_read_as_sizes() {
        assert_eq!(class(0), "≤ 1 B");
        assert_eq!(class(77), "≤ 128 B");
        assert_eq!(class(1000), "≤ 1 KiB");
        assert_eq!(class(16000), "≤ 16 KiB");
        assert_eq!(class(3 << 20), "≤ 4 MiB");
        assert_eq!(class(u64::MAX), "> 8 EiB");
        assert_eq!(bar(5, 10), "█".repeat(15));
        assert_eq!(bar(1, 1000), "█");
        assert_eq!(bar(0, 10), "");
    }
}
