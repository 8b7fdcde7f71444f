//! A tracing session, shared by `record` and `top`: checks the target, finds its allocator,
//! loads and attaches the probes (starting `-- CMD` paused until they are in place), then
//! drains the per-CPU rings into a [`Sink`] — stack records at once, events in time order —
//! on a tokio loop woken by a timer, the rings, signals, the target's exit and a deadline.
pub mod output;
pub mod record;
pub mod reorder;
pub mod spawn;

use std::{
    collections::{HashMap, HashSet},
    ffi::OsString,
    io,
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow, bail};
use memtrace_common::TaskEvent;
use tokio::{
    io::{Interest, unix::AsyncFd},
    signal::unix::{Signal, SignalKind, signal},
    sync::Notify,
    task::JoinHandle as TaskHandle,
};

pub use self::record::{RecordOptions, RecordSummary, record};
use self::{reorder::Reorder, spawn::PausedChild};
use crate::{
    event::{Event, Record, StackRecord, TaskSpace, decode},
    probes::{self, Allocator, CallGraph, Counters, Detaching, Probes, uprobe_multi::AttachPath},
    procfs,
    recording::RingBytes,
    sizes::usable::{Model, UsableSizes},
    unwind::{UnwindOptions, UnwindStats, Unwinder},
};

/// What to trace.
#[derive(Debug, Clone)]
pub enum Target {
    Pid(u32),
    Command(Vec<OsString>),
    All,
}

/// How to trace, whatever is done with the events.
#[derive(Debug, Clone)]
pub struct TraceOptions {
    pub target: Target,
    pub user: bool,
    pub kernel: bool,
    pub user_stacks: bool,
    pub kernel_stacks: bool,
    pub symbol_prefix: String,
    pub ring_bytes: u32,
    /// Trace the children the targets fork (always on for `-- CMD`).
    pub follow_forks: bool,
    pub quiet: bool,
    /// Size-weighted sampling of user allocations (mean bytes between samples).
    pub sample_bytes: Option<u64>,
    pub call_graph: CallGraph,
    /// How the unwinder keeps its tables (`--no-unwind-cache`, the memory cap).
    pub unwind: UnwindOptions,
}

/// Where drained records go.
pub trait Sink {
    /// The frames behind a stack hash (arrives before, or soon after, the events using it).
    fn stack(&mut self, stack: StackRecord);
    /// The next event in time order.
    fn event(&mut self, event: Event);
    /// A process just exec'd `filename`: learn its program while it still runs.
    fn exec_seen(&mut self, _pid: u32, _filename: &Path) {}
    /// A process forked a child, which starts with its address space.
    fn fork_seen(&mut self, _child: u32, _parent: u32) {}
    /// User frames will point into this file (by build id) from now on.
    fn file_seen(&mut self, _path: &Path) {}
    /// The name of a kernel slab cache (kmem_cache_alloc events carry the cache).
    fn cache_seen(&mut self, _cache: u64, _name: &str) {}
}

/// Events stamped within this long of "now" may still be on their way from another CPU.
const REORDER_LAG_NS: u64 = 100_000_000;
/// Records read from one ring per drain: what one drain holds in memory is bounded,
/// whatever the rings' size (a ring that has more is read again at once).
pub const RING_BATCH: usize = 1 << 15;
/// Events waiting to be put in time order, at most (beyond, the oldest are released before
/// their time: memory stays bounded under any load).
const MAX_HELD_EVENTS: usize = 1 << 21;
/// After forwarding Ctrl-C to the command, how long to wait for it to exit.
const CHILD_GRACE: Duration = Duration::from_secs(2);

pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: ts is a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Fails with a clear message if `pid` cannot be traced.
pub fn check_pid(pid: u32, user: bool) -> Result<()> {
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

/// A failure to start the command, carrying a shell's exit code.
#[derive(Debug)]
pub struct CommandFailed(pub spawn::SpawnError);
impl std::fmt::Display for CommandFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}
impl std::error::Error for CommandFailed {}

/// The probes of a session and what they trace.
pub struct Tracer {
    pub probes: Probes,
    pub allocator: Option<Allocator>,
    pub target_pid: Option<u32>,
    pub is_command: bool,
    pub options: TraceOptions,
    child: Option<PausedChild>,
    reorder: Reorder,
    /// Every allocator found so far: the target's, those of programs exec'd later, those
    /// loaded with dlopen. An allocator's index is its position plus one.
    pub allocators: Vec<Allocator>,
    /// (pid, allocator file, prefix) with probes (pid 0: every process).
    attached: HashSet<(u32, (u64, u64), String)>,
    /// Gives user allocations their usable size from their allocator's size classes.
    usable: UsableSizes,
    /// Processes followed (targets and their children), for the dlopen scan.
    followed: HashSet<u32>,
    /// Objects already checked for an allocator.
    checked_objects: HashSet<PathBuf>,
    /// Programs (and what they preload) whose allocators were resolved (exec'd again and
    /// again: resolved once).
    resolved_programs: HashMap<(PathBuf, Vec<PathBuf>), Vec<Allocator>>,
    last_scan: Instant,
    last_loss_check: Instant,
    lost_seen: u64,
    /// When the rings overflowed and sampling was switched on: (timestamp, mean bytes).
    pub degraded: Option<(u64, u64)>,
    /// Events stamped later than this are dropped (set when stopping).
    cutoff_ns: Option<u64>,
    /// Ring records that did not decode.
    pub decode_errors: u64,
    forwarded_signal: Option<(i32, Instant)>,
    /// Keeps the address spaces and per-file tables the probes unwind with, and finishes
    /// the stacks they could not (`--call-graph dwarf`).
    unwinder: Option<Unwinder>,
    /// Bytes read from the rings, by kind of record.
    pub ring_bytes: RingBytes,
}

/// How long `-- CMD` waits for the unwind tables of its program before it starts (its
/// first allocations are then walked whole); `--pid` waits less (its target runs already).
const COMMAND_TABLES_WAIT: Duration = Duration::from_secs(30);
const PID_TABLES_WAIT: Duration = Duration::from_secs(2);

impl Tracer {
    /// Checks the target, loads and attaches the probes. A command is forked but waits for
    /// [`Tracer::release`]; `before_load` runs after the cheap checks and before the probes
    /// load (the recorder creates its output file there, to fail early).
    pub fn start(options: &TraceOptions, before_load: impl FnOnce() -> Result<()>) -> Result<Self> {
        if !options.user && !options.kernel {
            bail!("--no-user and --no-kernel together leave nothing to trace");
        }
        let mut program = None;
        match &options.target {
            Target::Pid(pid) => check_pid(*pid, options.user)?,
            Target::Command(argv) => {
                program = Some(spawn::resolve_program(&argv[0]).map_err(|e| anyhow!(CommandFailed(e)))?);
            }
            Target::All => {}
        }
        probes::check_privileges()?;
        let prefix = &options.symbol_prefix;
        let found: Vec<Allocator> = match (&options.target, &program, options.user) {
            (_, _, false) => Vec::new(),
            (Target::Pid(pid), _, true) => {
                probes::allocator::all_for_process(*pid, prefix).with_context(|| format!("pid {pid}"))?
            }
            (Target::Command(_), Some(program), true) => probes::allocator::all_for_executable(program, None, prefix)
                .with_context(|| program.display().to_string())?,
            _ => probes::allocator::all_for_process(std::process::id(), prefix)?,
        };
        let mut usable = UsableSizes::default();
        // tcmalloc's classes follow TCMALLOC_TRANSFER_NUM_OBJ in the target's environment.
        let transfer = match &options.target {
            Target::Pid(pid) => tcmalloc_transfer_num_obj(*pid),
            _ => std::env::var("TCMALLOC_TRANSFER_NUM_OBJ").ok().and_then(|v| v.trim().parse().ok()),
        };
        let found: Vec<Allocator> = found
            .into_iter()
            .enumerate()
            .map(|(i, mut a)| {
                a.index = u8::try_from(i + 1).unwrap_or(0);
                usable.set_model(a.index, Model::for_family(a.family, transfer));
                a
            })
            .collect();
        let allocator = found.first().cloned();
        // A command may exec a program that preloads an installed allocator (`env
        // LD_PRELOAD=libjemalloc.so.2 prog`, a wrapper script): those libraries are probed
        // from the start, so its first calls are seen too (probes on a file cost nothing in
        // processes that do not map it).
        let mut found = found;
        if matches!(options.target, Target::Command(_)) && options.user && options.symbol_prefix.is_empty() {
            for mut extra in probes::allocator::installed_libraries() {
                if found.iter().any(|a| a.file_id == extra.file_id) {
                    continue;
                }
                let Ok(index) = u8::try_from(found.len() + 1) else { break };
                extra.index = index;
                usable.set_model(index, Model::for_family(extra.family, transfer));
                found.push(extra);
            }
        }
        let is_command = matches!(options.target, Target::Command(_));
        let mut unwinder = (options.call_graph != CallGraph::Fp && options.user_stacks && options.user)
            .then(|| Unwinder::new(&options.unwind));
        if let (Some(u), Some(program)) = (unwinder.as_mut(), &program) {
            // The program's own files: their tables are built while the probes load.
            u.prepare_files(&probes::allocator::program_files(program));
        }
        before_load()?;
        let mut probes = Probes::load(&probes::Settings {
            all_processes: matches!(options.target, Target::All),
            user_stacks: options.user_stacks,
            kernel_stacks: options.kernel_stacks,
            ring_bytes: options.ring_bytes,
            follow_children: is_command || options.follow_forks,
            sample_bytes: options.sample_bytes,
            call_graph: options.call_graph,
        })?;
        let mut child = None;
        let target_pid = match &options.target {
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
        let attached = (|| -> Result<()> {
            probes.attach_task_tracepoints()?;
            if unwinder.is_some() {
                probes.attach_mapping_tracker()?;
            }
            if options.kernel {
                probes.attach_kernel()?;
            }
            for allocator in &found {
                probes.attach_allocator(allocator, probe_scope(&probes, options, target_pid))?;
            }
            Ok(())
        })();
        if let Err(e) = attached {
            if let Some(c) = child {
                c.abandon();
            }
            return Err(e);
        }
        let attached_to = probe_scope(&probes, options, target_pid).unwrap_or(0);
        if let Some(u) = unwinder.as_mut() {
            let wait = match &options.target {
                Target::Pid(pid) => {
                    u.learn_process(*pid, &mut probes);
                    PID_TABLES_WAIT
                }
                _ => COMMAND_TABLES_WAIT,
            };
            let started = Instant::now();
            if !u.wait_tables(&mut probes, wait) {
                log::debug!("unwind tables still building after {wait:?}: early stacks are finished from copies");
            }
            log::debug!("unwind tables ready in {} ms: {:?}", started.elapsed().as_millis(), u.stats().tables);
        }
        Ok(Self {
            probes,
            attached: found.iter().map(|a| (attached_to, a.file_id, a.prefix.clone())).collect(),
            usable,
            followed: target_pid.into_iter().collect(),
            checked_objects: HashSet::new(),
            resolved_programs: program
                .as_ref()
                .and_then(|p| std::fs::canonicalize(p).ok())
                .map(|p| ((p, Vec::new()), found.clone()))
                .into_iter()
                .collect(),
            allocators: found,
            last_scan: Instant::now(),
            last_loss_check: Instant::now(),
            lost_seen: 0,
            degraded: None,
            allocator,
            target_pid,
            is_command,
            options: options.clone(),
            child,
            reorder: Reorder::new(),
            cutoff_ns: None,
            decode_errors: 0,
            forwarded_signal: None,
            unwinder,
            ring_bytes: RingBytes::default(),
        })
    }

    pub fn unwind_stats(&self) -> Option<UnwindStats> {
        self.unwinder.as_ref().map(Unwinder::stats)
    }

    /// A stack record from the probes: named (and finished, if the probes sent a copy)
    /// by the unwinder before it reaches the sink, or kept there until the table it needs
    /// is built.
    fn on_stack(&mut self, stack: StackRecord, sink: &mut dyn Sink) {
        let Some(unwinder) = self.unwinder.as_mut() else {
            sink.stack(stack);
            return;
        };
        if let Some(done) = unwinder.accept(stack, &mut self.probes) {
            Self::deliver(unwinder, done, sink);
        }
    }

    fn deliver(unwinder: &mut Unwinder, stack: StackRecord, sink: &mut dyn Sink) {
        for path in unwinder.take_new_files() {
            sink.file_seen(&path);
        }
        sink.stack(stack);
    }

    /// Lets a paused command exec; says what is traced unless quiet.
    pub fn release(&mut self) -> Result<()> {
        if let Some(c) = self.child.as_mut() {
            c.release().map_err(|e| anyhow!(CommandFailed(e)))?;
        }
        if !self.options.quiet {
            let what = match &self.options.target {
                Target::Pid(pid) => format!("pid {pid}"),
                Target::Command(argv) => {
                    format!("{} (pid {})", argv[0].to_string_lossy(), self.target_pid.unwrap_or(0))
                }
                Target::All => "every process and the kernel".into(),
            };
            eprintln!("memtrace: tracing {what}; Ctrl-C to stop");
        }
        Ok(())
    }

    /// Reads every ring dry into `sink`; releases the events old enough to be in order
    /// (all of them if `everything`). New processes are handled as soon as they are read:
    /// children get the allocator probes, programs exec'd get theirs. Returns how many
    /// records were read.
    pub fn drain(&mut self, sink: &mut dyn Sink, everything: bool) -> usize {
        let now = monotonic_ns();
        let mut n = 0;
        // Stacks wait until every ring is read: the mappings they need may be in another.
        let mut stacks = Vec::new();
        for cpu in 0..self.probes.rings_mut().len() {
            let mut taken = 0;
            while taken < RING_BATCH
                && let Some(record) = {
                    let ring = &mut self.probes.rings_mut()[cpu];
                    let cpu_id = ring.cpu;
                    ring.ring.next().map(|item| (item.len() as u64, decode(&item, cpu_id)))
                }
            {
                n += 1;
                taken += 1;
                let (len, record) = record;
                let bytes = &mut self.ring_bytes;
                match &record {
                    Ok(Record::Event(_)) => bytes.events += len,
                    Ok(Record::Stack(s)) if s.miss.is_some() => bytes.stack_copies += len,
                    Ok(Record::Stack(_)) => bytes.stacks += len,
                    _ => bytes.other += len,
                }
                match record {
                    Ok(Record::Stack(s)) => stacks.push(s),
                    Ok(Record::Mapping(m)) => {
                        if let Some(u) = self.unwinder.as_mut() {
                            u.mapping(&m, &mut self.probes);
                        }
                        // A library mapped executable (dlopen): look for allocators in it now.
                        if let Some(path) = &m.path
                            && self.cutoff_ns.is_none()
                            && self.followed.contains(&m.pid)
                        {
                            let object = procfs::path_in_process(m.pid, Path::new(path));
                            self.check_object(object);
                        }
                    }
                    Ok(Record::Cache { cache, name }) => sink.cache_seen(cache, &name),
                    Ok(Record::Task(t, space)) => {
                        // New processes and programs are handled at once: the sooner their
                        // address spaces and probes are in place, the fewer of their first
                        // allocations need a stack copy or go unseen.
                        if self.cutoff_ns.is_none() {
                            self.on_task(&t, space, sink);
                        }
                        if self.cutoff_ns.is_none_or(|c| t.ts_ns <= c) {
                            self.reorder.push(Event::Task(t));
                        }
                    }
                    Ok(Record::Event(e)) if self.cutoff_ns.is_none_or(|c| e.ts_ns() <= c) => self.reorder.push(e),
                    Ok(Record::Event(_)) => {}
                    Err(_) => self.decode_errors += 1,
                }
            }
        }
        for s in stacks {
            self.on_stack(s, sink);
        }
        if let Some(u) = self.unwinder.as_mut() {
            for done in u.poll(&mut self.probes) {
                Self::deliver(u, done, sink);
            }
        }
        let usable = &mut self.usable;
        let mut forward = |mut e: Event| {
            if usable.apply(&mut e) {
                sink.event(e)
            }
        };
        if everything {
            self.reorder.release_all(&mut forward);
        } else {
            self.reorder.release(now.saturating_sub(REORDER_LAG_NS), &mut forward);
            if self.reorder.len() > MAX_HELD_EVENTS {
                // Memory stays bounded whatever the event rate: the oldest go out early.
                self.reorder.release_oldest(self.reorder.len() - MAX_HELD_EVENTS / 2, &mut forward);
            }
        }
        n
    }

    /// A process forked, exec'd or exited: address spaces, probes and the sink follow.
    fn on_task(&mut self, t: &crate::event::Task, space: TaskSpace, sink: &mut dyn Sink) {
        match t.event {
            TaskEvent::Exec => {
                if let Some(u) = self.unwinder.as_mut() {
                    u.exec(t.pid, &t.filename, space, &mut self.probes);
                }
                sink.exec_seen(t.pid, Path::new(&t.filename));
                self.on_exec(t.pid);
            }
            TaskEvent::Fork => {
                if let Some(u) = self.unwinder.as_mut() {
                    u.fork(t.pid, space.asid, &mut self.probes);
                }
                sink.fork_seen(t.pid, t.ppid);
                self.on_fork(t.pid);
            }
            TaskEvent::Exit if t.flags & memtrace_common::flags::GROUP_DEAD != 0 => {
                if let Some(u) = self.unwinder.as_mut() {
                    u.exit(t.pid, &mut self.probes);
                }
            }
            _ => {}
        }
    }

    fn following(&self) -> bool {
        (self.is_command || self.options.follow_forks)
            && self.options.user
            && !matches!(self.options.target, Target::All)
    }

    /// Adds an allocator to the session's list (or finds it there), giving it its index.
    fn register(&mut self, mut allocator: Allocator) -> Allocator {
        if let Some(known) =
            self.allocators.iter_mut().find(|a| a.file_id == allocator.file_id && a.prefix == allocator.prefix)
        {
            known.found = true;
            return known.clone();
        }
        let Ok(index) = u8::try_from(self.allocators.len() + 1) else {
            return allocator; // index 0: counted, sizes unknown
        };
        allocator.index = index;
        let transfer = self.target_pid.and_then(tcmalloc_transfer_num_obj);
        self.usable.set_model(index, Model::for_family(allocator.family, transfer));
        if !self.options.quiet {
            log::info!("allocator found: {}", allocator.describe());
        }
        self.allocators.push(allocator.clone());
        allocator
    }

    fn attach(&mut self, pid: u32, allocator: &Allocator) {
        if !self.attached.insert((pid, allocator.file_id, allocator.prefix.clone())) {
            return;
        }
        if let Err(e) = self.probes.attach_allocator(allocator, (pid != 0).then_some(pid))
            && !self.options.quiet
        {
            eprintln!("memtrace: not tracing {} in pid {pid}: {e:#}", allocator.object.display());
        }
    }

    /// A child of a followed process: the allocators its parent has are its own. With
    /// multi links the probes already cover it (the kernel added it to the traced set at
    /// its fork), from its first instruction.
    fn on_fork(&mut self, pid: u32) {
        if !self.following() {
            return;
        }
        self.followed.insert(pid);
        if probe_scope(&self.probes, &self.options, Some(pid)).is_none() {
            return;
        }
        for allocator in self.allocators.clone() {
            self.attach(pid, &allocator);
        }
    }

    /// A traced process exec'd: its new program may bring another allocator (a static
    /// binary, another libc); probes already attached stay (they fire if the new program
    /// maps the same files).
    fn on_exec(&mut self, pid: u32) {
        if !self.options.user || (!self.followed.contains(&pid) && !matches!(self.options.target, Target::All)) {
            return;
        }
        let Ok(exe) = procfs::exe(pid) else { return };
        let exe = procfs::path_in_process(pid, &exe);
        if matches!(self.options.target, Target::All) && !self.checked_objects.insert(exe.clone()) {
            return; // a program seen before: its allocator is attached for everyone
        }
        let canonical = std::fs::canonicalize(&exe).unwrap_or_else(|_| exe.clone());
        let prefix = &self.options.symbol_prefix;
        // What the new program preloads is in its own environment (`env LD_PRELOAD=... prog`).
        let preload = procfs::ld_preload(pid);
        let resolved = self
            .resolved_programs
            .entry((canonical, preload.clone()))
            .or_insert_with(|| probes::allocator::all_for_executable(&exe, Some(&preload), prefix).unwrap_or_default())
            .clone();
        let scope = probe_scope(&self.probes, &self.options, Some(pid)).unwrap_or(0);
        for allocator in resolved {
            let allocator = self.register(allocator);
            self.attach(scope, &allocator);
        }
    }

    /// An object a followed process mapped: its allocators (its malloc family, prefixed
    /// jemallocs) get probes in every followed process.
    fn check_object(&mut self, object: PathBuf) {
        if !self.checked_objects.insert(object.clone()) {
            return;
        }
        let id = probes::allocator::file_id(&object);
        let mut found = probes::allocator::prefixed(std::slice::from_ref(&object));
        if !self.allocators.iter().any(|a| a.file_id == id && a.prefix == self.options.symbol_prefix)
            && let Ok(primary) = probes::allocator::resolve(std::slice::from_ref(&object), &self.options.symbol_prefix)
            && primary.file_id == id
        {
            found.insert(0, primary);
        }
        for allocator in found {
            let allocator = self.register(allocator);
            for p in self.followed.clone() {
                let scope = probe_scope(&self.probes, &self.options, Some(p)).unwrap_or(0);
                self.attach(scope, &allocator);
            }
        }
    }

    /// Housekeeping between drains: allocators loaded with dlopen by followed processes
    /// (every 2 s), and the rings' losses (every 100 ms): when they overflow, sampling is
    /// switched on rather than letting events drop.
    pub fn tend(&mut self) {
        if self.options.user
            && !matches!(self.options.target, Target::All)
            && self.last_scan.elapsed() >= Duration::from_secs(2)
        {
            self.last_scan = Instant::now();
            self.scan_for_dlopened_allocators();
        }
        if self.last_loss_check.elapsed() >= Duration::from_millis(100) {
            self.last_loss_check = Instant::now();
            let lost = self.probes.counters().map(|c| c.lost_events).unwrap_or(0);
            if lost > self.lost_seen
                && self.degraded.is_none()
                && self.options.sample_bytes.is_none()
                && self.options.user
            {
                const MEAN: u64 = 64 << 10;
                if self.probes.set_sampling(MEAN).is_ok() {
                    self.degraded = Some((monotonic_ns(), MEAN));
                    if !self.options.quiet {
                        eprintln!(
                            "memtrace: the rings overflowed ({} events lost): sampling user allocations from now on (each byte with probability 1/{MEAN}); figures become estimates",
                            lost - self.lost_seen
                        );
                    }
                }
            }
            self.lost_seen = lost;
        }
    }

    fn scan_for_dlopened_allocators(&mut self) {
        for pid in self.followed.clone() {
            let Ok(maps) = procfs::Maps::read(pid) else {
                self.followed.remove(&pid);
                continue;
            };
            let objects: Vec<PathBuf> = maps
                .file_mappings()
                .filter(|m| m.executable)
                .map(|m| procfs::path_in_process(pid, &m.path))
                .filter(|p| !self.checked_objects.contains(p))
                .collect();
            for object in objects {
                self.check_object(object);
            }
        }
    }

    /// Decides what a signal does: a command gets the first one (it decides how to stop),
    /// anything else stops the session. Returns whether to stop now.
    pub fn on_signal(&mut self, sig: i32) -> bool {
        match (self.is_command, self.forwarded_signal, self.target_pid) {
            (true, None, Some(pid)) => {
                // SAFETY: sends a signal to our own child.
                unsafe { libc::kill(pid as i32, sig) };
                self.forwarded_signal = Some((sig, Instant::now()));
                false
            }
            _ => true,
        }
    }

    /// A signal forwarded to the command that did not make it exit in time.
    pub fn signal_grace_expired(&self) -> Option<i32> {
        self.forwarded_signal.filter(|(_, at)| at.elapsed() > CHILD_GRACE).map(|(sig, _)| sig)
    }

    /// The command's exit code once it exited (None when tracing a pid we did not start).
    pub fn reap_command(&mut self) -> Option<i32> {
        if !self.is_command {
            return None;
        }
        let pid = self.target_pid?;
        let mut status = 0;
        // SAFETY: waits for our own child, which the pidfd reported as exited.
        let r = unsafe { libc::waitpid(pid as i32, &mut status, 0) };
        (r == pid as i32).then(|| spawn::exit_code(status))
    }

    /// Ends a command that is still running (the view it was started for is closing):
    /// SIGTERM, then SIGKILL if it has not exited within a second.
    pub fn end_command(&mut self) {
        let (true, Some(pid)) = (self.is_command, self.target_pid) else { return };
        let pid = pid as i32;
        let mut status = 0;
        // SAFETY: signals and reaps our own child; WNOHANG never blocks.
        unsafe {
            if libc::waitpid(pid, &mut status, libc::WNOHANG) != 0 {
                return; // already reaped, or exited just now
            }
            libc::kill(pid, libc::SIGTERM);
            for _ in 0..100 {
                if libc::waitpid(pid, &mut status, libc::WNOHANG) != 0 {
                    return;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, &mut status, 0);
        }
    }

    /// Stops tracing: events from now on are dropped, the probes detach on a background
    /// thread (join it before exiting), and everything already produced reaches `sink`.
    /// Returns the loss counters.
    pub fn stop(&mut self, sink: &mut dyn Sink) -> (Detaching, Counters) {
        self.cutoff_ns = Some(monotonic_ns());
        let teardown = self.probes.detach();
        let counters = self.probes.counters().unwrap_or_default();
        while self.drain(sink, true) > 0 {}
        if let Some(u) = self.unwinder.as_mut() {
            for done in u.flush(&mut self.probes) {
                Self::deliver(u, done, sink);
            }
        }
        (teardown, counters)
    }
}

/// Which processes a session's allocator probes fire for: `None`, every process (the
/// probes filter by the traced set in the kernel: `-a`, and with multi links, followed
/// processes, whose children the kernel adds at fork); else the one process.
fn probe_scope(probes: &Probes, options: &TraceOptions, pid: Option<u32>) -> Option<u32> {
    let following = matches!(options.target, Target::Command(_)) || options.follow_forks;
    match options.target {
        Target::All => None,
        _ if following && probes.attach_path() == AttachPath::Multi => None,
        _ => pid,
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

/// Why the loop woke.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// The timer, or a ring with a batch waiting.
    Tick,
    Signal(i32),
    TargetExited,
    Deadline,
}

/// Everything a session waits on. Create it inside the tokio runtime, and drop it (with
/// the runtime) before the tracer: its watchers borrow the rings' descriptors.
pub struct Waker {
    notify: Arc<Notify>,
    watchers: Vec<TaskHandle<()>>,
    target: Option<AsyncFd<OwnedFd>>,
    target_exited: bool,
    sigint: Signal,
    sigterm: Signal,
    sighup: Signal,
    tick: tokio::time::Interval,
    deadline: Option<tokio::time::Instant>,
}

impl Waker {
    pub fn new(tracer: &mut Tracer, interval: Duration, duration: Option<Duration>) -> Result<Self> {
        let notify = Arc::new(Notify::new());
        let mut watchers = Vec::new();
        for ring in tracer.probes.rings_mut() {
            // SAFETY: the ring outlives this watcher: the Waker, which aborts it, is dropped
            // with the runtime before the tracer and its rings.
            let fd = unsafe { AsyncFd::register_with_interest(BorrowedFd(ring.ring.as_raw_fd()), Interest::READABLE) }
                .map_err(|e| anyhow!("polling a ring buffer: {e}"))?;
            let notify = Arc::clone(&notify);
            watchers.push(tokio::spawn(async move {
                while let Ok(mut guard) = fd.readable().await {
                    guard.clear_ready();
                    notify.notify_one();
                }
            }));
        }
        let target = match tracer.target_pid {
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
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        Ok(Self {
            notify,
            watchers,
            target,
            target_exited: false,
            sigint: signal(SignalKind::interrupt())?,
            sigterm: signal(SignalKind::terminate())?,
            sighup: signal(SignalKind::hangup())?,
            tick,
            deadline: duration.map(|d| tokio::time::Instant::now() + d),
        })
    }

    pub async fn wait(&mut self) -> Wake {
        let target = self.target.as_ref().filter(|_| !self.target_exited);
        let target_exit = async {
            match target {
                Some(fd) => {
                    let _ = fd.readable().await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        let deadline = self.deadline;
        let until_deadline = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending::<()>().await,
            }
        };
        tokio::select! {
            _ = self.tick.tick() => Wake::Tick,
            _ = self.notify.notified() => Wake::Tick,
            _ = self.sigint.recv() => Wake::Signal(libc::SIGINT),
            _ = self.sigterm.recv() => Wake::Signal(libc::SIGTERM),
            _ = self.sighup.recv() => Wake::Signal(libc::SIGHUP),
            _ = target_exit => {
                self.target_exited = true;
                Wake::TargetExited
            }
            _ = until_deadline => Wake::Deadline,
        }
    }
}

impl Drop for Waker {
    fn drop(&mut self) {
        for w in &self.watchers {
            w.abort();
        }
    }
}

/// Runs `body` on a single-threaded tokio runtime that ends (with every task on it) when
/// `TCMALLOC_TRANSFER_NUM_OBJ` in a process's environment (it changes tcmalloc's classes).
fn tcmalloc_transfer_num_obj(pid: u32) -> Option<i64> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    environ
        .split(|&b| b == 0)
        .find_map(|v| v.strip_prefix(b"TCMALLOC_TRANSFER_NUM_OBJ="))
        .and_then(|v| std::str::from_utf8(v).ok()?.trim().parse().ok())
}

/// `body` returns.
pub fn block_on<T>(body: impl std::future::Future<Output = T>) -> Result<T> {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    Ok(runtime.block_on(body))
}

/// Runs `argv` with empty probes at the naive attach points (the benchmark's floor) and
/// returns its exit code.
pub fn run_baseline(argv: &[OsString], placed: bool, with_return: bool) -> Result<i32> {
    probes::check_privileges()?;
    let program = spawn::resolve_program(&argv[0]).map_err(|e| anyhow!(CommandFailed(e)))?;
    let allocator = probes::allocator::for_executable(&program, "")?;
    let mut probes = Probes::load(&probes::Settings {
        all_processes: false,
        user_stacks: false,
        kernel_stacks: false,
        ring_bytes: 4096,
        follow_children: false,
        sample_bytes: None,
        call_graph: CallGraph::Fp,
    })?;
    let mut child = spawn::spawn_paused(argv).map_err(|e| anyhow!(CommandFailed(e)))?;
    if let Err(e) = probes.attach_empty(&allocator, child.pid, placed, with_return) {
        child.abandon();
        return Err(e);
    }
    child.release().map_err(|e| anyhow!(CommandFailed(e)))?;
    let mut status = 0;
    // SAFETY: waits for our own child.
    unsafe { libc::waitpid(child.pid as i32, &mut status, 0) };
    probes.detach().join();
    Ok(spawn::exit_code(status))
}
