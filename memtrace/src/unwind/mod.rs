//! Whole user stacks without frame pointers, the userspace half. The probes walk user
//! stacks with per-file unwind tables ([`table`], built once per file from its call-frame
//! information by [`cfi`], by worker threads of the [`store`], kept in a disk [`cache`])
//! and per-process address spaces ([`spaces`]: which file each executable range maps).
//! [`Unwinder`] keeps both current from what the probes report (exec, fork, exit, each
//! executable mapping) and finishes the stacks the probes could not: when a walk meets a
//! frame whose file table is not installed yet, the probe sends the registers there and a
//! copy of the stack; the copy waits here until the table is built, then is walked with
//! the same table and step ([`walk`]) the probes use. Finally it names frames by build id
//! and file offset, so they can be symbolized after the processes are gone.
//!
//! Over 500 lines: the Unwinder ties spaces, store and walk together for exec, fork, exit, mapping and copies; its parts are in the files it names; tests from line 518.
pub mod cache;
pub mod cfi;
pub mod spaces;
pub mod store;
pub mod table;
pub mod walk;

use std::{
    collections::{HashMap, HashSet, VecDeque},
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use memtrace_common::{
    KERNEL_STACK_SEED, MAX_USER_DEPTH, MISS_HASH_MARK, USER_STACK_SEED, stack_hash_step, unwind::Regs,
};

use self::{
    cache::DiskCache,
    spaces::{SpaceSink, Spaces},
    store::{Slot, StoreStats, TableSink, TableState, TableStore},
    walk::{End, Lookup, StackCopy},
};
use crate::{
    elf,
    event::{FileMapping, RawUserFrame, StackRecord, TaskSpace, UserWalk},
    procfs::{self, Maps},
};

/// Copies waiting for tables are kept up to this many bytes; beyond, the oldest is
/// finished as far as the tables allow (truncated there).
const MAX_PENDING_BYTES: usize = 64 << 20;
/// Programs whose files a session remembers for the next one, at most.
const MAX_PROGRAMS_REMEMBERED: usize = 4096;
/// A copy waits at most this long for a table.
const MAX_WAIT: Duration = Duration::from_secs(20);
/// A stack the probes walked whole, with frames in no range of its space known here yet
/// (its exec's or its library's mapping record, from another CPU's ring, not read yet),
/// waits to be named until a drain begun after it was read has read every ring dry (every
/// record made before it is then handled), and at most [`PLACE_WAIT`]; at most
/// [`MAX_UNPLACED`] wait. (A count of polls was not enough: a ring full of stack copies is
/// read a share a drain, and its mapping records came more than 3 drains late: every libc
/// frame of a short `ls` under `-a` was `[unknown]` in a CI run.)
const PLACE_WAIT: Duration = Duration::from_secs(2);
const MAX_UNPLACED: usize = 1 << 16;
/// A copy taken in no space the probes knew, of a process started while traced, waits at
/// most this long for its fork record (its parent's CPU's ring, drained later: 20 ms seen
/// on 2 CPUs under `-a`).
const FORK_WAIT: Duration = Duration::from_secs(2);

/// The hash the probes give a stack (see memtrace-ebpf `user_stack` / `kernel_stack`); a
/// stack that ends truncated after a miss is marked so it never equals a whole one.
pub fn stack_hash(pid: u32, joined_kernel: Option<&[u64]>, user: &[u64], truncated_by_miss: bool) -> u64 {
    let mut h = match joined_kernel {
        Some(kernel) => {
            let mut h = stack_hash_step(KERNEL_STACK_SEED, u64::from(pid));
            for &ip in kernel.iter().take_while(|&&ip| ip != 0) {
                h = stack_hash_step(h, ip);
            }
            stack_hash_step(h, u64::MAX)
        }
        None => stack_hash_step(USER_STACK_SEED, u64::from(pid)),
    };
    for &ip in user.iter().take_while(|&&ip| ip != 0) {
        h = stack_hash_step(h, ip);
    }
    if truncated_by_miss { stack_hash_step(h, MISS_HASH_MARK) } else { h }
}

/// What the unwinder did, for the summary and the report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UnwindStats {
    /// Stack copies the probes sent (frames whose table was not ready).
    pub copies: u64,
    /// Copies that had to wait for a table to be built.
    pub waited: u64,
    /// Copies that still ended truncated (code without tables, the end of the copy).
    pub truncated: u64,
    /// Copies of the gap below an anchor whose walk landed on it (the stack joined whole),
    /// and those whose walk did not (the stack ends in the gap).
    pub anchored: u64,
    pub anchor_missed: u64,
    /// Copies finished before their table was ready (the wait bound, the memory bound,
    /// the end of the session).
    pub gave_up: u64,
    /// Fork, exec and exit records handled after a later record of their process (read a
    /// drain late, from another CPU's ring) and left out of its address space.
    pub late_task_records: u64,
    pub tables: StoreStats,
}

/// How the unwinder keeps its tables.
#[derive(Debug, Clone)]
pub struct UnwindOptions {
    /// Read and fill the disk cache of tables.
    pub disk_cache: bool,
    /// Cap on the bytes of tables installed in the probes.
    pub max_table_bytes: u64,
}

impl Default for UnwindOptions {
    fn default() -> Self {
        Self { disk_cache: true, max_table_bytes: store::DEFAULT_MAX_BYTES }
    }
}

struct Pending {
    /// The stack as the probes sent it, less its user frames: those are in `user`.
    record: StackRecord,
    /// The user frames, as addresses (a table walk's are): 8 bytes each, not a
    /// `RawUserFrame`'s 32, for the ~100 frames of each of the thousands of copies a cold
    /// start holds while a big library's table is built.
    user: Vec<u64>,
    since: Instant,
    bytes: usize,
    /// The table its last walk stopped at: it is walked again once that one is ready, not
    /// at every install (a cold start holds thousands while a hundred tables come in).
    waiting_on: Option<store::Slot>,
    /// Of a process not known yet: walked at this poll (one whole drain later), when the
    /// records of its fork, read from another CPU's ring, have had their turn; later, up to
    /// [`FORK_WAIT`], while that fork may still come ([`Unwinder::awaits_fork`]).
    process_at_poll: Option<u64>,
    /// Its last walk met an address in no range of its space known yet: walked again at
    /// each poll, until the ranges are settled (see [`Unwinder::poll`]).
    unplaced: bool,
    /// The poll after the drain that read it (as for `Unwinder::unplaced`).
    read_at_poll: u64,
}

/// Whether a file's loadable `segments` are the program the kernel mapped for `space`: its
/// code (`mm.start_code`..`end_code`) spans the file's executable segments (from the
/// lowest one's start to the highest one's end in the file), at a page-aligned bias.
/// (Older kernels began `start_code` at the lowest loadable segment, code or not: either
/// span is taken.)
fn spans_code(segments: &[cfi::Segment], space: &TaskSpace) -> bool {
    let code = segments.iter().filter(|s| s.executable);
    let Some(high) = code.clone().map(|s| s.vaddr + s.file_size).max() else { return false };
    let lows = [code.map(|s| s.vaddr).min(), segments.iter().map(|s| s.vaddr).min()];
    lows.into_iter()
        .flatten()
        .any(|low| high - low == space.code_end - space.code_start && space.code_start.wrapping_sub(low) % 4096 == 0)
}

/// The file a program was exec'd by name as: an absolute name as it is (not one that means
/// something else from here: /proc/self/exe is memtrace's), a relative one from memtrace's
/// own directory, where `record -- ./prog` started it (a short program's `/proc` is gone
/// by the time its exec is read: its frames were `[unknown]` in 3 runs of 20). The caller
/// takes it only if its code spans what the kernel mapped.
fn program_by_name(filename: &str) -> Option<PathBuf> {
    if filename.is_empty() || filename.starts_with("/proc/") || filename.starts_with("/dev/fd/") {
        return None;
    }
    let path = Path::new(filename);
    let path = if path.is_absolute() { path.to_path_buf() } else { std::env::current_dir().ok()?.join(path) };
    path.exists().then_some(path)
}

/// The interpreters a `#!` script runs under, in the order to try: the one its first line
/// names (through `env`, the program `env` finds first in the usual directories), nested
/// scripts followed a few levels, as the kernel does.
fn script_interpreters(pid: u32, script: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut at = script.to_path_buf();
    for _ in 0..4 {
        let Some(line) = shebang(&at) else { break };
        let mut words = line.split_whitespace();
        let Some(interpreter) = words.next() else { break };
        let interpreter = PathBuf::from(interpreter);
        if interpreter.file_name().is_some_and(|n| n == "env") {
            // `env [-S] prog`: the first word not an option.
            if let Some(program) = words.find(|w| !w.starts_with('-')) {
                let found = ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"]
                    .iter()
                    .map(|dir| procfs::path_in_process(pid, &Path::new(dir).join(program)))
                    .find(|p| p.is_file());
                out.push(procfs::path_in_process(pid, &interpreter));
                out.extend(found);
            }
            break;
        }
        at = procfs::path_in_process(pid, &interpreter);
        out.push(at.clone());
    }
    out
}

/// The `#!` line of a file (without the `#!`), if it starts with one.
fn shebang(path: &Path) -> Option<String> {
    use std::io::Read as _;
    let mut head = [0u8; 256];
    let n = std::fs::File::open(path).ok()?.read(&mut head).ok()?;
    let line = head[..n].strip_prefix(b"#!")?;
    let end = line.iter().position(|&b| b == b'\n').unwrap_or(line.len());
    Some(String::from_utf8_lossy(&line[..end]).trim().to_string())
}

/// The addresses of a table walk's user frames (a frame-pointer walk's named by build id
/// give their offset).
fn frame_addresses(user: &[RawUserFrame]) -> Vec<u64> {
    user.iter()
        .map(|f| match *f {
            RawUserFrame::Ip(ip) => ip,
            RawUserFrame::BuildId { offset, .. } => offset,
        })
        .collect()
}

/// (pid, address space, ranges) whose maps were handed out, remembered at most (then
/// forgotten and handed out again when met: a long-running agent stays bounded).
const MAX_MAPS_TOLD: usize = 1 << 16;

pub struct Unwinder {
    spaces: Spaces,
    store: TableStore,
    pending: VecDeque<Pending>,
    pending_bytes: usize,
    /// Polls so far (one per drain of the rings).
    polls: u64,
    /// The poll of the last drain that read every ring dry.
    last_dry_poll: u64,
    /// When this unwinder was made, in clock ticks since boot: a process started before
    /// has no fork record to wait for.
    made_at_ticks: u64,
    /// Children given their parent's learned space in the probes at their fork record
    /// (`-a`), until they exec or exit: what the probes hold for them then is checked.
    given_at_fork: crate::FastMap<u32, u32>,
    /// Stacks finished outside a poll (copies dropped for memory), handed out at the next.
    ready_late: Vec<StackRecord>,
    /// Stacks the probes walked whose frames wait for their ranges to be known (the poll
    /// they are named at, since when): [`Self::poll_unplaced`].
    unplaced: VecDeque<(u64, Instant, StackRecord)>,
    build_ids: crate::FastMap<PathBuf, Option<[u8; 20]>>,
    /// Files frames were named into since the last `take_new_files`.
    new_files: Vec<PathBuf>,
    /// Address spaces with frames in files without a build id, which stay bare addresses:
    /// their maps, for whoever names the frames (the process may be gone before its
    /// `/proc` maps are read), since the last `take_new_maps`; and what was handed out
    /// (pid, address space, ranges then).
    new_maps: Vec<(u32, Maps)>,
    maps_told: HashSet<(u32, u32, usize)>,
    stats: UnwindStats,
    /// Where each program's list of files is kept between runs.
    cache: Option<DiskCache>,
    /// The program each address space runs (from its exec).
    programs: HashMap<u32, PathBuf>,
    /// Per program: the files it mapped code from during this session, in order.
    used: HashMap<PathBuf, Vec<PathBuf>>,
    /// The tables of the files a command maps as it starts.
    startup: Vec<Slot>,
    /// Files programs exec'd while tracing used last time, whose tables are asked for a
    /// few at a time between reads of the rings ([`Self::poll`]).
    companions: VecDeque<PathBuf>,
}

/// How long one [`Unwinder::poll`] spends asking for the tables of exec'd programs' files:
/// each is opened and its headers read (~1 ms under load: 125 ms for the 132 files of the
/// heavy Python script, during which the rings were not read and the program's stacks
/// waited for its own table, asked for after them).
const COMPANIONS_PER_POLL: Duration = Duration::from_millis(2);

/// How long the end of a session waits for the builds under way when no copy needs them
/// (a huge build is not waited for).
const BUILDS_AT_END: Duration = Duration::from_millis(300);

/// A mapping as `Unwinder::named` found it for a frame, for the frames after it.
#[derive(Clone, Copy)]
struct Named {
    start: u64,
    end: u64,
    file_offset: u64,
    build_id: Option<[u8; 20]>,
    has_path: bool,
}

/// A path to `path` as process `pid` sees it, from here (the process may be gone, or in
/// another mount namespace).
fn readable_path(pid: u32, path: &str) -> Option<PathBuf> {
    if !path.starts_with('/') {
        return None;
    }
    let inside = procfs::path_in_process(pid, Path::new(path));
    if inside.exists() {
        return Some(inside);
    }
    Path::new(path).exists().then(|| PathBuf::from(path))
}

impl Unwinder {
    pub fn new(options: &UnwindOptions) -> Self {
        let cache = if options.disk_cache { DiskCache::open_default() } else { None };
        Self::with_cache(cache, options)
    }

    /// An unwinder whose tables and programs' file lists are kept in `cache`.
    fn with_cache(cache: Option<DiskCache>, options: &UnwindOptions) -> Self {
        let workers = std::thread::available_parallelism().map_or(1, |n| n.get()).clamp(1, 4);
        Self {
            spaces: Spaces::new(),
            store: TableStore::new(cache.clone(), workers, options.max_table_bytes),
            cache,
            programs: HashMap::new(),
            used: HashMap::new(),
            startup: Vec::new(),
            companions: VecDeque::new(),
            pending: VecDeque::new(),
            pending_bytes: 0,
            polls: 0,
            last_dry_poll: 0,
            made_at_ticks: procfs::boot_ticks_now(),
            given_at_fork: Default::default(),
            ready_late: Vec::new(),
            unplaced: VecDeque::new(),
            build_ids: Default::default(),
            new_files: Vec::new(),
            new_maps: Vec::new(),
            maps_told: HashSet::new(),
            stats: UnwindStats::default(),
        }
    }

    pub fn stats(&self) -> UnwindStats {
        UnwindStats { tables: self.store.stats(), late_task_records: self.spaces.late_records(), ..self.stats }
    }

    /// `pid` exec'd `filename` into a new address space, where the kernel mapped the
    /// program's code and its interpreter as `space` says.
    pub fn exec(&mut self, pid: u32, filename: &str, space: TaskSpace, ts_ns: u64, sink: &mut dyn SpaceSink) {
        if space.asid == 0 {
            return;
        }
        // The kernel gave it a space of its own: the one given at its fork is replaced.
        self.given_at_fork.remove(&pid);
        // Its copies taken before, the probes knowing no space of it, are walked in what it
        // ran then.
        self.spaces.learn_before_exec(pid, ts_ns, &mut self.store, sink);
        let live = self.spaces.learn_exec(pid, space.asid, ts_ns, sink);
        self.forget_emptied();
        log::trace!(
            "exec of {filename} in pid {pid}: asid {} code {:#x}..{:#x} interpreter at {:#x}; the probes have {:?} and {:?}",
            space.asid,
            space.code_start,
            space.code_end,
            space.interp_base,
            sink.lookup_mapping(space.asid, space.code_start),
            sink.lookup_mapping(space.asid, space.interp_base + 0x1b70),
        );
        if !live {
            // Read after the process's exit (or a later exec): what the probes installed at
            // the exec leaves them whatever is found below.
            self.spaces.forget_range(space.asid, space.code_start, space.code_end, sink);
        }
        // The program: /proc while the process lives, else the name it was exec'd by (only
        // that for a space no process runs in any more: /proc shows what the pid runs now),
        // or the interpreter its `#!` line names. Not a name that means something else from
        // here (/proc/self/exe is memtrace's). Only a file whose code spans what the kernel
        // mapped: `/proc` read after a second exec (`env prog`, a `#!/usr/bin/env` script)
        // names the next program, whose file offsets named this one's frames wrongly.
        // A relative name, resolved from memtrace's directory, only where the code the
        // kernel mapped can confirm it (a process elsewhere may have run another `./prog`).
        let by_name =
            program_by_name(filename).filter(|_| filename.starts_with('/') || space.code_end > space.code_start);
        let from_proc = live.then(|| procfs::exe(pid).ok().map(|p| procfs::path_in_process(pid, &p))).flatten();
        let interpreters = by_name.as_deref().map(|script| script_interpreters(pid, script)).unwrap_or_default();
        let exe = from_proc.into_iter().chain(by_name).chain(interpreters).find(|candidate| {
            candidate.exists()
                && (space.code_end <= space.code_start
                    || self.store.identify(candidate).is_some_and(|(_, segments)| spans_code(&segments, &space)))
        });
        let Some(exe) = exe else {
            log::debug!(
                "pid {pid}: its program {filename:?} cannot be read (or is not what was mapped at {:#x}..{:#x}): its \
                 frames are walked by frame pointers",
                space.code_start,
                space.code_end
            );
            return;
        };
        if live {
            self.programs.insert(space.asid, exe.clone());
            self.prepare_program(&exe, true);
        }
        if space.code_end > space.code_start
            && let Some((_, segments)) = self.store.identify(&exe)
            && let Some(text) = segments.iter().filter(|s| s.executable).min_by_key(|s| s.vaddr)
        {
            let text_offset = text.file_offset;
            self.spaces.add_mapping(
                space.asid,
                space.code_start,
                space.code_end - space.code_start,
                text_offset,
                Some(&exe),
                &mut self.store,
                sink,
            );
        }
        if space.interp_base != 0
            && let Some(interp) = crate::elf::ElfFile::open(&exe).ok().and_then(|e| e.interpreter())
        {
            let inside = procfs::path_in_process(pid, Path::new(&interp));
            let interp = if inside.exists() { inside } else { PathBuf::from(interp) };
            if let Some((_, segments)) = self.store.identify(&interp) {
                for s in segments.iter().filter(|s| s.executable && s.file_size > 0) {
                    let start = space.interp_base + s.vaddr;
                    self.spaces.add_mapping(
                        space.asid,
                        start,
                        s.file_size,
                        s.file_offset,
                        Some(&interp),
                        &mut self.store,
                        sink,
                    );
                }
            }
        }
    }

    /// `child` was forked from `parent` into address space `asid` (0: the probes knew no
    /// space of the parent's). With `learn_parent` (every process traced, `-a`), a parent
    /// that was running before tracing began and is not learned yet is learned now, from
    /// its maps, and the child given its space: the child runs the parent's code until it
    /// execs (a shell's subshell, a server's worker), and its stacks were otherwise walked
    /// against whatever the child's `/proc` showed when they were read (the program it
    /// exec'd since, or nothing: every one cut short at its first frame).
    pub fn fork(
        &mut self,
        (child, parent): (u32, u32),
        asid: u32,
        learn_parent: bool,
        ts_ns: u64,
        sink: &mut dyn SpaceSink,
    ) {
        let mut asid = asid;
        let mut tell_probes = false;
        if asid == 0
            && learn_parent
            && parent != 0
            // (The probes knew no space of the parent either: it ran in the one its stacks
            // taken so were, if it exec'd since, in a fork read after its exec.)
            && let Some(parent_asid) = self
                .spaces
                .first_space(parent)
                .or_else(|| self.spaces.asid_of(parent))
                .or_else(|| self.spaces.learn_process(parent, &mut self.store, sink))
            // Only a space learned here: one the kernel gave means the parent exec'd after
            // this fork (the fork would have shared it), and runs another program now.
            && spaces::is_learned(parent_asid)
        {
            asid = parent_asid;
            tell_probes = true;
        }
        // In the probes only for a child still running (an exit already handled there would
        // leave the entry for good) that has no space of its own since (its exec's: kept).
        let running = || procfs::process_state(child).is_ok_and(|s| s.state != 'Z' && s.state != 'X');
        if self.spaces.learn_fork(child, asid, ts_ns, sink) && tell_probes && running() {
            match sink.set_asid(child, asid, true) {
                Ok(given) if given == asid => {
                    self.given_at_fork.insert(child, asid);
                }
                Ok(_) => {}
                Err(e) => log::debug!("pid {child}: its parent's address space not given: {e:#}"),
            }
        }
        self.forget_emptied();
    }

    pub fn exit(&mut self, pid: u32, ts_ns: u64, sink: &mut dyn SpaceSink) {
        // A space given to a child at its fork record may have reached the probes after
        // they handled its exit (it was still exiting then): taken out again.
        if let Some(asid) = self.given_at_fork.remove(&pid)
            && let Err(e) = sink.remove_asid(pid, asid)
        {
            log::debug!("pid {pid}: the space given at its fork not taken back: {e:#}");
        }
        self.spaces.learn_exit(pid, ts_ns, sink);
        self.forget_emptied();
    }

    /// Forgets the programs of the spaces no process runs in any more (an exec empties the
    /// one it leaves as an exit does: kept, they grew by one per exec under `serve -a`).
    fn forget_emptied(&mut self) {
        for asid in self.spaces.take_emptied() {
            // (Unless a process came to it since, `/proc`-learned between two calls.)
            if !self.spaces.in_use(asid) {
                self.programs.remove(&asid);
            }
        }
    }

    /// Code a traced process mapped after its exec.
    pub fn mapping(&mut self, m: &FileMapping, sink: &mut dyn SpaceSink) {
        let path = m.path.as_deref().and_then(|opened| {
            // The kernel's own view of the mapping while the process lives (whatever the
            // path it was opened by), else that path.
            let mapped = PathBuf::from(format!("/proc/{}/map_files/{:x}-{:x}", m.pid, m.start, m.start + m.len));
            if let Ok(real) = std::fs::read_link(&mapped) {
                let inside = procfs::path_in_process(m.pid, &real);
                if inside.exists() {
                    return Some(inside);
                }
            }
            readable_path(m.pid, opened)
        });
        if m.path.is_some() && path.is_none() {
            log::debug!(
                "pid {}: cannot read the file mapped at {:#x} ({:?}): its frames are walked by frame pointers",
                m.pid,
                m.start,
                m.path
            );
        }
        // A process the probes know no space of (running before tracing began, under `-a`)
        // is learned first, as it was before this mapping: the session's snapshot misses
        // what it maps since (a library loaded with dlopen after the start was dropped).
        let asid = match m.asid {
            0 => self
                .spaces
                .asid_of(m.pid)
                .or_else(|| self.spaces.learn_process(m.pid, &mut self.store, sink))
                .unwrap_or(0),
            asid => asid,
        };
        log::trace!(
            "mapping in pid {} (asid {}, from the probes {}): {:#x}+{:#x} at offset {:#x} of {:?}",
            m.pid,
            asid,
            m.asid,
            m.start,
            m.len,
            m.file_offset,
            path
        );
        let (start, len) = if m.made_executable {
            match self.spaces.protected_range(asid, m.start, m.start.saturating_add(m.len)) {
                Some((lo, hi)) => (lo, hi - lo),
                None => return,
            }
        } else {
            (m.start, m.len)
        };
        if let (Some(file), Some(program)) = (&path, self.programs.get(&asid))
            && !file.starts_with("/proc/")
            && !program.starts_with("/proc/")
        {
            // Bounded however many programs a long session (`serve -a`) sees.
            if self.used.len() < MAX_PROGRAMS_REMEMBERED || self.used.contains_key(program) {
                let used = self.used.entry(program.clone()).or_default();
                if used.len() < cache::MAX_COMPANIONS && !used.contains(file) {
                    used.push(file.clone());
                }
            }
        }
        self.spaces.add_mapping(asid, start, len, m.file_offset, path.as_deref(), &mut self.store, sink);
    }

    /// The processes running when the session began, as they were then (`record -a`): a
    /// process among them is learned from there, not from its `/proc`, until it changes.
    pub fn set_at_start(&mut self, snapshot: std::sync::Arc<crate::at_start::Snapshot>) {
        self.spaces.set_at_start(snapshot);
    }

    /// Learns a process that existed before tracing began, from its maps.
    pub fn learn_process(&mut self, pid: u32, sink: &mut dyn SpaceSink) -> Option<u32> {
        let asid = self.spaces.learn_process(pid, &mut self.store, sink);
        self.forget_emptied();
        asid
    }

    /// Starts building the tables of files a program about to run will map.
    pub fn prepare_files(&mut self, paths: &[PathBuf]) {
        for path in paths {
            if let Some((slot, _)) = self.store.request(path) {
                self.startup.push(slot);
            }
        }
    }

    /// Starts building (or loading from the cache) the tables of the files a running
    /// process has mapped executable, so that they are ready, and installed while the
    /// probes are verified, by the time [`Self::learn_process`] maps them.
    pub fn prepare_process(&mut self, pid: u32) {
        let Ok(maps) = procfs::Maps::read(pid) else { return };
        for m in maps.mappings.iter().filter(|m| m.executable && m.is_file()) {
            self.store.request(&procfs::path_in_process(pid, &m.path));
        }
    }

    /// Installs, through `sink`, the tables built since the last call; never waits.
    pub fn install_ready(&mut self, sink: &mut dyn TableSink) {
        self.store.poll(sink);
    }

    /// Starts loading the table of `program` and those of the files it ran code from last
    /// time (the disk cache keeps the list): ready before it maps them, they are installed
    /// by the probes at each mmap, and its first stacks through them need no copy. The
    /// program's own comes first: every stack of it goes through its code. `later`: the
    /// program was exec'd while tracing, its files are asked for between reads of the rings
    /// (else now, before the command starts).
    pub fn prepare_program(&mut self, program: &Path, later: bool) {
        let Some(cache) = self.cache.clone() else { return };
        let Some((key, _)) = self.store.identify(program) else { return };
        let own = self.store.request(program).map(|(slot, _)| slot);
        let files: Vec<PathBuf> = cache.companions(&key);
        if !files.is_empty() {
            log::debug!("{}: loading the tables of {} files it used before", program.display(), files.len());
        }
        if later {
            self.companions.extend(files);
        } else {
            for file in files.iter().filter(|f| f.exists()) {
                self.store.request(file);
            }
        }
        // Built (read) first, ahead of those asked for before it.
        if let Some(slot) = own {
            self.store.prioritize(slot);
        }
    }

    /// Asks for the tables of exec'd programs' files for up to [`COMPANIONS_PER_POLL`].
    fn request_companions(&mut self) {
        let started = Instant::now();
        while started.elapsed() < COMPANIONS_PER_POLL
            && let Some(file) = self.companions.pop_front()
        {
            if file.exists() {
                // Behind the program's own table and any a stack waits for.
                self.store.request_behind(&file);
            }
        }
    }

    /// Keeps, for the next session, the files each program ran code from in this one.
    pub fn save_programs_files(&mut self) {
        let Some(cache) = self.cache.clone() else { return };
        for (program, used) in std::mem::take(&mut self.used) {
            let Some((key, _)) = self.store.identify(&program) else { continue };
            if let Err(e) = cache.store_companions(&key, &used) {
                log::debug!("unwind cache: keeping the file list of {}: {e}", program.display());
            }
        }
    }

    /// Waits (at most `timeout`) until every table asked for is installed.
    pub fn wait_tables(&mut self, sink: &mut dyn SpaceSink, timeout: Duration) -> bool {
        self.store.wait_idle(sink, timeout)
    }

    /// Waits (at most `timeout`) until the tables of the files a command maps as it starts
    /// ([`Self::prepare_files`]) are installed. The files it used last time and maps later
    /// (a Python program's extension modules) go on installing while it runs: waiting for
    /// all of them held a warm start of the heavy Python bench 80 ms and more, and a stack
    /// through one not installed yet is finished in userspace, where its table is loaded.
    pub fn wait_startup_tables(&mut self, sink: &mut dyn SpaceSink, timeout: Duration) -> bool {
        let startup = std::mem::take(&mut self.startup);
        self.store.wait_slots(&startup, sink, timeout)
    }

    /// A stack record from the probes: returned named, finished if it carries a copy (its
    /// hash stays the one the event refers to); None when it waits for a table (it comes
    /// back from [`Self::poll`] or [`Self::flush`]).
    pub fn accept(&mut self, record: StackRecord, sink: &mut dyn SpaceSink) -> Option<StackRecord> {
        if record.miss.is_none() {
            if self.unplaced.len() < MAX_UNPLACED && self.has_unplaced_frames(&record) {
                // (This drain's poll comes next: a later one must read the rings dry.)
                self.unplaced.push_back((self.polls + 1, Instant::now(), record));
                return None;
            }
            return Some(self.named(record));
        }
        self.stats.copies += 1;
        if log::log_enabled!(log::Level::Trace)
            && let Some(m) = &record.miss
        {
            let found = self.spaces.find(m.asid, m.ip).map(|m| m.path.clone());
            let probes = sink.lookup_mapping(m.asid, if m.exact { m.ip } else { m.ip - 1 });
            log::trace!(
                "copy from pid {} asid {} at {:#x} (exact {}, {} user frames before, kernel {}): {found:?}; the probes have {probes:?}",
                record.pid,
                m.asid,
                m.ip,
                m.exact,
                record.user.len(),
                record.joined_kernel
            );
        }
        let user = frame_addresses(&record.user);
        // A copy of a process the probes knew no address space of, nor does this side
        // (under -a: one running before tracing began, or the child of one, until it
        // execs). A child's stack can be read before its fork, which its parent's CPU's
        // ring holds; its `/proc`, read now, may show the program it exec'd since. It waits
        // one drain for the fork to give it its parent's space (longer where the fork is
        // still to come: `awaits_fork`). A space its exec gave it, read first from another
        // CPU's ring, is not the one the copy was taken in: the probes knew none, so it was
        // taken before the exec.
        let unknown_process = record.miss.as_ref().is_some_and(|m| m.asid == 0)
            && self.spaces.asid_of(record.pid).is_none_or(|a| !spaces::is_learned(a))
            && self.spaces.first_space(record.pid).is_none();
        let waits = unknown_process || self.space_to_come(&record);
        let finished = if waits { Err(None) } else { self.finish(&record, &user, sink, false, false) };
        match finished {
            Ok(done) => Some(self.named(done)),
            Err(waiting_on) => {
                self.stats.waited += 1;
                let mut record = record;
                record.user = Vec::new();
                let bytes = record.miss.as_ref().map_or(0, |m| m.copy.len())
                    + (user.len() + record.kernel.len()) * size_of::<u64>()
                    + size_of::<Pending>()
                    + size_of::<crate::event::StackMiss>();
                self.pending_bytes += bytes;
                let process_at_poll = waits.then_some(self.polls + 2);
                self.pending.push_back(Pending {
                    record,
                    user,
                    since: Instant::now(),
                    bytes,
                    waiting_on,
                    process_at_poll,
                    unplaced: !waits && waiting_on.is_none(),
                    read_at_poll: self.polls + 1,
                });
                let mut out = Vec::new();
                while self.pending_bytes > MAX_PENDING_BYTES {
                    let Some(p) = self.pending.pop_front() else { break };
                    self.pending_bytes -= p.bytes;
                    self.stats.gave_up += 1;
                    if let Ok(done) = self.finish(&p.record, &p.user, sink, true, true) {
                        out.push(done);
                    }
                }
                // Dropped copies are finished now: hand back one, keep any others named
                // for the next poll.
                for done in out {
                    let named = self.named(done);
                    self.ready_late.push(named);
                }
                None
            }
        }
    }

    /// Whether a stack the probes walked by the tables has a frame in no range of its space
    /// known here. The probes knew them (the kernel mapped the program at its exec, ld.so
    /// its libraries), but the records saying so may still be in another CPU's ring, read
    /// a drain later: named now, every such frame was `[unknown]` (helper-36: 83 of 245 of
    /// `head`'s allocations, libc included, under load).
    fn has_unplaced_frames(&self, record: &StackRecord) -> bool {
        record.walk == UserWalk::CallFrameInfo
            && record.asid != 0
            && record
                .user
                .iter()
                .any(|f| matches!(*f, RawUserFrame::Ip(ip) if self.spaces.find(record.asid, ip).is_none()))
    }

    /// The stacks the probes walked that waited for their ranges ([`Self::accept`]),
    /// named: those whose ranges are known now, those read before a drain that read every
    /// ring dry (`dry`: the drain just handled did; what their frames lie in is known by
    /// then, or never will be), or that waited their time (`all`: every one, tracing is
    /// over). Not copies: their hash is the probes' own, for every event of that stack.
    pub fn poll_unplaced(&mut self, all: bool, dry: bool) -> Vec<StackRecord> {
        if dry {
            self.last_dry_poll = self.polls;
        }
        let mut out = Vec::new();
        for (read_at_poll, since, record) in std::mem::take(&mut self.unplaced) {
            let settled = self.last_dry_poll > read_at_poll;
            let unplaced = !all && self.has_unplaced_frames(&record);
            if all || settled || since.elapsed() >= PLACE_WAIT || !unplaced {
                if unplaced {
                    log::debug!(
                        "pid {}: a stack named with frames in no known range of its space {} after {} ms{}",
                        record.pid,
                        record.asid,
                        since.elapsed().as_millis(),
                        if settled { "" } else { " (the rings were not read dry meanwhile)" }
                    );
                }
                out.push(self.named(record));
            } else {
                self.unplaced.push_back((read_at_poll, since, record));
            }
        }
        out
    }

    /// Installs the tables built since the last call, and returns the stacks that were
    /// waiting for them, finished and named.
    pub fn poll(&mut self, sink: &mut dyn SpaceSink) -> Vec<StackRecord> {
        self.request_companions();
        let installed = self.store.poll(sink);
        let mut out = std::mem::take(&mut self.ready_late);
        self.polls += 1;
        if self.pending.is_empty() {
            return out;
        }
        let timed_out = self.pending.front().is_some_and(|p| p.since.elapsed() > MAX_WAIT);
        let processes_due =
            self.pending.iter().any(|p| p.unplaced || p.process_at_poll.is_some_and(|at| at <= self.polls));
        if installed == 0 && !timed_out && !processes_due {
            return out;
        }
        // Per process, for this poll: whether its fork record may still come.
        let mut awaits_fork = crate::FastMap::default();
        for mut p in std::mem::take(&mut self.pending) {
            let give_up = p.since.elapsed() > MAX_WAIT;
            match p.process_at_poll {
                Some(at) if at > self.polls && !give_up => {
                    self.pending.push_back(p);
                    continue;
                }
                Some(_)
                    if p.since.elapsed() < FORK_WAIT
                        && !give_up
                        && (self.space_to_come(&p.record)
                            || *awaits_fork.entry(p.record.pid).or_insert_with(|| self.awaits_fork(p.record.pid))) =>
                {
                    p.process_at_poll = Some(self.polls + 1);
                    self.pending.push_back(p);
                    continue;
                }
                Some(_) => p.process_at_poll = None,
                None => {}
            }
            let still_building =
                p.waiting_on.is_some_and(|slot| matches!(self.store.state(slot), Some(TableState::Building)));
            if still_building && !give_up {
                self.pending.push_back(p);
                continue;
            }
            // A drain after the one that read it read every ring dry (its own may have read
            // a ring before the record), or it waited its time: the ranges its frames lie
            // in are known by now, or never will be.
            let settled = self.last_dry_poll > p.read_at_poll || p.since.elapsed() >= PLACE_WAIT;
            match self.finish(&p.record, &p.user, sink, give_up, settled) {
                Ok(done) => {
                    if give_up {
                        self.stats.gave_up += 1;
                    }
                    self.pending_bytes -= p.bytes;
                    out.push(self.named(done));
                }
                Err(waiting_on) => {
                    p.waiting_on = waiting_on;
                    p.unplaced = waiting_on.is_none();
                    self.pending.push_back(p);
                }
            }
        }
        out
    }

    /// Whether `record` is a copy taken in a space the kernel gave at an exec (or a fork)
    /// whose record is not handled here yet: task records read past what every ring was
    /// read up to wait for a later drain, and walked before, every frame of the new program
    /// was `[unknown]` (11 of `ls`'s 242 allocations, its reader stopped behind the probes).
    fn space_to_come(&self, record: &StackRecord) -> bool {
        record.miss.as_ref().is_some_and(|m| m.asid != 0 && !self.spaces.knows(m.asid))
    }

    /// Whether a copy of `pid` the probes took in no space they knew, one drain on, must
    /// wait longer: its fork record has not been read, and the process started while
    /// traced (or is gone), so that record is coming. Such a copy is of the child of a
    /// process running before tracing began (a subshell's under `-a`), taken in its
    /// parent's space, which only the fork names: by the time its parent's CPU's ring is
    /// drained the child may have exec'd, and its `/proc` (or its exec's space) named
    /// every frame `[unknown]` (helper-35). A process that started before tracing has no
    /// fork to come: its copies are walked in what its `/proc` shows.
    fn awaits_fork(&self, pid: u32) -> bool {
        self.spaces.first_space(pid).is_none()
            && procfs::start_ticks(pid).ok().is_none_or(|started| started >= self.made_at_ticks)
    }

    /// Finishes every waiting stack now (tracing is over): as far as the tables built so
    /// far allow, after giving the builds under way a little time.
    pub fn flush(&mut self, sink: &mut dyn SpaceSink) -> Vec<StackRecord> {
        // Copies wait for their tables; else the builds under way get a moment to end, so
        // that the summary counts them and the cache keeps them (a program exec'd and gone
        // within milliseconds of the end had its table built and installed, not counted).
        let wait = if self.pending.is_empty() { BUILDS_AT_END } else { Duration::from_secs(10) };
        if !self.store.wait_idle(sink, wait) {
            log::debug!("unwind tables still building after {wait:?} at the end: not waited for");
        }
        let mut out = self.poll(sink);
        for p in std::mem::take(&mut self.pending) {
            self.stats.gave_up += 1;
            if let Ok(done) = self.finish(&p.record, &p.user, sink, true, true) {
                out.push(self.named(done));
            }
        }
        self.pending_bytes = 0;
        out
    }

    /// Walks the copy of `record` on from its user frames `user`; Err with the table's slot
    /// if a table it needs is not ready (unless `give_up`: then the walk ends there,
    /// truncated); Err(None) if it met an address in no range of its space known yet
    /// (unless `ranges_settled` or `give_up`: the walk ends there). The mapping records of
    /// a library, read in a later drain than the copy (another CPU's ring, or held for
    /// the time order), left every frame past it `[unknown]`.
    fn finish(
        &mut self,
        record: &StackRecord,
        user: &[u64],
        sink: &mut dyn SpaceSink,
        give_up: bool,
        ranges_settled: bool,
    ) -> Result<StackRecord, Option<store::Slot>> {
        let Some(miss) = record.miss.as_ref() else { return Err(None) };
        let asid = match miss.asid {
            // Taken before the probes knew a space of the process: before any exec of it
            // while traced (an exec gives one). A child of a process running before tracing
            // began ran in the space its parent was learned in.
            0 => self
                .spaces
                .first_space(record.pid)
                .or_else(|| self.spaces.asid_of(record.pid))
                .or_else(|| self.spaces.learn_process(record.pid, &mut self.store, sink)),
            asid => Some(asid),
        };
        let mut ips = user.to_vec();
        // Frames the probes walked from an anchor above the gap: kept aside, joined on if
        // the walk of the gap lands on the anchor.
        let from_anchor = match miss.resume_at {
            0 => Vec::new(),
            at if at < ips.len() => ips.split_off(at),
            _ => Vec::new(),
        };
        let anchors: Vec<walk::Anchor> = from_anchor
            .iter()
            .zip(miss.resume_sps.iter().zip(&miss.resume_bps))
            .take_while(|&(_, (&sp, _))| sp != 0)
            .enumerate()
            .map(|(k, (&ip, (&sp, &bp)))| walk::Anchor { sp, ip, bp: (miss.bp_used >> k & 1 != 0).then_some(bp) })
            .collect();
        if ips.last() != Some(&miss.ip) {
            ips.push(miss.ip);
        }
        // The frames the probes walked (before the gap, and from an anchor) are named by the
        // ranges known here too: one in no range yet waits for them, as a walked stack does
        // (an `ls`'s libc frames under its copy's gap were `[unknown]`). The uprobes' page
        // (a return probe's trampoline) is in none.
        if !give_up
            && !ranges_settled
            && let Some(asid) = asid
            && ips
                .iter()
                .chain(&from_anchor)
                .any(|&ip| !crate::overhead::in_uprobes_page(ip) && self.spaces.find(asid, ip).is_none())
        {
            return Err(None);
        }
        let (end, waiting_on) = match asid {
            Some(asid) => {
                let regs = Regs { ip: miss.ip, sp: miss.sp, bp: miss.bp, exact: miss.exact };
                let memory = StackCopy { base: miss.sp, bytes: &miss.copy };
                let (spaces, store) = (&self.spaces, &self.store);
                let mut waiting_on = None;
                let end = walk::walk(regs, &memory, &mut ips, &miss.returns, &anchors, |addr| {
                    let Some(m) = spaces.find(asid, addr) else {
                        if !give_up && !ranges_settled {
                            return Lookup::Wait;
                        }
                        return Lookup::Rule(memtrace_common::UnwindRule::STOP);
                    };
                    let Some(slot) = m.slot else {
                        // JIT-compiled code, or a file without call-frame information.
                        return Lookup::Rule(memtrace_common::UnwindRule::FRAME_POINTER);
                    };
                    match store.state(slot) {
                        Some(TableState::Ready(t)) => Lookup::Rule(t.rule_at(addr.wrapping_sub(m.bias))),
                        Some(TableState::Building) if !give_up => {
                            waiting_on = m.slot;
                            Lookup::Wait
                        }
                        _ => Lookup::Rule(memtrace_common::UnwindRule::STOP),
                    }
                });
                // The code running now is in that file: its table is built next.
                if let Some(slot) = waiting_on {
                    self.store.prioritize(slot);
                }
                (end, waiting_on)
            }
            None => (End::Truncated, None),
        };
        if end == End::Wait {
            return Err(waiting_on);
        }
        let truncated = match end {
            End::Anchored(k) => {
                self.stats.anchored += 1;
                let room = MAX_USER_DEPTH.saturating_sub(ips.len());
                ips.extend(from_anchor[k..].iter().take(room));
                // How the probes' walk from the anchor ended.
                record.truncated || from_anchor.len() - k > room
            }
            // How the Python frames ended counts too (`Tracer::name_python`).
            End::Outermost => record.truncated,
            End::Truncated | End::Wait => true,
        };
        if !anchors.is_empty() && !matches!(end, End::Anchored(_)) {
            self.stats.anchor_missed += 1;
        }
        if truncated {
            self.stats.truncated += 1;
        }
        Ok(StackRecord {
            hash: record.hash,
            pid: record.pid,
            kernel: record.kernel.clone(),
            user: ips.into_iter().map(RawUserFrame::Ip).collect(),
            walk: UserWalk::CallFrameInfo,
            truncated,
            no_room: false,
            joined_kernel: record.joined_kernel,
            miss: None,
            asid: asid.unwrap_or(0),
            python_context: record.python_context.clone(),
            py_key: record.py_key,
        })
    }

    /// Names the user frames of a table walk by build id and file offset, where the
    /// address space says which file an address lies in.
    fn named(&mut self, mut stack: StackRecord) -> StackRecord {
        if stack.walk != UserWalk::CallFrameInfo {
            return stack;
        }
        let asid = if stack.asid != 0 { Some(stack.asid) } else { self.spaces.asid_of(stack.pid) };
        let Some(asid) = asid else { return stack };
        let mut bare = false;
        // The mapping of the frame before: most frames lie in the same file as their
        // caller (an interpreter's hundreds of frames in one library), and a deep stack
        // searched the address space for each (7 % of the reader's time in a cold start).
        let mut last: Option<Named> = None;
        for i in 0..stack.user.len() {
            let RawUserFrame::Ip(ip) = stack.user[i] else { continue };
            if let Some(n) = last.filter(|n| (n.start..n.end).contains(&ip)) {
                match n.build_id {
                    Some(build_id) => {
                        stack.user[i] = RawUserFrame::BuildId { build_id, offset: ip - n.start + n.file_offset }
                    }
                    None => bare |= n.has_path,
                }
                continue;
            }
            let Some(m) = self.spaces.find(asid, ip) else { continue };
            let offset = m.file_offset_of(ip);
            let (start, end, file_offset, has_path) = (m.start, m.end, m.file_offset, m.path.is_some());
            let build_id = match m.build_id.get() {
                Some(&id) => id,
                None => {
                    // The first frame in this mapping: its file's build id, kept with it.
                    let Some(path) = m.path.clone() else { continue };
                    let id = self.build_id(&path);
                    if let Some(m) = self.spaces.find(asid, ip) {
                        let _ = m.build_id.set(id);
                    }
                    id
                }
            };
            last = Some(Named { start, end, file_offset, build_id, has_path });
            match build_id {
                Some(build_id) => stack.user[i] = RawUserFrame::BuildId { build_id, offset },
                None => bare |= has_path,
            }
        }
        if self.maps_told.len() > MAX_MAPS_TOLD {
            self.maps_told.clear();
        }
        if bare
            && self.maps_told.insert((stack.pid, asid, self.spaces.mapping_count(asid)))
            && let Some(maps) = self.spaces.file_maps(asid)
        {
            self.new_maps.push((stack.pid, maps));
        }
        stack
    }

    /// The maps of processes whose frames stayed bare addresses in files without a build
    /// id (a static program linked without one), since the last call: as the probes saw
    /// them, so the frames can be named by file after the process is gone.
    pub fn take_new_maps(&mut self) -> Vec<(u32, Maps)> {
        std::mem::take(&mut self.new_maps)
    }

    fn build_id(&mut self, path: &Path) -> Option<[u8; 20]> {
        if let Some(id) = self.build_ids.get(path) {
            return *id;
        }
        if self.build_ids.len() >= 16_384 {
            self.build_ids.clear();
        }
        let id = elf::build_id(path).and_then(|b| <[u8; 20]>::try_from(b).ok());
        if id.is_some() {
            self.new_files.push(path.to_path_buf());
        }
        self.build_ids.insert(path.to_path_buf(), id);
        id
    }

    /// Files frames were named into since the last call (their build ids must be known to
    /// whoever symbolizes them).
    pub fn take_new_files(&mut self) -> Vec<PathBuf> {
        std::mem::take(&mut self.new_files)
    }

    /// Copies waiting for a table.
    pub fn waiting(&self) -> usize {
        self.pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::{spaces::tests::FakeProbes, *};
    use crate::{event::StackMiss, procfs::Maps};

    #[test]
    fn hashes_match_the_probes_construction() {
        let user = [0x10, 0x20];
        let mut h = stack_hash_step(USER_STACK_SEED, 7);
        h = stack_hash_step(stack_hash_step(h, 0x10), 0x20);
        assert_eq!(stack_hash(7, None, &user, false), h);
        assert_eq!(stack_hash(7, None, &user, true), stack_hash_step(h, MISS_HASH_MARK));
        let mut k = stack_hash_step(KERNEL_STACK_SEED, 7);
        k = stack_hash_step(k, 0xffff_0001);
        k = stack_hash_step(k, u64::MAX);
        k = stack_hash_step(stack_hash_step(k, 0x10), 0x20);
        assert_eq!(stack_hash(7, Some(&[0xffff_0001, 0]), &user, false), k);
    }

    /// A copy of this very thread's stack, as the probes' miss path sends it (no address
    /// space known: asid 0), said to be of process `pid`; and the copy's length.
    #[inline(never)]
    fn own_stack_copy(pid: u32) -> (StackRecord, usize) {
        let (ip, sp, bp): (u64, u64, u64);
        // SAFETY: reads three registers; no memory is touched.
        unsafe {
            std::arch::asm!("lea {ip}, [rip]", "mov {sp}, rsp", "mov {bp}, rbp", ip = out(reg) ip, sp = out(reg) sp, bp = out(reg) bp);
        }
        let stack_end = Maps::read_self().unwrap().find(sp).unwrap().end;
        let len = (stack_end - sp).min(64 * 1024) as usize;
        // SAFETY: [sp, sp + len) lies in this thread's mapped stack, above our own frame.
        let copy = unsafe { std::slice::from_raw_parts(sp as *const u8, len) }.to_vec();
        let copy_len = copy.len();
        let record = StackRecord {
            hash: 1,
            pid,
            kernel: vec![],
            user: vec![RawUserFrame::Ip(ip)],
            walk: UserWalk::CallFrameInfo,
            truncated: false,
            no_room: false,
            joined_kernel: false,
            miss: Some(Box::new(StackMiss {
                ip,
                sp,
                bp,
                returns: Vec::new(),
                asid: 0,
                exact: true,
                copy,
                resume_at: 0,
                resume_sps: [0; memtrace_common::unwind::RESUME_SPS],
                resume_bps: [0; memtrace_common::unwind::RESUME_SPS],
                bp_used: 0,
            })),
            asid: 0,
            python_context: None,
            py_key: 0,
        };
        (record, copy_len)
    }

    /// Polls until a waiting copy is finished (at most a minute).
    fn poll_until_finished(unwinder: &mut Unwinder, probes: &mut FakeProbes) -> Option<StackRecord> {
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline {
            if let Some(done) = unwinder.poll(probes).pop() {
                return Some(done);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        None
    }

    /// Unwinds this very thread from a copy of its own stack, as the probes' miss path
    /// would: it waits for the executable's table, then reaches the thread's start.
    #[test]
    fn finishes_a_real_stack_from_a_copy_once_its_table_is_built() {
        let pid = std::process::id();
        let (record, copy_len) = own_stack_copy(pid);
        let mut probes = FakeProbes::default();
        let mut unwinder = Unwinder::new(&UnwindOptions { disk_cache: false, ..Default::default() });
        // The process is learned on the spot; its tables are being built: the copy waits.
        assert!(unwinder.accept(record.clone(), &mut probes).is_none());
        assert_eq!(unwinder.waiting(), 1);
        // What a waiting copy holds, counted against MAX_PENDING_BYTES: the copy, its frame
        // as an address, the record.
        let held = copy_len + 8 + size_of::<Pending>() + size_of::<StackMiss>();
        assert_eq!(unwinder.pending_bytes, held);
        assert!(unwinder.pending[0].record.user.is_empty(), "frames kept once, as addresses");
        let whole = poll_until_finished(&mut unwinder, &mut probes).expect("finished once the tables were built");
        assert!(!whole.truncated, "{whole:?}");
        assert_eq!(whole.hash, 1, "the event's hash names the finished stack");
        assert!(whole.user.len() > 3);
        assert!(matches!(whole.user[0], RawUserFrame::BuildId { .. }), "named by build id");
        assert!(!probes.tables.is_empty(), "the tables went to the probes too");
        // The second time every table is there: finished at once.
        let again = unwinder.accept(record, &mut probes).expect("no wait");
        assert_eq!(again.user, whole.user);
    }

    /// A copy of a process neither side knows a space of (the child of one running before
    /// `-a` began) can be read a drain before its fork (in its parent's CPU's ring): it
    /// waits for the fork, and is walked in the space the fork gives, even after the child
    /// is gone. Walked at once, it was cut short (the child's `/proc`: gone, or the program
    /// it exec'd).
    #[test]
    fn a_copy_read_before_its_fork_is_walked_in_the_space_the_fork_gives() {
        let parent = std::process::id();
        let child = u32::MAX - 7; // no such process: its /proc says nothing
        let (record, _) = own_stack_copy(child);
        let mut probes = FakeProbes::default();
        let mut unwinder = Unwinder::new(&UnwindOptions { disk_cache: false, ..Default::default() });
        assert!(unwinder.accept(record, &mut probes).is_none(), "it waits for its fork");
        unwinder.fork((child, parent), 0, true, 1, &mut probes);
        unwinder.exit(child, 2, &mut probes);
        let whole = poll_until_finished(&mut unwinder, &mut probes).expect("finished");
        assert!(!whole.truncated, "{whole:?}");
        assert!(whole.user.len() > 3, "{whole:?}");
    }

    /// A copy taken in a space an exec gave, read before the records of that space (task
    /// and mapping records past what every ring was read up to wait for a later drain):
    /// it waits for them, and for the ranges of the libraries its walk meets, instead of
    /// stopping at the first address in no known range (every libc frame of an `ls`
    /// `[unknown]`, its reader stopped behind the probes).
    #[test]
    fn a_copy_waits_for_the_ranges_of_its_space() {
        let pid = u32::MAX - 9; // no such process: only the records say where its code is
        let (mut record, _) = own_stack_copy(pid);
        let asid = 42;
        record.miss.as_mut().unwrap().asid = asid;
        let ip = record.miss.as_ref().unwrap().ip;
        let mut probes = FakeProbes::default();
        let mut unwinder = Unwinder::new(&UnwindOptions { disk_cache: false, ..Default::default() });
        assert!(unwinder.accept(record, &mut probes).is_none(), "its space is to come");
        assert!(unwinder.poll(&mut probes).is_empty());
        let maps = Maps::read_self().unwrap();
        let mapping = |m: &crate::procfs::Mapping| FileMapping {
            ts_ns: 1,
            pid,
            asid,
            start: m.start,
            len: m.end - m.start,
            file_offset: m.offset,
            path: Some(m.path.to_string_lossy().into_owned()),
            made_executable: false,
        };
        let code: Vec<_> = maps.file_mappings().filter(|m| m.executable).collect();
        let (own, libraries): (Vec<_>, Vec<_>) = code.into_iter().partition(|m| (m.start..m.end).contains(&ip));
        for m in &own {
            unwinder.mapping(&mapping(m), &mut probes);
        }
        // The test program's frames walk; the first in libc has no range yet: it waits.
        let deadline = Instant::now() + Duration::from_millis(300);
        while Instant::now() < deadline {
            assert!(unwinder.poll(&mut probes).is_empty(), "walked before libc's range came");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(unwinder.waiting(), 1);
        for m in &libraries {
            unwinder.mapping(&mapping(m), &mut probes);
        }
        let whole = poll_until_finished(&mut unwinder, &mut probes).expect("finished");
        assert!(!whole.truncated, "{whole:?}");
        assert!(whole.user.len() > 3, "{whole:?}");
    }

    /// The program the kernel mapped is told by its code's span: `/proc/PID/exe` read after
    /// a second exec names another file, whose span differs.
    #[test]
    fn a_program_is_the_file_whose_code_spans_what_was_mapped() {
        let segment = |vaddr, file_size, executable| cfi::Segment { file_offset: vaddr, vaddr, file_size, executable };
        // Two code segments (the kernel spans them both) around data.
        let file = [
            segment(0, 0x800, false),
            segment(0x1000, 0x500, true),
            segment(0x3000, 0x140, true),
            segment(0x5000, 0x200, false),
        ];
        let space =
            |start: u64, len: u64| TaskSpace { asid: 1, code_start: start, code_end: start + len, interp_base: 0 };
        assert!(spans_code(&file, &space(0x5555_0000_1000, 0x2140)));
        assert!(!spans_code(&file, &space(0x5555_0000_1000, 0x2141)), "another file's code");
        assert!(!spans_code(&file, &space(0x5555_0000_1800, 0x2140)), "a bias not page-aligned");
        assert!(!spans_code(&file[..1], &space(0x1000, 0x500)), "no code");
        assert!(spans_code(&file, &space(0x5555_0000_0000, 0x3140)), "from the first segment (older kernels)");
        // This test's own program, as the kernel mapped it.
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let segments = cfi::segments_of(&object::File::parse(&*std::fs::read(&exe).unwrap()).unwrap());
        let maps = Maps::read(std::process::id()).unwrap();
        let text = maps.file_mappings().find(|m| m.executable && m.path == exe).unwrap();
        let low = segments.iter().filter(|s| s.executable).map(|s| s.vaddr).min().unwrap();
        let high = segments.iter().filter(|s| s.executable).map(|s| s.vaddr + s.file_size).max().unwrap();
        // The mapping holds file offset `text.offset` at `text.start`.
        let first = segments.iter().find(|s| s.executable).unwrap();
        let bias = text.start.wrapping_sub(text.offset).wrapping_add(first.file_offset).wrapping_sub(first.vaddr);
        assert!(spans_code(&segments, &space(bias + low, high - low)));
    }

    /// A stack the probes walked whose frames lie in ranges not known here yet (their
    /// records in another CPU's ring) waits to be named until they are, or until the rings were read dry.
    #[test]
    fn a_walked_stack_waits_for_the_ranges_of_its_frames() {
        let mut unwinder = Unwinder::with_cache(None, &UnwindOptions::default());
        let mut probes = FakeProbes::default();
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let maps = Maps::read(std::process::id()).unwrap();
        let text = maps.file_mappings().find(|m| m.executable && m.path == exe).unwrap().clone();
        let record = StackRecord {
            hash: 7,
            pid: 99,
            kernel: Vec::new(),
            user: vec![RawUserFrame::Ip(text.start + 0x10)],
            walk: UserWalk::CallFrameInfo,
            truncated: false,
            no_room: false,
            joined_kernel: false,
            miss: None,
            asid: 5,
            python_context: None,
            py_key: 0,
        };
        assert!(unwinder.accept(record.clone(), &mut probes).is_none(), "its range is not known yet");
        assert!(unwinder.poll_unplaced(false, false).is_empty());
        unwinder.spaces.learn_exec(99, 5, 1, &mut probes);
        let len = text.end - text.start;
        unwinder.spaces.add_mapping(5, text.start, len, text.offset, Some(&exe), &mut unwinder.store, &mut probes);
        let named = unwinder.poll_unplaced(false, false);
        assert_eq!(named.iter().map(|s| s.hash).collect::<Vec<_>>(), [7]);
        // Named at once when its ranges are known.
        assert!(unwinder.accept(StackRecord { hash: 8, ..record.clone() }, &mut probes).is_some());
        // A stack whose ranges never come is named as it is once a drain begun after it
        // was read has read every ring dry: not at its own drain's poll, dry or not, nor
        // while the drains leave records in a ring.
        assert!(unwinder.accept(StackRecord { hash: 9, asid: 6, ..record }, &mut probes).is_none());
        unwinder.poll(&mut probes);
        assert!(unwinder.poll_unplaced(false, true).is_empty(), "its own drain may have read a ring before the record");
        for _ in 0..5 {
            unwinder.poll(&mut probes);
            assert!(unwinder.poll_unplaced(false, false).is_empty(), "a ring still holds records");
        }
        unwinder.poll(&mut probes);
        assert_eq!(unwinder.poll_unplaced(false, true).len(), 1);
    }

    /// A `#!` script runs under the interpreter its first line names, through `env` too, and
    /// nested scripts are followed.
    #[test]
    fn a_scripts_interpreters_are_found_from_its_first_line() {
        let tmp = tempfile::Builder::new().prefix("memtrace-shebang-").tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let write = |name: &str, text: &str| {
            let path = dir.join(name);
            std::fs::write(&path, text).unwrap();
            path
        };
        let pid = std::process::id();
        let plain = write("plain", "#!/bin/sh -e\necho\n");
        assert_eq!(script_interpreters(pid, &plain), [PathBuf::from("/bin/sh")]);
        let env = write("env", "#!/usr/bin/env -S sh -e\n");
        let found = script_interpreters(pid, &env);
        assert_eq!(found[0], PathBuf::from("/usr/bin/env"));
        assert!(found.len() == 2 && found[1].ends_with("sh") && found[1].is_file(), "{found:?}");
        let nested = write("nested", &format!("#!{}\n", plain.display()));
        assert_eq!(script_interpreters(pid, &nested), [plain.clone(), PathBuf::from("/bin/sh")]);
        let binary = std::fs::read_link("/proc/self/exe").unwrap();
        assert!(script_interpreters(pid, &binary).is_empty());
    }

    /// The program of a space is forgotten when its last process leaves it, by an exec as
    /// by an exit (before, an exec's old space kept its entry for the whole session).
    #[test]
    fn a_spaces_program_is_forgotten_when_an_exec_or_exit_empties_it() {
        let mut unwinder = Unwinder::with_cache(None, &UnwindOptions::default());
        let mut probes = FakeProbes::default();
        let pid = std::process::id();
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let name = exe.to_str().unwrap();
        let space = |asid| TaskSpace { asid, ..Default::default() };
        unwinder.exec(pid, name, space(10), 1, &mut probes);
        assert_eq!(unwinder.programs.keys().collect::<Vec<_>>(), [&10]);
        unwinder.exec(pid, name, space(11), 2, &mut probes);
        assert_eq!(unwinder.programs.keys().collect::<Vec<_>>(), [&11], "the space the exec left");
        // A forked child shares the space: it stays while either runs there.
        unwinder.fork((pid + 1, pid), 11, false, 3, &mut probes);
        unwinder.exit(pid, 4, &mut probes);
        assert_eq!(unwinder.programs.keys().collect::<Vec<_>>(), [&11]);
        unwinder.exit(pid + 1, 5, &mut probes);
        assert!(unwinder.programs.is_empty());
    }

    /// A short program exec'd by a relative name (`record -- ./prog`) whose `/proc` is gone
    /// by the time its exec is read is found from memtrace's directory.
    #[test]
    fn a_program_execd_by_a_relative_name_is_found_after_it_exited() {
        let mut unwinder = Unwinder::with_cache(None, &UnwindOptions::default());
        let mut probes = FakeProbes::default();
        let mut gone = std::process::Command::new("true").spawn().unwrap();
        gone.wait().unwrap();
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let cwd = std::env::current_dir().unwrap();
        let base = cwd.ancestors().find(|a| exe.starts_with(a)).unwrap();
        let ups = cwd.strip_prefix(base).unwrap().components().count();
        let relative = "../".repeat(ups) + exe.strip_prefix(base).unwrap().to_str().unwrap();
        assert!(!relative.starts_with('/'), "{relative}");
        // The code the kernel mapped, as it would for this program: a relative name is
        // taken only where that confirms it.
        let (_, segments) = unwinder.store.identify(&exe).unwrap();
        let code = segments.iter().filter(|s| s.executable);
        let low = code.clone().map(|s| s.vaddr).min().unwrap();
        let high = code.map(|s| s.vaddr + s.file_size).max().unwrap();
        let code_start = 0x5555_0000_0000 + low;
        let space = TaskSpace { asid: 10, code_start, code_end: code_start + high - low, interp_base: 0 };
        unwinder.exec(gone.id(), &relative, TaskSpace { asid: 9, ..Default::default() }, 1, &mut probes);
        assert!(!unwinder.programs.contains_key(&9), "nothing mapped to confirm it by");
        unwinder.exec(gone.id(), &relative, space, 2, &mut probes);
        assert_eq!(unwinder.programs.get(&10).map(|p| p.canonicalize().unwrap()), Some(exe));
        assert_eq!(program_by_name("/proc/self/exe"), None, "memtrace's own");
        assert_eq!(program_by_name("./no-such-program"), None);
    }

    /// Under `-a`, a process running before tracing began forks before it was learned: the
    /// parent is learned then, and the child (running its code until it execs) shares its
    /// space, in the probes too. Otherwise a fork of an unknown space stays unknown.
    #[test]
    fn a_fork_of_a_process_not_learned_yet_gives_the_child_its_parents_space() {
        let mut unwinder = Unwinder::with_cache(None, &UnwindOptions::default());
        let mut probes = FakeProbes::default();
        let parent = std::process::id();
        let mut child = std::process::Command::new("sleep").arg("5").spawn().unwrap();
        unwinder.fork((child.id(), parent), 0, false, 1, &mut probes);
        assert_eq!((unwinder.spaces.asid_of(parent), unwinder.spaces.asid_of(child.id())), (None, None));
        unwinder.fork((child.id(), parent), 0, true, 2, &mut probes);
        let asid = unwinder.spaces.asid_of(parent).expect("the parent learned from its maps");
        assert_eq!(unwinder.spaces.asid_of(child.id()), Some(asid));
        assert_eq!(probes.asids.get(&child.id()), Some(&asid), "the probes walk the child in it");
        // Its exit takes it back out of the probes (their own exit may have come first).
        let mut gone = FakeProbes::default();
        gone.asids.insert(child.id(), asid);
        unwinder.exit(child.id(), 3, &mut gone);
        assert!(gone.asids.is_empty());
        let code = Maps::read_self().unwrap().mappings.into_iter().find(|m| m.executable).unwrap();
        assert!(unwinder.spaces.find(asid, code.start).is_some(), "the child's frames are in the parent's files");
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// A program exec'd while tracing: its own table is asked for at once, the files it
    /// used last time between reads of the rings (asking for the 132 of a Python script
    /// first held the reader 125 ms while the program's stacks waited for its own table).
    /// Before the command starts, all at once.
    #[test]
    fn an_exec_asks_for_the_programs_table_first_and_its_files_between_reads() {
        let tmp = tempfile::Builder::new().prefix("memtrace-companions-").tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let cache = DiskCache::open(&dir, 1 << 30).unwrap();
        let exe = std::fs::read_link("/proc/self/exe").unwrap();
        let files: Vec<PathBuf> = Maps::read_self()
            .unwrap()
            .mappings
            .iter()
            .filter(|m| m.executable && m.is_file() && m.path != exe)
            .map(|m| m.path.clone())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        assert!(files.len() >= 2, "{files:?}");
        cache.store_companions(&cache::FileKey::of(&exe).unwrap(), &files).unwrap();
        let options = UnwindOptions::default();
        let mut probes = FakeProbes::default();

        let mut later = Unwinder::with_cache(Some(cache.clone()), &options);
        later.prepare_program(&exe, true);
        assert!(later.store.slot_of(&exe).is_some(), "the program's own table is asked for");
        assert!(files.iter().all(|f| later.store.slot_of(f).is_none()), "its files wait for a poll");
        assert_eq!(later.companions.len(), files.len());
        let deadline = Instant::now() + Duration::from_secs(30);
        while !later.companions.is_empty() && Instant::now() < deadline {
            later.poll(&mut probes);
        }
        assert!(files.iter().all(|f| later.store.slot_of(f).is_some()), "asked for by the polls");

        let mut now = Unwinder::with_cache(Some(cache), &options);
        now.prepare_program(&exe, false);
        assert!(now.companions.is_empty());
        assert!(files.iter().chain([&exe]).all(|f| now.store.slot_of(f).is_some()));
    }
}
