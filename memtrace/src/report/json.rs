//! The JSON report (`--format json`), for scripts and the integration tests: totals per
//! domain, losses, recorder figures, stack coverage, the recording's metadata, every group
//! with its frames, and the leaks when asked for. Field names and units are stable.
use std::collections::BTreeMap;

use anyhow::Result;
use serde::Serialize;

use super::{
    analyze::{GroupRow, Summary},
    json_memory::{self, JsonBin},
    options::ReportOptions,
};
use crate::{
    analysis::{Domain, Totals},
    grouping::{GroupBy, domain_name},
    stacks::Frame,
};

#[derive(Serialize)]
struct JsonTotals {
    allocs: u64,
    frees: u64,
    bytes_req: u64,
    bytes_alloc: u64,
    live_allocs: u64,
    live_bytes_req: u64,
    live_bytes_alloc: u64,
    frag_pct: f64,
    wasted: u64,
    peak_live_bytes_req: u64,
    unmatched_frees: u64,
    missed_frees: u64,
    allocator_frees: u64,
    inherited_frees: u64,
    temporary: u64,
    freed_on_other_cpu: u64,
    lifetime_p50_ns: Option<u64>,
    lifetime_p99_ns: Option<u64>,
    size_histogram: Vec<JsonBin>,
    /// GPU allocation calls that failed, and the bytes they asked for.
    #[serde(skip_serializing_if = "is_zero")]
    failed: u64,
    #[serde(skip_serializing_if = "is_zero")]
    failed_bytes_req: u64,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

impl JsonTotals {
    fn of(t: &Totals) -> Self {
        let s = &t.stats;
        Self {
            allocs: s.allocs,
            frees: s.frees,
            bytes_req: s.bytes_req,
            bytes_alloc: s.bytes_alloc,
            live_allocs: s.live_allocs,
            live_bytes_req: s.live_bytes_req,
            live_bytes_alloc: s.live_bytes_alloc,
            frag_pct: round2(s.frag_pct()),
            wasted: s.wasted(),
            peak_live_bytes_req: s.peak_live_bytes_req,
            unmatched_frees: t.unmatched_frees,
            missed_frees: t.missed_frees,
            allocator_frees: t.allocator_frees,
            inherited_frees: t.inherited_frees,
            temporary: s.temporary,
            freed_on_other_cpu: s.freed_on_other_cpu,
            lifetime_p50_ns: s.lifetimes.quantile(0.5),
            lifetime_p99_ns: s.lifetimes.quantile(0.99),
            size_histogram: json_memory::size_histogram(&s.sizes),
            failed: s.failed,
            failed_bytes_req: s.failed_bytes_req,
        }
    }
}

fn round2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

#[derive(Serialize)]
struct JsonSite<'a> {
    domain: Domain,
    /// The stack in `frames` was cut before its outermost frame.
    truncated: bool,
    kinds: Vec<&'static str>,
    pids: &'a [u32],
    frames: &'a [Frame],
    allocs: u64,
    frees: u64,
    bytes_req: u64,
    bytes_alloc: u64,
    req_per_call: f64,
    alloc_per_call: f64,
    frag_pct: f64,
    wasted: u64,
    live_allocs: u64,
    live_bytes_req: u64,
    live_bytes_alloc: u64,
    peak_live_bytes_req: u64,
    lifetime_p50_ns: Option<u64>,
    lifetime_p99_ns: Option<u64>,
    temporary: u64,
    freed_on_other_cpu: u64,
    leaked_at_exit: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    process: Option<String>,
    /// `--by function`: the function the row stands for (a Python process's rows are its
    /// Python functions; `frames` is one of the row's stacks).
    #[serde(skip_serializing_if = "Option::is_none")]
    function: Option<String>,
    /// `--by site`: the row's name as the text report prints it: the site and the callers
    /// all its stacks share, then `[N callers]` where they part (`frames` is one of them).
    #[serde(skip_serializing_if = "Option::is_none")]
    site: Option<String>,
    /// Live at the moment of the domain's peak.
    live_bytes_req_at_peak: u64,
    live_allocs_at_peak: u64,
    size_histogram: Vec<JsonBin>,
    /// Live bytes per interval of `timeline` (the first sites, with `--timeline`).
    #[serde(skip_serializing_if = "Option::is_none")]
    timeline: Option<&'a [u64]>,
    /// User sites: the family of the allocator that served them.
    #[serde(skip_serializing_if = "Option::is_none")]
    allocator: Option<&'a str>,
    /// GPU sites: the devices allocated on, where the call names one.
    #[serde(skip_serializing_if = "<[i32]>::is_empty")]
    devices: &'a [i32],
    /// Kernel sites: the slab caches of their kmem_cache_alloc allocations, by name.
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    caches: &'a [String],
    /// GPU allocation calls from this site that failed, and the bytes they asked for.
    #[serde(skip_serializing_if = "is_zero")]
    failed: u64,
    #[serde(skip_serializing_if = "is_zero")]
    failed_bytes_req: u64,
}

#[derive(Serialize)]
struct JsonLeak<'a> {
    domain: Domain,
    frames: &'a [Frame],
    blocks: u64,
    bytes_req: u64,
    bytes_alloc: u64,
    oldest_age_ns: u64,
    pids: &'a [u32],
}

/// One row of `sites`, its frames as given (named for the row as it is written).
fn json_site<'a>(a: &'a Summary, g: &'a GroupRow, frames: &'a [Frame]) -> JsonSite<'a> {
    let s = &g.stats;
    let per_call = |v: u64| {
        if s.allocs == 0 { 0.0 } else { round2(v as f64 / s.allocs as f64) }
    };
    JsonSite {
        domain: g.domain,
        truncated: g.truncated,
        kinds: g.kinds.iter().map(|k| k.name()).collect(),
        pids: &g.pids,
        frames,
        allocs: s.allocs,
        frees: s.frees,
        bytes_req: s.bytes_req,
        bytes_alloc: s.bytes_alloc,
        req_per_call: per_call(s.bytes_req),
        alloc_per_call: per_call(s.bytes_alloc),
        frag_pct: round2(s.frag_pct()),
        wasted: s.wasted(),
        live_allocs: s.live_allocs,
        live_bytes_req: s.live_bytes_req,
        live_bytes_alloc: s.live_bytes_alloc,
        peak_live_bytes_req: s.peak_live_bytes_req,
        lifetime_p50_ns: s.lifetimes.quantile(0.5),
        lifetime_p99_ns: s.lifetimes.quantile(0.99),
        temporary: s.temporary,
        freed_on_other_cpu: s.freed_on_other_cpu,
        leaked_at_exit: s.leaked_at_exit,
        process: (a.by == GroupBy::Process).then(|| g.label.clone()),
        function: (a.by == GroupBy::Function).then(|| g.label.clone()),
        site: (a.by == GroupBy::Site).then(|| g.label.clone()),
        live_bytes_req_at_peak: s.live_bytes_req_at_peak,
        live_allocs_at_peak: s.live_allocs_at_peak,
        size_histogram: json_memory::size_histogram(&s.sizes),
        timeline: (!g.timeline.is_empty()).then_some(&g.timeline[..]),
        allocator: g.allocator.as_deref(),
        devices: &g.devices,
        caches: &g.caches,
        failed: s.failed,
        failed_bytes_req: s.failed_bytes_req,
    }
}

/// The rows of `sites`, each named as it is written when the analysis left them unnamed:
/// made into one JSON value, a report by stack of a deep Python recording (37,854 rows,
/// 11 M frames) took 12.5 GB.
struct Sites<'a>(&'a Summary);

impl Serialize for Sites<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq as _;
        let a = self.0;
        let mut seq = serializer.serialize_seq(Some(a.groups.len()))?;
        for g in &a.groups {
            let frames = crate::export::row_frames(a, g);
            // Through a value, one row at a time: its objects' fields in the order of their
            // names, as the report has always written them.
            let row = serde_json::to_value(json_site(a, g, &frames)).map_err(serde::ser::Error::custom)?;
            seq.serialize_element(&row)?;
        }
        seq.end()
    }
}

/// `leaks`, as [`Sites`] (each made into a value alone).
struct Leaks<'a>(&'a Summary);

impl Serialize for Leaks<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq as _;
        let mut seq = serializer.serialize_seq(Some(self.0.leaks.len()))?;
        for l in &self.0.leaks {
            let leak = JsonLeak {
                domain: l.domain,
                frames: &l.frames,
                blocks: l.blocks,
                bytes_req: l.bytes_req,
                bytes_alloc: l.bytes_alloc,
                oldest_age_ns: l.oldest_age_ns,
                pids: &l.pids,
            };
            seq.serialize_element(&serde_json::to_value(leak).map_err(serde::ser::Error::custom)?)?;
        }
        seq.end()
    }
}

/// A JSON object written as it is made: `value`'s entries in their order, with the entry
/// named `first.0` (and `second.0`) taken from a serializer that writes its rows one at a
/// time rather than from `value` (the report's sites and leaks, the comparison's rows).
pub(super) struct Spliced<A, B> {
    pub value: serde_json::Map<String, serde_json::Value>,
    pub first: (&'static str, A),
    pub second: Option<(&'static str, B)>,
}

impl<A: Serialize, B: Serialize> Serialize for Spliced<A, B> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap as _;
        let mut map = serializer.serialize_map(Some(self.value.len()))?;
        for (key, value) in &self.value {
            match &self.second {
                _ if key == self.first.0 => map.serialize_entry(key, &self.first.1)?,
                Some((name, second)) if key == name => map.serialize_entry(key, second)?,
                _ => map.serialize_entry(key, value)?,
            }
        }
        map.end()
    }
}

pub fn render_json(a: &Summary, opts: &ReportOptions) -> Result<String> {
    let mut out = Vec::new();
    write_json(a, opts, &mut out)?;
    Ok(String::from_utf8(out)?)
}

/// The JSON report written to `w` as it is made (see [`Sites`]). A failed write keeps its
/// kind (a closed pipe is not an error of the report's).
pub fn write_json(a: &Summary, opts: &ReportOptions, w: &mut dyn std::io::Write) -> std::io::Result<()> {
    let mut totals: BTreeMap<&str, JsonTotals> = a
        .totals
        .iter()
        .filter(|(d, _)| opts.filters.domain.admits(**d))
        .map(|(d, t)| (domain_name(*d), JsonTotals::of(t)))
        .collect();
    // Wherever user figures are, the reserved ones are too (zero when nothing was).
    if totals.contains_key("user") {
        totals.entry(domain_name(Domain::Reserved)).or_insert_with(|| JsonTotals::of(&Totals::default()));
    }
    // Apart: one `json!` of it all passed the macro's recursion limit.
    let recorder = serde_json::json!({
        "cpu_ns": a.stats.recorder_cpu_ns,
        "peak_rss_bytes": a.stats.recorder_peak_rss_bytes,
        "bpf_mapped_rss_bytes": a.stats.recorder_bpf_mapped_rss_bytes,
        "bpf_map_bytes": a.stats.bpf_map_bytes,
        "lost_sampled_live": a.stats.lost_sampled_live,
        "unwind_copies": a.stats.unwind_copies,
        "unwind_budget_truncated": a.stats.unwind_budget_truncated,
        "unwind_no_room_stacks": a.stats.unwind_no_room_stacks.len(),
        "unwind_copies_waited": a.stats.unwind_copies_waited,
        "unwind_copies_gave_up": a.stats.unwind_copies_gave_up,
        "unwind_copies_anchored": a.stats.unwind_copies_anchored,
        "unwind_copies_anchor_missed": a.stats.unwind_copies_anchor_missed,
        "unwind_copy_repeats": a.stats.unwind_copy_repeats,
        "unwind_copy_repeats_unmatched": a.stats.unwind_copy_repeats_unmatched,
        "unwind_late_task_records": a.stats.unwind_late_task_records,
        "unwind_tables": {
            "built": a.stats.unwind_tables_built,
            "from_cache": a.stats.unwind_tables_cached,
            "without_cfi": a.stats.unwind_tables_without_cfi,
            "over_cap": a.stats.unwind_tables_over_cap,
            "bytes": a.stats.unwind_table_bytes,
            "rows": a.stats.unwind_table_rows,
            "build_ms": a.stats.unwind_build_ms,
            "longest_build_ms": a.stats.unwind_longest_build_ms,
        },
        "unwind_frames": a.stats.unwind_frames,
        "unwind_cache_hits": a.stats.unwind_cache_hits,
        "unwind_frames_reused": a.stats.unwind_frames_reused,
        "kernel_stacks_reused": a.stats.kernel_stacks_reused,
        "kernel_stacks_checked": a.stats.kernel_stacks_checked,
        "kernel_stacks_differed": a.stats.kernel_stacks_differed,
        "user_walks_interleaved": a.stats.user_walks_interleaved,
        "mremaps_unlooked": a.stats.mremaps_unlooked,
        "unwind_walks_reused": a.stats.unwind_walks_reused,
        "user_returns": a.stats.user_returns,
        "ring_bytes": a.stats.ring_bytes,
    });
    let value = serde_json::json!({
        "totals": totals,
        "lost_events": a.stats.lost_events,
        "probe_overhead": a.probe_overhead,
        "user_mmaps": a.user_mmaps,
        "slab_pages": a.slab_pages,
        "lost_events_per_cpu": a.stats.lost_events_per_cpu,
        "lost_stacks": a.stats.lost_stacks,
        "lost_inflight": a.stats.lost_inflight,
        "lost_kernel_live": a.stats.lost_kernel_live,
        "events": a.events,
        "duration_ns": a.duration_ns,
        "finalized": a.finalized,
        "warnings": a.warnings,
        "exit_code": a.stats.exit_code,
        "end_reason": a.stats.end_reason,
        "sampled_from": a.stats.sampled_from,
        "recorder": recorder,
        "stacks": a.coverage.iter().map(|(d, c)| (domain_name(*d), c)).collect::<BTreeMap<_, _>>(),
        "recording": a.meta,
        "group_by": a.by,
        "allocators": a.allocators,
        "python": a.stats.python,
        // Written by `Sites` in its place.
        "sites": serde_json::Value::Null,
        // Written by `Leaks` in its place.
        "leaks": serde_json::Value::Null,
        // Live blocks `--leaks` leaves out: the runtime's own (libstdc++'s emergency pool).
        "leaks_kept_by_runtime": opts.leaks.then(|| serde_json::json!({
            "blocks": a.leak_totals.runtime_blocks,
            "bytes_req": a.leak_totals.runtime_bytes_req,
        })),
        "peak": json_memory::peaks(a, opts.filters.domain),
        "timeline_interval_ns": a.memory.interval_ns,
        "timeline": json_memory::timeline(a, opts.filters.domain),
    });
    let serde_json::Value::Object(value) = value else { unreachable!("the report is an object") };
    // (`leaks` is null without `--leaks`.)
    let document =
        Spliced { value, first: ("sites", Sites(a)), second: Some(("leaks", opts.leaks.then_some(Leaks(a)))) };
    Ok(serde_json::to_writer_pretty(w, &document)?)
}
