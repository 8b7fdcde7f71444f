//! `/debug/pprof/heap` and `/debug/pprof/allocs` with the conventions of Go's
//! net/http/pprof, so `go tool pprof`, Parca and Grafana Alloy's `pyroscope.scrape` read
//! them unchanged: a gzipped profile.proto with the sample types `alloc_objects`,
//! `alloc_space`, `inuse_objects` and `inuse_space` (in that order), the sampling period as
//! `space`/`bytes` (1 when every allocation is traced), the default sample type left unset
//! for heap (readers show the last one, `inuse_space`) and `alloc_space` for allocs; values
//! scaled for sampling as Go's runtime scales them (each sampled allocation of size s stands
//! for 1/(1 − e^(−s/period)) of them). `?seconds=N` serves the difference between now and N
//! seconds later (Go's delta profile); `?pid=` and `?domain=` select.
//!
//! Space is what the allocator handed out (`malloc_usable_size` for glibc), as Go counts its
//! size classes; `/metrics` has the requested bytes too.
use std::collections::HashMap;

use super::{
    model::{SiteKey, SiteStats, Snapshot},
    names::{Names, site_label},
};
use crate::{
    analysis::Domain,
    export::pprof::{LabelValue, ProfileBuilder, ProfileHeader},
    grouping::domain_name,
    stacks::Frame,
};

/// Go's sample types of heap profiles, in its order.
pub const SAMPLE_TYPES: [(&str, &str); 4] =
    [("alloc_objects", "count"), ("alloc_space", "bytes"), ("inuse_objects", "count"), ("inuse_space", "bytes")];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProfileKind {
    Heap,
    Allocs,
}

impl ProfileKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::Heap => "heap",
            Self::Allocs => "allocs",
        }
    }

    /// As runtime/pprof writes them: unset for heap, alloc_space for allocs.
    pub fn default_sample_type(self) -> Option<&'static str> {
        match self {
            Self::Heap => None,
            Self::Allocs => Some("alloc_space"),
        }
    }
}

/// What a profile request asks for.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProfileQuery {
    /// A delta profile over this many seconds.
    pub seconds: Option<u64>,
    /// Only these processes (none: all).
    pub pids: Vec<u32>,
    /// Only this domain (none: both).
    pub domain: Option<Domain>,
}

/// A request memtrace cannot serve as asked: the one line a 400 carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadRequest(pub String);

impl std::fmt::Display for BadRequest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn bad(message: impl Into<String>) -> BadRequest {
    BadRequest(message.into())
}

fn hex_value(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
}

fn percent_decode(s: &str) -> Result<String, BadRequest> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' => {
                let hi = bytes.get(i + 1).copied().and_then(hex_value);
                let lo = bytes.get(i + 2).copied().and_then(hex_value);
                let (Some(hi), Some(lo)) = (hi, lo) else {
                    return Err(bad(format!("malformed query: bad percent-encoding in {s:?}")));
                };
                out.push(hi << 4 | lo);
                i += 2;
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8(out).map_err(|_| bad(format!("malformed query: {s:?} is not UTF-8")))
}

/// The name=value pairs of a query string, decoded.
pub fn parse_form(query: &str) -> Result<Vec<(String, String)>, BadRequest> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            Ok((percent_decode(k)?, percent_decode(v)?))
        })
        .collect()
}

/// Parses a profile request's query (Go's parameters: `seconds`, `gc` and `debug=0`
/// accepted; memtrace's: `pid` (repeated or comma-separated) and `domain`).
pub fn parse_query(query: &str, max_seconds: u64) -> Result<ProfileQuery, BadRequest> {
    let mut q = ProfileQuery::default();
    let mut seen_domain = false;
    for (key, value) in parse_form(query)? {
        match key.as_str() {
            "seconds" => {
                if q.seconds.is_some() {
                    return Err(bad("\"seconds\" given twice"));
                }
                let n: u64 = value.parse().ok().filter(|&n| n > 0).ok_or_else(|| {
                    bad(format!("invalid value for \"seconds\": {value:?} - must be a positive integer"))
                })?;
                if n > max_seconds {
                    return Err(bad(format!(
                        "invalid value for \"seconds\": {n} - memtrace serves delta profiles of at most {max_seconds} seconds"
                    )));
                }
                q.seconds = Some(n);
            }
            "pid" => {
                for part in value.split(',') {
                    let pid =
                        part.trim().parse::<u32>().ok().filter(|&p| p > 0).ok_or_else(|| {
                            bad(format!("invalid value for \"pid\": {part:?} - must be a process id"))
                        })?;
                    if !q.pids.contains(&pid) {
                        q.pids.push(pid);
                    }
                }
            }
            "domain" => {
                if seen_domain {
                    return Err(bad("\"domain\" given twice"));
                }
                seen_domain = true;
                q.domain = match value.as_str() {
                    "user" => Some(Domain::User),
                    "kernel" => Some(Domain::Kernel),
                    "all" | "both" | "" => None,
                    other => {
                        return Err(bad(format!(
                            "invalid value for \"domain\": {other:?} - must be user or kernel (no other domain is traced)"
                        )));
                    }
                };
            }
            // Go's: run a GC first (nothing to do here).
            "gc" if value.parse::<i64>().is_ok() || value.is_empty() => {}
            "debug" if value == "0" || value.is_empty() => {}
            "debug" => {
                return Err(bad(format!(
                    "debug={value} (text output) is not supported: memtrace serves gzipped profiles (read them with go tool pprof)"
                )));
            }
            other => {
                return Err(bad(format!("unknown parameter {other:?} - profiles take seconds, pid and domain")));
            }
        }
    }
    Ok(q)
}

fn values(s: &SiteStats) -> [i64; 4] {
    [s.allocs as i64, s.bytes_alloc as i64, s.live_allocs as i64, s.live_bytes_alloc as i64]
}

/// The profile of `snap` (minus `base`: a delta profile), gzipped.
pub fn build(
    snap: &Snapshot,
    base: Option<&Snapshot>,
    names: &mut Names,
    kind: ProfileKind,
    q: &ProfileQuery,
) -> Result<Vec<u8>, BadRequest> {
    for pid in &q.pids {
        if !snap.processes.iter().any(|p| p.pid == *pid) {
            return Err(bad(format!("pid {pid} is not traced (or exited and was dropped)")));
        }
    }
    let before: HashMap<(u32, SiteKey), SiteStats> = base
        .map(|b| b.sites.iter().map(|s| ((b.processes[s.process].instance, s.key), s.stats)).collect())
        .unwrap_or_default();
    let mut builder = ProfileBuilder::new(&SAMPLE_TYPES);
    let mut frames_of: HashMap<SiteKey, Vec<Frame>> = HashMap::new();
    // User sites first: the first mapping is the one readers name the profile after
    // (go tool pprof's "File:"), the module of the first user frame.
    let user_first = snap.sites.iter().filter(|s| s.key.domain() == Domain::User);
    for s in user_first.chain(snap.sites.iter().filter(|s| s.key.domain() == Domain::Kernel)) {
        let p = &snap.processes[s.process];
        let domain = s.key.domain();
        if q.domain.is_some_and(|d| d != domain) || (!q.pids.is_empty() && !q.pids.contains(&p.pid)) {
            continue;
        }
        let mut v = values(&s.stats);
        if base.is_some() {
            let b = before.get(&(p.instance, s.key)).map(values).unwrap_or_default();
            for (x, y) in v.iter_mut().zip(b) {
                *x -= y;
            }
        }
        if v.iter().all(|&x| x == 0) {
            continue;
        }
        let frames = frames_of.entry(s.key).or_insert_with(|| {
            let frames = names.frames(s.key.stack, s.key.call_site);
            if frames.is_empty() {
                // A sample needs a location: the site's name stands for its stack.
                vec![Frame {
                    function: site_label(domain, s.key.kind, s.key.stack, &[]).into(),
                    file: None,
                    line: None,
                    module: "[unknown]".into(),
                    address: 0,
                    kernel: domain == Domain::Kernel,
                    inlined: false,
                    python: false,
                    unknown: true,
                    wrapper: false,
                }]
            } else {
                frames
            }
        });
        builder.add_sample(
            frames,
            &v,
            &[
                ("domain", LabelValue::Str(domain_name(domain))),
                ("process", LabelValue::Str(&p.comm)),
                ("pid", LabelValue::Num(i64::from(p.pid))),
            ],
        );
    }
    Ok(builder.finish_gzipped(&ProfileHeader {
        time_nanos: snap.unix_ns,
        duration_nanos: base.map_or(0, |b| snap.unix_ns.saturating_sub(b.unix_ns)),
        period_type: ("space", "bytes"),
        period: snap.sample_bytes.unwrap_or(1) as i64,
        default_sample_type: kind.default_sample_type(),
    }))
}
