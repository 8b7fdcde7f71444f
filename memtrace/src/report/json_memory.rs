//! The JSON of memory over time, the peak and the size histograms: `timeline` (one entry
//! per interval: `t_ns` from the start of the recording, `<domain>_live_bytes`, and
//! `processes` for those that held the most), `peak` per domain, and `size_histogram`
//! arrays for totals and sites.
use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::{Map, Value, json};

use super::analyze::Summary;
use crate::{
    analysis::sizes::SizeHistogram,
    grouping::{DomainFilter, domain_name},
};

/// One bucket of a size histogram.
#[derive(Serialize)]
pub struct JsonBin {
    min_size: u64,
    max_size: u64,
    allocs: u64,
    bytes_req: u64,
    bytes_alloc: u64,
    frag_pct: f64,
}

pub fn size_histogram(h: &SizeHistogram) -> Vec<JsonBin> {
    h.bins()
        .map(|b| JsonBin {
            min_size: b.min_size,
            max_size: b.max_size,
            allocs: b.allocs,
            bytes_req: b.bytes_req,
            bytes_alloc: b.bytes_alloc,
            frag_pct: (b.frag_pct() * 100.0).round() / 100.0,
        })
        .collect()
}

/// `timeline`: an entry per interval.
pub fn timeline(a: &Summary, domains: DomainFilter) -> Vec<Value> {
    let m = &a.memory;
    (0..m.intervals())
        .map(|i| {
            let mut entry = Map::new();
            entry.insert("t_ns".into(), json!(i as u64 * m.interval_ns));
            for (d, series) in m.domains.iter().filter(|(d, _)| domains.admits(**d)) {
                entry.insert(format!("{}_live_bytes", domain_name(*d)), json!(series[i]));
            }
            let processes: BTreeMap<String, u64> =
                m.processes.iter().map(|(pid, series)| (pid.to_string(), series[i])).collect();
            entry.insert("processes".into(), json!(processes));
            Value::Object(entry)
        })
        .collect()
}

/// `peak`: per domain, when (`t_ns` from the start of the recording) and how much.
pub fn peaks(a: &Summary, domains: DomainFilter) -> Value {
    let m = &a.memory;
    let peaks: BTreeMap<&str, Value> = m
        .peaks
        .iter()
        .filter(|(d, _)| domains.admits(**d))
        .map(|(d, p)| {
            let value = json!({
                "t_ns": m.since_start(p.ts_ns),
                "live_bytes_req": p.live_bytes_req,
                "live_allocs": p.live_allocs,
                "interval": m.interval_of(p.ts_ns),
            });
            (domain_name(*d), value)
        })
        .collect();
    json!(peaks)
}
