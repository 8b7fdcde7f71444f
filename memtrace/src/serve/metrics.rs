//! `/metrics`: the Prometheus exposition of a snapshot, through the `prometheus-client`
//! crate — per-site gauges (live bytes, live blocks) and counters (allocations, bytes
//! allocated, requested and wasted), labelled with site, domain, comm and cgroup (pod UID and
//! container id when the cgroup path has them, pid when asked), and memtrace's own figures.
//!
//! **Bounded cardinality.** Per process (its comm and cgroup, or its pid with
//! `--pid-label`) and domain, the top N sites by live bytes have their own series and the
//! rest are summed under `site="[other]"`. Counters stay monotonic while sites move in and
//! out of the top N: each scrape adds what a site allocated since the previous one to the
//! series it belongs to now, so a site's series counts from when it entered (what `rate()`
//! needs) and `[other]` never goes down. Series of processes gone end with them; their
//! counters linger ([`GROUP_LINGER`]) for a process of the same group started soon after.
//! Past `--max-series` per family, whole groups (the fewest live bytes first) are summed
//! into one overflow series per domain the same way ([`overflow_group`]).
//!
//! OpenMetrics is served to clients that ask for it (Prometheus does); others get the
//! classic text format (0.0.4) that `promtool check metrics` reads.
//!
//! Over 500 lines: one exposition: every family, its labels and its bounds must agree, and the unit tests of the format sit beside it.
use std::{
    collections::{BTreeMap, HashMap, HashSet},
    sync::Arc,
    time::{Duration, Instant},
};

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric, NoLabelSet},
    metrics::{MetricType, counter::ConstCounter, gauge::ConstGauge},
    registry::{Registry, Unit},
};

use super::{
    cgroup::Cgroup,
    model::{SiteKey, SiteStats, Snapshot},
    names::{Names, site_label},
};
use crate::{analysis::Domain, grouping::domain_name};

/// What a series set stands for: one process (or all those sharing a command name and
/// cgroup), in one domain.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Group {
    pub comm: Arc<str>,
    pub cgroup: Arc<Cgroup>,
    pub pid: Option<u32>,
    pub domain: Domain,
}

/// Cumulative figures a counter shows.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Totals {
    pub allocs: u64,
    pub bytes_alloc: u64,
    pub bytes_req: u64,
    pub wasted: u64,
}

impl Totals {
    fn of(s: &SiteStats) -> Self {
        Self { allocs: s.allocs, bytes_alloc: s.bytes_alloc, bytes_req: s.bytes_req, wasted: s.wasted() }
    }

    fn since(self, before: Self) -> Self {
        Self {
            allocs: self.allocs.saturating_sub(before.allocs),
            bytes_alloc: self.bytes_alloc.saturating_sub(before.bytes_alloc),
            bytes_req: self.bytes_req.saturating_sub(before.bytes_req),
            wasted: self.wasted.saturating_sub(before.wasted),
        }
    }

    fn add(&mut self, d: Self) {
        self.allocs += d.allocs;
        self.bytes_alloc += d.bytes_alloc;
        self.bytes_req += d.bytes_req;
        self.wasted += d.wasted;
    }
}

/// One site of one process instance, named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub instance: u32,
    pub key: SiteKey,
    pub group: Group,
    pub site: Arc<str>,
    pub stats: SiteStats,
}

/// A series' figures.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Figures {
    pub live_bytes: u64,
    pub live_blocks: u64,
    pub totals: Totals,
}

/// What one scrape shows of the sites: per group, the series of its top sites by name,
/// and "other".
#[derive(Debug, Default, PartialEq, Eq)]
pub struct SiteSeries {
    pub groups: BTreeMap<Group, (BTreeMap<String, Figures>, Figures)>,
    /// Groups summed into the overflow group ([`overflow_group`]) by `--max-series`.
    pub folded_groups: u64,
}

/// Where the groups beyond `--max-series` are summed, per domain: `comm="[other]"`, no
/// cgroup, its one series `site="[other]"` (as OpenTelemetry's cardinality limit sums the
/// overflow into one series).
pub fn overflow_group(domain: Domain) -> Group {
    Group { comm: Arc::from(OTHER), cgroup: Arc::default(), pid: None, domain }
}

/// The label value of the series that sums the sites beyond the top N (in brackets: no
/// function or file is named so, so no site's own series can take its labels).
pub const OTHER: &str = "[other]";

/// The counters of a group whose processes are all gone are kept this long (not shown): a
/// process of the same command and cgroup started meanwhile goes on from them. Started from
/// 0 again, its counter could pass the old value within a `rate()` window, which Prometheus
/// would take for an increase, not a reset.
pub const GROUP_LINGER: Duration = Duration::from_secs(600);
/// At most this many groups linger (the longest gone go first).
pub const MAX_LINGERING: usize = 4096;

/// What counters need between scrapes.
#[derive(Debug, Default)]
pub struct MetricsState {
    /// Per (instance, site): the totals at the previous scrape.
    last: HashMap<(u32, SiteKey), Totals>,
    /// Per series (group, then site): the counters' values.
    sites: HashMap<Group, HashMap<Arc<str>, Totals>>,
    other: HashMap<Group, Totals>,
    /// Groups with no process at the last scrapes: when they were last seen.
    gone: HashMap<Group, Instant>,
    /// Per group: the sites with series of their own at the previous scrape.
    shown: HashMap<Group, HashSet<Arc<str>>>,
    /// Series per site family at most (`--max-series`; 0: no cap): past it, the groups with
    /// the fewest live bytes are summed into [`overflow_group`].
    pub max_series: usize,
}

impl MetricsState {
    /// The series of this scrape, `top` sites per group.
    pub fn update(&mut self, rows: &[Row], top: usize) -> SiteSeries {
        self.update_at(rows, top, Instant::now())
    }

    /// [`Self::update`] at `now` (for tests).
    pub fn update_at(&mut self, rows: &[Row], top: usize, now: Instant) -> SiteSeries {
        // Past `--max-series`, whole groups go to the overflow group, whose only series is
        // `[other]`: what they did since the previous scrape is added there.
        let (folded, tops) = self.folded(rows, top);
        let folded_rows: Vec<Row>;
        let rows = if folded.is_empty() {
            rows
        } else {
            folded_rows = rows
                .iter()
                .map(|r| match folded.contains(&r.group) {
                    true => Row { group: overflow_group(r.group.domain), ..r.clone() },
                    false => r.clone(),
                })
                .collect();
            &folded_rows
        };
        // Per site: live bytes, live blocks, bytes allocated in all.
        let mut live: HashMap<&Group, HashMap<&str, (u64, u64, u64)>> = HashMap::new();
        for r in rows {
            let e = live.entry(&r.group).or_default().entry(&*r.site).or_default();
            e.0 += r.stats.live_bytes_alloc;
            e.1 += r.stats.live_allocs;
            e.2 += r.stats.bytes_alloc;
        }
        // The top by live bytes; among equals (a process that exited has none), the sites
        // shown at the previous scrape first, then by bytes allocated: the series do not
        // change hands when a process exits.
        let mut exposed: HashMap<&Group, HashSet<&str>> = HashMap::new();
        for (group, sites) in &live {
            if !folded.is_empty() && **group == overflow_group(group.domain) {
                exposed.insert(*group, HashSet::new());
                continue;
            }
            let top = tops.get(*group).copied().unwrap_or(top);
            let before = self.shown.get(*group);
            let mut ranked: Vec<(&str, u64, bool, u64)> = sites
                .iter()
                .map(|(s, &(bytes, _, total))| (*s, bytes, before.is_some_and(|b| b.contains(*s)), total))
                .collect();
            ranked.sort_by(|a, b| b.1.cmp(&a.1).then(b.2.cmp(&a.2)).then(b.3.cmp(&a.3)).then(a.0.cmp(b.0)));
            exposed.insert(*group, ranked.into_iter().take(top).map(|(s, ..)| s).collect());
        }
        self.shown =
            exposed.iter().map(|(g, sites)| ((*g).clone(), sites.iter().map(|s| Arc::from(*s)).collect())).collect();
        // Counters: what each site did since the previous scrape goes to its series now.
        let mut last = HashMap::with_capacity(rows.len());
        for r in rows {
            let now = Totals::of(&r.stats);
            let before = self.last.get(&(r.instance, r.key)).copied().unwrap_or_default();
            last.insert((r.instance, r.key), now);
            let delta = now.since(before);
            // Entries are made once per series; later scrapes only look them up.
            if exposed[&r.group].contains(&*r.site) {
                let sites = match self.sites.get_mut(&r.group) {
                    Some(sites) => sites,
                    None => self.sites.entry(r.group.clone()).or_default(),
                };
                match sites.get_mut(&r.site) {
                    Some(t) => t.add(delta),
                    None => {
                        sites.insert(Arc::clone(&r.site), delta);
                    }
                }
            } else {
                match self.other.get_mut(&r.group) {
                    Some(t) => t.add(delta),
                    None => {
                        self.other.insert(r.group.clone(), delta);
                    }
                }
            }
        }
        self.last = last;
        // Groups gone stop being shown; their counters linger a while.
        for g in self.sites.keys().chain(self.other.keys()) {
            if !live.contains_key(g) && !self.gone.contains_key(g) {
                self.gone.insert(g.clone(), now);
            }
        }
        self.gone.retain(|g, since| !live.contains_key(g) && now.saturating_duration_since(*since) < GROUP_LINGER);
        if self.gone.len() > MAX_LINGERING {
            let mut by_age: Vec<(Instant, Group)> = self.gone.iter().map(|(g, &t)| (t, g.clone())).collect();
            by_age.sort_unstable();
            for (_, g) in by_age.into_iter().take(self.gone.len() - MAX_LINGERING) {
                self.gone.remove(&g);
            }
        }
        let gone = &self.gone;
        self.sites.retain(|g, _| live.contains_key(g) || gone.contains_key(g));
        self.other.retain(|g, _| live.contains_key(g) || gone.contains_key(g));

        let mut out = SiteSeries::default();
        for (group, sites) in &live {
            let shown = &exposed[group];
            let mut series = BTreeMap::new();
            let mut other =
                Figures { totals: self.other.get(*group).copied().unwrap_or_default(), ..Default::default() };
            for (site, (bytes, blocks, _)) in sites {
                if shown.contains(site) {
                    let totals = self.sites.get(*group).and_then(|s| s.get(*site)).copied().unwrap_or_default();
                    series.insert(site.to_string(), Figures { live_bytes: *bytes, live_blocks: *blocks, totals });
                } else {
                    other.live_bytes += bytes;
                    other.live_blocks += blocks;
                }
            }
            out.groups.insert((*group).clone(), (series, other));
        }
        out.folded_groups = folded.len() as u64;
        out
    }

    /// The groups of this scrape summed into the overflow group: with more series than
    /// `max_series` (per family: a group's top sites and its `[other]`), the groups after
    /// the longest run of groups that fits, ranked by live bytes (among equals, those
    /// shown at the previous scrape first, then by bytes allocated), one series kept for
    /// the overflow's. The first group that does not fit whole keeps the sites that fit
    /// (at least one): its number of sites is the second part.
    fn folded(&self, rows: &[Row], top: usize) -> (HashSet<Group>, HashMap<Group, usize>) {
        let mut tops = HashMap::new();
        if self.max_series == 0 {
            return (HashSet::new(), tops);
        }
        // Per group: its distinct sites, live bytes, bytes allocated.
        let mut groups: HashMap<&Group, (HashSet<&str>, u64, u64)> = HashMap::new();
        for r in rows {
            let e = groups.entry(&r.group).or_default();
            e.0.insert(&r.site);
            e.1 += r.stats.live_bytes_alloc;
            e.2 += r.stats.bytes_alloc;
        }
        let cost = |sites: &HashSet<&str>| sites.len().min(top) + 1;
        if groups.values().map(|g| cost(&g.0)).sum::<usize>() <= self.max_series {
            return (HashSet::new(), tops);
        }
        let mut ranked: Vec<(&Group, usize, u64, bool, u64)> = groups
            .iter()
            .map(|(g, (sites, bytes, total))| (*g, cost(sites), *bytes, self.shown.contains_key(*g), *total))
            .collect();
        ranked.sort_by(|a, b| b.2.cmp(&a.2).then(b.3.cmp(&a.3)).then(b.4.cmp(&a.4)).then(a.0.cmp(b.0)));
        // One series per domain for the overflow.
        let domains: HashSet<Domain> = groups.keys().map(|g| g.domain).collect();
        let mut used = domains.len();
        let mut out = HashSet::new();
        for (group, cost, ..) in ranked {
            let left = self.max_series.saturating_sub(used);
            if !out.is_empty() || left < 2 {
                out.insert(group.clone());
            } else if cost <= left {
                used += cost;
            } else {
                // Its first sites and its [other]; the groups after it are folded.
                tops.insert(group.clone(), left - 1);
                used = self.max_series;
            }
        }
        (out, tops)
    }
}

/// Names the sites of a snapshot for the series.
pub fn rows(snap: &Snapshot, names: &mut Names, pid_label: bool) -> Vec<Row> {
    let mut labels: HashMap<SiteKey, Arc<str>> = HashMap::new();
    let comms: Vec<Arc<str>> = snap.processes.iter().map(|p| Arc::from(p.comm.as_str())).collect();
    snap.sites
        .iter()
        .map(|s| {
            let p = &snap.processes[s.process];
            let site = labels.entry(s.key).or_insert_with(|| {
                let frames = names.frames(s.key.stack, s.key.call_site);
                Arc::from(site_label(s.key.domain(), s.key.kind, s.key.stack, &frames))
            });
            Row {
                instance: p.instance,
                key: s.key,
                group: Group {
                    comm: Arc::clone(&comms[s.process]),
                    cgroup: Arc::clone(&p.cgroup),
                    pid: pid_label.then_some(p.pid),
                    domain: s.key.domain(),
                },
                site: Arc::clone(site),
                stats: s.stats,
            }
        })
        .collect()
}

/// memtrace's own figures at a scrape.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SelfFigures {
    pub events: u64,
    pub lost_events: u64,
    pub sampled_allocations: u64,
    pub sample_period_bytes: u64,
    pub ring_fill: super::selfstats::FillHistogram,
    pub probes: u64,
    pub live_blocks: u64,
    pub live_blocks_limit: u64,
    pub untracked_allocations: u64,
    pub unmatched_frees: u64,
    pub inherited_frees: u64,
    pub probe_allocations: u64,
    pub slab_page_allocations: u64,
    pub stacks: u64,
    pub stacks_limit: u64,
    pub stack_table_full: u64,
    pub symbols: u64,
    pub processes_running: u64,
    pub processes_exited: u64,
    pub processes_dropped: u64,
    pub scrapes: Vec<(&'static str, u64)>,
    pub responses: Vec<(u16, u64)>,
    pub resident_bytes: u64,
    pub cpu_seconds: f64,
    pub open_fds: u64,
    pub start_time_seconds: f64,
}

#[derive(Debug, Clone)]
enum Value {
    Count(u64),
    RealCount(f64),
    Gauge(i64),
    Real(f64),
    Histogram(Box<super::selfstats::FillHistogram>),
}

impl Value {
    fn encode(&self, mut m: prometheus_client::encoding::MetricEncoder<'_>) -> Result<(), std::fmt::Error> {
        match *self {
            Self::Count(v) => ConstCounter::new(v).encode(m),
            Self::RealCount(v) => ConstCounter::new(v).encode(m),
            Self::Gauge(v) => ConstGauge::new(v).encode(m),
            Self::Real(v) => ConstGauge::new(v).encode(m),
            Self::Histogram(ref h) => {
                // Counts per bucket, not cumulative (the encoder adds them up). Every
                // observation is at most 1: the `+Inf` bucket, which the encoder writes only
                // when given one, adds none.
                let buckets: Vec<(f64, u64)> =
                    super::selfstats::FILL_BOUNDS.iter().copied().zip(h.buckets).chain([(f64::INFINITY, 0)]).collect();
                m.encode_histogram::<NoLabelSet>(h.sum, h.count, &buckets, None)
            }
        }
    }
}

/// A label set, shared by the families showing one series (one allocation each).
type Labels = Arc<Vec<(&'static str, String)>>;

#[derive(Debug)]
struct Family {
    name: &'static str,
    help: &'static str,
    unit: Option<Unit>,
    counter: bool,
    samples: Vec<(Labels, Value)>,
}

/// The families of one scrape, encoded by prometheus-client as a collector.
#[derive(Debug, Default)]
struct Families(Vec<Family>);

impl Families {
    fn family(&mut self, name: &'static str, help: &'static str, unit: Option<Unit>, counter: bool) -> &mut Family {
        self.0.push(Family { name, help, unit, counter, samples: Vec::new() });
        self.0.last_mut().expect("just pushed")
    }

    fn histogram(
        &mut self,
        name: &'static str,
        help: &'static str,
        unit: Option<Unit>,
        h: &super::selfstats::FillHistogram,
    ) {
        let value = Value::Histogram(Box::new(h.clone()));
        self.family(name, help, unit, false).samples.push((Labels::default(), value));
    }

    fn one(&mut self, name: &'static str, help: &'static str, unit: Option<Unit>, value: Value) {
        let counter = matches!(value, Value::Count(_) | Value::RealCount(_));
        self.family(name, help, unit, counter).samples.push((Labels::default(), value));
    }
}

impl Collector for Families {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for f in &self.0 {
            let kind = match f.samples.first() {
                Some((_, Value::Histogram(_))) => MetricType::Histogram,
                _ if f.counter => MetricType::Counter,
                _ => MetricType::Gauge,
            };
            let mut metric = encoder.encode_descriptor(f.name, f.help, f.unit.as_ref(), kind)?;
            match f.samples.as_slice() {
                // A lone sample without labels is written without braces.
                [(labels, value)] if labels.is_empty() => value.encode(metric)?,
                samples => {
                    for (labels, value) in samples {
                        value.encode(metric.encode_family(labels.as_ref())?)?;
                    }
                }
            }
        }
        Ok(())
    }
}

fn labels(group: &Group, site: &str) -> Labels {
    let mut l = vec![
        ("site", site.to_string()),
        ("domain", domain_name(group.domain).to_string()),
        ("comm", group.comm.to_string()),
        ("cgroup", group.cgroup.path.clone()),
    ];
    if let Some(uid) = &group.cgroup.pod_uid {
        l.push(("pod_uid", uid.clone()));
    }
    if let Some(id) = &group.cgroup.container_id {
        l.push(("container_id", id.clone()));
    }
    if let Some(pid) = group.pid {
        l.push(("pid", pid.to_string()));
    }
    Arc::new(l)
}

fn site_families(series: &SiteSeries, f: &mut Families) {
    type Pick = fn(&Figures) -> Value;
    let metrics: [(&'static str, &'static str, Option<Unit>, bool, Pick); 6] = [
        (
            "memtrace_live",
            "Bytes allocated and not freed yet (what the allocator holds for the program), per allocating site.",
            Some(Unit::Bytes),
            false,
            |x| Value::Gauge(x.live_bytes as i64),
        ),
        ("memtrace_live_blocks", "Blocks allocated and not freed yet, per allocating site.", None, false, |x| {
            Value::Gauge(x.live_blocks as i64)
        }),
        ("memtrace_allocations", "Allocations, per allocating site.", None, true, |x| Value::Count(x.totals.allocs)),
        ("memtrace_allocated", "Bytes the allocator handed out, per allocating site.", Some(Unit::Bytes), true, |x| {
            Value::Count(x.totals.bytes_alloc)
        }),
        ("memtrace_requested", "Bytes the program asked for, per allocating site.", Some(Unit::Bytes), true, |x| {
            Value::Count(x.totals.bytes_req)
        }),
        (
            "memtrace_wasted",
            "Bytes allocated beyond the requests (internal fragmentation), per allocating site.",
            Some(Unit::Bytes),
            true,
            |x| Value::Count(x.totals.wasted),
        ),
    ];
    let mut rows: Vec<(Labels, &Figures)> = Vec::new();
    for (group, (sites, other)) in &series.groups {
        rows.extend(sites.iter().map(|(site, figures)| (labels(group, site), figures)));
        rows.push((labels(group, OTHER), other));
    }
    for (name, help, unit, counter, pick) in metrics {
        let family = f.family(name, help, unit, counter);
        family.samples.extend(rows.iter().map(|(labels, figures)| (Arc::clone(labels), pick(figures))));
    }
    f.one(
        "memtrace_groups_folded",
        "Process groups whose sites were summed under comm=\"[other]\" at this scrape: --max-series was reached.",
        None,
        Value::Gauge(series.folded_groups as i64),
    );
}

fn self_families(s: &SelfFigures, f: &mut Families) {
    let build = f.family("memtrace_build_info", "memtrace's version.", None, false);
    build.samples.push((Arc::new(vec![("version", env!("CARGO_PKG_VERSION").to_string())]), Value::Gauge(1)));
    f.one(
        "memtrace_events",
        "Events the probes delivered (allocations, frees, process events).",
        None,
        Value::Count(s.events),
    );
    f.one(
        "memtrace_events_lost",
        "Events the probes could not deliver (rings full): figures miss them.",
        None,
        Value::Count(s.lost_events),
    );
    f.one(
        "memtrace_sampled_allocations",
        "User allocations the probes sampled and delivered (each stands for several when sampling).",
        None,
        Value::Count(s.sampled_allocations),
    );
    f.one(
        "memtrace_sample_period",
        "Mean bytes allocated between two sampled user allocations (0: every allocation is traced).",
        Some(Unit::Bytes),
        Value::Gauge(s.sample_period_bytes as i64),
    );
    f.histogram(
        "memtrace_ring_fill",
        "How full the fullest ring buffer was at each drain (1: events are being lost).",
        Some(Unit::Other("ratio".to_string())),
        &s.ring_fill,
    );
    f.one("memtrace_probes", "Probe links attached (uprobes, tracepoints).", None, Value::Gauge(s.probes as i64));
    f.one("memtrace_tracked_blocks", "Live blocks followed now.", None, Value::Gauge(s.live_blocks as i64));
    f.one(
        "memtrace_tracked_blocks_limit",
        "Live blocks followed at most (--max-live-blocks).",
        None,
        Value::Gauge(s.live_blocks_limit as i64),
    );
    f.one(
        "memtrace_untracked_allocations",
        "Allocations counted but not followed to their free: the live-block table was full.",
        None,
        Value::Count(s.untracked_allocations),
    );
    f.one(
        "memtrace_unmatched_frees",
        "Frees of blocks not followed (allocated before tracing began, or not followed).",
        None,
        Value::Count(s.unmatched_frees),
    );
    f.one(
        "memtrace_inherited_frees",
        "Frees in forked children of blocks their parent allocated (the child's copy of its heap): the parent's, \
         not counted again.",
        None,
        Value::Count(s.inherited_frees),
    );
    f.one(
        "memtrace_probe_allocations",
        "Kernel allocations the probes caused in the traced processes (the uprobe machinery's breakpoint pages, \
         return instances and task state, the BPF programs' task storage): counted here, in no site.",
        None,
        Value::Count(s.probe_allocations),
    );
    f.one(
        "memtrace_slab_page_allocations",
        "Page allocations of new slabs in the traced processes: their objects count in the sites of their own \
         kmalloc or kmem_cache_alloc, the pages here, in no site.",
        None,
        Value::Count(s.slab_page_allocations),
    );
    f.one("memtrace_stacks", "Distinct stacks kept.", None, Value::Gauge(s.stacks as i64));
    f.one(
        "memtrace_stacks_limit",
        "Distinct stacks kept at most (--max-stacks).",
        None,
        Value::Gauge(s.stacks_limit as i64),
    );
    f.one(
        "memtrace_stack_table_full",
        "Allocations whose stack was not kept: the stack table was full.",
        None,
        Value::Count(s.stack_table_full),
    );
    f.one("memtrace_symbols", "Addresses named so far.", None, Value::Gauge(s.symbols as i64));
    let processes =
        f.family("memtrace_processes", "Processes with figures, running or exited and not yet dropped.", None, false);
    processes.samples.push((Arc::new(vec![("state", "running".into())]), Value::Gauge(s.processes_running as i64)));
    processes.samples.push((Arc::new(vec![("state", "exited".into())]), Value::Gauge(s.processes_exited as i64)));
    f.one(
        "memtrace_processes_dropped",
        "Exited processes dropped after their last scrape.",
        None,
        Value::Count(s.processes_dropped),
    );
    let scrapes = f.family("memtrace_scrapes", "Snapshots served, per endpoint.", None, true);
    for (endpoint, n) in &s.scrapes {
        scrapes.samples.push((Arc::new(vec![("endpoint", endpoint.to_string())]), Value::Count(*n)));
    }
    let responses = f.family("memtrace_http_responses", "HTTP responses, per status code.", None, true);
    for (code, n) in &s.responses {
        responses.samples.push((Arc::new(vec![("code", code.to_string())]), Value::Count(*n)));
    }
    f.one(
        "process_resident_memory",
        "memtrace's resident memory.",
        Some(Unit::Bytes),
        Value::Gauge(s.resident_bytes as i64),
    );
    f.one("process_cpu", "memtrace's CPU time, user and system.", Some(Unit::Seconds), Value::RealCount(s.cpu_seconds));
    f.one("process_open_fds", "memtrace's open file descriptors.", None, Value::Gauge(s.open_fds as i64));
    f.one(
        "process_start_time",
        "When memtrace started, since the epoch.",
        Some(Unit::Seconds),
        Value::Real(s.start_time_seconds),
    );
}

/// The exposition of a scrape: OpenMetrics text, or the classic text format.
pub fn encode(series: &SiteSeries, own: &SelfFigures, openmetrics: bool) -> String {
    let mut families = Families::default();
    site_families(series, &mut families);
    self_families(own, &mut families);
    let mut registry = Registry::default();
    registry.register_collector(Box::new(families));
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry).expect("writing to a String");
    if openmetrics { out } else { openmetrics_to_text(&out) }
}

/// OpenMetrics text as the classic text format (0.0.4): counters are declared under their
/// sample name (`x_total`), and the `# UNIT` and `# EOF` lines go.
pub fn openmetrics_to_text(om: &str) -> String {
    let counters: HashSet<&str> =
        om.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter")).collect();
    let mut out = String::with_capacity(om.len());
    for line in om.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        let renamed = ["# HELP ", "# TYPE "].iter().find_map(|prefix| {
            let rest = line.strip_prefix(prefix)?;
            let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
            counters.contains(name).then(|| format!("{prefix}{name}_total {tail}"))
        });
        match renamed {
            Some(l) => out.push_str(l.trim_end()),
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// Content types of the two formats.
pub const OPENMETRICS_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
pub const TEXT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether an Accept header asks for OpenMetrics.
pub fn wants_openmetrics(accept: &str) -> bool {
    accept.split(',').any(|part| {
        let mut params = part.split(';').map(str::trim);
        // q=0 (0.0, 0.000): not acceptable.
        let refused =
            |p: &str| p.replace(' ', "").strip_prefix("q=").is_some_and(|q| q.parse::<f64>().is_ok_and(|q| q <= 0.0));
        params.next() == Some("application/openmetrics-text") && !params.any(refused)
    })
}
