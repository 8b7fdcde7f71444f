//! The tables of the HTML report: the summary per domain, the top sites (sortable by the
//! page's script: each cell carries its number) with Frag %, and the size histograms.
use std::fmt::Write as _;

use super::escape;
use crate::{
    analysis::{Domain, Stats, Totals, sizes::SizeHistogram},
    grouping::domain_name,
    report::{Summary, sizes::size_class},
    units::{bytes, count, duration, percent},
};

/// Sites listed, at most.
pub const MAX_SITES: usize = 100;

/// A numeric cell: shown as `text`, sorted by `value`.
fn num(value: impl std::fmt::Display, text: &str) -> String {
    format!("<td class=\"num\" data-value=\"{value}\">{}</td>", escape(text))
}

/// The totals of each domain, with its peak.
pub fn summary(a: &Summary, domains: &[Domain]) -> String {
    let mut out = String::from(
        "<table class=\"totals\">\n<thead><tr><th></th><th>allocations</th><th>frees</th><th>requested</th>\
         <th>allocated</th><th>frag</th><th>wasted</th><th>live at the end</th><th>peak</th><th>peak at</th>\
         <th>frees without allocation</th></tr></thead>\n<tbody>\n",
    );
    for d in domains {
        let Some(Totals { stats: s, unmatched_frees, .. }) = a.totals.get(d) else {
            continue;
        };
        let peak_at = a.memory.peaks.get(d).map_or_else(|| "-".into(), |p| duration(a.memory.since_start(p.ts_ns)));
        let _ = writeln!(
            out,
            "<tr><th><span class=\"swatch {n}\"></span>{n}</th><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{} in {} blocks</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            count(s.allocs),
            count(s.frees),
            bytes(s.bytes_req),
            bytes(s.bytes_alloc),
            percent(s.frag_pct()),
            bytes(s.wasted()),
            bytes(s.live_bytes_req),
            count(s.live_allocs),
            bytes(s.peak_live_bytes_req),
            peak_at,
            count(*unmatched_frees),
            n = domain_name(*d),
        );
    }
    out.push_str("</tbody>\n</table>\n");
    out
}

fn site_cells(s: &Stats) -> String {
    [
        num(s.allocs, &count(s.allocs)),
        num(s.bytes_req, &bytes(s.bytes_req)),
        num(s.bytes_alloc, &bytes(s.bytes_alloc)),
        num(format!("{:.2}", s.frag_pct()), &percent(s.frag_pct())),
        num(s.wasted(), &bytes(s.wasted())),
        num(s.live_bytes_req, &bytes(s.live_bytes_req)),
        num(s.live_bytes_req_at_peak, &bytes(s.live_bytes_req_at_peak)),
        num(s.temporary, &count(s.temporary)),
    ]
    .concat()
}

/// The first sites of the report (as sorted), each with its whole stack on hover.
pub fn sites(a: &Summary) -> String {
    let mut out = String::from(
        "<table class=\"sites sortable\">\n<thead><tr><th data-sort=\"text\">domain</th><th>allocations</th>\
         <th>requested</th><th>allocated</th><th>frag %</th><th>wasted</th><th>leaked</th><th>at peak</th>\
         <th>temporary</th><th data-sort=\"text\">site</th></tr></thead>\n<tbody>\n",
    );
    for g in a.groups.iter().take(MAX_SITES) {
        let stack: Vec<String> = crate::export::row_frames(a, g)
            .iter()
            .map(|f| format!("{}{f}", if f.kernel { "[k] " } else { "" }))
            .collect();
        let _ = writeln!(
            out,
            "<tr><td data-value=\"{d}\"><span class=\"swatch {d}\"></span>{d}</td>{}<td class=\"site\" title=\"{}\">{}</td></tr>",
            site_cells(&g.stats),
            escape(&stack.join("\n")),
            escape(&g.label),
            d = domain_name(g.domain),
        );
    }
    out.push_str("</tbody>\n</table>\n");
    if a.groups.len() > MAX_SITES {
        let _ = writeln!(out, "<p class=\"note\">The first {MAX_SITES} of {} sites.</p>", a.groups.len());
    }
    out
}

/// One domain's size histogram, with bars.
pub fn histogram(domain: Domain, h: &SizeHistogram) -> String {
    let max = h.bins().map(|b| b.allocs).max().unwrap_or(0).max(1);
    let mut out = format!(
        "<table class=\"histogram\" data-domain=\"{}\">\n<thead><tr><th>requested size</th><th>allocations</th><th></th>\
         <th>requested</th><th>allocated</th><th>frag %</th></tr></thead>\n<tbody>\n",
        domain_name(domain)
    );
    for b in h.bins() {
        let _ = writeln!(
            out,
            "<tr><td>{}</td><td class=\"num\">{}</td><td class=\"bar\"><span class=\"{}\" style=\"width:{:.1}%\"></span></td><td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td></tr>",
            escape(&size_class(b)),
            count(b.allocs),
            domain_name(domain),
            100.0 * b.allocs as f64 / max as f64,
            bytes(b.bytes_req),
            bytes(b.bytes_alloc),
            percent(b.frag_pct()),
        );
    }
    out.push_str("</tbody>\n</table>\n");
    out
}
