//! `report --timeline` in the terminal: one sparkline row per domain, then per row of the
//! report that has a series (the first ones), each scaled to its own highest value, which
//! is printed beside it; columns fit the width and each shows the most live within it.
use std::fmt::Write as _;

use super::{analyze::Summary, options::ReportOptions};
use crate::{
    analysis::Domain,
    columns::{NAME_FIT_WIDTH, NAME_MIN_WIDTH, Width, ellipsize},
    grouping::domain_name,
    units::{bytes, duration},
};

const LEVELS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];

/// Rows of sites drawn under the domains, at most.
pub const SITE_ROWS: usize = 5;

/// Most columns a sparkline takes.
const MAX_COLUMNS: usize = 100;

/// Room before the sparkline: domain letter, highest value, gaps.
const PREFIX: usize = 1 + 2 + 9 + 2;

/// `series` with `per_column` intervals in each column, each the highest of its intervals.
pub fn squeeze(series: &[u64], per_column: usize) -> Vec<u64> {
    series.chunks(per_column.max(1)).map(|c| c.iter().copied().max().unwrap_or(0)).collect()
}

/// One character per value, scaled to `max`: blank for nothing live.
pub fn sparkline(values: &[u64], max: u64) -> String {
    values
        .iter()
        .map(|&v| {
            if v == 0 || max == 0 {
                ' '
            } else {
                let level = (v as f64 / max as f64 * LEVELS.len() as f64).ceil() as usize;
                LEVELS[level.clamp(1, LEVELS.len()) - 1]
            }
        })
        .collect()
}

fn row(out: &mut String, domain: Domain, series: &[u64], per_column: usize, name: &str, width: Width) {
    let squeezed = squeeze(series, per_column);
    let columns = squeezed.len();
    let max = squeezed.iter().copied().max().unwrap_or(0);
    let letter = crate::grouping::domain_letter(domain);
    let line = format!("{letter}  {:>9}  {:<columns$}  {name}", bytes(max), sparkline(&squeezed, max));
    let line = match width {
        Width::Columns(w) => ellipsize(&line, w.max(PREFIX + columns + 2 + NAME_MIN_WIDTH)),
        Width::Unlimited => line,
    };
    let _ = writeln!(out, "{}", line.trim_end());
}

/// The timeline section of the text report, ending in a blank line (empty when nothing was
/// live at any time).
pub fn render_timeline(a: &Summary, opts: &ReportOptions) -> String {
    let m = &a.memory;
    let n = m.intervals();
    let domains: Vec<(&Domain, &Vec<u64>)> =
        m.domains.iter().filter(|(d, s)| opts.filters.domain.admits(**d) && s.iter().any(|&v| v > 0)).collect();
    if domains.is_empty() {
        return String::new();
    }
    let room = match opts.layout.width {
        Width::Columns(w) => w.saturating_sub(PREFIX + 2 + NAME_FIT_WIDTH),
        Width::Unlimited => MAX_COLUMNS,
    };
    // Whole intervals per column, so that every column stands for the same time.
    let per_column = n.div_ceil(room.clamp(10, MAX_COLUMNS)).max(1);
    let columns = n.div_ceil(per_column);
    let span = n as u64 * m.interval_ns;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "memory over time: {} in {columns} columns of {}, each the most bytes live within it:",
        duration(span),
        duration(per_column as u64 * m.interval_ns)
    );
    let end = duration(span);
    let _ = writeln!(out, "{:>w$}0{end:>pad$}", "", w = PREFIX, pad = columns.saturating_sub(1).max(end.len()));
    for (domain, series) in domains {
        let peak = m.peaks.get(domain).copied().unwrap_or_default();
        let name = format!(
            "{}: peak {} at {}",
            domain_name(*domain),
            bytes(peak.live_bytes_req),
            duration(m.since_start(peak.ts_ns))
        );
        row(&mut out, *domain, series, per_column, &name, opts.layout.width);
    }
    for g in a.groups.iter().filter(|g| !g.timeline.is_empty()).take(SITE_ROWS) {
        row(&mut out, g.domain, &g.timeline, per_column, &g.label, opts.layout.width);
    }
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparklines_scale_to_their_highest_and_keep_spikes() {
        assert_eq!(sparkline(&[0, 1, 4, 8, 7], 8), " ▁▄█▇");
        assert_eq!(sparkline(&[0, 0], 0), "  ");
        assert_eq!(squeeze(&[1, 9, 2, 3, 0, 0, 5, 1], 2), [9, 3, 0, 5]);
        assert_eq!(squeeze(&[1, 2, 3], 1), [1, 2, 3]);
        assert_eq!(squeeze(&[1, 2, 3, 4, 5, 6, 7], 3), [3, 6, 7]);
    }
}
