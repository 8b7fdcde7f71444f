//! The flame graphs of the HTML report, drawn by inferno (its interactive SVG: zoom on
//! click, search, details on hover): allocations, bytes requested, bytes live at the peak
//! and bytes leaked (live at the end), one set per domain. Each SVG is kept as a string in
//! the page's data and shown by the page's script in a frame of its own (inferno's script
//! expects a document to itself).
use std::collections::BTreeMap;

use anyhow::Result;
use base64::Engine as _;
use serde::Serialize;

use crate::{
    analysis::Domain,
    export::{Weight, draw_svg, folded_line},
    grouping::domain_name,
    report::{GroupRow, Summary},
    units::{bytes, duration},
};

/// The flame graphs offered, in order: (id, tab name, weight).
pub const VIEWS: [(&str, &str, Weight); 4] = [
    ("allocs", "Allocations", Weight::Allocs),
    ("bytes", "Bytes", Weight::Bytes),
    ("peak", "Live at peak", Weight::Peak),
    ("leaked", "Leaked", Weight::Live),
];

/// One flame graph, or why there is none.
#[derive(Serialize)]
pub struct Flame {
    /// The SVG, without its XML prologue (the page puts it in an HTML document), deflated
    /// (zlib) and in base64: the page inflates it (`DecompressionStream`) when it is
    /// shown. Inferno's SVGs repeat themselves: the heavy Python bench's twelve took 36 MB
    /// of page as text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub svgz: Option<String>,
    /// Its height in pixels.
    pub height: u32,
    pub empty: Option<String>,
}

/// `svg` deflated (zlib, as the browser's `DecompressionStream("deflate")` reads it), in
/// base64.
fn packed(svg: &str) -> Result<String> {
    use std::io::Write as _;
    let mut z = flate2::write::ZlibEncoder::new(Vec::with_capacity(svg.len() / 8), flate2::Compression::default());
    z.write_all(svg.as_bytes())?;
    Ok(base64::engine::general_purpose::STANDARD.encode(z.finish()?))
}

/// The SVG a page's `svgz` holds (for tests).
#[cfg(test)]
pub fn unpacked(svgz: &str) -> String {
    use std::io::Read as _;
    let bytes = base64::engine::general_purpose::STANDARD.decode(svgz).expect("base64");
    let mut svg = String::new();
    flate2::read::ZlibDecoder::new(&bytes[..]).read_to_string(&mut svg).expect("zlib");
    svg
}

/// The SVG from its `<svg` on, and its height.
fn body(svg: &str) -> (String, u32) {
    let start = svg.find("<svg").unwrap_or(0);
    let svg = svg[start..].to_string();
    let tag_end = svg.find('>').unwrap_or(svg.len());
    let height = svg[..tag_end]
        .split("height=\"")
        .nth(1)
        .and_then(|h| h.split('"').next())
        .and_then(|h| h.parse().ok())
        .unwrap_or(400);
    (svg, height)
}

/// A flame graph of the domain's rows, whose folded stacks are `folded` (made once for
/// every view: on a big recording they took most of the page's time).
fn flame(stacks: &Summary, folded: &[(&GroupRow, String)], domain: Domain, weight: Weight) -> Result<Flame> {
    let (what, _) = weight.describe();
    let mut merged: BTreeMap<&str, u64> = BTreeMap::new();
    for (row, line) in folded {
        let value = weight.of(&row.stats);
        if value > 0 {
            *merged.entry(line.as_str()).or_insert(0) += value;
        }
    }
    let lines: Vec<String> = merged.into_iter().map(|(s, v)| format!("{s} {v}")).collect();
    if lines.is_empty() {
        return Ok(Flame {
            svgz: None,
            height: 0,
            empty: Some(format!("No {} stack has any {what}.", domain_name(domain))),
        });
    }
    let subtitle = match weight {
        Weight::Peak => stacks.memory.peaks.get(&domain).map(|p| {
            format!(
                "at the {} peak: {} live, {} into the recording",
                domain_name(domain),
                bytes(p.live_bytes_req),
                duration(stacks.memory.since_start(p.ts_ns))
            )
        }),
        Weight::Live => Some("blocks never freed: still live when the recording (or their process) ended".into()),
        _ => None,
    };
    let mut svg = Vec::new();
    draw_svg(&lines, weight, &format!("{} {what}", domain_name(domain)), subtitle, &mut svg)?;
    let (svg, height) = body(&String::from_utf8_lossy(&svg));
    Ok(Flame { svgz: Some(packed(&svg)?), height, empty: None })
}

/// Every flame graph: domain → view id → flame graph.
pub fn flames(stacks: &Summary, domains: &[Domain]) -> Result<BTreeMap<&'static str, BTreeMap<&'static str, Flame>>> {
    let mut out = BTreeMap::new();
    for &domain in domains {
        let folded: Vec<(&GroupRow, String)> =
            stacks.groups.iter().filter(|r| r.domain == domain).map(|r| (r, folded_line(stacks, r))).collect();
        let mut views = BTreeMap::new();
        for (id, _, weight) in VIEWS {
            views.insert(id, flame(stacks, &folded, domain, weight)?);
        }
        out.insert(domain_name(domain), views);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_svg_is_cut_from_its_tag_on() {
        let (svg, height) = body(
            "<?xml version=\"1.0\"?><!DOCTYPE svg><svg version=\"1.1\" width=\"1200\" height=\"342\" onload=\"init(evt)\"><g/></svg>",
        );
        assert!(svg.starts_with("<svg version"));
        assert_eq!(height, 342);
    }
}
