//! What a row of `top` shows, for both views: the summary lines, the columns (header,
//! minimum width, priority when the width is short) and their cells, and which columns fit.
use super::model::{Column, Row, Snapshot};
use crate::{
    columns::{
        ColumnChoice, Layout, NAME_FIT_WIDTH, NAME_MIN_WIDTH, TextColumn, TextTable, Width, fit, flow, width_of, wrap,
    },
    grouping::{GroupBy, domain_letter},
    units::{bytes, bytes_per_sec, count, percent, rate, signed_bytes},
};

impl Column {
    /// Every column, in display order.
    pub const DISPLAY: [Column; 7] =
        [Self::AllocsPerSec, Self::BytesPerSec, Self::LiveAllocs, Self::Live, Self::Frag, Self::Growth, Self::Allocs];

    pub fn header(self) -> &'static str {
        match self {
            Self::AllocsPerSec => "ALLOCS/s",
            Self::BytesPerSec => "BYTES/s",
            Self::LiveAllocs => "LIVE",
            Self::Live => "LIVE BYTES",
            Self::Frag => "FRAG",
            Self::Growth => "GROWTH",
            Self::Allocs => "ALLOCS",
        }
    }

    /// Width in the full-screen view (wider when a figure needs it), so that columns do
    /// not move at every refresh.
    pub fn min_width(self) -> usize {
        match self {
            Self::AllocsPerSec => 8,
            Self::BytesPerSec => 11,
            Self::LiveAllocs => 8,
            Self::Live => 10,
            Self::Frag => 6,
            Self::Growth => 11,
            Self::Allocs => 10,
        }
    }

    /// Which columns stay when the width is short: lower first (the column sorted by comes
    /// before all of them).
    pub fn rank(self) -> usize {
        match self {
            Self::BytesPerSec => 2,
            Self::AllocsPerSec => 3,
            Self::Live => 4,
            Self::Growth => 5,
            Self::Frag => 6,
            Self::Allocs => 7,
            Self::LiveAllocs => 8,
        }
    }

    pub fn cell(self, r: &Row) -> String {
        match self {
            Self::AllocsPerSec => rate(r.allocs_per_sec),
            Self::BytesPerSec => bytes_per_sec(r.bytes_per_sec),
            Self::LiveAllocs => count(r.stats.live_allocs),
            Self::Live => bytes(r.stats.live_bytes_req),
            Self::Frag => percent(r.stats.frag_pct()),
            Self::Growth => signed_bytes(r.growth),
            Self::Allocs => count(r.stats.allocs),
        }
    }
}

/// `U`, `R` or `K`.
pub fn domain_cell(r: &Row) -> String {
    domain_letter(r.domain).into()
}

/// Header of the name column.
pub fn names_header(by: GroupBy) -> &'static str {
    by.header()
}

/// The summary lines shared by both views, flowed to `width`: the title, the figures, and
/// the live-block table's state.
pub fn summary(s: &Snapshot, title: &str, status: &str, width: Width) -> Vec<String> {
    let live: u64 = s.totals.values().map(|t| t.stats.live_bytes_req).sum();
    let live_blocks: u64 = s.totals.values().map(|t| t.stats.live_allocs).sum();
    let alloc: u64 = s.totals.values().map(|t| t.stats.bytes_alloc).sum();
    let req: u64 = s.totals.values().map(|t| t.stats.bytes_req).sum();
    let frag = if alloc == 0 { 0.0 } else { 100.0 - 100.0 * req as f64 / alloc as f64 };
    let mut title_items = vec![title.to_string()];
    if !status.trim().is_empty() {
        title_items.push(status.trim().to_string());
    }
    let mut lines = flow(&title_items, width);
    lines.extend(flow(
        &[
            format!("allocs {}/s", rate(s.allocs_per_sec)),
            format!("frees {}/s", rate(s.frees_per_sec)),
            format!("{} requested", bytes_per_sec(s.bytes_per_sec)),
            format!("live {} ({} blocks)", bytes(live), count(live_blocks)),
            format!("wasted {} ({})", bytes(alloc.saturating_sub(req)), percent(frag)),
            format!("lost {}", count(s.lost_events)),
        ],
        width,
    ));
    if s.untracked > 0 {
        lines.extend(wrap(
            &format!(
                "live-block table full ({} blocks): {} allocations counted but not followed; live figures undercount",
                count(s.live_limit as u64),
                count(s.untracked)
            ),
            width,
        ));
    }
    lines
}

/// A column's rank, the one sorted by first.
fn rank(c: Column, sorted: Column) -> usize {
    if c == sorted { 1 } else { c.rank() }
}

/// The batch view's table: the domain, the figures that fit, the names.
pub fn text_table(rows: &[Row], by: GroupBy, sorted: Column, layout: &Layout<Column>) -> TextTable {
    let mut columns = vec![TextColumn::new("", 0, rows.iter().map(domain_cell).collect())];
    for c in layout.candidates(&Column::DISPLAY) {
        columns.push(TextColumn::new(c.header(), rank(c, sorted), rows.iter().map(|r| c.cell(r)).collect()));
    }
    TextTable {
        columns,
        names: Some((names_header(by).into(), rows.iter().map(|r| r.label.clone()).collect())),
        keep_all: !matches!(layout.columns, ColumnChoice::Fit),
    }
}

/// The full-screen table's columns: which (display order) and how wide, and the width
/// left for the names.
pub struct ScreenColumns {
    pub columns: Vec<(Column, usize)>,
    pub names_width: usize,
}

/// Spacing between the full-screen table's columns.
pub const SCREEN_SPACING: usize = 1;

/// Chooses the full-screen columns for a table `width` wide, of which `overhead` goes to
/// what is not a figure or a name (selection mark, domain column, spacing). The screen
/// bounds every choice, so columns that do not fit are left out, lowest priority first;
/// the names keep [`NAME_FIT_WIDTH`] by default, [`NAME_MIN_WIDTH`] with `--wide` or
/// `--fields` (less when every name is shorter).
pub fn screen_columns(
    rows: &[Row],
    by: GroupBy,
    sorted: Column,
    choice: &ColumnChoice<Column>,
    width: usize,
    overhead: usize,
) -> ScreenColumns {
    let layout = Layout { width: Width::Columns(width), columns: choice.clone() };
    let candidates = layout.candidates(&Column::DISPLAY);
    let widths: Vec<usize> = candidates
        .iter()
        .map(|c| rows.iter().map(|r| width_of(&c.cell(r))).chain([c.min_width(), c.header().len()]).max().unwrap_or(0))
        .collect();
    let ranks: Vec<usize> = candidates.iter().map(|c| rank(*c, sorted)).collect();
    let names = rows.iter().map(|r| width_of(&r.label)).max().unwrap_or(0).max(names_header(by).len());
    let reserve = names.min(if matches!(choice, ColumnChoice::Fit) { NAME_FIT_WIDTH } else { NAME_MIN_WIDTH });
    let kept = fit(&widths, &ranks, SCREEN_SPACING, width.saturating_sub(overhead + reserve));
    let used: usize = kept.iter().map(|&i| widths[i] + SCREEN_SPACING).sum();
    ScreenColumns {
        columns: kept.iter().map(|&i| (candidates[i], widths[i])).collect(),
        names_width: width.saturating_sub(overhead + used),
    }
}
