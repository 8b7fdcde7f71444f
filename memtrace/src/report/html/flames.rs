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
    report::Summary,
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

/// A domain's distinct folded stacks, each with its weight in every view (made once for
/// every view: on a big recording they took most of the page's time, and one copy of
/// them per view most of its memory).
type Folded = Vec<(String, [u64; VIEWS.len()])>;

/// The flame graph of view `view` of the domain's stacks `folded`.
fn flame(stacks: &Summary, folded: &mut Folded, domain: Domain, view: usize) -> Result<Flame> {
    let weight = VIEWS[view].2;
    let (what, _) = weight.describe();
    if folded.iter().all(|(_, w)| w[view] == 0) {
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
    // Each line's weight written after it for this view, and taken off after.
    let lengths: Vec<usize> = folded.iter().map(|(line, _)| line.len()).collect();
    for (line, w) in folded.iter_mut() {
        use std::fmt::Write as _;
        let _ = write!(line, " {}", w[view]);
    }
    let mut svg = Vec::new();
    let drawn = draw_svg(
        folded.iter().filter(|(_, w)| w[view] > 0).map(|(line, _)| line.as_str()),
        weight,
        &format!("{} {what}", domain_name(domain)),
        subtitle,
        &mut svg,
    );
    for ((line, _), len) in folded.iter_mut().zip(lengths) {
        line.truncate(len);
    }
    drawn?;
    let (svg, height) = body(&String::from_utf8_lossy(&svg));
    Ok(Flame { svgz: Some(packed(&svg)?), height, empty: None })
}

/// Every flame graph: domain → view id → flame graph. The rows of `stacks` are taken:
/// each one's frames (named now when the analysis left them unnamed) are let go once its
/// folded stack is made.
pub fn flames(
    stacks: &mut Summary,
    domains: &[Domain],
) -> Result<BTreeMap<&'static str, BTreeMap<&'static str, Flame>>> {
    let mut by_domain: BTreeMap<Domain, BTreeMap<String, [u64; VIEWS.len()]>> = BTreeMap::new();
    for row in std::mem::take(&mut stacks.groups) {
        if !domains.contains(&row.domain) {
            continue;
        }
        let weights = VIEWS.map(|(_, _, weight)| weight.of(&row.stats));
        if weights.iter().all(|&w| w == 0) {
            continue;
        }
        let sum = by_domain.entry(row.domain).or_default().entry(folded_line(stacks, &row)).or_default();
        for (s, w) in sum.iter_mut().zip(weights) {
            *s += w;
        }
    }
    let mut out = BTreeMap::new();
    for &domain in domains {
        let mut folded: Folded = by_domain.remove(&domain).unwrap_or_default().into_iter().collect();
        let mut views = BTreeMap::new();
        for (i, (id, _, _)) in VIEWS.iter().enumerate() {
            views.insert(*id, flame(stacks, &mut folded, domain, i)?);
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
