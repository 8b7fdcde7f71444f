//! `memtrace record`: a session whose sink writes the recording file — events in time
//! order, the stacks and modules they refer to, process names, and at the end every
//! frame symbolized while the files are at hand. Every way a recording ends (the target
//! exits, Ctrl-C/SIGTERM/SIGHUP, --duration, a write error) goes through the same
//! finalization: detach, drain, symbolize, write stats and the end marker.
use std::{
    collections::HashMap,
    fs::File,
    io::{self, BufWriter, IsTerminal as _, Write as _},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result};

use super::{Sink, TraceOptions, Tracer, Wake, WakeLoop, block_on, monotonic_ns, output};
use crate::{
    event::{Event, StackRecord},
    naming::Namer,
    perf_map::PerfMapSource,
    recording::{FileFrame, Meta, Stats, Symbol, SymbolKey, Writer},
    symbolize::Background,
};

#[derive(Debug, Clone)]
pub struct RecordOptions {
    pub trace: TraceOptions,
    pub output: PathBuf,
    pub force: bool,
    pub duration: Option<Duration>,
    /// Event timestamps are kept to this many nanoseconds (1: exact).
    pub time_resolution_ns: u64,
}

/// How a recording went.
#[derive(Debug, Clone)]
pub struct RecordSummary {
    /// memtrace's exit code: the command's for `-- CMD`, else 0.
    pub exit_code: i32,
    pub events: u64,
    pub lost_events: u64,
    pub bytes: u64,
    pub end_reason: String,
}

const DRAIN_INTERVAL: Duration = Duration::from_millis(20);
/// How often pending events and definitions are written out, at most: what a SIGKILL of
/// memtrace can lose. Every events chunk starts its references afresh, so longer chunks
/// are smaller: on the heavy Python bench 1 s takes 2.3 % off the file that 500 ms made
/// (9 events chunks → 5); chunks are also cut at 1 MiB of encoded events.
const FLUSH_INTERVAL: Duration = Duration::from_secs(1);

fn realtime_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

/// CPU time (ns) and peak resident memory (bytes) of this process so far.
fn self_usage() -> (u64, u64) {
    // SAFETY: getrusage fills the struct it is given.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above; RUSAGE_SELF is always valid.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as u64 * 1_000_000_000 + t.tv_usec as u64 * 1000;
    // The peak of this program's own memory: `VmHWM`, which starts afresh at exec, where
    // `ru_maxrss` keeps the peak of whatever ran in the process before (the parent that
    // forked it: a script, a bench harness holding reports).
    let hwm = std::fs::read_to_string("/proc/self/status").ok().and_then(|s| {
        s.lines().find_map(|l| l.strip_prefix("VmHWM:")?.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
    });
    (tv(ru.ru_utime) + tv(ru.ru_stime), hwm.map_or(ru.ru_maxrss as u64, |kb| kb) * 1024)
}

/// At debug level: where this process's resident memory is now (heap, file pages such as
/// the rings' and the symbolizer's mappings) and its peak, after `step` of the stop.
fn log_memory(step: &str) {
    if log::log_enabled!(log::Level::Debug) {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let fields: Vec<String> = status
            .lines()
            .filter(|l| ["VmHWM:", "VmRSS:", "RssAnon:", "RssFile:"].iter().any(|p| l.starts_with(p)))
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .collect();
        log::debug!("memory {step}: {}", fields.join(", "));
    }
}

fn read_trimmed(path: &str) -> String {
    std::fs::read_to_string(path).map(|s| s.trim().to_string()).unwrap_or_default()
}

/// Processes whose JIT frames a recording names from their perf maps, at most.
const MAX_JIT_PROCESSES: usize = 1024;

/// The sink of a recording.
struct Recorder {
    writer: Writer<BufWriter<File>>,
    /// Stacks, modules and process names, as `top` names them too.
    namer: Namer,
    user_frames: crate::FastSet<FileFrame>,
    /// Frames in memory without a file (JIT code), by process, and where the process's
    /// perf map is (noted at its first such frame, while it lives): named from it.
    jit_frames: crate::FastMap<u32, (Option<PerfMapSource>, crate::FastSet<u64>)>,
    /// When the recording began.
    started: std::time::SystemTime,
    kernel_addrs: crate::FastSet<u64>,
    /// Stacks cut short for want of ring room for a copy (the first
    /// [`crate::recording::MAX_NO_ROOM_STACKS`]), so the report names that cause per process.
    no_room_stacks: crate::FastSet<u32>,
    /// Stacks cut short at a frame in no file (the same bound), so the report names that
    /// cause per process.
    unplaced_stacks: crate::FastSet<u32>,
    /// The slab caches' names, as the probes sent them (each once a session).
    slab_caches: std::collections::BTreeMap<u64, String>,
    write_error: Option<io::Error>,
    /// Has read the kernel's symbols and the command's files' while the probes loaded;
    /// names every frame at the end. (The other objects a recording meets are read then,
    /// not as they are met: read early, a big program's libraries kept their tables in
    /// memory through the whole recording — the heavy Python bench peaked 300 MB with
    /// that, 250–270 MB without — for a gain only short recordings see.)
    symbols: Background,
}

impl Recorder {
    fn write(&mut self, event: &Event) {
        if self.write_error.is_none()
            && let Err(e) = self.writer.event(event)
        {
            self.write_error = Some(e);
        }
    }

    /// Symbolizes every frame the recording refers to, while the files are at hand.
    fn write_symbols(&mut self) {
        self.symbols.hurry();
        self.namer.modules.find_missing_files();
        for m in self.namer.modules.take_new() {
            self.writer.module(&m);
        }
        let mut by_module: HashMap<u32, Vec<u64>> = HashMap::new();
        for frame in &self.user_frames {
            if let FileFrame::Module { module, offset } = *frame {
                by_module.entry(module).or_default().push(offset);
            }
        }
        let modules = self.namer.modules.modules().to_vec();
        let mut asked: Vec<(u32, Vec<u64>)> = Vec::new();
        let mut jobs: Vec<(PathBuf, Vec<u64>)> = Vec::new();
        for (module, mut offsets) in by_module {
            let Some(m) = modules.get(module as usize) else { continue };
            // Python frames name themselves (`python::function_of`).
            if m.path.is_empty() || crate::python::function_of(m).is_some() {
                continue;
            }
            offsets.sort_unstable();
            // Return addresses point after the call; name the call instruction.
            jobs.push((PathBuf::from(&m.path), offsets.iter().map(|o| o.saturating_sub(1)).collect()));
            asked.push((module, offsets));
        }
        let writer = &mut self.writer;
        self.symbols.objects(jobs, &mut |i, results| {
            let (module, offsets) = &asked[i];
            for (offset, symbols) in offsets.iter().zip(results) {
                if !symbols.is_empty() {
                    writer.symbol(SymbolKey::User(FileFrame::Module { module: *module, offset: *offset }), &symbols);
                }
            }
        });
        self.name_jit_frames();
        let mut addrs: Vec<u64> = self.kernel_addrs.iter().copied().collect();
        addrs.sort_unstable();
        let lookups: Vec<u64> = addrs.iter().map(|a| a.saturating_sub(1)).collect();
        let started = std::time::Instant::now();
        let n = lookups.len();
        let kernel = self.symbols.run(move |s| s.kernel(&lookups)).unwrap_or_default();
        log::debug!("kernel: {n} addresses symbolized in {} ms", started.elapsed().as_millis());
        for (addr, symbols) in addrs.iter().zip(kernel) {
            if !symbols.is_empty() {
                self.writer.symbol(SymbolKey::Kernel(*addr), &symbols);
            }
        }
    }
}

impl Recorder {
    /// Names the frames in JIT-compiled code from their processes' perf maps, where the
    /// runtime writes one (`perf_map`).
    fn name_jit_frames(&mut self) {
        // An address is named for every process (its symbol has no pid): where the maps of
        // two processes name it differently, it stays unnamed.
        let mut names: crate::FastMap<u64, Option<String>> = Default::default();
        for (pid, (source, ips)) in std::mem::take(&mut self.jit_frames) {
            // A return address names the call before it.
            let mut wanted: Vec<u64> = ips.iter().map(|ip| ip.saturating_sub(1)).collect();
            wanted.sort_unstable();
            let Some(map) = source.and_then(|s| s.read(&wanted)) else { continue };
            let mut named = 0usize;
            for ip in ips {
                let Some(name) = map.name(ip.saturating_sub(1)) else { continue };
                named += 1;
                names
                    .entry(ip)
                    .and_modify(|n| {
                        if n.as_deref() != Some(name) {
                            *n = None;
                        }
                    })
                    .or_insert_with(|| Some(name.to_string()));
            }
            log::debug!("pid {pid}: {named} JIT frames named from its perf map");
        }
        for (ip, name) in names {
            if let Some(name) = name {
                let symbol = Symbol { name: name.into(), file: None, line: 0, inlined: false };
                self.writer.symbol(SymbolKey::User(FileFrame::Address(ip)), &[symbol]);
            }
        }
    }
}

impl Sink for Recorder {
    fn stack(&mut self, s: StackRecord) {
        let no_room = s.no_room;
        let Some(stack) = self.namer.stack(s) else { return };
        if no_room && self.no_room_stacks.len() < crate::recording::MAX_NO_ROOM_STACKS {
            self.no_room_stacks.insert(stack.id);
        } else if !no_room && !self.no_room_stacks.is_empty() {
            // (An id defined again names another stack.)
            self.no_room_stacks.remove(&stack.id);
        }
        let unplaced = stack.truncated && matches!(stack.user.last(), Some(FileFrame::Address(_)));
        if unplaced && self.unplaced_stacks.len() < crate::recording::MAX_NO_ROOM_STACKS {
            self.unplaced_stacks.insert(stack.id);
        } else if !unplaced && !self.unplaced_stacks.is_empty() {
            self.unplaced_stacks.remove(&stack.id);
        }
        for frame in &stack.user {
            if let FileFrame::Address(ip) = *frame {
                let pid = stack.pid;
                // Each process's source holds a descriptor: bounded under `record -a`.
                if self.jit_frames.len() >= MAX_JIT_PROCESSES && !self.jit_frames.contains_key(&pid) {
                    break;
                }
                let since = self.started;
                self.jit_frames
                    .entry(pid)
                    .or_insert_with(|| (PerfMapSource::of(pid, since), Default::default()))
                    .1
                    .insert(ip);
            }
        }
        self.user_frames.extend(stack.user.iter().copied());
        self.kernel_addrs.extend(stack.kernel.iter().copied());
        for m in self.namer.modules.take_new() {
            self.writer.module(&m);
        }
        self.writer.stack(&stack);
    }

    fn event(&mut self, mut event: Event) {
        if let Some(name) = self.namer.event(&mut event) {
            self.write(&name);
        }
        if let Event::Alloc(a) = &event
            && a.call_site != 0
        {
            self.kernel_addrs.insert(a.call_site);
        }
        self.write(&event);
    }

    fn exec_seen(&mut self, pid: u32, filename: &Path) {
        self.namer.exec_seen(pid, filename);
    }

    fn processes_at_start(&mut self, snapshot: std::sync::Arc<crate::at_start::Snapshot>) {
        self.namer.set_at_start(snapshot);
    }

    fn fork_seen(&mut self, child: u32, parent: u32) {
        self.namer.fork_seen(child, parent);
    }

    fn maps_seen(&mut self, pid: u32, maps: crate::procfs::Maps) {
        self.namer.maps_seen(pid, maps);
    }

    fn file_seen(&mut self, path: &Path) {
        self.namer.file_seen(path);
    }

    fn cache_seen(&mut self, cache: u64, name: &str) {
        // A kernel has a few hundred caches; the bound is against a runaway, not a need.
        if self.slab_caches.len() < MAX_SLAB_CACHES {
            self.slab_caches.insert(cache, name.to_string());
        }
    }
}

/// Slab cache names a recording keeps at most.
const MAX_SLAB_CACHES: usize = 65_536;

#[derive(Debug, Clone, PartialEq, Eq)]
enum StopReason {
    TargetExited(Option<i32>),
    Signal(i32),
    Duration,
    WriteFailed,
}

fn human_count(n: f64) -> String {
    if n >= 1e9 {
        format!("{:.2}G", n / 1e9)
    } else if n >= 1e6 {
        format!("{:.2}M", n / 1e6)
    } else if n >= 1e3 {
        format!("{:.1}k", n / 1e3)
    } else {
        format!("{n:.0}")
    }
}

fn status_line(
    tracer: &Tracer,
    recorder: &Recorder,
    started: Instant,
    events_before: u64,
    interval: Duration,
) -> String {
    let events = recorder.writer.events_written();
    let rate = (events - events_before) as f64 / interval.as_secs_f64().max(1e-9);
    let lost = tracer.probes.counters().map(|c| c.lost_events).unwrap_or(0);
    format!(
        "memtrace: {:6.1}s  {:>8} events/s  {:>8} events  {} lost  {:.1} MB",
        started.elapsed().as_secs_f64(),
        human_count(rate),
        human_count(events as f64),
        lost,
        recorder.writer.bytes_written() as f64 / 1e6
    )
}

async fn run(tracer: &mut Tracer, recorder: &mut Recorder, opts: &RecordOptions) -> Result<StopReason> {
    let mut waker = WakeLoop::new(tracer, DRAIN_INTERVAL, opts.duration)?;
    // Only on a terminal, and not when a command we run writes to it too: its output would
    // land after the status line (`0.3 MBbye`).
    let show_status = !opts.trace.quiet && io::stderr().is_terminal() && !tracer.is_command;
    let started = Instant::now();
    let mut last_status = Instant::now();
    let mut events_at_status = 0u64;
    let mut last_flush = Instant::now();
    let mut allocators_written = (0, 0, 0);
    let reason = loop {
        let wake = waker.wait().await;
        // A signal is decided as it is read, and one passed on is timed again once the
        // drains below are done: its twin (`timeout` signals memtrace, then its process
        // group) waits through them, and is read at once after.
        let stop_on = match wake {
            Wake::Signal(sig) => tracer.on_signal(sig).then_some(sig),
            _ => None,
        };
        // A ring with more than one batch waiting is read again at once (a few times).
        for _ in 0..8 {
            tracer.drain(recorder, false);
            if tracer.caught_up() {
                break;
            }
        }
        tracer.housekeeping();
        if recorder.write_error.is_some() {
            break StopReason::WriteFailed;
        }
        match wake {
            Wake::Tick => {}
            Wake::Deadline => break StopReason::Duration,
            Wake::TargetExited => break StopReason::TargetExited(tracer.reap_command()),
            Wake::Signal(sig) if stop_on == Some(sig) => break StopReason::Signal(sig),
            Wake::Signal(_) => tracer.signal_read_through(),
        }
        // The allocators found (at the start, exec, dlopen), in the file as they come (the
        // final figures come at the end): a recording cut short still knows them. At most
        // once a flush interval after the first (`-a` meets a new one with many a program).
        // (An allocator remembered from an earlier run is listed before it is found.)
        let found =
            (tracer.allocators.len(), tracer.allocators.iter().filter(|a| a.found).count(), tracer.late_probes.len());
        if found != allocators_written && (allocators_written == (0, 0, 0) || last_flush.elapsed() >= FLUSH_INTERVAL) {
            let stats = Stats { allocators: allocators_meta(tracer), ..Default::default() };
            if let Err(e) = recorder.writer.stats_so_far(&stats) {
                recorder.write_error = Some(e);
                break StopReason::WriteFailed;
            }
            allocators_written = found;
        }
        if last_flush.elapsed() >= FLUSH_INTERVAL {
            if let Err(e) = recorder.writer.flush_behind() {
                recorder.write_error = Some(e);
                break StopReason::WriteFailed;
            }
            last_flush = Instant::now();
        }
        if show_status && last_status.elapsed() >= Duration::from_secs(1) {
            eprint!("\r\x1b[K{}", status_line(tracer, recorder, started, events_at_status, last_status.elapsed()));
            events_at_status = recorder.writer.events_written();
            last_status = Instant::now();
        }
    };
    if show_status {
        eprint!("\r\x1b[K");
    }
    Ok(reason)
}

/// The allocators found so far, as the recording keeps them.
fn allocators_meta(tracer: &Tracer) -> Vec<crate::recording::AllocatorMeta> {
    tracer
        .allocators
        .iter()
        .map(|a| crate::recording::AllocatorMeta {
            module: a.object.display().to_string(),
            family: a.family.name().to_string(),
            prefix: a.prefix.clone(),
            found: a.found,
            probed_late: tracer.late_probes.get(&a.index).cloned(),
        })
        .collect()
}

/// Runs a whole recording.
pub fn record(opts: RecordOptions) -> Result<RecordSummary> {
    let started = Instant::now();
    // Reading the kernel's symbols takes tens of milliseconds: done while the probes load.
    let symbols = Background::start();
    if opts.trace.kernel {
        symbols.prepare_kernel();
    }
    let mut file = None;
    let mut tracer = match Tracer::start(&opts.trace, |program_files| {
        file = Some(output::create(&opts.output, opts.force)?);
        for path in program_files {
            symbols.prepare_object(path.clone());
        }
        Ok(())
    }) {
        Ok(tracer) => tracer,
        Err(e) => {
            if file.is_some() {
                // Nothing was recorded: do not leave an empty file behind.
                let _ = std::fs::remove_file(&opts.output);
            }
            return Err(e);
        }
    };
    let file = file.expect("created before the probes load");
    let target = &opts.trace.target;
    let meta = Meta {
        memtrace_version: env!("CARGO_PKG_VERSION").into(),
        hostname: read_trimmed("/proc/sys/kernel/hostname"),
        kernel_release: read_trimmed("/proc/sys/kernel/osrelease"),
        mode: match target {
            super::Target::Pid(_) => "pid",
            super::Target::Command(_) => "command",
            super::Target::All => "all",
        }
        .into(),
        target_pids: tracer.target_pid.into_iter().collect(),
        target_command: match target {
            super::Target::Command(argv) => argv.iter().map(|a| a.to_string_lossy().into_owned()).collect(),
            _ => Vec::new(),
        },
        start_unix_ns: realtime_ns(),
        start_monotonic_ns: monotonic_ns(),
        // SAFETY: sysconf has no preconditions.
        page_size: unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64,
        allocator: tracer.allocator.as_ref().map(|a| a.object.display().to_string()),
        allocator_is_glibc: tracer.allocator.as_ref().is_some_and(|a| a.glibc),
        user: opts.trace.user,
        kernel: opts.trace.kernel,
        sample_bytes: opts.trace.sample_bytes,
        call_graph: if opts.trace.user_stacks { opts.trace.call_graph.name().into() } else { String::new() },
        time_resolution_ns: opts.time_resolution_ns,
    };
    let writer = Writer::new(BufWriter::with_capacity(1 << 20, file), &meta)
        .with_context(|| format!("writing {}", opts.output.display()))?;
    let mut recorder = Recorder {
        writer,
        namer: Namer::new(),
        user_frames: Default::default(),
        jit_frames: Default::default(),
        no_room_stacks: Default::default(),
        unplaced_stacks: Default::default(),
        slab_caches: Default::default(),
        started: std::time::SystemTime::now(),
        kernel_addrs: Default::default(),
        write_error: None,
        symbols,
    };
    // The process attached to is named now: one that makes no allocation while traced
    // would otherwise have no name in the recording. (Stamped when the session began:
    // its events, from the probes' attaching on, come after it, in `dump` too.)
    if let (super::Target::Pid(_), Some(pid)) = (target, tracer.target_pid)
        && let Some(name) = recorder.namer.name_process(pid, tracer.began_ns)
    {
        recorder.write(&name);
    }
    if let Err(e) = tracer.release() {
        drop(recorder);
        let _ = std::fs::remove_file(&opts.output);
        return Err(e);
    }
    let reason = block_on(run(&mut tracer, &mut recorder, &opts))??;
    finish(tracer, recorder, &opts, reason, started)
}

/// A write that failed (a full disk, an I/O error): the recording stops, and the file
/// keeps the whole chunks written before, which `report` reads.
fn write_failed(opts: &RecordOptions, events: u64, e: &io::Error) -> anyhow::Error {
    anyhow::anyhow!(
        "writing {}: {e}; the file keeps the {events} events written before the failure",
        opts.output.display()
    )
}

fn finish(
    mut tracer: Tracer,
    mut recorder: Recorder,
    opts: &RecordOptions,
    reason: StopReason,
    started: Instant,
) -> Result<RecordSummary> {
    // While the rings are mapped.
    let bpf_mapped_rss = crate::procfs::own_bpf_mapped_rss_bytes();
    log_memory("before the last drain");
    let (teardown, counters) = tracer.stop(&mut recorder);
    log_memory("after the last drain");
    log::debug!("probe counters: {counters:?}");
    let left_running = match reason {
        StopReason::Signal(_) => tracer.command_left_running(),
        _ => None,
    };
    let end_reason = match &reason {
        StopReason::TargetExited(Some(code)) => match &tracer.command_ended {
            Some(how) => format!("the command {how}"),
            None => format!("the command exited with status {code}"),
        },
        StopReason::TargetExited(None) => crate::recording::TARGET_EXITED.into(),
        StopReason::Signal(sig) => match left_running {
            Some(pid) => {
                format!("interrupted by signal {sig}; the command (pid {pid}) was left running, no longer traced")
            }
            None => format!("interrupted by signal {sig}"),
        },
        StopReason::Duration => "the duration elapsed".into(),
        StopReason::WriteFailed => "writing the recording failed".into(),
    };
    if let Some(e) = recorder.write_error.take() {
        return Err(write_failed(opts, recorder.writer.events_flushed(), &e));
    }
    let unwind = tracer.unwind_stats().unwrap_or_default();
    log::debug!("unwinder: {unwind:?}");
    log::debug!(
        "kernel stacks: {} taken from an earlier unwind of their path; {} more unwound to check them, {} of which \
         differed",
        counters.kstacks_reused,
        counters.kstacks_checked + counters.kstacks_differed,
        counters.kstacks_differed
    );
    let stats = Stats {
        lost_events: counters.lost_events,
        lost_events_per_cpu: counters.lost_events_per_cpu.clone(),
        lost_stacks: counters.lost_stacks,
        lost_inflight: counters.lost_inflight,
        lost_kernel_live: counters.lost_kernel_live,
        no_ring: counters.no_ring,
        lost_sampled_live: counters.lost_sampled_live,
        events: recorder.writer.events_written(),
        end_monotonic_ns: monotonic_ns(),
        exit_code: match reason {
            StopReason::TargetExited(code) => code,
            _ => None,
        },
        end_reason: end_reason.clone(),
        sampled_from: tracer.degraded,
        unwind_copies: unwind.copies,
        unwind_budget_truncated: counters.unwind_budget,
        unwind_copies_waited: unwind.waited,
        unwind_copies_gave_up: unwind.gave_up,
        unwind_copies_anchored: unwind.anchored,
        unwind_copies_anchor_missed: unwind.anchor_missed,
        unwind_copy_repeats: tracer.copy_repeats().0,
        unwind_copy_repeats_unmatched: tracer.copy_repeats().1,
        unwind_late_task_records: unwind.late_task_records,
        unwind_no_room_stacks: {
            let mut ids: Vec<u32> = recorder.no_room_stacks.iter().copied().collect();
            ids.sort_unstable();
            ids
        },
        unwind_unplaced_stacks: {
            let mut ids: Vec<u32> = recorder.unplaced_stacks.iter().copied().collect();
            ids.sort_unstable();
            ids
        },
        slab_caches: std::mem::take(&mut recorder.slab_caches).into_iter().collect(),
        unwind_tables_built: unwind.tables.built,
        unwind_tables_cached: unwind.tables.from_cache,
        unwind_tables_without_cfi: unwind.tables.without_cfi,
        unwind_tables_over_cap: unwind.tables.over_cap,
        unwind_table_bytes: unwind.tables.bytes,
        unwind_table_rows: unwind.tables.rows,
        unwind_build_ms: unwind.tables.build_ms,
        unwind_longest_build_ms: unwind.tables.longest_build_ms,
        unwind_frames: counters.unwind_frames,
        unwind_cache_hits: counters.unwind_cache_hits,
        unwind_frames_reused: counters.unwind_frames_reused,
        kernel_stacks_reused: counters.kstacks_reused,
        kernel_stacks_checked: counters.kstacks_checked,
        kernel_stacks_differed: counters.kstacks_differed,
        user_walks_interleaved: counters.user_walks_interleaved,
        unwind_walks_reused: counters.unwind_reused,
        user_returns: counters.user_returns,
        probe_map_allocs: counters.probe_busy_allocs,
        probe_map_bytes: counters.probe_busy_bytes,
        mremaps_unlooked: counters.mremaps_unlooked,
        ring_bytes: tracer.ring_bytes,
        // The maps this process holds (rings, outer arrays, the rest), and the unwind
        // tables, which only their outer array holds.
        bpf_map_bytes: crate::procfs::own_bpf_map_bytes() + unwind.tables.bytes,
        python: tracer.python_found(),
        allocators: allocators_meta(&tracer),
        ..Default::default()
    };
    log::debug!("ring records read across a ring's end: {}", tracer.probes.ring_records_joined());
    tracer.shed();
    recorder.namer.forget_stacks();
    log_memory("once tracing's state is let go");
    // Every event and stack reaches the file first: the warnings the report will print are
    // read from it on another thread while the frames are named (each took 0.1–0.25 s of
    // the heavy Python bench's stop, one after the other).
    if let Err(e) = recorder.writer.flush_last() {
        return Err(write_failed(opts, recorder.writer.events_flushed(), &e));
    }
    let warnings = (!opts.trace.quiet).then(|| {
        let (path, len, stats) = (opts.output.clone(), recorder.writer.bytes_written(), stats.clone());
        std::thread::Builder::new().name("memtrace-warnings".into()).spawn(move || {
            let started = Instant::now();
            let lines = crate::report::warnings::of_recording_so_far(&path, len, &stats);
            log::debug!("the recording's warnings read in {} ms", started.elapsed().as_millis());
            lines
        })
    });
    log_memory("with the warnings pass started");
    recorder.write_symbols();
    let usage = self_usage();
    log_memory("at the end");
    let stats = Stats {
        recorder_cpu_ns: usage.0,
        recorder_peak_rss_bytes: usage.1,
        recorder_bpf_mapped_rss_bytes: bpf_mapped_rss,
        ..stats
    };
    let events = recorder.writer.events_written();
    // The pending events first, so that a failure counts the events kept exactly.
    if let Err(e) = recorder.writer.flush() {
        return Err(write_failed(opts, recorder.writer.events_flushed(), &e));
    }
    let kept = recorder.writer.events_flushed();
    let file = recorder.writer.finish(&stats).map_err(|e| write_failed(opts, kept, &e))?;
    let bytes = file.get_ref().metadata().map(|m| m.len()).unwrap_or(0);
    let exit_code = match reason {
        StopReason::TargetExited(Some(code)) => code,
        StopReason::Signal(sig) if tracer.is_command => 128 + sig,
        _ => 0,
    };
    if !opts.trace.quiet {
        // What the report will warn of (the probes detach meanwhile), waited for before
        // stderr is held: the pass logs as it ends.
        let waited = Instant::now();
        let warned = match warnings {
            Some(Ok(thread)) => thread.join().unwrap_or_default(),
            _ => Vec::new(),
        };
        log::debug!("the recording's warnings waited for {} ms", waited.elapsed().as_millis());
        let mut err = io::stderr().lock();
        // The rings' pages are the kernel's, all resident from the start: said apart, as
        // on a machine of many CPUs they are a large part of the peak.
        let rings = match stats.recorder_bpf_mapped_rss_bytes {
            0 => String::new(),
            b => format!(" ({:.0} MB of it the rings' pages)", b as f64 / 1e6),
        };
        let _ = writeln!(
            err,
            "memtrace: {end_reason}; recorded {} events ({} lost) in {:.1}s to {} ({:.1} MB); memtrace used {:.2}s CPU, {:.0} MB peak{rings}",
            events,
            counters.lost_events,
            started.elapsed().as_secs_f64(),
            opts.output.display(),
            bytes as f64 / 1e6,
            stats.recorder_cpu_ns as f64 / 1e9,
            stats.recorder_peak_rss_bytes as f64 / 1e6,
        );
        for w in warned {
            let _ = writeln!(err, "memtrace: warning: {w}");
        }
    }
    let joined = Instant::now();
    teardown.join();
    log::debug!("probe teardown joined after a further {} ms", joined.elapsed().as_millis());
    Ok(RecordSummary { exit_code, events, lost_events: counters.lost_events, bytes, end_reason })
}
