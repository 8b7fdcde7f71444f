//! The memory-over-time charts of the HTML report, drawn by plotters as inline SVG: one
//! chart per domain (their scales differ by orders of magnitude), live bytes as a step
//! area, the peak marked with a dashed line, a dot and its figures. The page's script
//! adds a hover read-out from the pixel range recorded on each chart.
use anyhow::{Result, anyhow};
use plotters::{
    prelude::*,
    style::text_anchor::{HPos, Pos, VPos},
};

use super::escape;
use crate::{
    analysis::Domain,
    grouping::domain_name,
    report::memory::MemoryView,
    units::{bytes, duration},
};

const WIDTH: u32 = 960;
const HEIGHT: u32 = 230;

/// A domain's colour, as the page's CSS uses it.
pub fn color(domain: Domain) -> RGBColor {
    match domain {
        Domain::User => RGBColor(0x2f, 0x6f, 0xb7),
        Domain::Kernel => RGBColor(0xd9, 0x6c, 0x23),
        Domain::Reserved => RGBColor(0x7a, 0x7a, 0x8c),
        Domain::Gpu => RGBColor(0x4e, 0x9a, 0x2f),
        Domain::GpuAddress => RGBColor(0x9a, 0xb8, 0x8c),
    }
}

/// The chart of one domain's series, as an SVG element wrapped in a `<figure>` that
/// carries what the hover read-out needs.
fn chart(m: &MemoryView, domain: Domain, series: &[u64]) -> Result<String> {
    let n = series.len().max(1);
    let span_s = (n as u64 * m.interval_ns) as f64 / 1e9;
    let top = series.iter().copied().max().unwrap_or(0).max(1) as f64 * 1.15;
    let c = color(domain);
    let peak = m.peaks.get(&domain).copied().unwrap_or_default();
    let peak_s = m.since_start(peak.ts_ns) as f64 / 1e9;
    let mut svg = String::new();
    let plot_x;
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow!("drawing the chart: {e}"))?;
        let mut chart = ChartBuilder::on(&root)
            .margin(12)
            .x_label_area_size(28)
            .y_label_area_size(78)
            .build_cartesian_2d(0f64..span_s, 0f64..top)
            .map_err(|e| anyhow!("drawing the chart: {e}"))?;
        chart
            .configure_mesh()
            .x_labels(10)
            .y_labels(5)
            .x_label_formatter(&|x| duration((x * 1e9) as u64))
            .y_label_formatter(&|y| bytes(*y as u64))
            .light_line_style(RGBColor(0xee, 0xee, 0xee))
            .draw()
            .map_err(|e| anyhow!("drawing the chart: {e}"))?;
        // Steps: each interval holds its value for its whole length.
        let step = m.interval_ns as f64 / 1e9;
        let points = series
            .iter()
            .enumerate()
            .flat_map(|(i, &v)| [(i as f64 * step, v as f64), ((i + 1) as f64 * step, v as f64)]);
        chart
            .draw_series(AreaSeries::new(points, 0.0, c.mix(0.25)).border_style(c.stroke_width(2)))
            .map_err(|e| anyhow!("drawing the chart: {e}"))?;
        let y = peak.live_bytes_req as f64;
        chart
            .draw_series(DashedLineSeries::new(
                [(peak_s, 0.0), (peak_s, top)],
                6,
                4,
                RGBColor(0x99, 0x10, 0x10).stroke_width(1),
            ))
            .map_err(|e| anyhow!("drawing the chart: {e}"))?;
        chart
            .draw_series([Circle::new((peak_s, y), 5, RGBColor(0x99, 0x10, 0x10).filled())])
            .map_err(|e| anyhow!("drawing the chart: {e}"))?;
        let label = format!("peak {} at {}", bytes(peak.live_bytes_req), duration(m.since_start(peak.ts_ns)));
        let (px, _) = chart.backend_coord(&(peak_s, y));
        let right = px > WIDTH as i32 * 2 / 3;
        let anchor = Pos::new(if right { HPos::Right } else { HPos::Left }, VPos::Bottom);
        let style = TextStyle::from(("sans-serif", 14).into_font()).color(&RGBColor(0x99, 0x10, 0x10)).pos(anchor);
        let dx = if right { -8.0 } else { 8.0 } * span_s / WIDTH as f64;
        chart
            .draw_series([Text::new(label, (peak_s + dx, y), style)])
            .map_err(|e| anyhow!("drawing the chart: {e}"))?;
        plot_x = chart.plotting_area().get_pixel_range().0;
        root.present().map_err(|e| anyhow!("drawing the chart: {e}"))?;
    }
    let values: Vec<String> = series.iter().map(u64::to_string).collect();
    Ok(format!(
        "<figure class=\"chart\" data-domain=\"{d}\" data-width=\"{WIDTH}\" data-left=\"{}\" data-right=\"{}\" data-interval-ns=\"{}\" data-values=\"{}\" data-peak-interval=\"{}\">\n<figcaption>{} <span class=\"swatch {d}\"></span></figcaption>\n{svg}\n<div class=\"readout\" hidden></div>\n</figure>\n",
        plot_x.start,
        plot_x.end,
        m.interval_ns,
        values.join(" "),
        m.interval_of(peak.ts_ns),
        escape(&format!(
            "{} memory: live bytes requested (the most within each {} interval)",
            domain_name(domain),
            duration(m.interval_ns)
        )),
        d = domain_name(domain),
    ))
}

/// Every domain's chart.
pub fn charts(m: &MemoryView, admits: impl Fn(Domain) -> bool) -> Result<String> {
    let mut out = String::new();
    for (domain, series) in m.domains.iter().filter(|(d, s)| admits(**d) && s.iter().any(|&v| v > 0)) {
        out.push_str(&chart(m, *domain, series)?);
    }
    if out.is_empty() {
        out.push_str("<p class=\"empty\">Nothing was live at any time.</p>\n");
    }
    Ok(out)
}
