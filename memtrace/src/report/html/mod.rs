//! `report --format html`: one self-contained page to read offline or attach to a ticket —
//! the summary, memory over time with the peak marked ([`chart`], plotters), interactive
//! flame graphs of allocations, bytes, live at peak and leaked per domain ([`flames`],
//! inferno), the top sites with Frag % and the size histograms ([`tables`]). Scripts,
//! styles and data are inline; a Content-Security-Policy forbids any fetch.
pub mod chart;
pub mod flames;
pub mod tables;

use std::{fmt::Write as _, path::Path};

use anyhow::Result;

use super::{ReportOptions, Summary, analyze};
use crate::{
    analysis::Domain,
    grouping::{GroupBy, domain_name},
    units::{count, duration},
};

const CSS: &str = include_str!("page.css");
const SCRIPT: &str = include_str!("page.js");

/// Text as HTML (element content or a quoted attribute).
pub fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// JSON that is safe inside a `<script>` element: no `<` at all (it cannot end the element).
fn script_json(value: &impl serde::Serialize) -> Result<String> {
    Ok(serde_json::to_string(value)?.replace('<', "\\u003c"))
}

/// What was traced, on one line.
fn describe(a: &Summary) -> String {
    let m = &a.meta;
    let target = match m.mode.as_str() {
        "command" => format!("command `{}`", m.target_command.join(" ")),
        "pid" => format!("pid {}", m.target_pids.first().copied().unwrap_or(0)),
        _ => "the whole machine".into(),
    };
    format!(
        "{target} on {}, kernel {}: {} of events, {} events, {} lost",
        m.hostname,
        m.kernel_release,
        duration(a.duration_ns),
        count(a.events),
        count(a.stats.lost_events)
    )
}

/// The page for the recording at `input`: its sites as `opts` asks (grouping, filters,
/// sort), its stacks for the flame graphs.
pub fn render_html(input: &Path, opts: &ReportOptions) -> Result<String> {
    // Rows named only for the first sites the table shows (`tables::sites`).
    let sites = analyze(input, &ReportOptions { timeline: true, rows_unnamed: true, ..opts.clone() })?;
    super::check_filters(&sites, &opts.filters, input)?;
    let stacks_opts = ReportOptions {
        by: GroupBy::Stack,
        split_processes: true,
        filters: opts.filters.clone(),
        // Each row is named as it is folded (all at once: 1 GB for a deep Python recording).
        rows_unnamed: true,
        ..Default::default()
    };
    let stacks = analyze(input, &stacks_opts)?;
    page(&sites, stacks, opts)
}

/// The page, from the report's summary and its stacks' (whose rows the flame graphs take).
pub fn page(sites: &Summary, mut stacks: Summary, opts: &ReportOptions) -> Result<String> {
    let domains: Vec<Domain> = sites.totals.keys().copied().filter(|d| opts.filters.domain.admits(*d)).collect();
    let flames = flames::flames(&mut stacks, &domains)?;
    let title = format!("memtrace report: {}", describe(sites));
    let mut out = String::with_capacity(1 << 20);
    let _ = writeln!(
        out,
        "<!DOCTYPE html>\n<!-- memtrace report: self-contained, reads nothing from the network -->\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:\">\n<meta name=\"generator\" content=\"memtrace {}\">\n<title>{}</title>\n<style>\n{CSS}</style>\n</head>\n<body>",
        env!("CARGO_PKG_VERSION"),
        escape(&title),
    );
    let _ = writeln!(out, "<header>\n<h1>memtrace report</h1>\n<p class=\"target\">{}</p>", escape(&describe(sites)));
    for w in &sites.warnings {
        let _ = writeln!(out, "<p class=\"warning\">warning: {}</p>", escape(w));
    }
    out.push_str("<div id=\"errors\" hidden></div>\n</header>\n");

    let _ = writeln!(out, "<section id=\"summary\">\n<h2>Summary</h2>\n{}</section>", tables::summary(sites, &domains));
    let _ = writeln!(
        out,
        "<section id=\"memory\">\n<h2>Memory over time</h2>\n{}</section>",
        chart::charts(&sites.memory, |d| domains.contains(&d))?
    );

    out.push_str("<section id=\"flamegraphs\">\n<h2>Flame graphs</h2>\n<div class=\"controls\">\n<div class=\"tabs\" role=\"tablist\">");
    for (id, name, _) in flames::VIEWS {
        let _ = write!(out, "<button type=\"button\" role=\"tab\" data-view=\"{id}\">{name}</button>");
    }
    out.push_str("</div>\n<div class=\"domains\" role=\"tablist\">");
    for d in &domains {
        let _ = write!(out, "<button type=\"button\" role=\"tab\" data-domain=\"{0}\">{0}</button>", domain_name(*d));
    }
    out.push_str(
        "</div>\n</div>\n<p class=\"note\">Widths are the figure named on the tab; click a frame to zoom, \
         Search (or Ctrl+F in the graph) to highlight; kernel frames end in <code>_[k]</code>.</p>\n\
         <iframe id=\"flame\" title=\"flame graph\"></iframe>\n<p id=\"flame-empty\" class=\"empty\" hidden></p>\n</section>\n",
    );

    let sorted = clap::ValueEnum::to_possible_value(&opts.sort).map(|v| v.get_name().to_string()).unwrap_or_default();
    let _ = writeln!(
        out,
        "<section id=\"sites\">\n<h2>Top {}</h2>\n<p class=\"note\">In the order of <code>--sort {sorted}</code> (click a heading to sort by it). Leaked: bytes still live at the end; at peak: bytes live at the moment of the domain's peak.</p>\n{}</section>",
        sites.by.plural(),
        tables::sites(sites)
    );
    out.push_str("<section id=\"sizes\">\n<h2>Requested sizes</h2>\n");
    for d in &domains {
        if let Some(t) = sites.totals.get(d).filter(|t| !t.stats.sizes.is_empty()) {
            let _ = writeln!(out, "<h3>{}</h3>\n{}", domain_name(*d), tables::histogram(*d, &t.stats.sizes));
        }
    }
    out.push_str("</section>\n");
    let _ = writeln!(
        out,
        "<footer>memtrace {}</footer>\n<script type=\"application/json\" id=\"flamegraph-data\">{}</script>\n<script>\n{SCRIPT}</script>\n</body>\n</html>",
        env!("CARGO_PKG_VERSION"),
        script_json(&flames)?
    );
    Ok(out)
}

#[cfg(test)]
mod tests;
