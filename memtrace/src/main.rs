//! The `memtrace` command line: parses arguments, runs a subcommand, and turns every error
//! into one line on stderr and a non-zero exit code.
//!
//! Over 500 lines: the clap definitions of every subcommand and their translation to options; the work is done in the library.
/// memtrace's own allocations go to the mimalloc built into it, never through the C
/// library's malloc: its probes trap on every call of every process using that library,
/// memtrace included, and memtrace allocates for each stack it reads.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

// SAFETY: `mi_option_set(mi_option_t, long)` is mimalloc's C API, in the static library the
// `mimalloc` crate links (libmimalloc-sys 0.1.49 builds mimalloc v3; its Rust constants
// stop before the two options below).
unsafe extern "C" {
    fn mi_option_set(option: std::ffi::c_int, value: std::ffi::c_long);
}

/// Positions in mimalloc v3's `mi_option_e` (stable: retired options keep their place).
const MI_OPTION_ARENA_EAGER_COMMIT: std::ffi::c_int = 4;
const MI_OPTION_PURGE_DELAY: std::ffi::c_int = 15;

/// Keeps memtrace's heap to what it uses: mimalloc's defaults commit its arenas eagerly
/// and hand freed memory back to the OS a second later, which on the heavy Python bench
/// held a peak of 245-270 MB (295-319 MB with a cold unwind cache); with lazily committed
/// arenas and memory handed back at once, 160-181 MB (168-175 MB cold), for no measurable
/// CPU. A burst of stacks is decoded and dropped within a drain; without this its pages
/// stayed resident.
///
/// Runs before `main` (from `.init_array`), before the Rust runtime's first allocation
/// makes mimalloc reserve its first arena with the default options.
extern "C" fn tune_heap() {
    // SAFETY: plain setters of mimalloc's global options, called before any thread starts.
    unsafe {
        mi_option_set(MI_OPTION_ARENA_EAGER_COMMIT, 0);
        mi_option_set(MI_OPTION_PURGE_DELAY, 0);
    }
}

#[used]
// SAFETY: `.init_array` holds pointers to functions the loader calls before `main`;
// `tune_heap` takes no arguments and touches nothing but mimalloc's options.
#[unsafe(link_section = ".init_array")]
static TUNE_HEAP: extern "C" fn() = tune_heap;

use std::{
    ffi::OsString,
    io::Write,
    path::{Path, PathBuf},
    process::ExitCode,
    time::Duration,
};

use anyhow::{Result, bail};
use clap::{Args, Parser, Subcommand};
use memtrace::{
    columns::Layout,
    export::{self, ExportFormat, Weight},
    grouping::{DomainFilter, Filters, GroupBy, KindFilter},
    probes::{CallGraph, PythonFrames},
    report::{self, Format, ReportColumn, ReportOptions, SortKey},
    serve::config::{parse_sample_bytes, parse_size},
    session::{self, CommandFailed, RecordOptions, Target, TraceOptions, priority::Niceness},
    top::model::{Column, ViewOptions},
    unwind::UnwindOptions,
};

#[derive(Parser)]
#[command(name = "memtrace", version, about = "Trace memory allocations, kernel and user, with eBPF")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Trace allocations and frees into a recording file.
    Record(RecordArgs),
    /// Summarize a recording per call site, stack, function or process.
    Report(ReportArgs),
    /// Print every event of a recording, one per line (like `perf script`).
    Dump(DumpArgs),
    /// Write folded stacks, an SVG flame graph or a pprof profile.
    Export(ExportArgs),
    /// Compare two recordings site by site: what grew and what shrank, largest growth first.
    Diff(DiffArgs),
    /// A live view of allocations, like top (whole machine unless --pid or -- CMD).
    Top(TopArgs),
    /// An always-on agent: Prometheus /metrics and Go-style /debug/pprof/heap and allocs
    /// over HTTP, sampled by default.
    Serve(memtrace::serve::ServeArgs),
    /// Benchmark baseline: run a command with empty probes at malloc entry/return and
    /// free entry (what any uprobe tracer pays at least).
    #[command(hide = true)]
    BenchBaseline(BaselineArgs),
}

#[derive(Args)]
struct BaselineArgs {
    /// Put the empty probes where memtrace places its own, not at the function entries.
    #[arg(long)]
    placed: bool,
    /// No return probe on malloc (what an entry program that skips its return probe, as
    /// uprobe sessions allow, would cost).
    #[arg(long)]
    no_return: bool,
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<OsString>,
}

#[derive(Args)]
struct TopArgs {
    /// Watch a running process (and its threads).
    #[arg(short, long, conflicts_with = "command", allow_negative_numbers = true)]
    pid: Option<u32>,
    /// Seconds between refreshes.
    #[arg(
        short = 'd',
        long = "delay",
        value_parser = parse_positive_duration,
        default_value = "1",
        allow_hyphen_values = true
    )]
    delay: Duration,
    /// Batch mode: plain-text snapshots on stdout, like top -b.
    #[arg(short, long)]
    batch: bool,
    /// Stop after this many refreshes (with a command: one still running then is ended,
    /// SIGTERM, and top says so).
    #[arg(short = 'n', long, value_parser = clap::value_parser!(u64).range(1..))]
    iterations: Option<u64>,
    /// Rows per snapshot in batch mode.
    #[arg(long, default_value_t = 25)]
    rows: usize,
    /// What a row stands for.
    #[arg(long, value_enum, default_value_t)]
    by: GroupBy,
    /// Which allocations: user space, kernel, or both.
    #[arg(long, value_enum, default_value_t)]
    domain: DomainFilter,
    /// Column to sort by.
    #[arg(long, value_enum, default_value_t)]
    sort: Column,
    /// Only rows whose name or stack contains this text.
    #[arg(long, default_value = "")]
    filter: String,
    /// Every column; batch snapshots are not fitted to the terminal (the full-screen view
    /// shows what fits the screen).
    #[arg(short, long)]
    wide: bool,
    /// These columns, in this order (comma-separated); the domain comes first and the name
    /// last.
    #[arg(long, value_enum, value_delimiter = ',')]
    fields: Vec<Column>,
    /// Live blocks followed at most; beyond, allocations are counted but not followed
    /// (bounds memtrace's memory: about 100 bytes per block).
    #[arg(long, default_value_t = 2_000_000)]
    max_live_blocks: usize,
    /// Do not trace user-space allocators.
    #[arg(long)]
    no_user: bool,
    /// Do not trace kernel allocations.
    #[arg(long)]
    no_kernel: bool,
    /// Prefix of the allocator's functions, for custom allocators.
    #[arg(long, default_value = "")]
    symbol_prefix: String,
    /// Sample user allocations: each byte with probability 1/SIZE (figures are estimates);
    /// 0 (the default) shows every allocation.
    #[arg(long, value_parser = parse_sample_bytes)]
    sample_bytes: Option<u64>,
    /// How to walk user stacks: dwarf (call-frame information, whole stacks without frame
    /// pointers) or fp (frame pointers only, cheapest).
    #[arg(long, value_enum, default_value_t)]
    call_graph: CallGraph,
    /// Python frames in the stacks of processes running CPython 3.10 to 3.13: each
    /// interpreter frame replaced by the Python functions and lines it ran (off: native
    /// frames only).
    #[arg(long, value_enum, default_value_t)]
    python_frames: PythonFrames,
    /// memtrace's own niceness while it traces, -20 to 19 (default: -10 when started at the
    /// usual 0, else the one it was started with): its threads drain the rings and build
    /// unwind tables ahead of a busy machine's load. The command runs at the niceness
    /// memtrace was started with.
    #[arg(long, allow_negative_numbers = true, value_parser = clap::value_parser!(i32).range(-20..=19))]
    nice: Option<i32>,
    #[command(flatten)]
    sites: memtrace::wrappers::AllocFnArgs,
    /// The command to run and watch, with its arguments (`--` before it is optional).
    #[arg(trailing_var_arg = true, value_name = "CMD")]
    command: Vec<OsString>,
}

fn top(args: TopArgs) -> Result<i32> {
    let target = match (args.pid, args.command.is_empty()) {
        (Some(pid), _) => Target::Pid(pid),
        (None, false) => Target::Command(args.command),
        (None, true) => Target::All,
    };
    memtrace::top::run(memtrace::top::TopOptions {
        trace: TraceOptions {
            target,
            user: !args.no_user,
            kernel: !args.no_kernel,
            user_stacks: true,
            kernel_stacks: true,
            symbol_prefix: args.symbol_prefix,
            ring_bytes: default_ring_bytes() as u32,
            follow_forks: false,
            quiet: false,
            sample_bytes: args.sample_bytes.filter(|&n| n > 0),
            call_graph: args.call_graph,
            unwind: UnwindOptions::default(),
            python_frames: args.python_frames,
            nice: Niceness::Take(args.nice),
        },
        interval: args.delay.max(Duration::from_millis(100)),
        batch: args.batch,
        iterations: args.iterations,
        live_limit: args.max_live_blocks,
        rows: args.rows,
        view: ViewOptions { by: args.by, domain: args.domain, sort: args.sort, filter: args.filter },
        layout: Layout::from_flags(args.wide, args.fields),
        alloc_fns: args.sites.alloc_fns(),
    })
}

#[derive(Args)]
struct ExportArgs {
    /// The recording to read.
    #[arg(short, long, default_value = DEFAULT_RECORDING)]
    input: PathBuf,
    /// Where to write (default: standard output). An existing file is replaced only if it
    /// is an earlier export of the same format; never the recording itself.
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// Replace the output file even if it is not an earlier export of this format.
    #[arg(long)]
    force: bool,
    #[arg(long, value_enum, default_value_t)]
    format: ExportFormat,
    /// What the width of a frame stands for (folded and svg; pprof carries them all).
    #[arg(long, value_enum, default_value_t)]
    weight: Weight,
    /// Export the change since this earlier recording: a differential flame graph (folded
    /// `stack old new`, svg) or a pprof profile with the base subtracted.
    #[arg(long, value_name = "OLD")]
    diff_base: Option<PathBuf>,
    #[command(flatten)]
    filters: FilterArgs,
}

/// Which allocations count: the filters `report` and `export` share.
#[derive(Args)]
struct FilterArgs {
    /// Which allocations: user space, kernel, or both side by side.
    #[arg(long, value_enum, default_value_t)]
    domain: DomainFilter,
    /// Only this process.
    #[arg(long)]
    pid: Option<u32>,
    /// Only processes with this command name.
    #[arg(long)]
    comm: Option<String>,
    /// Only allocations of at least this many bytes requested (e.g. 4k).
    #[arg(long, value_parser = parse_size)]
    min_size: Option<u64>,
    /// Only these kinds of allocation (repeat or comma-separate).
    #[arg(long, value_enum, value_delimiter = ',')]
    kind: Vec<KindFilter>,
    /// Only user allocations of this allocator: a family (glibc, jemalloc, mimalloc,
    /// tcmalloc, musl, unknown), a symbol prefix, or part of the module's path.
    #[arg(long)]
    allocator: Option<String>,
}

impl From<FilterArgs> for Filters {
    fn from(a: FilterArgs) -> Self {
        Self { domain: a.domain, pid: a.pid, comm: a.comm, min_size: a.min_size, kinds: a.kind, allocator: a.allocator }
    }
}

/// Where `record` writes and `report`, `dump` and `export` read by default.
const DEFAULT_RECORDING: &str = "memtrace.data";

fn export(args: ExportArgs) -> Result<i32> {
    readable_recording(&args.input)?;
    // `-o -`: standard output, as without `-o`.
    let output = args.output.as_deref().filter(|p| *p != std::path::Path::new("-"));
    if args.format == ExportFormat::Pprof && output.is_none() && std::io::IsTerminal::is_terminal(&std::io::stdout()) {
        // As gzip refuses to: the profile is gzip-compressed bytes.
        bail!("a pprof profile is binary (gzip-compressed): give -o FILE.pb.gz (or redirect the output)");
    }
    let opts = ReportOptions {
        by: GroupBy::Stack,
        filters: args.filters.into(),
        split_processes: true,
        // Each export names its rows one at a time.
        rows_unnamed: true,
        ..Default::default()
    };
    let summary = report::analyze(&args.input, &opts)?;
    report::check_filters(&summary, &opts.filters, &args.input)?;
    let base = args.diff_base.as_ref().map(|p| report::analyze(p, &opts)).transpose()?;
    for w in &summary.warnings {
        eprintln!("memtrace: warning: {w}");
    }
    if let (Some(base), Some(path)) = (&base, &args.diff_base) {
        warn_of(path, &base.warnings);
    }
    let mut out: Box<dyn std::io::Write> = match output {
        Some(path) => {
            let format = args.format;
            let inputs: Vec<&Path> = std::iter::once(args.input.as_path()).chain(args.diff_base.as_deref()).collect();
            let file =
                session::output::create_export(path, &inputs, args.force, format.noun(), &|p| format.recognizes(p))?;
            Box::new(std::io::BufWriter::new(file))
        }
        None => Box::new(std::io::BufWriter::new(std::io::stdout().lock())),
    };
    let result =
        export::write(args.format, summary, base.as_ref(), args.weight, &mut out).and_then(|()| Ok(out.flush()?));
    drop(out);
    match result {
        Err(e) if e.downcast_ref::<std::io::Error>().is_some_and(|e| e.kind() == std::io::ErrorKind::BrokenPipe) => {
            Ok(0)
        }
        Err(e) => {
            if let Some(path) = output {
                // Nothing usable was written: leave no file behind.
                let _ = std::fs::remove_file(path);
                return Err(e.context(format!("writing {}", path.display())));
            }
            Err(e.context("writing the export to standard output"))
        }
        Ok(()) => Ok(0),
    }
}

#[derive(Args)]
struct DiffArgs {
    /// The earlier recording (the base).
    old: PathBuf,
    /// The later recording.
    new: PathBuf,
    #[arg(long, value_enum, default_value_t)]
    format: report::diff::DiffFormat,
    /// What a row stands for; rows are matched by their symbolized frames.
    #[arg(long, value_enum, default_value_t)]
    by: GroupBy,
    #[command(flatten)]
    filters: FilterArgs,
    /// The change rows are sorted by, largest growth first.
    #[arg(long, value_enum, default_value_t)]
    sort: report::diff::DiffSort,
    /// Show only the first N rows that changed.
    #[arg(long)]
    top: Option<usize>,
    /// Lines as long as their names (default: fit the terminal).
    #[arg(short, long)]
    wide: bool,
    /// Where to write (default: standard output).
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// With -o: replace the file even if it is not an earlier memtrace report.
    #[arg(long, requires = "output")]
    force: bool,
    #[command(flatten)]
    sites: memtrace::wrappers::AllocFnArgs,
}

/// A recording's warnings on stderr, each naming the recording (one of two read).
fn warn_of(recording: &std::path::Path, warnings: &[String]) {
    for w in warnings {
        eprintln!("memtrace: warning: {}: {w}", recording.display());
    }
}

fn diff(args: DiffArgs) -> Result<i32> {
    use report::diff::{DiffFormat, DiffOptions};
    readable_recording(&args.old)?;
    readable_recording(&args.new)?;
    let opts = DiffOptions {
        format: args.format,
        by: args.by,
        filters: args.filters.into(),
        sort: args.sort,
        top: args.top,
        width: Layout::<ReportColumn>::from_flags(args.wide, Vec::new()).width,
        alloc_fns: args.sites.alloc_fns(),
    };
    let d = report::diff::diff(&args.old, &args.new, &opts)?;
    // The warnings report gives of each recording (truncated, not finalized, damaged,
    // under-counting), naming it.
    warn_of(&args.old, &d.old.warnings);
    warn_of(&args.new, &d.new.warnings);
    let inputs = [args.old.as_path(), args.new.as_path()];
    match opts.format {
        DiffFormat::Text => {
            let text = report::diff_render::render_diff_text(&d, opts.width);
            write_report("comparison", args.output.as_deref(), &inputs, args.force, &|w| w.write_all(text.as_bytes()))
        }
        // Written as it is made: every row of two deep recordings by stack runs to GBs.
        DiffFormat::Json => {
            let write = |w: &mut dyn Write| report::diff_render::write_diff_json(&d, w);
            write_report("comparison", args.output.as_deref(), &inputs, args.force, &write)
        }
    }
}

#[derive(Args)]
struct DumpArgs {
    /// The recording to read.
    #[arg(short, long, default_value = DEFAULT_RECORDING)]
    input: PathBuf,
    /// Print each allocation's stack under it, symbolized (like `perf script` with -g
    /// recordings).
    #[arg(short = 'g', long)]
    call_graph: bool,
    /// Print the stacks events refer to (`stack=N`) instead of the events.
    #[arg(long)]
    stacks: bool,
}

fn dump(args: DumpArgs) -> Result<i32> {
    readable_recording(&args.input)?;
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    let opts = memtrace::dump::DumpOptions { call_graph: args.call_graph, stacks: args.stacks };
    memtrace::dump::dump(&args.input, opts, &mut out)?;
    Ok(0)
}

/// Timestamps of a recording are kept to this many nanoseconds unless `--exact-times`.
const DEFAULT_TIME_RESOLUTION_NS: u64 = 1000;

fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (number, scale) = if let Some(v) = s.strip_suffix("ms") {
        (v, 1e-3)
    } else if let Some(v) = s.strip_suffix('s') {
        (v, 1.0)
    } else if let Some(v) = s.strip_suffix('m') {
        (v, 60.0)
    } else if let Some(v) = s.strip_suffix('h') {
        (v, 3600.0)
    } else {
        (s, 1.0)
    };
    let value: f64 = number.trim().parse().map_err(|_| format!("not a duration: {s:?} (try 5s, 500ms, 2m)"))?;
    if !(value.is_finite() && value >= 0.0) {
        return Err(format!("not a duration: {s:?}"));
    }
    Ok(Duration::from_secs_f64(value * scale))
}

/// A duration longer than zero (a refresh delay, how long to record).
fn parse_positive_duration(s: &str) -> Result<Duration, String> {
    let d = parse_duration(s)?;
    if d.is_zero() {
        return Err(format!("{s:?} is no time: give a duration above zero (e.g. 500ms)"));
    }
    Ok(d)
}

/// A time resolution (`500ns`, `10us`, `1ms`, `1s`) in nanoseconds, from 1 ns to 1 s.
fn parse_time_resolution(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (number, ns) = [("ns", 1.0), ("us", 1e3), ("µs", 1e3), ("ms", 1e6), ("s", 1e9)]
        .into_iter()
        .find_map(|(unit, ns)| t.strip_suffix(unit).map(|n| (n, ns)))
        .ok_or_else(|| format!("not a resolution: {s:?} (try 10us, 1ms)"))?;
    let value: f64 = number.trim().parse().map_err(|_| format!("not a resolution: {s:?} (try 10us, 1ms)"))?;
    let total = value * ns;
    if !(total.is_finite() && (1.0..=1e9).contains(&total)) || total.fract() != 0.0 {
        return Err(format!("a resolution is a whole number of nanoseconds from 1ns to 1s, not {s:?}"));
    }
    Ok(total as u64)
}

#[derive(Args)]
struct RecordArgs {
    /// Trace a running process (and its threads).
    #[arg(short, long, conflicts_with_all = ["all", "command"], allow_negative_numbers = true)]
    pid: Option<u32>,
    /// Trace every process and the kernel, including processes started later.
    #[arg(short = 'a', long, conflicts_with = "command")]
    all: bool,
    /// Where to write the recording.
    #[arg(short, long, default_value = DEFAULT_RECORDING)]
    output: PathBuf,
    /// Replace the output file even if it is not a memtrace recording.
    #[arg(long)]
    force: bool,
    /// Stop after this long (e.g. 10s, 500ms, 2m).
    #[arg(short, long, value_parser = parse_positive_duration, allow_hyphen_values = true)]
    duration: Option<Duration>,
    /// Do not trace user-space allocators.
    #[arg(long)]
    no_user: bool,
    /// Do not trace kernel allocations.
    #[arg(long)]
    no_kernel: bool,
    /// Do not walk kernel stacks (kernel call sites are still recorded).
    #[arg(long)]
    no_kernel_stacks: bool,
    /// Do not walk user stacks.
    #[arg(long)]
    no_user_stacks: bool,
    /// How to walk user stacks: dwarf (the modules' call-frame information: whole stacks
    /// without frame pointers, like perf --call-graph dwarf) or fp (frame pointers only:
    /// cheapest, but stacks stop at code built without them).
    #[arg(long, value_enum, default_value_t)]
    call_graph: CallGraph,
    /// Python frames in the stacks of processes running CPython 3.10 to 3.13: each
    /// interpreter frame replaced by the Python functions and lines it ran (off: native
    /// frames only).
    #[arg(long, value_enum, default_value_t)]
    python_frames: PythonFrames,
    /// Build every unwind table afresh: do not read or fill the cache of tables
    /// (/var/cache/memtrace/unwind).
    #[arg(long)]
    no_unwind_cache: bool,
    /// Memory the unwind tables may take in the kernel (default 1G); past it, further files
    /// are walked by frame pointers only (stacks are cut short where they keep none), with
    /// a warning.
    #[arg(long, value_parser = parse_size)]
    unwind_memory: Option<u64>,
    /// Prefix of the allocator's functions, for custom allocators (e.g. je_ for jemalloc).
    #[arg(long, default_value = "")]
    symbol_prefix: String,
    /// Ring buffer size per CPU (e.g. 4M; a power of two). Default: 32M shared among the
    /// CPUs, 4M to 16M each (room for the stack copies sent while a new process's unwind
    /// rules are learned).
    #[arg(long, value_parser = parse_size)]
    ring_size: Option<u64>,
    /// memtrace's own niceness while it traces, -20 to 19 (default: -10 when started at the
    /// usual 0, else the one it was started with): its threads drain the rings and build
    /// unwind tables ahead of a busy machine's load. The command runs at the niceness
    /// memtrace was started with.
    #[arg(long, allow_negative_numbers = true, value_parser = clap::value_parser!(i32).range(-20..=19))]
    nice: Option<i32>,
    /// With --pid, also trace the children the process forks from now on.
    #[arg(long)]
    follow_forks: bool,
    /// Sample user allocations: each byte with probability 1/SIZE (e.g. 512k), like
    /// jemalloc/tcmalloc heap profiles; reports scale the figures back (estimates). 0 (the
    /// default) records every allocation, as `serve --sample-bytes 0` does.
    #[arg(long, value_parser = parse_sample_bytes)]
    sample_bytes: Option<u64>,
    /// Keep event timestamps to the nanosecond (default: to the microsecond, as `perf
    /// script` prints them; the nanoseconds are below the probes' own cost and took most of a
    /// recording's size).
    #[arg(long, conflicts_with = "time_resolution")]
    exact_times: bool,
    /// Keep event timestamps to this resolution (default 1us; e.g. 10us, 1ms, at most 1s):
    /// a coarser one makes the recording of an allocation-heavy program smaller (times are
    /// a third of GCC's; heaptrack keeps one timestamp each 10 ms), and lifetimes and
    /// times are known to it only.
    #[arg(long, value_parser = parse_time_resolution, value_name = "DURATION")]
    time_resolution: Option<u64>,
    /// No status line or summary on stderr.
    #[arg(short, long)]
    quiet: bool,
    /// The command to run and trace, with its arguments (like `perf record ./prog args`;
    /// everything from the command on is its own; `--` before it is optional).
    #[arg(trailing_var_arg = true, value_name = "CMD")]
    command: Vec<OsString>,
}

#[derive(Args)]
struct ReportArgs {
    /// The recording to read.
    #[arg(short, long, default_value = DEFAULT_RECORDING)]
    input: PathBuf,
    #[arg(long, value_enum, default_value_t)]
    format: Format,
    /// What a row stands for.
    #[arg(long, value_enum, default_value_t)]
    by: GroupBy,
    #[command(flatten)]
    filters: FilterArgs,
    /// Column to sort by (largest first; with --leaks: blocks, bytes or age, largest bytes
    /// allocated first by default).
    #[arg(long, value_enum, default_value_t)]
    sort: SortKey,
    /// Show only the first N rows (with --by process, the first N processes, each with its
    /// rows per domain).
    #[arg(long)]
    top: Option<usize>,
    /// Every column, and lines as long as their names (default: the columns that fit the
    /// terminal: $COLUMNS, else its width, else 80).
    #[arg(short, long)]
    wide: bool,
    /// These columns, in this order (comma-separated); the domain comes first and the name
    /// last.
    #[arg(long, value_enum, value_delimiter = ',')]
    fields: Vec<ReportColumn>,
    /// List the blocks still live at the end, grouped by stack, largest first (--sort age:
    /// oldest first).
    #[arg(long)]
    leaks: bool,
    /// With --leaks: only blocks at least this old at the end (e.g. 5s).
    #[arg(long, value_parser = parse_duration, requires = "leaks")]
    older_than: Option<Duration>,
    /// Memory over time: a sparkline per domain and per top row (JSON: each top site's
    /// series; the domains' are always in `timeline`).
    #[arg(long)]
    timeline: bool,
    /// Requested sizes in power-of-two buckets, per domain and per top row.
    #[arg(long)]
    histogram: bool,
    /// Where to write (default: standard output); the HTML report goes here.
    #[arg(short, long)]
    output: Option<PathBuf>,
    /// With -o: replace the file even if it is not an earlier memtrace report.
    #[arg(long, requires = "output")]
    force: bool,
    #[command(flatten)]
    sites: memtrace::wrappers::AllocFnArgs,
}

/// Per-CPU ring size: 32 MiB shared among the CPUs, between 4 and 16 MiB each.
fn default_ring_bytes() -> u64 {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
    (32u64 << 20).div_ceil(cpus).next_power_of_two().clamp(4 << 20, 16 << 20)
}

fn record(args: RecordArgs) -> Result<i32> {
    // `perf record -o -` writes to stdout; a recording is read twice (its definitions,
    // then its events) and so must be a file: a file named "-" was written instead.
    if args.output.as_os_str() == "-" {
        bail!("-o -: a recording is a file that report, export and dump read more than once; give a path");
    }
    let target = match (args.pid, args.all, args.command.is_empty()) {
        (Some(pid), _, _) => Target::Pid(pid),
        (None, true, _) => Target::All,
        (None, false, false) => Target::Command(args.command),
        (None, false, true) => bail!("say what to trace: a command (CMD [ARGS...]), --pid PID, or -a"),
    };
    let ring_size = args.ring_size.unwrap_or_else(default_ring_bytes);
    let ring_bytes = u32::try_from(ring_size).ok().filter(|b| b.is_power_of_two() && *b >= 4096);
    let Some(ring_bytes) = ring_bytes else {
        bail!("--ring-size must be a power of two between 4K and 2G, not {ring_size}");
    };
    if args.follow_forks && args.pid.is_none() {
        bail!("--follow-forks goes with --pid (children of -- CMD are always traced)");
    }
    let summary = session::record(RecordOptions {
        trace: TraceOptions {
            target,
            user: !args.no_user,
            kernel: !args.no_kernel,
            user_stacks: !args.no_user_stacks,
            kernel_stacks: !args.no_kernel_stacks,
            symbol_prefix: args.symbol_prefix,
            ring_bytes,
            follow_forks: args.follow_forks,
            quiet: args.quiet,
            sample_bytes: args.sample_bytes.filter(|&n| n > 0),
            call_graph: args.call_graph,
            unwind: UnwindOptions {
                disk_cache: !args.no_unwind_cache,
                max_table_bytes: args.unwind_memory.unwrap_or(memtrace::unwind::store::DEFAULT_MAX_BYTES),
            },
            python_frames: args.python_frames,
            nice: Niceness::Take(args.nice),
        },
        output: args.output,
        force: args.force,
        duration: args.duration,
        time_resolution_ns: if args.exact_times {
            1
        } else {
            args.time_resolution.unwrap_or(DEFAULT_TIME_RESOLUTION_NS)
        },
    })?;
    Ok(summary.exit_code)
}

fn report(args: ReportArgs) -> Result<i32> {
    if args.sort == SortKey::Age && !args.leaks {
        bail!("--sort age goes with --leaks (rows of allocations sort by lifetime: --sort p50 or p99)");
    }
    readable_recording(&args.input)?;
    if args.format == Format::Html && args.output.is_none() && std::io::IsTerminal::is_terminal(&std::io::stdout()) {
        bail!("an HTML report is a file for a browser: give -o FILE.html (or redirect the output)");
    }
    let opts = ReportOptions {
        format: args.format,
        by: args.by,
        filters: args.filters.into(),
        sort: args.sort,
        top: args.top,
        leaks: args.leaks,
        older_than: args.older_than,
        split_processes: false,
        layout: Layout::from_flags(args.wide, args.fields),
        timeline: args.timeline || args.format == Format::Html,
        histogram: args.histogram,
        alloc_fns: args.sites.alloc_fns(),
        // Reports name each row as they write it (by stack, a deep recording's rows held
        // every whole stack at once: 1.4 GB of text, 12.5 GB as JSON values).
        rows_unnamed: true,
        labels_without_addresses: false,
    };
    let text = match opts.format {
        Format::Html => report::html::render_html(&args.input, &opts)?,
        Format::Text => {
            let summary = report::analyze(&args.input, &opts)?;
            report::check_filters(&summary, &opts.filters, &args.input)?;
            // Written as it is made: hundreds of MB for every stack of a deep recording.
            let write = |w: &mut dyn Write| report::write_text(&summary, &opts, w);
            return write_report("report", args.output.as_deref(), &[&args.input], args.force, &write);
        }
        Format::Json => {
            let summary = report::analyze(&args.input, &opts)?;
            report::check_filters(&summary, &opts.filters, &args.input)?;
            let write = |w: &mut dyn Write| {
                report::write_json(&summary, &opts, w)?;
                w.write_all(b"\n")
            };
            return write_report("report", args.output.as_deref(), &[&args.input], args.force, &write);
        }
    };
    write_report("report", args.output.as_deref(), &[&args.input], args.force, &|w| w.write_all(text.as_bytes()))
}

/// Writes a report (`what` names it in an error) to `output` (as
/// `report::output::write_file` does) or to stdout (a closed pipe ends it quietly, as
/// `| head` does).
fn write_report(
    what: &str,
    output: Option<&Path>,
    inputs: &[&Path],
    force: bool,
    write: &dyn Fn(&mut dyn Write) -> std::io::Result<()>,
) -> Result<i32> {
    if let Some(path) = output {
        report::output::write_file_with(path, inputs, force, write)?;
        return Ok(0);
    }
    let mut stdout = std::io::BufWriter::with_capacity(1 << 16, std::io::stdout().lock());
    if let Err(e) = write(&mut stdout).and_then(|()| stdout.flush())
        && e.kind() != std::io::ErrorKind::BrokenPipe
    {
        bail!("writing the {what}: {e}");
    }
    Ok(0)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    memtrace::logging::init();
    let result = match cli.command {
        Command::Record(args) => record(args),
        Command::Report(args) => report(args),
        Command::Dump(args) => dump(args),
        Command::Export(args) => export(args),
        Command::Diff(args) => diff(args),
        Command::Top(args) => top(args),
        Command::Serve(args) => memtrace::serve::run(args),
        Command::BenchBaseline(args) => session::run_baseline(&args.command, args.placed, !args.no_return),
    };
    match result {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            eprintln!("memtrace: {}", explain(e.as_ref()).unwrap_or_else(|| message(&e)));
            let code = e.downcast_ref::<CommandFailed>().map_or(1, |c| c.0.exit_code());
            ExitCode::from(code as u8)
        }
    }
}

/// An error and its causes on one line, each said once: a cause whose text its wrapper
/// already quotes (`reading the recording: No such file…`) is not repeated.
fn message<E: AsRef<dyn std::error::Error + 'static>>(e: &E) -> String {
    let mut out = String::new();
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e.as_ref());
    while let Some(c) = cause {
        let text = c.to_string();
        if !out.contains(&text) {
            if !out.is_empty() {
                out.push_str(": ");
            }
            out.push_str(&text);
        }
        cause = c.source();
    }
    out
}

/// What to do about an error users can fix, when the error itself does not say: a
/// program without a malloc memtrace can probe.
fn explain(e: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut root = e;
    while let Some(next) = root.source() {
        root = next;
    }
    let root = root.to_string();
    if !(root.starts_with("no ") && root.contains("malloc and ") && root.contains("free found in")) {
        return None;
    }
    // The outermost context names the program or the pid.
    let what = e.to_string();
    let what = if what == root { String::new() } else { format!("{what}: ") };
    Some(format!(
        "{what}no malloc to probe: the program does not allocate through a C allocator memtrace can see (a Go program, or one statically linked without symbols); trace its kernel allocations with --no-user, or name a custom allocator's functions with --symbol-prefix"
    ))
}

/// Fails with one line saying what to do when the recording at `path` cannot be opened.
fn readable_recording(path: &Path) -> Result<()> {
    let Err(e) = std::fs::File::open(path) else { return Ok(()) };
    match e.kind() {
        std::io::ErrorKind::NotFound if path == Path::new(DEFAULT_RECORDING) => {
            bail!("no {DEFAULT_RECORDING} here; record one with `sudo memtrace record -- CMD`")
        }
        std::io::ErrorKind::NotFound => {
            bail!(
                "{}: no such file; record one with `sudo memtrace record -o {} -- CMD`",
                path.display(),
                path.display()
            )
        }
        std::io::ErrorKind::PermissionDenied => {
            use std::os::unix::fs::MetadataExt as _;
            let owner = match std::fs::metadata(path).map(|m| m.uid()) {
                Ok(0) => "root".to_string(),
                Ok(uid) => format!("uid {uid}"),
                Err(_) => "another user".to_string(),
            };
            bail!(
                "{}: permission denied (it belongs to {owner}); read it with sudo, or make it yours with `sudo chown $USER {}`",
                path.display(),
                path.display()
            )
        }
        _ => bail!("{}: {e}", path.display()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_resolutions_are_whole_nanoseconds_up_to_a_second() {
        assert_eq!(parse_time_resolution("1us"), Ok(1000));
        assert_eq!(parse_time_resolution(" 10µs "), Ok(10_000));
        assert_eq!(parse_time_resolution("1ms"), Ok(1_000_000));
        assert_eq!(parse_time_resolution("0.5ms"), Ok(500_000));
        assert_eq!(parse_time_resolution("250ns"), Ok(250));
        assert_eq!(parse_time_resolution("1s"), Ok(1_000_000_000));
        for bad in ["0ns", "2s", "1.5ns", "10", "ms", "-1us", "1 parsec", "NaNms"] {
            assert!(parse_time_resolution(bad).is_err(), "{bad}");
        }
    }
}
