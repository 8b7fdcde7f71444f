//! `memtrace record`: sets up the target and the probes, then drains the per-CPU rings on
//! a tokio loop (on a timer and whenever a ring wakes us), orders events, and writes them,
//! with the stacks, modules and symbols they need, to the recording file. Every way a
//! recording ends (the target exits, Ctrl-C/SIGTERM/SIGHUP, --duration, a write error)
//! goes through the same finalization: detach, drain, symbolize, write stats and the end
//! marker.
pub mod output;
pub mod reorder;
pub mod spawn;

use std::{
    collections::{HashMap, HashSet},
    ffi::OsString,
    fs::File,
    io::{self, BufWriter, IsTerminal as _, Write as _},
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow, bail};
use memtrace_common::{TaskEvent, flags};
use tokio::{
    io::{Interest, unix::AsyncFd},
    signal::unix::{SignalKind, signal},
    sync::Notify,
};

use self::{reorder::Reorder, spawn::PausedChild};
use crate::{
    event::{Event, Record, StackRecord, Task, decode},
    modules::ModuleTable,
    probes::{self, Allocator, Probes},
    procfs,
    recording::{FileFrame, FileStack, Meta, Stats, SymbolKey, Writer},
    symbolize::Symbolizer,
};

/// What to trace.
#[derive(Debug, Clone)]
pub enum Target {
    Pid(u32),
    Command(Vec<OsString>),
    All,
}

#[derive(Debug, Clone)]
pub struct RecordOptions {
    pub target: Target,
    pub output: PathBuf,
    pub force: bool,
    pub duration: Option<Duration>,
    pub user: bool,
    pub kernel: bool,
    pub user_stacks: bool,
    pub kernel_stacks: bool,
    pub symbol_prefix: String,
    pub ring_bytes: u32,
    pub follow_forks: bool,
    pub quiet: bool,
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

/// Events stamped within this long of "now" may still be on their way from another CPU.
const REORDER_LAG_NS: u64 = 100_000_000;
const DRAIN_INTERVAL: Duration = Duration::from_millis(20);
const FLUSH_INTERVAL: Duration = Duration::from_millis(500);
/// After forwarding Ctrl-C to the command, how long to wait for it to exit.
const CHILD_GRACE: Duration = Duration::from_secs(2);

pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: ts is a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn realtime_ns() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(0)
}

/// Fails with a clear message if `pid` cannot be traced.
fn check_pid(pid: u32, user: bool) -> Result<()> {
    let state = match procfs::process_state(pid) {
        Ok(s) => s,
        Err(e) if e.kind() == io::ErrorKind::NotFound => bail!("no process with pid {pid}"),
        Err(e) => return Err(e).with_context(|| format!("reading the state of pid {pid}")),
    };
    if state.state == 'Z' {
        bail!("process {pid} is a zombie (it exited and awaits its parent): nothing left to trace");
    }
    if state.kernel_thread && user {
        bail!("pid {pid} is a kernel thread: it has no user space (use --no-user to trace its kernel allocations)");
    }
    Ok(())
}

/// The event sink: writes ordered events, and everything they refer to, to the file.
struct Recorder {
    writer: Writer<BufWriter<File>>,
    modules: ModuleTable,
    /// Probe stack hash → file stack id.
    stack_ids: HashMap<u64, u32>,
    defined: HashSet<u32>,
    user_frames: HashSet<FileFrame>,
    kernel_addrs: HashSet<u64>,
    pids_seen: HashSet<u32>,
    /// Processes whose allocator was attached (followed children).
    attached: HashSet<u32>,
    /// Children waiting for their uprobes.
    new_children: Vec<u32>,
    /// Processes whose name the recording already holds.
    named: HashSet<u32>,
    write_error: Option<io::Error>,
    decode_errors: u64,
}

impl Recorder {
    fn stack_id(&mut self, hash: u64) -> u32 {
        let next = self.stack_ids.len() as u32;
        *self.stack_ids.entry(hash).or_insert(next)
    }

    fn on_stack(&mut self, s: StackRecord) {
        let id = self.stack_id(s.hash);
        if !self.defined.insert(id) {
            return;
        }
        if self.pids_seen.insert(s.pid) {
            self.modules.learn_process(s.pid);
        }
        let (user, truncated) = self.modules.resolve_stack(s.pid, &s.user);
        self.user_frames.extend(user.iter().copied());
        self.kernel_addrs.extend(s.kernel.iter().copied());
        for m in self.modules.take_new() {
            self.writer.module(&m);
        }
        self.writer.stack(&FileStack { id, pid: s.pid, kernel: s.kernel, user, truncated });
    }

    /// Records the name of a process met for the first time (one already running when
    /// tracing began has no exec event to name it).
    fn name_process(&mut self, pid: u32, ts_ns: u64) {
        if pid == 0 || !self.named.insert(pid) {
            return;
        }
        if let Some(comm) = procfs::comm(pid, pid) {
            self.write(&Event::Task(Task {
                ts_ns,
                event: TaskEvent::Rename,
                flags: 0,
                pid,
                tid: pid,
                ppid: 0,
                comm,
                filename: String::new(),
            }));
        }
    }

    fn write(&mut self, event: &Event) {
        if self.write_error.is_none()
            && let Err(e) = self.writer.event(event)
        {
            self.write_error = Some(e);
        }
    }

    fn on_event(&mut self, mut event: Event) {
        match &event {
            Event::Alloc(a) => self.name_process(a.pid, a.ts_ns),
            Event::Free(f) => self.name_process(f.pid, f.ts_ns),
            Event::Task(t) if t.tid == t.pid && t.event != TaskEvent::Exit => {
                self.named.insert(t.pid);
            }
            Event::Task(_) => {}
        }
        match &mut event {
            Event::Alloc(a) => {
                if a.stack != 0 || a.flags & flags::HAS_STACK != 0 {
                    a.stack = u64::from(self.stack_id(a.stack)) + 1;
                }
                a.flags &= !flags::HAS_STACK;
                if a.call_site != 0 {
                    self.kernel_addrs.insert(a.call_site);
                }
            }
            Event::Free(_) => {}
            Event::Task(t) => match t.event {
                TaskEvent::Exec => {
                    self.pids_seen.remove(&t.pid);
                }
                TaskEvent::Fork => self.new_children.push(t.pid),
                _ => {}
            },
        }
        self.write(&event);
    }

    /// Symbolizes every frame the recording refers to, while the files are at hand.
    fn write_symbols(&mut self) {
        let symbolizer = Symbolizer::new();
        let mut by_module: HashMap<u32, Vec<u64>> = HashMap::new();
        for frame in &self.user_frames {
            if let FileFrame::Module { module, offset } = *frame {
                by_module.entry(module).or_default().push(offset);
            }
        }
        let modules = self.modules.modules().to_vec();
        for (module, mut offsets) in by_module {
            let Some(m) = modules.get(module as usize) else {
                continue;
            };
            if m.path.is_empty() {
                continue;
            }
            offsets.sort_unstable();
            // Return addresses point after the call; name the call instruction.
            let lookups: Vec<u64> = offsets.iter().map(|o| o.saturating_sub(1)).collect();
            let results = symbolizer.object(Path::new(&m.path), &lookups);
            for (offset, symbols) in offsets.iter().zip(results) {
                if !symbols.is_empty() {
                    self.writer.symbol(SymbolKey::User(FileFrame::Module { module, offset: *offset }), &symbols);
                }
            }
        }
        let mut addrs: Vec<u64> = self.kernel_addrs.iter().copied().collect();
        addrs.sort_unstable();
        let lookups: Vec<u64> = addrs.iter().map(|a| a.saturating_sub(1)).collect();
        for (addr, symbols) in addrs.iter().zip(symbolizer.kernel(&lookups)) {
            if !symbols.is_empty() {
                self.writer.symbol(SymbolKey::Kernel(*addr), &symbols);
            }
        }
    }
}

/// A raw fd polled for readiness, owned elsewhere (the ring).
struct BorrowedFd(RawFd);
impl AsRawFd for BorrowedFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the syscall returned a descriptor we now own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

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

struct Session {
    probes: Probes,
    recorder: Recorder,
    reorder: Reorder,
    allocator: Option<Allocator>,
    opts: RecordOptions,
    target_pid: Option<u32>,
    is_command: bool,
    started: Instant,
    /// Events stamped later than this are dropped (set when stopping).
    cutoff_ns: Option<u64>,
}

impl Session {
    /// Reads every ring dry and releases what is old enough.
    fn drain(&mut self, everything: bool) -> usize {
        let now = monotonic_ns();
        let mut n = 0;
        for ring in self.probes.rings_mut() {
            while let Some(item) = ring.ring.next() {
                n += 1;
                match decode(&item, ring.cpu) {
                    Ok(Record::Stack(s)) => self.recorder.on_stack(s),
                    Ok(Record::Event(e)) if self.cutoff_ns.is_none_or(|c| e.ts_ns() <= c) => {
                        // Learn a new program's build id at once, while it still runs.
                        if let Event::Task(t) = &e
                            && t.event == TaskEvent::Exec
                        {
                            self.recorder.modules.learn_exec(t.pid, Path::new(&t.filename));
                        }
                        self.reorder.push(e)
                    }
                    Ok(Record::Event(_)) => {}
                    Err(_) => self.recorder.decode_errors += 1,
                }
            }
        }
        let recorder = &mut self.recorder;
        if everything {
            self.reorder.release_all(&mut |e| recorder.on_event(e));
        } else {
            self.reorder.release(now.saturating_sub(REORDER_LAG_NS), &mut |e| recorder.on_event(e));
        }
        self.attach_new_children();
        n
    }

    /// Children of a traced command get the allocator probes as soon as we see them.
    fn attach_new_children(&mut self) {
        let children = std::mem::take(&mut self.recorder.new_children);
        let (Some(allocator), true) = (&self.allocator, self.opts.follow_forks && self.opts.user) else {
            return;
        };
        for pid in children {
            if self.recorder.attached.insert(pid)
                && let Err(e) = self.probes.attach_allocator(allocator, Some(pid))
                && !self.opts.quiet
            {
                eprintln!("memtrace: not tracing the allocations of child {pid}: {e:#}");
            }
        }
    }

    fn status_line(&self, events_before: u64, interval: Duration) -> String {
        let events = self.recorder.writer.events_written();
        let rate = (events - events_before) as f64 / interval.as_secs_f64().max(1e-9);
        let lost = self.probes.counters().map(|c| c.lost_events).unwrap_or(0);
        format!(
            "memtrace: {:6.1}s  {:>8} events/s  {:>8} events  {} lost  {:.1} MB",
            self.started.elapsed().as_secs_f64(),
            human_count(rate),
            human_count(events as f64),
            lost,
            self.recorder.writer.bytes_written() as f64 / 1e6
        )
    }

    async fn run(&mut self) -> Result<StopReason> {
        let notify = Arc::new(Notify::new());
        let mut watchers = Vec::new();
        for ring in self.probes.rings_mut() {
            // SAFETY: the ring outlives this watcher: watchers are aborted when `run`
            // returns and the runtime (dropping them) ends before the rings are dropped.
            let fd = unsafe { AsyncFd::register_with_interest(BorrowedFd(ring.ring.as_raw_fd()), Interest::READABLE) }
                .map_err(|e| anyhow!("polling a ring buffer: {e}"))?;
            let notify = Arc::clone(&notify);
            watchers.push(tokio::spawn(async move {
                loop {
                    let Ok(mut guard) = fd.readable().await else {
                        break;
                    };
                    guard.clear_ready();
                    notify.notify_one();
                }
            }));
        }
        let target_fd = match self.target_pid {
            Some(pid) => {
                let pidfd = pidfd_open(pid).with_context(|| format!("watching process {pid}"))?;
                // SAFETY: the AsyncFd owns the pidfd, which stays open as long as it does.
                Some(
                    unsafe { AsyncFd::register_with_interest(pidfd, Interest::READABLE) }
                        .map_err(|e| anyhow!("{e}"))?,
                )
            }
            None => None,
        };
        let mut sigint = signal(SignalKind::interrupt())?;
        let mut sigterm = signal(SignalKind::terminate())?;
        let mut sighup = signal(SignalKind::hangup())?;
        let mut tick = tokio::time::interval(DRAIN_INTERVAL);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let deadline = self.opts.duration.map(|d| tokio::time::Instant::now() + d);
        let show_status = !self.opts.quiet && io::stderr().is_terminal();
        let mut last_status = Instant::now();
        let mut events_at_status = 0u64;
        let mut last_flush = Instant::now();
        let mut forwarded_signal: Option<(i32, Instant)> = None;

        let reason = loop {
            let target_exit = async {
                match &target_fd {
                    Some(fd) => {
                        let _ = fd.readable().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            };
            let until_deadline = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending::<()>().await,
                }
            };
            let mut signal_received = None;
            let mut exited = false;
            tokio::select! {
                _ = tick.tick() => {}
                _ = notify.notified() => {}
                _ = sigint.recv() => signal_received = Some(libc::SIGINT),
                _ = sigterm.recv() => signal_received = Some(libc::SIGTERM),
                _ = sighup.recv() => signal_received = Some(libc::SIGHUP),
                _ = target_exit => exited = true,
                _ = until_deadline => break StopReason::Duration,
            }
            self.drain(false);
            if self.recorder.write_error.is_some() {
                break StopReason::WriteFailed;
            }
            if exited {
                break StopReason::TargetExited(self.reap_command());
            }
            if let Some(sig) = signal_received {
                match (self.is_command, forwarded_signal) {
                    // The command decides how to stop; a second signal stops us at once.
                    (true, None) => {
                        if let Some(pid) = self.target_pid {
                            // SAFETY: sends a signal to our own child.
                            unsafe { libc::kill(pid as i32, sig) };
                        }
                        forwarded_signal = Some((sig, Instant::now()));
                    }
                    _ => break StopReason::Signal(sig),
                }
            }
            if let Some((sig, at)) = forwarded_signal
                && at.elapsed() > CHILD_GRACE
            {
                break StopReason::Signal(sig);
            }
            if last_flush.elapsed() >= FLUSH_INTERVAL {
                if let Err(e) = self.recorder.writer.flush() {
                    self.recorder.write_error = Some(e);
                    break StopReason::WriteFailed;
                }
                last_flush = Instant::now();
            }
            if show_status && last_status.elapsed() >= Duration::from_secs(1) {
                eprint!("\r\x1b[K{}", self.status_line(events_at_status, last_status.elapsed()));
                events_at_status = self.recorder.writer.events_written();
                last_status = Instant::now();
            }
        };
        if show_status {
            eprint!("\r\x1b[K");
        }
        for w in watchers {
            w.abort();
        }
        Ok(reason)
    }

    /// The command's exit code once it exited (None when tracing a pid we did not start).
    fn reap_command(&mut self) -> Option<i32> {
        if !self.is_command {
            return None;
        }
        let pid = self.target_pid?;
        let mut status = 0;
        // SAFETY: waits for our own child, which the pidfd reported as exited.
        let r = unsafe { libc::waitpid(pid as i32, &mut status, 0) };
        (r == pid as i32).then(|| spawn::exit_code(status))
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname").map(|s| s.trim().to_string()).unwrap_or_default()
}

fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease").map(|s| s.trim().to_string()).unwrap_or_default()
}

/// Runs a whole recording.
pub fn record(opts: RecordOptions) -> Result<RecordSummary> {
    if !opts.user && !opts.kernel {
        bail!("--no-user and --no-kernel together leave nothing to trace");
    }
    // Cheap checks first, so mistakes fail before anything is loaded.
    let mut program = None;
    match &opts.target {
        Target::Pid(pid) => check_pid(*pid, opts.user)?,
        Target::Command(argv) => {
            program = Some(spawn::resolve_program(&argv[0]).map_err(|e| anyhow!(CommandFailed(e)))?);
        }
        Target::All => {}
    }
    probes::check_privileges()?;
    let file = output::create(&opts.output, opts.force)?;

    let allocator = if opts.user {
        Some(match (&opts.target, &program) {
            (Target::Pid(pid), _) => {
                probes::allocator::for_process(*pid, &opts.symbol_prefix).with_context(|| format!("pid {pid}"))?
            }
            (Target::Command(_), Some(program)) => probes::allocator::for_executable(program, &opts.symbol_prefix)
                .with_context(|| program.display().to_string())?,
            _ => probes::allocator::system_libc(&opts.symbol_prefix)?,
        })
    } else {
        None
    };

    let all = matches!(opts.target, Target::All);
    let is_command = matches!(opts.target, Target::Command(_));
    let mut probes = Probes::load(&probes::Settings {
        all_processes: all,
        user_stacks: opts.user_stacks,
        kernel_stacks: opts.kernel_stacks,
        glibc_chunks: allocator.as_ref().is_some_and(|a| a.glibc),
        ring_bytes: opts.ring_bytes,
        follow_children: is_command || opts.follow_forks,
    })?;

    let mut child: Option<PausedChild> = None;
    let target_pid = match &opts.target {
        Target::Pid(pid) => {
            probes.trace_tgid(*pid, false)?;
            Some(*pid)
        }
        Target::Command(argv) => {
            let c = spawn::spawn_paused(argv).map_err(|e| anyhow!(CommandFailed(e)))?;
            let pid = c.pid;
            child = Some(c);
            probes.trace_tgid(pid, true)?;
            Some(pid)
        }
        Target::All => None,
    };
    let attach = (|| -> Result<()> {
        probes.attach_task_tracepoints()?;
        if opts.kernel {
            probes.attach_kernel()?;
        }
        if let Some(allocator) = &allocator {
            probes.attach_allocator(allocator, target_pid)?;
        }
        Ok(())
    })();
    if let Err(e) = attach {
        if let Some(c) = child {
            c.abandon();
        }
        return Err(e);
    }

    let meta = Meta {
        memtrace_version: env!("CARGO_PKG_VERSION").into(),
        hostname: hostname(),
        kernel_release: kernel_release(),
        mode: match opts.target {
            Target::Pid(_) => "pid",
            Target::Command(_) => "command",
            Target::All => "all",
        }
        .into(),
        target_pids: target_pid.into_iter().collect(),
        target_command: match &opts.target {
            Target::Command(argv) => argv.iter().map(|a| a.to_string_lossy().into_owned()).collect(),
            _ => Vec::new(),
        },
        start_unix_ns: realtime_ns(),
        start_monotonic_ns: monotonic_ns(),
        // SAFETY: sysconf has no preconditions.
        page_size: unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as u64,
        allocator: allocator.as_ref().map(|a| a.object.display().to_string()),
        allocator_is_glibc: allocator.as_ref().is_some_and(|a| a.glibc),
        user: opts.user,
        kernel: opts.kernel,
        sample_bytes: None,
    };
    let writer = Writer::new(BufWriter::with_capacity(1 << 20, file), &meta)
        .with_context(|| format!("writing {}", opts.output.display()))?;
    let mut recorder = Recorder {
        writer,
        modules: ModuleTable::new(),
        stack_ids: HashMap::new(),
        defined: HashSet::new(),
        user_frames: HashSet::new(),
        kernel_addrs: HashSet::new(),
        pids_seen: HashSet::new(),
        attached: HashSet::new(),
        new_children: Vec::new(),
        named: HashSet::new(),
        write_error: None,
        decode_errors: 0,
    };
    if let Some(pid) = target_pid {
        recorder.attached.insert(pid);
    }
    if let Some(c) = child.as_mut() {
        c.release().map_err(|e| anyhow!(CommandFailed(e)))?;
    }

    if !opts.quiet {
        let what = match &opts.target {
            Target::Pid(pid) => format!("pid {pid}"),
            Target::Command(argv) => format!("{} (pid {})", argv[0].to_string_lossy(), target_pid.unwrap_or(0)),
            Target::All => "every process and the kernel".into(),
        };
        eprintln!("memtrace: tracing {what}; Ctrl-C to stop");
    }
    let mut session = Session {
        probes,
        recorder,
        reorder: Reorder::new(),
        allocator,
        opts: opts.clone(),
        target_pid,
        is_command,
        started: Instant::now(),
        cutoff_ns: None,
    };
    let reason = {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        runtime.block_on(session.run())?
        // The runtime, and the ring watchers with it, end here, before the rings do.
    };
    finish(session, reason)
}

/// A failure to start the command, carrying a shell's exit code.
#[derive(Debug)]
pub struct CommandFailed(pub spawn::SpawnError);
impl std::fmt::Display for CommandFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}
impl std::error::Error for CommandFailed {}

fn finish(mut session: Session, reason: StopReason) -> Result<RecordSummary> {
    // Events stamped after this moment come from the teardown: not part of the recording.
    session.cutoff_ns = Some(monotonic_ns());
    let teardown = session.probes.detach();
    let counters = session.probes.counters().unwrap_or_default();
    while session.drain(true) > 0 {}
    let s = &mut session;
    let end_reason = match &reason {
        StopReason::TargetExited(Some(code)) => format!("the command exited with status {code}"),
        StopReason::TargetExited(None) => "the target process exited".into(),
        StopReason::Signal(sig) => format!("interrupted by signal {sig}"),
        StopReason::Duration => "the duration elapsed".into(),
        StopReason::WriteFailed => "writing the recording failed".into(),
    };
    let stats = Stats {
        lost_events: counters.lost_events,
        lost_events_per_cpu: counters.lost_events_per_cpu.clone(),
        lost_stacks: counters.lost_stacks,
        lost_inflight: counters.lost_inflight,
        lost_kernel_live: counters.lost_kernel_live,
        no_ring: counters.no_ring,
        events: s.recorder.writer.events_written(),
        end_monotonic_ns: monotonic_ns(),
        exit_code: match reason {
            StopReason::TargetExited(code) => code,
            _ => None,
        },
        end_reason: end_reason.clone(),
    };
    if let Some(e) = s.recorder.write_error.take() {
        let events = s.recorder.writer.events_written();
        bail!(
            "writing {}: {e}; the file keeps the events written before the failure (about {events})",
            s.opts.output.display()
        );
    }
    s.recorder.write_symbols();
    let events = s.recorder.writer.events_written();
    let Session { recorder, opts, started, .. } = session;
    let file = recorder.writer.finish(&stats).with_context(|| format!("finishing {}", opts.output.display()))?;
    let bytes = file.get_ref().metadata().map(|m| m.len()).unwrap_or(0);
    let exit_code = match reason {
        StopReason::TargetExited(Some(code)) => code,
        StopReason::Signal(sig) if matches!(opts.target, Target::Command(_)) => 128 + sig,
        _ => 0,
    };
    if !opts.quiet {
        let mut err = io::stderr().lock();
        let _ = writeln!(
            err,
            "memtrace: {end_reason}; recorded {} events ({} lost) in {:.1}s to {} ({:.1} MB)",
            events,
            counters.lost_events,
            started.elapsed().as_secs_f64(),
            opts.output.display(),
            bytes as f64 / 1e6
        );
    }
    let _ = teardown.join();
    Ok(RecordSummary { exit_code, events, lost_events: counters.lost_events, bytes, end_reason })
}
