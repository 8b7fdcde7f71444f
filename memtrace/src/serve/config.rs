//! `memtrace serve`'s command line and what it becomes: what to trace, how (sampled by
//! default), where to listen (loopback unless told otherwise), the bearer token, and the
//! bounds on memory and on clients.
use std::{
    ffi::OsString,
    net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs as _},
    path::PathBuf,
    time::Duration,
};

use anyhow::{Context as _, Result, bail};
use clap::Args;

use crate::{
    probes::{CallGraph, PythonFrames},
    session::{Target, TraceOptions, priority::Niceness},
};

/// The port Go programs serve pprof on by convention.
pub const DEFAULT_PORT: u16 = 6060;
/// Go's `runtime.MemProfileRate`: one sample per 512 KiB allocated.
pub const DEFAULT_SAMPLE_BYTES: u64 = 512 << 10;

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Where to serve /metrics and /debug/pprof/: HOST:PORT, [IPv6]:PORT, or PORT (on
    /// 127.0.0.1). Other hosts can scrape only with an address they reach, e.g.
    /// 0.0.0.0:6060. Port 0 picks a free port (printed at start).
    #[arg(long, default_value = "127.0.0.1:6060", value_name = "ADDR")]
    pub listen: String,
    /// Trace this running process (repeat for several).
    #[arg(short, long = "pid", value_name = "PID", conflicts_with_all = ["all", "command"], allow_negative_numbers = true)]
    pub pids: Vec<u32>,
    /// Trace every process and the kernel, including processes started later.
    #[arg(short = 'a', long, conflicts_with = "command")]
    pub all: bool,
    /// Sample user allocations: each byte with probability 1/SIZE, figures scaled back
    /// (Go's and jemalloc's default, 512k); 0 records every allocation.
    #[arg(long, value_parser = parse_sample_bytes, default_value = "512k", value_name = "SIZE")]
    pub sample_bytes: u64,
    /// memtrace's own niceness, -20 to 19 (default: the one it was started with; `record`
    /// and `top` take -10): under `-a` on a busy host, its threads then drain the rings
    /// ahead of the load. The command runs at the niceness memtrace was started with.
    #[arg(long, allow_negative_numbers = true, value_parser = clap::value_parser!(i32).range(-20..=19))]
    pub nice: Option<i32>,
    /// Sites per process (and domain) with their own series in /metrics, by live bytes;
    /// the others are summed under site="[other]".
    #[arg(long, default_value_t = 20, value_name = "N", allow_negative_numbers = true)]
    pub top_sites: usize,
    /// Series per metric at most (at least 10; 0: no cap), as OpenTelemetry's cardinality
    /// limit: past it, the process groups with the fewest live bytes are summed into one
    /// series, comm="[other]" site="[other]" (memtrace_groups_folded says how many), and
    /// the last group shown keeps the sites that fit. Keeps a scrape under Prometheus's
    /// sample_limit under -a with --pid-label.
    #[arg(long, default_value_t = 2000, value_name = "N", allow_negative_numbers = true)]
    pub max_series: usize,
    /// Add a pid label to the series (one series set per process rather than per command
    /// name and cgroup).
    #[arg(long)]
    pub pid_label: bool,
    /// Live blocks followed at most; beyond, allocations are counted but not followed
    /// (about 50 bytes each).
    #[arg(long, default_value_t = 1_000_000, value_name = "N", allow_negative_numbers = true)]
    pub max_live_blocks: usize,
    /// Distinct stacks kept at most (a stack goes when no site of a live process uses it);
    /// beyond, new stacks show as "[stack table full]".
    #[arg(long, default_value_t = 100_000, value_name = "N", allow_negative_numbers = true)]
    pub max_stacks: usize,
    /// Require `Authorization: Bearer TOKEN` (the token is the file's content), as
    /// Prometheus's, Parca's and Alloy's scrape configs can send.
    #[arg(long, value_name = "FILE")]
    pub auth_token_file: Option<PathBuf>,
    /// Requests answered at once, scrapes of /metrics and profiles each; more wait a second
    /// for a slot, then get 503 (the health check takes none). 16 times as many
    /// connections are kept open.
    #[arg(long, default_value_t = 8, value_name = "N", allow_negative_numbers = true)]
    pub max_connections: usize,
    /// Do not trace user-space allocators.
    #[arg(long)]
    pub no_user: bool,
    /// Do not trace kernel allocations.
    #[arg(long)]
    pub no_kernel: bool,
    /// Do not walk kernel stacks (kernel call sites are still known; much cheaper under -a).
    #[arg(long)]
    pub no_kernel_stacks: bool,
    /// How to walk user stacks: dwarf (call-frame information) or fp (frame pointers).
    #[arg(long, value_enum, default_value_t)]
    pub call_graph: CallGraph,
    /// Python frames in the stacks of processes running CPython 3.10 to 3.13: each
    /// interpreter frame replaced by the Python functions and lines it ran (off: native
    /// frames only).
    #[arg(long, value_enum, default_value_t)]
    pub python_frames: PythonFrames,
    /// Prefix of the allocator's functions, for custom allocators.
    #[arg(long, default_value = "", value_name = "PREFIX")]
    pub symbol_prefix: String,
    /// Ring buffer size per CPU (a power of two). Default: 16M shared among the CPUs, 1M to
    /// 8M each (sampling keeps the traffic low; the rings are most of the agent's memory).
    #[arg(long, value_parser = parse_size, value_name = "SIZE")]
    pub ring_size: Option<u64>,
    #[command(flatten)]
    pub sites: crate::wrappers::AllocFnArgs,
    /// The command to run and trace, with its arguments (`--` before it is optional);
    /// memtrace exits with it.
    #[arg(trailing_var_arg = true, value_name = "CMD")]
    pub command: Vec<OsString>,
}

/// What the HTTP side needs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpConfig {
    pub auth_token: Option<String>,
    pub max_connections: usize,
    /// Longest `?seconds=` of a delta profile.
    pub max_profile_seconds: u64,
    /// Waiting for a request's head.
    pub header_timeout: Duration,
    /// Building a response (beyond a delta profile's wait).
    pub request_timeout: Duration,
    pub top_sites: usize,
    pub pid_label: bool,
    /// Series per metric at most (0: no cap).
    pub max_series: usize,
}

/// The whole configuration, checked.
#[derive(Debug, Clone)]
pub struct Config {
    pub listen: SocketAddr,
    pub trace: TraceOptions,
    /// Every pid of `--pid` (the session starts with the first).
    pub pids: Vec<u32>,
    pub http: HttpConfig,
    pub max_live_blocks: usize,
    pub max_stacks: usize,
    /// The allocation wrappers a site is named past (`--alloc-fn`).
    pub alloc_fns: crate::wrappers::AllocFns,
}

/// Parses a listen address: HOST:PORT, [V6]:PORT, :PORT or PORT (the last two on the
/// loopback interface: memtrace exposes what other users' programs do, so it is reachable
/// from elsewhere only when asked).
pub fn parse_listen(s: &str) -> Result<SocketAddr> {
    let s = s.trim();
    let port_only = s.strip_prefix(':').unwrap_or(s);
    if let Ok(port) = port_only.parse::<u16>() {
        return Ok(SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), port));
    }
    if let Ok(addr) = s.parse::<SocketAddr>() {
        return Ok(addr);
    }
    let Some((host, port)) = s.rsplit_once(':') else {
        bail!("--listen {s:?}: expected HOST:PORT (e.g. 127.0.0.1:6060, [::1]:6060, 0.0.0.0:6060) or PORT");
    };
    if port.parse::<u16>().is_err() {
        bail!("--listen {s:?}: {port:?} is not a port number");
    }
    // A name: the first address it resolves to.
    (host, port.parse::<u16>()?)
        .to_socket_addrs()
        .with_context(|| format!("--listen {s:?}: cannot resolve {host:?}"))?
        .next()
        .with_context(|| format!("--listen {s:?}: {host:?} has no address"))
}

/// Sizes as `record` takes them: 4096, 64k, 2M, 1G.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let n: u64 = number.parse().map_err(|_| format!("not a size: {s:?}"))?;
    let scale = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        other => return Err(format!("unknown size unit {other:?}")),
    };
    n.checked_mul(scale).ok_or_else(|| format!("size too large: {s:?}"))
}

/// A sampling period (`--sample-bytes`): below 1 TiB; 0 records every allocation.
pub fn parse_sample_bytes(s: &str) -> Result<u64, String> {
    let n = parse_size(s)?;
    if n >= 1 << 40 {
        return Err(format!("sampling period must be below 1 TiB, not {s:?}"));
    }
    Ok(n)
}

/// Reads the bearer token: the file's content without surrounding whitespace. The file
/// may be a symbolic link (Kubernetes mounts secrets so); it must hold a token.
pub fn read_token(path: &std::path::Path) -> Result<String> {
    let meta = std::fs::metadata(path).with_context(|| format!("--auth-token-file {}", path.display()))?;
    if !meta.is_file() {
        bail!("--auth-token-file {}: not a regular file", path.display());
    }
    if meta.len() > 4096 {
        bail!("--auth-token-file {}: {} bytes is too long for a token", path.display(), meta.len());
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("--auth-token-file {}", path.display()))?;
    let token = text.trim();
    if token.is_empty() {
        bail!("--auth-token-file {}: the file is empty", path.display());
    }
    if token.chars().any(|c| c.is_whitespace() || c.is_control()) {
        bail!("--auth-token-file {}: a token is one line without spaces", path.display());
    }
    Ok(token.to_string())
}

/// Per-CPU ring size: 16 MiB shared among the CPUs, between 1 and 8 MiB each (half of
/// `record`'s: sampled user events are few).
fn default_ring_bytes() -> u64 {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
    (16u64 << 20).div_ceil(cpus).next_power_of_two().clamp(1 << 20, 8 << 20)
}

impl Config {
    pub fn from_args(args: ServeArgs) -> Result<Self> {
        let target = match (args.pids.first(), args.all, args.command.is_empty()) {
            (Some(&pid), _, _) => Target::Pid(pid),
            (None, true, _) => Target::All,
            (None, false, false) => Target::Command(args.command.clone()),
            (None, false, true) => bail!("say what to trace: --pid PID, -a, or -- CMD [ARGS...]"),
        };
        let mut pids: Vec<u32> = Vec::with_capacity(args.pids.len());
        for &pid in &args.pids {
            if !pids.contains(&pid) {
                pids.push(pid);
            }
        }
        if (1..10).contains(&args.max_series) {
            bail!("--max-series must be at least 10 (or 0: no cap)");
        }
        if args.top_sites == 0 {
            bail!("--top-sites must be at least 1");
        }
        if args.max_connections == 0 {
            bail!("--max-connections must be at least 1");
        }
        let ring_size = args.ring_size.unwrap_or_else(default_ring_bytes);
        let Some(ring_bytes) = u32::try_from(ring_size).ok().filter(|b| b.is_power_of_two() && *b >= 4096) else {
            bail!("--ring-size must be a power of two between 4K and 2G, not {ring_size}");
        };
        let auth_token = args.auth_token_file.as_deref().map(read_token).transpose()?;
        Ok(Self {
            listen: parse_listen(&args.listen)?,
            trace: TraceOptions {
                target,
                user: !args.no_user,
                kernel: !args.no_kernel,
                user_stacks: true,
                kernel_stacks: !args.no_kernel_stacks,
                symbol_prefix: args.symbol_prefix,
                ring_bytes,
                follow_forks: false,
                quiet: false,
                sample_bytes: (args.sample_bytes > 0).then_some(args.sample_bytes),
                call_graph: args.call_graph,
                unwind: Default::default(),
                python_frames: args.python_frames,
                nice: args.nice.map_or(Niceness::Keep, |n| Niceness::Take(Some(n))),
            },
            pids,
            http: HttpConfig {
                auth_token,
                max_connections: args.max_connections,
                max_profile_seconds: 300,
                header_timeout: Duration::from_secs(10),
                request_timeout: Duration::from_secs(30),
                top_sites: args.top_sites,
                pid_label: args.pid_label,
                max_series: args.max_series,
            },
            max_live_blocks: args.max_live_blocks,
            max_stacks: args.max_stacks,
            alloc_fns: args.sites.alloc_fns(),
        })
    }
}
