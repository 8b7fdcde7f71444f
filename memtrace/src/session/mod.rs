//! A tracing session, shared by `record`, `top` and `serve`: checks the target, finds its
//! allocator, loads and attaches the probes (starting `-- CMD` paused until they are in
//! place), then drains the per-CPU rings into a [`Sink`] — stack records at once, events in
//! time order. This file owns the tracer's core (start, drain, stop); beside it:
//! [`follow`] (forks, execs, dlopens, sampling on loss), [`overload`] (what that switch hands
//! the probes), [`command`] (signals, reaping),
//! [`wake`] (the loop it runs on), [`spawn`] (the paused command), [`priority`] (its own
//! niceness), [`reorder`] (time order), [`output`] (files written safely), [`record`] (the
//! `record` subcommand).
//!
//! Over 500 lines: the tracer's core (start, drain, stop) is one state machine; following, commands, the wake loop and the baseline are already in their own files.
mod baseline;
mod command;
mod copies;
mod follow;
mod gpu;
mod objects;
pub mod output;
pub mod overload;
pub mod priority;
mod python;
pub mod record;
mod remembered;
pub mod reorder;
pub mod spawn;
mod wake;

use std::{
    collections::{HashMap, HashSet},
    ffi::OsString,
    io,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, Result, anyhow, bail};

pub use self::{
    baseline::run_baseline,
    record::{RecordOptions, RecordSummary, record},
    wake::{Wake, WakeLoop, block_on},
};
use self::{reorder::Reorder, spawn::PausedChild};
use crate::{
    event::{Event, Record, StackRecord, decode},
    probes::{self, Allocator, CallGraph, Counters, Detaching, Probes},
    procfs,
    recording::RingBytes,
    sizes::usable::{Model, UsableSizes},
    unwind::{UnwindOptions, UnwindStats, Unwinder, table::Table},
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
    /// Walk the Python frames of processes running CPython (`--python-frames`).
    pub python_frames: crate::probes::PythonFrames,
    /// memtrace's own niceness while it traces (`--nice`); `serve`, an agent that samples,
    /// keeps the one it was started with unless told.
    pub nice: priority::Niceness,
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
    /// The executable mappings of `pid` as the probes saw them, for frames in files without
    /// a build id (they stay addresses; the process may be gone before `/proc` is read).
    fn maps_seen(&mut self, _pid: u32, _maps: procfs::Maps) {}
    /// The name of a kernel slab cache (kmem_cache_alloc events carry the cache).
    fn cache_seen(&mut self, _cache: u64, _name: &str) {}
    /// The processes running when the session began, as they were then (`record -a`),
    /// before any of their records: who names their frames and them learns them from
    /// there, not from a `/proc` read after they may have exec'd.
    fn processes_at_start(&mut self, _snapshot: std::sync::Arc<crate::at_start::Snapshot>) {}
}

/// Events stamped within this long of "now" may still be on their way from another CPU.
const REORDER_LAG_NS: u64 = 100_000_000;
/// Events waiting at most while a ring left with records holds their release (~30 MB): a
/// reader stopped or descheduled for a while catches up in order, one that stays behind
/// under a load it cannot follow keeps its memory ([`MAX_HELD_EVENTS`] is the bound).
const HOLD_BEHIND_EVENTS: usize = 1 << 18;
/// Records read from one ring per drain: what one drain holds in memory is bounded,
/// whatever the rings' size (a ring that has more is read again at once).
pub const RING_BATCH: usize = 1 << 15;
/// Bytes of stack records one drain holds (each ring's share of it, at least
/// [`MIN_STACK_BYTES_PER_RING`], so the bound is the larger of this and 128 KiB per ring:
/// 32 MiB on 256 CPUs; a ring overshoots its share by one record at most): a drain's
/// stacks wait until every ring is read, and 32,768 records from each of 16 rings held
/// ~300 MB of a PyTorch program's stacks (49 MB on 2 CPUs). Decoded, a stack takes about
/// four times its record's bytes (a user address is 8 bytes in the ring, 32 as a frame):
/// 8 MiB held 29 MB of PyTorch's stacks on 2 CPUs. A ring with more is read again at once.
const STACK_BYTES_PER_DRAIN: u64 = 2 << 20;
const MIN_STACK_BYTES_PER_RING: u64 = 128 << 10;
/// A ring's share of [`STACK_BYTES_PER_DRAIN`].
fn stack_bytes_per_ring(rings: usize) -> u64 {
    (STACK_BYTES_PER_DRAIN / rings.max(1) as u64).max(MIN_STACK_BYTES_PER_RING)
}

/// Records read from a ring between two looks at the losses while sampling is not on yet
/// (`Tracer::switch_on_loss`): ~2 ms of reading.
const LOSS_CHECK_RECORDS: usize = 4096;
/// Events waiting to be put in time order, at most (beyond, the oldest are released before
/// their time: memory stays bounded under any load).
const MAX_HELD_EVENTS: usize = 1 << 21;
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

/// A program as the session keys it: its canonical path and what it preloads.
type ProgramKey = (PathBuf, Vec<PathBuf>);

/// The probes of a session and what they trace.
pub struct Tracer {
    pub probes: Probes,
    pub allocator: Option<Allocator>,
    pub target_pid: Option<u32>,
    /// Readable once the target exits: opened before the probes were attached, so that its
    /// exit is seen however soon it comes (taken by the wake loop).
    pub target_pidfd: Option<std::os::fd::OwnedFd>,
    pub is_command: bool,
    /// How the command ended, once reaped (`spawn::describe_status`).
    pub command_ended: Option<String>,
    pub options: TraceOptions,
    child: Option<PausedChild>,
    reorder: Reorder,
    /// The time of the last event read from each ring: one left with records holds the
    /// release of every ring's events after it ([`reorder::watermark`]).
    ring_last_ts: Vec<u64>,
    /// The time up to which the rings are read in the next drain: the last event of the
    /// ring furthest behind, plus the lag (None when every ring was read dry).
    read_up_to: Option<u64>,
    /// Every allocator found so far: the target's, those of programs exec'd later, those
    /// loaded with dlopen. An allocator's index is its position plus one.
    pub allocators: Vec<Allocator>,
    /// (pid, allocator file, prefix) with probes (pid 0: every process).
    attached: HashSet<(u32, (u64, u64), String)>,
    /// Gives user allocations their usable size from their allocator's size classes.
    usable: UsableSizes,
    /// Processes followed (targets and their children), for the dlopen scan.
    followed: HashSet<u32>,
    /// Which task records are news (one read a drain after a later one of its process is
    /// not).
    lifecycles: crate::lifecycle::Lifecycles,
    /// Objects already checked for an allocator, by name and by file, and the thread
    /// looking into them.
    checked_objects: HashSet<PathBuf>,
    checked_files: HashSet<(u64, u64)>,
    objects: objects::ObjectChecks,
    /// Programs (and what they preload) whose allocators were resolved (exec'd again and
    /// again: resolved once).
    resolved_programs: HashMap<ProgramKey, Vec<Allocator>>,
    /// Answers for programs whose process was gone before it was looked into: not reused
    /// in this session (a chroot's program would have its libraries looked for in ours),
    /// but what the next session of the command may probe ahead (the short program that
    /// exec'd its own allocator is the case the memory of sessions is for).
    unsure_programs: HashMap<ProgramKey, Vec<Allocator>>,
    /// A command's program and the allocator files probed from the start without the
    /// memory of earlier sessions ([`remembered`]): the programs exec'd with others are
    /// remembered for the next session.
    base_allocators: Option<(PathBuf, HashSet<(u64, u64)>)>,
    /// Programs being looked into on the objects' thread, and the processes that exec'd
    /// them meanwhile (`make -j` starting the compiler several times): one search each.
    programs_in_flight: HashMap<ProgramKey, Vec<(u32, u64)>>,
    /// Allocators (by index) probed after a traced process could call them: the first
    /// such process and how late, for the recording's warnings.
    pub late_probes: HashMap<u8, crate::recording::LateProbe>,
    last_scan: Instant,
    last_loss_check: Instant,
    lost_seen: u64,
    /// When the rings overflowed and sampling was switched on: (timestamp, mean bytes).
    pub degraded: Option<(u64, u64)>,
    /// The switch to sampling and the live blocks it hands to the probes.
    overload: overload::Overload,
    /// When the last drain that read every ring dry began.
    caught_up_ns: u64,
    /// When the session began, before any probe was loaded: no event is older.
    pub began_ns: u64,
    /// Whether the last drain read every ring dry (else one has more waiting).
    last_drain_dry: bool,
    /// The most bytes of stack records one drain held (for the debug log).
    most_stack_bytes_held: u64,
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
    /// The CUDA driver modules found and probed.
    gpu: gpu::GpuState,
    /// The Python interpreters found in the traced processes.
    python: python::PythonState,
    /// Finished stack copies named by their content.
    copies: copies::CopyNames,
    /// The copies each ring carried last (`Record::CopyRepeat`).
    recent_copies: copies::RecentCopies,
    /// Every process when tracing began (`record -a`), for the sink at its first drain.
    at_start: Option<Arc<crate::at_start::Snapshot>>,
    /// Task and mapping records read past what every ring was read up to, handled in a
    /// later drain ([`reorder::handled_up_to`]).
    lifecycle_held: Vec<Lifecycle>,
}

/// How long `-- CMD` waits for the unwind tables of its program before it starts (its
/// first allocations are then walked whole); `--pid` waits less (its target runs already).
const COMMAND_TABLES_WAIT: Duration = Duration::from_secs(30);
const PID_TABLES_WAIT: Duration = Duration::from_secs(2);

/// Verifies the programs `plan` needs while this thread installs the unwind tables that
/// are ready meanwhile (each install waits for an RCU grace period, which the
/// verification's CPU time hides).
fn verify_installing_tables(probes: &mut Probes, plan: probes::verify::Plan, unwinder: &mut Unwinder) -> Result<()> {
    // The store's install thread starts at once (with the maps installed ahead of need):
    // installs made on this thread held it for a batch's grace periods, 70–200 ms past the
    // end of the verification when a warm cache had a hundred tables to install.
    let installer = std::cell::RefCell::new(crate::unwind::store::TableSink::installer(&*probes));
    let mut maps = Handoff { maps: probes.table_maps()?, installer };
    std::thread::scope(|scope| {
        let verifying = scope.spawn(|| probes.verify_ahead(plan));
        while !verifying.is_finished() {
            unwinder.install_ready(&mut maps);
            std::thread::sleep(Duration::from_millis(2));
        }
        verifying.join().map_err(|_| anyhow!("verifying the probes panicked"))?
    })
}

/// The tables' maps while the probes are verified, handing the store its install thread.
struct Handoff {
    maps: probes::TableMaps,
    installer: std::cell::RefCell<Option<crate::unwind::store::Installer>>,
}

impl crate::unwind::store::TableSink for Handoff {
    fn install_tables(&mut self, tables: &[(u32, &Table)]) -> Vec<crate::unwind::store::InstallResult> {
        self.maps.install_tables(tables)
    }

    fn installer(&self) -> Option<crate::unwind::store::Installer> {
        self.installer.borrow_mut().take()
    }

    fn place_table(&mut self, slot: u32, table: &Table) -> Option<crate::unwind::store::InstallResult> {
        self.maps.place_table(slot, table)
    }

    fn register_file(
        &mut self,
        id: memtrace_common::unwind::FileId,
        table: memtrace_common::unwind::FileTable,
    ) -> Result<()> {
        self.maps.register_file(id, table)
    }
}

impl Tracer {
    /// Checks the target, loads and attaches the probes. A command is forked but waits for
    /// [`Tracer::release`]; `before_load` runs after the cheap checks and before the probes
    /// load (the recorder creates its output file there, to fail early), given the files a
    /// command's program will map (none for `--pid` and `-a`).
    pub fn start(options: &TraceOptions, before_load: impl FnOnce(&[PathBuf]) -> Result<()>) -> Result<Self> {
        if !options.user && !options.kernel {
            bail!("--no-user and --no-kernel together leave nothing to trace");
        }
        let began_ns = monotonic_ns();
        priority::take(options.nice);
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
            // Every process's: the C library's, as memtrace itself maps it. Not the mimalloc
            // linked into memtrace's own executable, which would probe every process running
            // it, this one included, and trap on each of its own allocations.
            _ => {
                let mut all = probes::allocator::all_for_process(std::process::id(), prefix)?;
                all.retain(|a| !probes::allocator::is_own_executable(a.file_id));
                all
            }
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
        // The target's own allocators: what cannot be probed among them fails the session.
        let own_allocators = found.len();
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
        // What the files probed so far are, before the programs remembered from earlier
        // sessions add theirs (what this session finds beyond them is remembered).
        let base_allocators: HashSet<(u64, u64)> = found.iter().map(|a| a.file_id).collect();
        // Looked up and kept under the same terms: a command's session, with the plain
        // allocator names, and the disk cache in use.
        let remembers = is_command && options.user && options.symbol_prefix.is_empty() && options.unwind.disk_cache;
        let remembered = program.clone().filter(|_| remembers).map(remembered::look_up);
        // The user stacks of kernel allocations need the tables too (`--no-user`): without
        // them each walk stopped at its first frame and sent a stack copy no one read (136 MB
        // of ring for a program faulting in 64 MiB, whose stacks then waited for room).
        let mut unwinder =
            (options.call_graph != CallGraph::Fp && options.user_stacks).then(|| Unwinder::new(&options.unwind));
        let program_files = program.as_deref().map(probes::allocator::program_files).unwrap_or_default();
        if let (Some(u), Some(program)) = (unwinder.as_mut(), &program) {
            // The program's own files: their tables are built while the probes load.
            u.prepare_files(&program_files);
            u.prepare_program(program, false);
        }
        if let (Some(u), Target::Pid(pid)) = (unwinder.as_mut(), &options.target) {
            u.prepare_process(*pid);
        }
        before_load(&program_files)?;
        // The mappings processes make: the table walk learns its files from them, the
        // Python frames their interpreter (a shared libpython is mapped after the exec),
        // whichever way the native frames are walked, and the traced processes the
        // allocators of the libraries they load with dlopen, whatever the stacks (without
        // them a library's allocator was found by the scan of the processes' maps every 2 s:
        // pyarrow's mimalloc, loaded and used within a second of a script's start, went
        // unseen with `--no-user-stacks` and its arenas showed as 1.1 GiB of user mmaps).
        let python = python::wanted(options);
        let loads_allocators = options.user;
        let track_mappings = unwinder.is_some() || python || loads_allocators;
        let mut probes = Probes::load(&probes::Settings {
            all_processes: matches!(options.target, Target::All),
            user_stacks: options.user_stacks,
            kernel_stacks: options.kernel_stacks,
            ring_bytes: options.ring_bytes,
            follow_children: is_command || options.follow_forks,
            sample_bytes: options.sample_bytes,
            call_graph: options.call_graph,
            track_mappings,
            layout_cache: options.unwind.disk_cache,
        })?;
        let mut child = None;
        let mut python_state = python::PythonState::default();
        let target_pid = match &options.target {
            Target::Pid(pid) => {
                probes.trace_tgid(*pid, false)?;
                // Its interpreter, before its allocator is probed: else its allocations
                // until the tracer is made (the tables' wait, up to a second) had no Python
                // frames.
                if python {
                    python_state.check(*pid, &mut probes, options.quiet);
                }
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
        // A `--pid` target that exited and was reaped between its check and here is gone
        // before tracing began.
        let target_pidfd = match target_pid.map(|pid| (pid, wake::pidfd_open(pid))) {
            Some((_, Ok(fd))) => Some(fd),
            Some((pid, Err(e))) => {
                if let Some(c) = child.take() {
                    c.abandon();
                }
                if e.raw_os_error() == Some(libc::ESRCH) {
                    bail!("process {pid} exited before tracing began");
                }
                return Err(e).with_context(|| format!("watching process {pid}"));
            }
            None => None,
        };
        let pythons_running = if python && matches!(options.target, Target::All) {
            python_state.scan_all(&mut probes, options.quiet)
        } else {
            Vec::new()
        };
        if let Some(look) = remembered {
            for mut extra in look.take() {
                if found.iter().any(|a| a.file_id == extra.file_id && a.prefix == extra.prefix) {
                    continue;
                }
                let Ok(index) = u8::try_from(found.len() + 1) else { break };
                extra.index = index;
                // Counted as found when a program of this session maps it.
                extra.found = false;
                usable.set_model(index, Model::for_family(extra.family, transfer));
                found.push(extra);
            }
        }
        let attached = (|| -> Result<()> {
            let plan = probes::verify::Plan {
                mappings: track_mappings,
                kernel: options.kernel,
                allocators: !found.is_empty(),
            };
            match unwinder.as_mut() {
                Some(u) => verify_installing_tables(&mut probes, plan, u)?,
                None => probes.verify_ahead(plan)?,
            }
            let started = Instant::now();
            probes.attach_task_tracepoints()?;
            if track_mappings {
                probes.attach_mapping_tracker()?;
            }
            let tracepoints = started.elapsed();
            if options.kernel {
                probes.attach_kernel()?;
            }
            let kernel = started.elapsed();
            let scope = probe_scope(&probes, options, target_pid);
            for (i, allocator) in found.iter().enumerate() {
                match probes.attach_allocator(allocator, scope) {
                    Ok(()) => {}
                    // Probed ahead (an installed library, a program remembered from an
                    // earlier session): one that cannot be probed is not the command's own,
                    // and the session goes on without it (the links it made are closed). It
                    // counts as attached: not tried again (what failed would fail again).
                    Err(e) if i >= own_allocators => {
                        log::debug!("not probing {} ahead: {e:#}", allocator.object.display());
                    }
                    Err(e) => return Err(e),
                }
                probes.load_cuda_programs()?;
            }
            log::debug!(
                "attached in {} ms: task and mapping tracepoints {} ms, kernel {} ms, {} allocators {} ms",
                started.elapsed().as_millis(),
                tracepoints.as_millis(),
                (kernel - tracepoints).as_millis(),
                found.len(),
                (started.elapsed() - kernel).as_millis()
            );
            Ok(())
        })();
        if let Err(e) = attached {
            if let Some(c) = child {
                c.abandon();
            }
            return Err(e);
        }
        let attached_to = probe_scope(&probes, options, target_pid).unwrap_or(0);
        // Under `-a`, every process as it is now that the probes see what changes it (perf's
        // synthesized mmap events): one running before tracing began was learned from its
        // `/proc` when its first record was read, and a shell that had exec'd its last
        // command by then had its stacks walked and named in that command's maps.
        let at_start = matches!(options.target, Target::All).then(|| {
            let reading = Instant::now();
            let snapshot = Arc::new(crate::at_start::Snapshot::take(std::process::id()));
            log::debug!(
                "{} processes running, {} executable mappings, read in {} ms",
                snapshot.len(),
                snapshot.mappings(),
                reading.elapsed().as_millis()
            );
            snapshot
        });
        if let (Some(u), Some(snapshot)) = (unwinder.as_mut(), &at_start) {
            u.set_at_start(snapshot.clone());
        }
        if let Some(u) = unwinder.as_mut() {
            let started = Instant::now();
            let (ready, wait) = match &options.target {
                Target::Pid(pid) => {
                    u.learn_process(*pid, &mut probes);
                    (u.wait_tables(&mut probes, PID_TABLES_WAIT), PID_TABLES_WAIT)
                }
                Target::Command(_) => (u.wait_startup_tables(&mut probes, COMMAND_TABLES_WAIT), COMMAND_TABLES_WAIT),
                Target::All => (u.wait_tables(&mut probes, COMMAND_TABLES_WAIT), COMMAND_TABLES_WAIT),
            };
            if !ready {
                log::debug!("unwind tables still building after {wait:?}: early stacks are finished from copies");
            }
            log::debug!("unwind tables ready in {} ms: {:?}", started.elapsed().as_millis(), u.stats().tables);
        }
        let mut tracer = Self {
            probes,
            attached: found.iter().map(|a| (attached_to, a.file_id, a.prefix.clone())).collect(),
            usable,
            followed: target_pid.into_iter().collect(),
            lifecycles: crate::lifecycle::Lifecycles::new(),
            checked_objects: HashSet::new(),
            checked_files: HashSet::new(),
            objects: objects::ObjectChecks::new(),
            programs_in_flight: HashMap::new(),
            late_probes: HashMap::new(),
            unsure_programs: HashMap::new(),
            resolved_programs: program
                .as_ref()
                .and_then(|p| std::fs::canonicalize(p).ok())
                // The program's own allocators: the installed libraries probed ahead of
                // time count as found only when a program maps them.
                .map(|p| ((p, Vec::new()), found.iter().filter(|a| a.found).cloned().collect()))
                .into_iter()
                .collect(),
            allocators: found,
            base_allocators: program.clone().filter(|_| remembers).map(|p| (p, base_allocators)),
            last_scan: Instant::now(),
            last_loss_check: Instant::now(),
            lost_seen: 0,
            degraded: None,
            overload: overload::Overload::new(),
            caught_up_ns: 0,
            began_ns,
            last_drain_dry: true,
            most_stack_bytes_held: 0,
            allocator,
            target_pid,
            target_pidfd,
            is_command,
            command_ended: None,
            options: options.clone(),
            child,
            reorder: Reorder::new(),
            ring_last_ts: Vec::new(),
            read_up_to: None,
            cutoff_ns: None,
            decode_errors: 0,
            forwarded_signal: None,
            unwinder,
            ring_bytes: RingBytes::default(),
            gpu: Default::default(),
            python: python_state,
            copies: Default::default(),
            recent_copies: Default::default(),
            at_start,
            lifecycle_held: Vec::new(),
        };
        if let (Target::Pid(pid), true) = (&options.target, options.user) {
            // A running process may have loaded the CUDA driver already.
            tracer.check_cuda_mapped(*pid);
        }
        if !pythons_running.is_empty()
            && let Some(u) = tracer.unwinder.as_mut()
        {
            // As for --pid: their first stacks find the tables of the files they run.
            for &pid in &pythons_running {
                u.learn_process(pid, &mut tracer.probes);
            }
            u.wait_tables(&mut tracer.probes, PID_TABLES_WAIT);
        }
        Ok(tracer)
    }

    /// Whether the last [`Tracer::drain`] read every ring dry (else a ring has more
    /// waiting than one drain takes: read again at once).
    pub fn caught_up(&self) -> bool {
        self.last_drain_dry
    }

    /// Kernel allocations finished by an earlier copy of their syscall, and references
    /// whose copy was not found.
    pub fn copy_repeats(&self) -> (u64, u64) {
        (self.recent_copies.matched, self.recent_copies.unmatched)
    }

    pub fn unwind_stats(&self) -> Option<UnwindStats> {
        self.unwinder.as_ref().map(Unwinder::stats)
    }

    /// After [`Tracer::stop`] and once its figures are read: lets go of what only tracing
    /// needed — the unwinder's tables and address spaces, the Python names, the reorder
    /// buffer, the rings' mapped pages (`stop` emptied the copies already) — before a recording names its frames, which needs
    /// memory of its own (a PyTorch recording's peak was the two held together).
    pub fn shed(&mut self) {
        self.unwinder = None;
        self.python = python::PythonState::default();
        self.reorder = Reorder::new();
        self.recent_copies = Default::default();
        self.probes.unmap_rings();
    }

    /// A stack record from the probes: named (and finished, if the probes sent a copy)
    /// by the unwinder before it reaches the sink, or kept there until the table it needs
    /// is built.
    fn on_stack(&mut self, mut stack: StackRecord, sink: &mut dyn Sink) {
        if !self.name_python(&mut stack) {
            let (hash, copy) = (stack.hash, stack.miss.is_some());
            match self.python_wait(stack) {
                Some(cut) => stack = cut,
                None => {
                    if copy {
                        // Its allocation may go out first: it keeps the copy's hash.
                        self.copies.waiting(hash);
                    }
                    return;
                }
            }
        }
        self.on_named_stack(stack, sink);
    }

    /// A stack with its Python frames: on to the unwinder and the sink.
    fn on_named_stack(&mut self, stack: StackRecord, sink: &mut dyn Sink) {
        let Some(unwinder) = self.unwinder.as_mut() else {
            sink.stack(stack);
            return;
        };
        let (hash, copy) = (stack.hash, stack.miss.is_some());
        match unwinder.accept(stack, &mut self.probes) {
            Some(done) if copy => Self::deliver_copy(unwinder, &mut self.copies, done, sink),
            Some(done) => Self::deliver(unwinder, Some(done), sink),
            None if copy => self.copies.waiting(hash),
            // Waits for the ranges of its frames (`Unwinder::poll_unplaced`).
            None => {}
        }
    }

    fn deliver(unwinder: &mut Unwinder, stack: Option<StackRecord>, sink: &mut dyn Sink) {
        for path in unwinder.take_new_files() {
            sink.file_seen(&path);
        }
        for (pid, maps) in unwinder.take_new_maps() {
            sink.maps_seen(pid, maps);
        }
        if let Some(stack) = stack {
            sink.stack(stack);
        }
    }

    /// A finished stack copy, under its content's hash where it can be (once per content).
    fn deliver_copy(unwinder: &mut Unwinder, copies: &mut copies::CopyNames, stack: StackRecord, sink: &mut dyn Sink) {
        Self::deliver(unwinder, copies.finished(stack), sink);
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

    /// Code a traced process mapped: the unwinder's address space, Python, and the
    /// allocators a library brings (dlopen).
    fn on_mapping(&mut self, m: &crate::event::FileMapping) {
        let handling = std::time::Instant::now();
        self.on_code_mapped(m);
        if let Some(path) = &m.path {
            self.python_mapped(m.pid, std::path::Path::new(path));
        }
        if let Some(u) = self.unwinder.as_mut() {
            u.mapping(m, &mut self.probes);
        }
        // A library mapped executable (dlopen): look for allocators in it now (under `-a`,
        // any process's: Python's extension modules bring theirs, pyarrow a mimalloc).
        if let Some(path) = &m.path
            && self.cutoff_ns.is_none()
            && (self.followed.contains(&m.pid) || matches!(self.options.target, Target::All))
        {
            let object = procfs::path_in_process(m.pid, Path::new(path));
            self.check_object(object, Some((m.pid, m.ts_ns)));
        }
        let took = handling.elapsed();
        if took > std::time::Duration::from_millis(10) {
            // The rings wait meanwhile.
            log::debug!("mapping of {:?} in {}: handled in {} ms", m.path, m.pid, took.as_millis());
        }
    }

    /// Reads every ring dry into `sink`; releases the events old enough to be in order
    /// (all of them if `everything`). New processes are handled as soon as the rings are
    /// read: children get the allocator probes, programs exec'd get theirs. Returns how
    /// many records were read.
    pub fn drain(&mut self, sink: &mut dyn Sink, everything: bool) -> usize {
        if let Some(snapshot) = self.at_start.take() {
            sink.processes_at_start(snapshot);
        }
        let now = monotonic_ns();
        let mut n = 0;
        // Stacks wait until every ring is read: the mappings they need may be in another.
        let mut stacks = Vec::new();
        // Forks, execs, exits and mappings, handled once every ring is read, in the order
        // they happened: the rings are read one after another, and a child's exec (in its
        // CPU's ring) read before its parent's fork (in another) would find the child not
        // yet followed, and the fork would pull it back into its parent's address space.
        let mut lifecycle: Vec<Lifecycle> = Vec::new();
        let mut dry = true;
        let rings = self.probes.rings_mut().len();
        self.ring_last_ts.resize(rings, 0);
        // The last event read from each ring left with records this drain.
        let mut behind = Vec::new();
        // Rings are read up to the time of the one furthest behind (and the lag): a ring
        // read far ahead of another only waits in memory for it, and past
        // `HOLD_BEHIND_EVENTS` waiting would go out of order.
        let mut up_to = self.read_up_to;
        let stack_budget = stack_bytes_per_ring(rings);
        let mut held_stack_bytes = 0u64;
        for cpu in 0..rings {
            let mut taken = 0;
            let mut stack_bytes = 0u64;
            let mut ahead = false;
            while taken < RING_BATCH
                && stack_bytes < stack_budget
                && !ahead
                && let Some(record) = {
                    let ring = &mut self.probes.rings_mut()[cpu];
                    let cpu_id = ring.cpu;
                    ring.ring.read(|item| (item.len() as u64, decode(item, cpu_id)))
                }
            {
                n += 1;
                taken += 1;
                if taken % LOSS_CHECK_RECORDS == 0 && self.may_switch() {
                    self.switch_on_loss();
                }
                let (len, record) = record;
                let bytes = &mut self.ring_bytes;
                match &record {
                    Ok(Record::Event(_)) => bytes.events += len,
                    Ok(Record::Stack(s)) if s.miss.is_some() => bytes.stack_copies += len,
                    Ok(Record::Stack(_) | Record::CopyRepeat(..)) => bytes.stacks += len,
                    _ => bytes.other += len,
                }
                match record {
                    Ok(Record::Stack(s)) => {
                        stack_bytes += len;
                        self.recent_copies.seen(cpu, &s);
                        stacks.push(s);
                    }
                    Ok(Record::CopyRepeat(s, of)) => {
                        let s = self.recent_copies.resolve(cpu, s, of);
                        // Held as a copy of its own until finished.
                        stack_bytes += len + s.miss.as_ref().map_or(0, |m| m.copy.len() as u64);
                        stacks.push(s);
                    }
                    Ok(Record::Mapping(m)) => lifecycle.push(Lifecycle::Mapping(m)),
                    Ok(Record::Cache { cache, name }) => sink.cache_seen(cache, &name),
                    Ok(Record::PyCode(code)) => self.python_code(code),
                    Ok(Record::PyStack(frames)) => self.python_stack(frames),
                    Ok(Record::Task(t, space)) => {
                        // New processes and programs are handled in this drain: the sooner
                        // their address spaces and probes are in place, the fewer of their
                        // first allocations need a stack copy or go unseen.
                        if self.cutoff_ns.is_none() {
                            lifecycle.push(Lifecycle::Task(t.clone(), space));
                        }
                        let last = &mut self.ring_last_ts[cpu];
                        *last = (*last).max(t.ts_ns);
                        ahead = up_to.is_some_and(|u| t.ts_ns > u);
                        if self.cutoff_ns.is_none_or(|c| t.ts_ns <= c) {
                            self.reorder.push(Event::Task(t));
                        }
                    }
                    Ok(Record::Event(e)) if self.cutoff_ns.is_none_or(|c| e.ts_ns() <= c) => {
                        let last = &mut self.ring_last_ts[cpu];
                        *last = (*last).max(e.ts_ns());
                        ahead = up_to.is_some_and(|u| e.ts_ns() > u);
                        self.reorder.push(e)
                    }
                    Ok(Record::Event(_)) => {}
                    Err(_) => self.decode_errors += 1,
                }
            }
            let ring_dry = taken < RING_BATCH && stack_bytes < stack_budget && !ahead;
            if !ring_dry {
                behind.push(self.ring_last_ts[cpu]);
                up_to = reorder::read_up_to(up_to, self.ring_last_ts[cpu], REORDER_LAG_NS);
            }
            dry &= ring_dry;
            held_stack_bytes += stack_bytes;
        }
        self.read_up_to = behind.iter().min().map(|&last| last.saturating_add(REORDER_LAG_NS));
        self.most_stack_bytes_held = self.most_stack_bytes_held.max(held_stack_bytes);
        if dry {
            self.caught_up_ns = now;
        }
        self.last_drain_dry = dry;
        // Stable: a ring's records of one time keep their order. Those past what every ring
        // was read up to wait for the next drain, which may read older ones.
        lifecycle.append(&mut self.lifecycle_held);
        lifecycle.sort_by_key(Lifecycle::ts_ns);
        let up_to = reorder::handled_up_to(now, &behind);
        let handled = lifecycle.partition_point(|r| r.ts_ns() <= up_to);
        self.lifecycle_held = lifecycle.split_off(handled);
        for record in lifecycle {
            match record {
                Lifecycle::Task(t, space) => self.on_task(&t, space, sink),
                Lifecycle::Mapping(m) => self.on_mapping(&m),
            }
        }
        self.attach_found_allocators();
        for s in stacks {
            self.on_stack(s, sink);
        }
        for s in self.python_ready(everything) {
            self.on_named_stack(s, sink);
        }
        if let Some(u) = self.unwinder.as_mut() {
            for done in u.poll(&mut self.probes) {
                Self::deliver_copy(u, &mut self.copies, done, sink);
            }
            for done in u.poll_unplaced(false, dry) {
                Self::deliver(u, Some(done), sink);
            }
        }
        self.forget_python_keys();
        let (usable, copies, overload) = (&mut self.usable, &mut self.copies, &mut self.overload);
        let watch = self.options.user && self.options.sample_bytes.is_none();
        let mut forward = |mut e: Event| {
            if let Event::Alloc(a) = &mut e
                && a.stack != 0
            {
                a.stack = copies.released(a.stack);
            }
            if usable.apply(&mut e) {
                if watch {
                    overload.observe(&e);
                }
                sink.event(e)
            }
        };
        // Everything goes out only once every ring was read dry: a ring left with more (its
        // share of a drain reached) may still hold events older than other rings' last.
        if everything && dry {
            self.reorder.release_all(&mut forward);
        } else {
            // Memory first: past HOLD_BEHIND_EVENTS waiting, they go out `REORDER_LAG_NS`
            // behind now whatever the rings still hold.
            if self.reorder.len() > HOLD_BEHIND_EVENTS {
                behind.clear();
            }
            self.reorder.release(reorder::watermark(now, REORDER_LAG_NS, behind), &mut forward);
            if self.reorder.len() > MAX_HELD_EVENTS {
                // Memory stays bounded whatever the event rate: the oldest go out early.
                self.reorder.release_oldest(self.reorder.len() - MAX_HELD_EVENTS / 2, &mut forward);
            }
        }
        self.check_overload();
        n
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
                Self::deliver_copy(u, &mut self.copies, done, sink);
            }
            for done in u.poll_unplaced(true, true) {
                Self::deliver(u, Some(done), sink);
            }
            u.save_programs_files();
        }
        if let Some((command, base)) = &self.base_allocators {
            // A short program's exec is often looked into after it is gone: its answer
            // still says what to probe from the next start.
            for found in self.objects.wait_for_the_rest(Duration::from_millis(500)) {
                if let objects::Found::Program { canonical, preload, allocators: Some(allocators), sure, .. } = found {
                    let answers = if sure { &mut self.resolved_programs } else { &mut self.unsure_programs };
                    answers.insert((canonical, preload), allocators);
                }
            }
            let canonical = std::fs::canonicalize(command).unwrap_or_else(|_| command.clone());
            let answers = self.resolved_programs.iter().chain(self.unsure_programs.iter());
            let programs = remembered::programs_with_own_allocators(&canonical, base, answers);
            if remembered::save(command, &programs) {
                // What the warnings may promise: the next record probes these from the start.
                for late in self.late_probes.values_mut().filter(|l| l.exec) {
                    late.remembered = programs.iter().any(|p| p.display().to_string() == late.program);
                }
            }
        }
        log::debug!("stack copies delivered as a stack met before: {}", self.copies.merged);
        log::debug!(
            "kernel allocations finished by an earlier copy of their syscall: {} ({} whose copy was not found)",
            self.recent_copies.matched,
            self.recent_copies.unmatched
        );
        log::debug!(
            "most stack record bytes one drain held: {} (at most {} from each of {} rings)",
            self.most_stack_bytes_held,
            stack_bytes_per_ring(self.probes.rings_mut().len()),
            self.probes.rings_mut().len()
        );
        log::debug!("most events waiting at once to be put in time order: {}", self.reorder.most_held());
        self.copies.clear();
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
        _ if following && probes.attach_path().uses_links() => None,
        _ => pid,
    }
}
/// `TCMALLOC_TRANSFER_NUM_OBJ` in a process's environment (it changes tcmalloc's classes).
fn tcmalloc_transfer_num_obj(pid: u32) -> Option<i64> {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
    environ
        .split(|&b| b == 0)
        .find_map(|v| v.strip_prefix(b"TCMALLOC_TRANSFER_NUM_OBJ="))
        .and_then(|v| std::str::from_utf8(v).ok()?.trim().parse().ok())
}

/// A task or mapping record read in a drain, handled once every ring is read.
enum Lifecycle {
    Task(crate::event::Task, crate::event::TaskSpace),
    Mapping(crate::event::FileMapping),
}

impl Lifecycle {
    fn ts_ns(&self) -> u64 {
        match self {
            Lifecycle::Task(t, _) => t.ts_ns,
            Lifecycle::Mapping(m) => m.ts_ns,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What one drain holds of stacks is 2 MiB, or 128 KiB per ring past 16 rings, and
    /// every ring gets a share large enough for a few of the deepest stacks (511 user
    /// frames with their files' build ids, ~16 KiB) and hundreds of common ones.
    #[test]
    fn a_drain_holds_a_bounded_share_of_stacks_from_each_ring() {
        for rings in [0, 1, 2, 3, 16, 64, 256, 1024] {
            let each = stack_bytes_per_ring(rings);
            assert!(each >= MIN_STACK_BYTES_PER_RING, "{rings} rings: {each}");
            let total = each * rings as u64;
            assert!(
                total <= STACK_BYTES_PER_DRAIN.max(rings as u64 * MIN_STACK_BYTES_PER_RING),
                "{rings} rings: {total}"
            );
        }
        assert_eq!(stack_bytes_per_ring(2), 1 << 20);
        assert_eq!(stack_bytes_per_ring(16), 128 << 10);
    }
}
