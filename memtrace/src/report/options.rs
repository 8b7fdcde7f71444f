//! What a report is asked for: output format, grouping and filters, sort order, how many
//! rows, leaks, and the text layout (terminal width, `--wide`, `--fields`).
use std::time::Duration;

use clap::ValueEnum;

use crate::{
    columns::Layout,
    grouping::{Filters, GroupBy},
};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum Format {
    #[default]
    Text,
    Json,
    /// One self-contained page (charts, flame graphs, tables); with `-o FILE`.
    Html,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Default)]
pub enum SortKey {
    Allocs,
    Frees,
    /// Bytes requested.
    Req,
    /// Bytes allocated.
    #[default]
    Alloc,
    /// Bytes lost to internal fragmentation (allocated − requested).
    Wasted,
    /// Fragmentation percentage.
    Frag,
    /// Live bytes at the end.
    Live,
    LiveAllocs,
    /// Bytes live at the moment of the domain's peak (heaptrack's "peak").
    Peak,
    /// Most bytes the row had live at once (at any moment, its own high).
    MaxLive,
    /// Median lifetime of freed blocks.
    P50,
    P99,
    /// Temporary allocations.
    Temp,
    /// Kernel blocks freed on another CPU.
    OtherCpu,
    /// Frees seen without their allocation (counted in the summary only).
    Unmatched,
    /// With --leaks: the oldest block first.
    Age,
}

impl SortKey {
    /// The column showing the figure sorted by (none for `unmatched`).
    pub fn column(self) -> Option<ReportColumn> {
        Some(match self {
            Self::Allocs => ReportColumn::Allocs,
            Self::Frees => ReportColumn::Frees,
            Self::Req => ReportColumn::Req,
            Self::Alloc => ReportColumn::Alloc,
            Self::Wasted => ReportColumn::Wasted,
            Self::Frag => ReportColumn::Frag,
            Self::Live => ReportColumn::Live,
            Self::LiveAllocs => ReportColumn::LiveAllocs,
            Self::Peak => ReportColumn::Peak,
            Self::MaxLive => ReportColumn::MaxLive,
            Self::P50 => ReportColumn::P50,
            Self::P99 => ReportColumn::P99,
            Self::Temp => ReportColumn::Temp,
            Self::OtherCpu => ReportColumn::OtherCpu,
            Self::Unmatched | Self::Age => return None,
        })
    }

    /// What rows sorted by this key are sorted by, in words.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Allocs => "allocations",
            Self::Frees => "frees",
            Self::Req => "bytes requested",
            Self::Alloc | Self::Unmatched => "bytes allocated",
            Self::Wasted => "bytes wasted",
            Self::Frag => "fragmentation",
            Self::Live => "live bytes",
            Self::LiveAllocs => "live blocks",
            Self::Peak => "bytes live at the peak",
            Self::MaxLive => "most live bytes at once",
            Self::P50 => "median lifetime",
            Self::P99 => "99th-percentile lifetime",
            Self::Temp => "temporary allocations",
            Self::OtherCpu => "frees on another CPU",
            Self::Age => "age",
        }
    }

    /// What leak rows sorted by this key are sorted by (`--leaks` has blocks, bytes and
    /// ages).
    pub fn describe_leaks(self) -> &'static str {
        match self {
            Self::Allocs | Self::LiveAllocs | Self::Frees | Self::Temp => "blocks",
            Self::Req | Self::Live | Self::Peak | Self::MaxLive => "bytes requested",
            Self::Wasted => "bytes wasted",
            Self::Frag => "fragmentation",
            Self::Age | Self::P50 | Self::P99 => "age, oldest first",
            Self::Alloc | Self::OtherCpu | Self::Unmatched => "bytes allocated",
        }
    }
}

/// The figures of the text report's table, for `--fields` (named as for `--sort`). The
/// domain (U/K) comes first and the name of the row last, always.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, ValueEnum)]
pub enum ReportColumn {
    /// ALLOCS: allocations.
    Allocs,
    /// FREES: frees.
    Frees,
    /// REQUESTED: bytes requested.
    Req,
    /// ALLOCATED: bytes allocated.
    Alloc,
    /// REQ/CALL: bytes requested per allocation.
    ReqPerCall,
    /// ALLOC/CALL: bytes allocated per allocation.
    AllocPerCall,
    /// FRAG: internal fragmentation, percent.
    Frag,
    /// WASTED: bytes allocated but not requested.
    Wasted,
    /// LIVE: blocks live at the end.
    LiveAllocs,
    /// LIVE BYTES: bytes live at the end.
    Live,
    /// PEAK: bytes live at the moment of the domain's peak.
    Peak,
    /// MAX LIVE: most bytes live at once (the row's own high).
    MaxLive,
    /// LIFE p50: median lifetime of the blocks freed.
    P50,
    /// LIFE p99.
    P99,
    /// TEMP: blocks freed before their thread allocated again.
    Temp,
    /// OTHER CPU: kernel blocks freed on another CPU.
    OtherCpu,
}

impl ReportColumn {
    /// Every column, in display order.
    pub const ALL: [Self; 16] = [
        Self::Allocs,
        Self::Frees,
        Self::Req,
        Self::Alloc,
        Self::ReqPerCall,
        Self::AllocPerCall,
        Self::Frag,
        Self::Wasted,
        Self::LiveAllocs,
        Self::Live,
        Self::Peak,
        Self::MaxLive,
        Self::P50,
        Self::P99,
        Self::Temp,
        Self::OtherCpu,
    ];

    pub fn header(self) -> &'static str {
        match self {
            Self::Allocs => "ALLOCS",
            Self::Frees => "FREES",
            Self::Req => "REQUESTED",
            Self::Alloc => "ALLOCATED",
            Self::ReqPerCall => "REQ/CALL",
            Self::AllocPerCall => "ALLOC/CALL",
            Self::Frag => "FRAG",
            Self::Wasted => "WASTED",
            Self::LiveAllocs => "LIVE",
            Self::Live => "LIVE BYTES",
            Self::Peak => "PEAK",
            Self::MaxLive => "MAX LIVE",
            Self::P50 => "LIFE p50",
            Self::P99 => "LIFE p99",
            Self::Temp => "TEMP",
            Self::OtherCpu => "OTHER CPU",
        }
    }

    /// Which columns stay when the terminal is narrow: lower first (after the domain and
    /// the column sorted by).
    pub fn rank(self) -> usize {
        match self {
            Self::Allocs => 2,
            Self::Alloc => 3,
            Self::Req => 4,
            Self::Live => 5,
            Self::Wasted => 6,
            Self::Frag => 7,
            Self::Frees => 8,
            Self::Peak => 9,
            Self::LiveAllocs => 10,
            Self::AllocPerCall => 11,
            Self::ReqPerCall => 12,
            Self::P50 => 13,
            Self::P99 => 14,
            Self::Temp => 15,
            Self::OtherCpu => 16,
            Self::MaxLive => 17,
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct ReportOptions {
    pub format: Format,
    pub by: GroupBy,
    pub filters: Filters,
    pub sort: SortKey,
    pub top: Option<usize>,
    pub leaks: bool,
    pub older_than: Option<Duration>,
    /// With `GroupBy::Stack`: keep each process's share of a stack apart (exports put
    /// the process name at the root of every stack).
    pub split_processes: bool,
    /// Width and columns of the text report.
    pub layout: Layout<ReportColumn>,
    /// Follow each row's live bytes over time (`--timeline`; the text report then draws them).
    pub timeline: bool,
    /// The text report shows the size histograms (`--histogram`).
    pub histogram: bool,
    /// The allocation wrappers a site is named past (`--alloc-fn`).
    pub alloc_fns: crate::wrappers::AllocFns,
    /// Leave each row's frames unnamed (empty): the caller names one row at a time from
    /// `Summary::stacks` and lets it go (a folded export of a deep Python recording held
    /// all 11 million of its frames at once, 870 MB).
    pub rows_unnamed: bool,
    /// Rows of one name stay named alike, without the offset that tells them apart
    /// (`sites::disambiguate`): `diff` matches rows by name across builds, where addresses
    /// move, so twins are one row there and an offset in its name would be one of theirs.
    pub labels_without_addresses: bool,
}
