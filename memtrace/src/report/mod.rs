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

use std::path::Path;

use crate::grouping::Filters;

pub use self::{
    analyze::{GroupRow, LeakRow, LeakTotals, StackCoverage, Summary, analyze},
    json::{render_json, write_json},
    load::{Definitions, Outline, for_each_event, read_definitions, read_outline},
    options::{Format, ReportColumn, ReportOptions, SortKey},
    text::{render_text, write_text},
};

/// Fails when a filter names what the recording (`input`) has none of: a `--pid` with
/// neither events nor a name there, a `--comm` no process had, an `--allocator` it did not
/// find. Each message names what it has. A filter that exists there but matches nothing
/// (with `--min-size`, say) is an empty report, not an error.
pub fn check_filters(summary: &Summary, filters: &Filters, input: &Path) -> anyhow::Result<()> {
    if summary.totals.values().any(|t| t.stats.allocs > 0 || t.stats.frees > 0) {
        return Ok(());
    }
    let at = input.display();
    if let Some(pid) = filters.pid
        && !summary.comms.contains_key(&pid)
        && !summary.allocs_by_pid.contains_key(&pid)
        && !summary.meta.target_pids.contains(&pid)
    {
        anyhow::bail!("pid {pid} is not in {at}: {}", processes(summary));
    }
    if let Some(comm) = &filters.comm
        && !summary.comms.values().any(|c| c == comm)
    {
        // The kernel keeps a name's first 15 bytes (TASK_COMM_LEN), cut at a character.
        let cut = (comm.len() > 15).then(|| &comm[..comm.floor_char_boundary(15)]);
        let hint = match cut {
            Some(cut) if summary.comms.values().any(|c| c == cut) => {
                format!(" (the kernel keeps a name's first 15 characters: --comm {cut})")
            }
            _ => String::new(),
        };
        anyhow::bail!("no process named {comm} in {at}: {}{hint}", processes(summary));
    }
    if let Some(name) = &filters.allocator {
        let all = &summary.stats.allocators;
        // Those a traced program used: the installed libraries probed ahead of time that none
        // did are not there to ask for.
        let known = name == "unknown"
            || (1..=all.len())
                .filter_map(|i| u8::try_from(i).ok())
                .any(|i| all[usize::from(i) - 1].found && analyze::allocator_matches(all, i, name));
        if !known {
            let mut found: Vec<String> =
                all.iter().filter(|a| a.found).map(|a| format!("{} ({})", a.family, a.module)).collect();
            found.push("unknown".into());
            anyhow::bail!("no allocator {name} in {at}: it has {}", found.join(", "));
        }
    }
    Ok(())
}

/// The processes a recording has allocations of, most first: `it has sort [12] (4,000
/// allocations), …`.
fn processes(summary: &Summary) -> String {
    // Not pid 0: kernel allocations in interrupts, no process's.
    let mut pids: Vec<(u32, u64)> =
        summary.allocs_by_pid.iter().filter(|&(&p, _)| p != 0).map(|(&p, &n)| (p, n)).collect();
    if pids.is_empty() {
        return "it has no process's allocations".into();
    }
    pids.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    let more = if pids.len() > 8 { format!(" and {} more", pids.len() - 8) } else { String::new() };
    let named: Vec<String> = pids
        .iter()
        .take(8)
        .map(|&(pid, n)| {
            let comm = summary.comms.get(&pid).map_or("?", String::as_str);
            format!("{comm} [{pid}] ({})", crate::units::counted(n, "allocation", "allocations"))
        })
        .collect();
    format!("it has {}{more}", named.join(", "))
}

/// The report as `opts.format` asks, ending in a newline.
pub fn render(summary: &Summary, opts: &ReportOptions) -> anyhow::Result<String> {
    Ok(match opts.format {
        Format::Text => render_text(summary, opts),
        Format::Json => render_json(summary, opts)? + "\n",
        Format::Html => anyhow::bail!("the HTML report is written to a file: --format html -o report.html"),
    })
}
