//! `memtrace serve`: an always-on agent. It traces (sampled by default, as Go's heap
//! profiler does), keeps the live aggregation in memory, bounded, and serves it over HTTP
//! in the formats the tools people already run scrape: Prometheus's `/metrics`, and Go's
//! `/debug/pprof/heap` and `/debug/pprof/allocs` (go tool pprof, Parca, Grafana Alloy's
//! `pyroscope.scrape`).
//!
//! Three threads share [`Shared`]: the tracer's (the session loop: drains the rings into the
//! [`model`], never waits on a client), the HTTP server's ([`http`]: its own runtime, a
//! bounded number of clients, timeouts), and the namer's ([`names`]: symbolizes new stacks
//! every second). Endpoints copy a [`model::Snapshot`] out under the model's lock and do
//! the rest — naming, [`metrics`], [`profile`] encoding — without it.
//!
//! - [`config`]: the command line;
//! - [`model`]: the aggregation (the session sink), bounded for weeks;
//! - [`cgroup`]: container and pod of a process;
//! - [`names`]: stacks to frames and site labels;
//! - [`metrics`], [`profile`]: the two formats;
//! - [`http`]: the server; [`selfstats`]: memtrace's own figures.
pub mod cgroup;
pub mod config;
pub mod http;
pub mod metrics;
pub mod model;
pub mod names;
pub mod profile;
pub mod selfstats;
#[cfg(test)]
mod tests;

use std::{
    collections::BTreeMap,
    io,
    net::{SocketAddr, TcpListener},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow};

pub use self::config::ServeArgs;
use self::{
    config::{Config, HttpConfig},
    metrics::{MetricsState, SelfFigures},
    model::{Limits, Model, Scraper, Snapshot},
    names::{Namer, lock},
    profile::{BadRequest, ProfileKind, ProfileQuery},
};
use crate::{
    probes,
    session::{Target, Tracer, Wake, WakeLoop, block_on, check_pid},
};

const DRAIN_INTERVAL: Duration = Duration::from_millis(20);
const HOUSEKEEPING_INTERVAL: Duration = Duration::from_millis(500);

/// What the tracer reports besides the model, refreshed twice a second.
#[derive(Debug, Clone, Copy, Default)]
pub struct TracerStatus {
    pub lost_events: u64,
}

/// What the tracer, the namer and the endpoints share.
pub struct Shared {
    pub model: Mutex<Model>,
    pub namer: Namer,
    pub metrics: Mutex<MetricsState>,
    pub status: Mutex<TracerStatus>,
    /// How full the fullest ring was at each drain.
    pub ring_fill: Mutex<selfstats::FillHistogram>,
    scrapes: [AtomicU64; 3],
    responses: Mutex<BTreeMap<u16, u64>>,
    start_time: f64,
}

impl Shared {
    pub fn new(limits: Limits) -> Self {
        Self {
            model: Mutex::new(Model::new(limits)),
            namer: Namer::default(),
            metrics: Mutex::new(MetricsState::default()),
            status: Mutex::new(TracerStatus::default()),
            ring_fill: Mutex::new(selfstats::FillHistogram::default()),
            scrapes: Default::default(),
            responses: Mutex::new(BTreeMap::new()),
            start_time: model::unix_now_ns() as f64 / 1e9,
        }
    }

    fn scraper_index(s: Scraper) -> usize {
        match s {
            Scraper::Metrics => 0,
            Scraper::Heap => 1,
            Scraper::Allocs => 2,
        }
    }

    /// A snapshot for `scraper`, every stack in it named.
    pub fn snapshot(&self, scraper: Scraper) -> Snapshot {
        self.namer.sync(&self.model);
        let snap = lock(&self.model).snapshot(scraper);
        self.scrapes[Self::scraper_index(scraper)].fetch_add(1, Ordering::Relaxed);
        snap
    }

    pub fn count_response(&self, code: u16) {
        *lock(&self.responses).entry(code).or_default() += 1;
    }

    /// The body of /metrics.
    pub fn metrics_text(&self, config: &HttpConfig, openmetrics: bool) -> String {
        // One scrape at a time from snapshot to counters, so they only go up.
        let mut state = lock(&self.metrics);
        let snap = self.snapshot(Scraper::Metrics);
        let (counters, usage, limits) = {
            let m = lock(&self.model);
            (m.counters, m.usage(), m.limits())
        };
        let (rows, symbols) = {
            let mut names = self.namer.names();
            (metrics::rows(&snap, &mut names, config.pid_label), names.symbols())
        };
        state.max_series = config.max_series;
        let series = state.update(&rows, config.top_sites);
        drop(state);
        let (open_fds, probes) = selfstats::descriptors();
        let lost_events = lock(&self.status).lost_events;
        let own = SelfFigures {
            events: counters.events,
            lost_events,
            sampled_allocations: if snap.sample_bytes.is_some() { counters.user_allocations } else { 0 },
            sample_period_bytes: snap.sample_bytes.unwrap_or(0),
            ring_fill: lock(&self.ring_fill).clone(),
            probes,
            live_blocks: usage.live_blocks as u64,
            live_blocks_limit: limits.max_live_blocks as u64,
            untracked_allocations: counters.untracked,
            unmatched_frees: counters.unmatched_frees,
            inherited_frees: counters.inherited_frees,
            probe_allocations: counters.probe_allocations,
            slab_page_allocations: counters.slab_page_allocations,
            stacks: usage.stacks as u64,
            stacks_limit: limits.max_stacks as u64,
            stack_table_full: counters.stacks_dropped,
            symbols: symbols as u64,
            processes_running: usage.processes as u64,
            processes_exited: usage.exited as u64,
            processes_dropped: counters.processes_dropped,
            scrapes: ["metrics", "heap", "allocs"]
                .into_iter()
                .zip(&self.scrapes)
                .map(|(name, n)| (name, n.load(Ordering::Relaxed)))
                .collect(),
            responses: lock(&self.responses).iter().map(|(&c, &n)| (c, n)).collect(),
            resident_bytes: selfstats::resident_bytes(),
            cpu_seconds: selfstats::cpu_seconds(),
            open_fds,
            start_time_seconds: self.start_time,
        };
        metrics::encode(&series, &own, openmetrics)
    }

    /// A profile: of now, or (with `base`) of what happened since `base`.
    pub fn profile(&self, kind: ProfileKind, q: &ProfileQuery, base: Option<&Snapshot>) -> Result<Vec<u8>, BadRequest> {
        let scraper = match kind {
            ProfileKind::Heap => Scraper::Heap,
            ProfileKind::Allocs => Scraper::Allocs,
        };
        let snap = self.snapshot(scraper);
        let mut names = self.namer.names();
        profile::build(&snap, base, &mut names, kind, q)
    }
}

/// Binds the listening socket, with a message that says what to do when it is taken.
pub fn bind(addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr).map_err(|e| match e.kind() {
        io::ErrorKind::AddrInUse => anyhow!(
            "cannot listen on {addr}: the address is already in use (another memtrace serve, or another program); choose another with --listen"
        ),
        io::ErrorKind::PermissionDenied => anyhow!("cannot listen on {addr}: permission denied"),
        io::ErrorKind::AddrNotAvailable => anyhow!("cannot listen on {addr}: no interface has this address"),
        _ => anyhow!("cannot listen on {addr}: {e}"),
    })
}

/// Why serving stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    Signal(i32),
    /// The command exited with this code.
    Command(i32),
    /// Every traced pid exited.
    Pids,
}

fn signal_name(sig: i32) -> String {
    match sig {
        libc::SIGINT => "SIGINT".into(),
        libc::SIGTERM => "SIGTERM".into(),
        libc::SIGHUP => "SIGHUP".into(),
        other => format!("signal {other}"),
    }
}

/// Whether a process is gone (or a zombie: it exited, its parent has not reaped it).
fn exited(pid: u32) -> bool {
    crate::procfs::process_state(pid).map_or(true, |s| s.state == 'Z')
}

/// Adds another `--pid` to a started session: the process joins the traced set and gets
/// the allocator probes of its own allocator.
fn add_pid(tracer: &mut Tracer, pid: u32) -> Result<()> {
    tracer.probes.trace_tgid(pid, false)?;
    if tracer.options.user {
        let allocator =
            probes::allocator::for_process(pid, &tracer.options.symbol_prefix).with_context(|| format!("pid {pid}"))?;
        tracer.probes.attach_allocator(&allocator, Some(pid)).with_context(|| format!("pid {pid}"))?;
    }
    Ok(())
}

async fn trace(tracer: &mut Tracer, shared: &Shared, pids: &[u32]) -> Result<Stop> {
    let mut waker = WakeLoop::new(tracer, DRAIN_INTERVAL, None)?;
    let mut last_housekeeping = Instant::now();
    let mut running: Vec<u32> = pids.to_vec();
    loop {
        let wake = waker.wait().await;
        let mut stop = match wake {
            Wake::Signal(sig) if tracer.on_signal(sig) => Some(Stop::Signal(sig)),
            Wake::TargetExited if tracer.is_command => Some(Stop::Command(tracer.reap_command().unwrap_or(1))),
            _ => None,
        };
        if let (None, Some(sig)) = (stop, tracer.signal_grace_expired()) {
            let _ = tracer.end_command();
            stop = Some(Stop::Command(128 + sig));
        }
        selfstats::sample_fill(tracer.probes.rings_mut(), &shared.ring_fill);
        {
            let mut model = lock(&shared.model);
            tracer.drain(&mut *model, false);
            model.sample_from = tracer.degraded;
        }
        tracer.housekeeping();
        let housekeeping = last_housekeeping.elapsed() >= HOUSEKEEPING_INTERVAL;
        if housekeeping || wake == Wake::TargetExited {
            last_housekeeping = Instant::now();
            lock(&shared.model).housekeep(Instant::now());
            // A failed read keeps the last figure: the counter never goes down.
            if let Ok(c) = tracer.probes.counters() {
                let mut status = lock(&shared.status);
                status.lost_events = status.lost_events.max(c.lost_events);
            }
            let before = running.len();
            running.retain(|&pid| {
                let gone = exited(pid);
                if gone {
                    eprintln!("memtrace: pid {pid} exited");
                }
                !gone
            });
            if before > 0 && running.is_empty() && stop.is_none() {
                stop = Some(Stop::Pids);
            }
        }
        if let Some(stop) = stop {
            return Ok(stop);
        }
    }
}

/// Symbolizes new stacks in the background until the namer is stopped.
fn spawn_namer(shared: Arc<Shared>) -> Result<std::thread::JoinHandle<()>> {
    Ok(std::thread::Builder::new().name("memtrace-namer".into()).spawn(move || shared.namer.run(&shared.model))?)
}

pub fn run(args: ServeArgs) -> Result<i32> {
    let config = Config::from_args(args)?;
    for &pid in config.pids.iter().skip(1) {
        check_pid(pid, config.trace.user)?;
    }
    // The address first: a taken one fails before any probe is loaded.
    let listener = bind(config.listen)?;
    let addr = listener.local_addr().unwrap_or(config.listen);
    let mut tracer = Tracer::start(&config.trace, |_| Ok(()))?;
    for &pid in config.pids.iter().skip(1) {
        add_pid(&mut tracer, pid)?;
    }
    let shared = Arc::new(Shared::new(Limits {
        max_live_blocks: config.max_live_blocks,
        max_stacks: config.max_stacks,
        sample_bytes: config.trace.sample_bytes,
    }));
    shared.namer.names().set_alloc_fns(config.alloc_fns.clone());
    let server = http::Server::start(listener, Arc::clone(&shared), config.http.clone())?;
    let namer = spawn_namer(Arc::clone(&shared))?;
    let sampling = match config.trace.sample_bytes {
        Some(n) => format!("sampling one allocation per {} KiB on average", n >> 10),
        None => "every allocation".into(),
    };
    eprintln!("memtrace: serving on http://{addr}: /metrics, /debug/pprof/heap, /debug/pprof/allocs ({sampling})");
    if let Err(e) = tracer.release() {
        server.shutdown(Duration::ZERO);
        shared.namer.stop();
        let _ = namer.join();
        return Err(e);
    }
    let pids: Vec<u32> = match &config.trace.target {
        Target::Pid(_) => config.pids.clone(),
        _ => Vec::new(),
    };
    let stop = block_on(trace(&mut tracer, &shared, &pids))??;
    match stop {
        Stop::Signal(sig) => eprintln!("memtrace: {}: stopping", signal_name(sig)),
        Stop::Command(code) => eprintln!("memtrace: the command exited (status {code}): stopping"),
        Stop::Pids => eprintln!("memtrace: every traced process exited: stopping"),
    }
    // A command still running (a second Ctrl-C, or it ignored the first) ends with us.
    let _ = tracer.end_command();
    // The probes go first; clients in flight get their answer from what was gathered.
    let (teardown, _) = {
        let mut model = lock(&shared.model);
        tracer.stop(&mut *model)
    };
    teardown.join();
    server.shutdown(Duration::from_secs(2));
    shared.namer.stop();
    let _ = namer.join();
    eprintln!("memtrace: stopped; every probe removed");
    Ok(match stop {
        Stop::Command(code) => code,
        Stop::Signal(sig) if tracer.is_command => 128 + sig,
        _ => 0,
    })
}
