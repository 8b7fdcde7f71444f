//! `memtrace report`: reads a recording (definitions first, then the events, streaming),
//! pairs and aggregates per call site / stack / function / process, and prints the table
//! users read — or JSON for scripts, or the blocks still live (`--leaks`).
//!
//! - [`options`]: what is asked (format, grouping, filters, sort, layout);
//! - [`load`]: reading a recording;
//! - [`analyze`]: adding it up into a [`Summary`];
//! - [`text`] and [`json`]: printing it.
pub mod analyze;
pub mod diff;
pub mod diff_render;
pub mod html;
pub mod json;
pub mod json_memory;
pub mod load;
pub mod memory;
pub mod options;
pub mod output;
pub mod sites;
pub mod sizes;
pub mod sparkline;
#[cfg(test)]
pub(crate) mod tests;
#[cfg(test)]
mod tests_diff;
#[cfg(test)]
mod tests_memory;
pub mod text;
pub mod warnings;

pub use self::{
    analyze::{GroupRow, LeakRow, LeakTotals, StackCoverage, Summary, analyze},
    json::render_json,
    load::{Definitions, Outline, for_each_event, read_definitions, read_outline},
    options::{Format, ReportColumn, ReportOptions, SortKey},
    text::render_text,
};

/// Fails when `--pid` asks for a process the recording (`input`) has nothing of: neither
/// its events nor its name, nor among the processes it was recorded for. The message names
/// the processes it has.
pub fn check_pid(summary: &Summary, opts: &ReportOptions, input: &std::path::Path) -> anyhow::Result<()> {
    let Some(pid) = opts.filters.pid else { return Ok(()) };
    if summary.comms.contains_key(&pid)
        || summary.meta.target_pids.contains(&pid)
        || summary.totals.values().any(|t| t.stats.allocs > 0 || t.stats.frees > 0)
    {
        return Ok(());
    }
    let mut pids: Vec<String> = summary.comms.iter().map(|(p, c)| format!("{c} [{p}]")).collect();
    if pids.is_empty() {
        anyhow::bail!("pid {pid} is not in {}: it has no process's events", input.display());
    }
    pids.sort();
    let more = if pids.len() > 8 { format!(" and {} more", pids.len() - 8) } else { String::new() };
    pids.truncate(8);
    anyhow::bail!("pid {pid} is not in {}: it has {}{more}", input.display(), pids.join(", "))
}

/// The report as `opts.format` asks, ending in a newline.
pub fn render(summary: &Summary, opts: &ReportOptions) -> anyhow::Result<String> {
    Ok(match opts.format {
        Format::Text => render_text(summary, opts),
        Format::Json => render_json(summary, opts)? + "\n",
        Format::Html => anyhow::bail!("the HTML report is written to a file: --format html -o report.html"),
    })
}
