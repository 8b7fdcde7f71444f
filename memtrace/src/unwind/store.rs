//! The unwind tables of a session, one per file whatever the number of processes mapping
//! it: a slot per file (its index in the probes' tables array), built off the event path
//! by worker threads (or read from the disk cache), then installed in the probes and
//! registered with them by an install thread of the store's own, as soon as each build
//! ends, whatever the thread that drains the rings is doing; [`TableStore::poll`] learns
//! of them after. Userspace finishes stack copies with the same tables. Memory is bounded: past the cap a file gets an empty table (its frames are
//! walked by frame pointers only, counted) and a warning names it.
use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{
        Arc, Condvar, Mutex,
        mpsc::{self, Receiver, Sender},
    },
    thread::JoinHandle,
    time::{Duration, Instant},
};

use memtrace_common::{FileId, FileTable, MAX_TABLES, unwind::NO_SLOT};

use super::{
    cache::{DiskCache, FileKey},
    cfi::{Cfi, Segment},
    table::Table,
};

/// A table's place in the probes' tables array.
pub type Slot = u32;

/// What the store knows of a file's table.
#[derive(Clone)]
pub enum TableState {
    Building,
    Ready(Arc<Table>),
}

/// Figures for the summary and the report.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Tables built from call-frame information in this session.
    pub built: u64,
    /// Tables read from the disk cache.
    pub from_cache: u64,
    /// Files without usable call-frame information (their frames are walked by frame
    /// pointers).
    pub without_cfi: u64,
    /// Files refused a table because the memory cap was reached.
    pub over_cap: u64,
    /// Bytes of tables installed in the probes.
    pub bytes: u64,
    /// Rows installed.
    pub rows: u64,
    /// Time spent building (worker threads, all files), and the longest single build.
    pub build_ms: u64,
    pub longest_build_ms: u64,
}

struct Job {
    slot: Slot,
    key: FileKey,
    path: PathBuf,
    asked: Instant,
}

/// The builds waiting for a worker. The newest goes first: a library's code runs right
/// after it is mapped (its initializers, then the calls into it), while the files mapped
/// before it have been running a while, their stacks finished from copies or not needed
/// yet; and a build the probes are waiting for (a stack copy stopped in its file) is moved
/// to the front ([`TableStore::prioritize`]).
#[derive(Default)]
struct JobQueue {
    /// Taken from the back.
    jobs: Vec<Job>,
    closed: bool,
}

/// The queue and the condition its workers wait on.
type SharedQueue = Arc<(Mutex<JobQueue>, Condvar)>;

/// The next job for a worker, waiting for one; None once the store is gone.
fn next_job(queue: &SharedQueue) -> Option<Job> {
    let (lock, ready) = &**queue;
    let mut q = lock.lock().ok()?;
    loop {
        if let Some(job) = q.jobs.pop() {
            return Some(job);
        }
        if q.closed {
            return None;
        }
        q = ready.wait(q).ok()?;
    }
}

struct Done {
    slot: Slot,
    table: Option<Table>,
    from_cache: bool,
    elapsed: Duration,
    path: PathBuf,
    asked: Instant,
}

/// What became of a build: the table the probes get (empty without call-frame information
/// or past the cap) and how it came.
enum Outcome {
    Built(Duration),
    FromCache,
    WithoutCfi,
    OverCap,
}

/// A finished build ready for the probes, and its outcome.
struct Finished {
    slot: Slot,
    table: Arc<Table>,
    outcome: Outcome,
    path: PathBuf,
    asked: Instant,
}

impl Finished {
    /// Takes a worker's result; `installed_bytes` counts the bytes given to the probes so
    /// far, against `max_bytes`.
    fn of(done: Done, installed_bytes: &mut u64, max_bytes: u64) -> Self {
        let (table, outcome) = match done.table {
            Some(t) if *installed_bytes + t.byte_size() as u64 > max_bytes => {
                (Table::from_rows(&[], Vec::new()), Outcome::OverCap)
            }
            Some(t) if done.from_cache => (t, Outcome::FromCache),
            Some(t) => (t, Outcome::Built(done.elapsed)),
            None => (Table::from_rows(&[], Vec::new()), Outcome::WithoutCfi),
        };
        *installed_bytes += table.byte_size() as u64;
        Self { slot: done.slot, table: Arc::new(table), outcome, path: done.path, asked: done.asked }
    }

    /// Takes the result of the install: a table built here is read from the probes' array
    /// from now on, when the sink mapped it.
    fn adopt(&mut self, installed: InstallResult) -> anyhow::Result<()> {
        if let Some(fd) = installed?
            && !self.table.is_mapped()
            && let Some(table) = self.table.in_probes_map(fd)
        {
            self.table = Arc::new(table);
        }
        Ok(())
    }
}

/// A table installed (or not: `result`) by the install thread; `registered` when the thread
/// registered its file with the probes too (a file without an interpreter to wait for).
struct Answer {
    finished: Finished,
    result: anyhow::Result<()>,
    registered: bool,
}

/// Bytes of tables installed in one batch (their maps are created and filled before the
/// batch is installed).
const BATCH_BYTES: usize = 8 << 20;

/// The largest table a sink may put in the probes at once ([`TableSink::place_table`]).
pub const PLACEABLE_BYTES: usize = 1 << 20;

/// What installing a table gives back: `Ok(Some(fd))`, a descriptor of the probes' array
/// that holds it, which the store reads a table built here from from then on
/// ([`Table::in_probes_map`]) rather than keep it in the heap; `Ok(None)`, installed.
pub type InstallResult = anyhow::Result<Option<std::os::fd::OwnedFd>>;

/// Where tables go once built: the probes' array (the session's `Probes`).
pub trait TableSink {
    /// Installs each table in its slot (its elements laid out as the probes read them:
    /// [`Table::elements`]); one result per table, in order.
    fn install_tables(&mut self, tables: &[(Slot, &Table)]) -> Vec<InstallResult>;
    /// A sink for a thread of the store's own, which installs and registers each table as
    /// its build ends: the kernel waits for an RCU grace period (10-30 ms) at each install,
    /// and the thread that drains the rings is busy for 100 ms and more at times (probes
    /// attached to a library just loaded). Tables that went through it were in the probes
    /// ~400 ms after they were asked for on the heavy Python bench's cold start, most of it
    /// waiting for that thread, while stack copies waited for them and filled the rings.
    /// None: install on the caller's thread.
    fn installer(&self) -> Option<Installer> {
        None
    }
    /// Puts one table in the probes at once if it can (written into a map installed ahead
    /// of need, no grace period to wait for); None: install it with the others.
    fn place_table(&mut self, _slot: Slot, _table: &Table) -> Option<InstallResult> {
        None
    }
    /// Tells the probes a file's table is installed, so they add its mappings themselves.
    fn register_file(&mut self, _id: FileId, _table: FileTable) -> anyhow::Result<()> {
        Ok(())
    }
}

/// Installs tables from another thread (see [`TableSink::installer`]).
pub type Installer = Box<dyn TableSink + Send>;

/// The thread that takes the workers' builds, installs them in the probes and registers
/// their files: one answer per table out.
struct InstallThread {
    answers: Receiver<Answer>,
}

impl InstallThread {
    /// Starts the thread on the workers' results; on failure hands them back.
    fn start(
        mut sink: Installer,
        results: Receiver<Done>,
        mut installed_bytes: u64,
        max_bytes: u64,
    ) -> Result<Self, Receiver<Done>> {
        let (answer_tx, answers) = mpsc::channel();
        let (handoff_tx, handoff) = mpsc::channel::<Receiver<Done>>();
        let spawned = std::thread::Builder::new().name("memtrace-install".into()).spawn(move || {
            let Ok(results) = handoff.recv() else { return };
            // Ends when the workers are gone (the store closed their queue).
            while let Ok(first) = results.recv() {
                // Every build waiting joins this batch: the installs of one call share
                // their grace periods, and batches installed one by one each waited for
                // their own (a cold start's small libraries queued ~60 ms).
                let mut done: Vec<Finished> = vec![Finished::of(first, &mut installed_bytes, max_bytes)];
                done.extend(results.try_iter().map(|d| Finished::of(d, &mut installed_bytes, max_bytes)));
                // Those that fit a map installed ahead go in now, and are answered before
                // the others' installs wait for their grace period.
                let mut rest = Vec::new();
                for mut f in done {
                    let placed = if f.table.byte_size() <= PLACEABLE_BYTES {
                        let placed = sink.place_table(f.slot, &f.table);
                        f.table.drop_resident();
                        placed
                    } else {
                        None
                    };
                    match placed {
                        Some(result) => {
                            let result = f.adopt(result);
                            if result.is_ok() {
                                log::debug!(
                                    "{}: its unwind table written into a map installed ahead",
                                    f.path.display()
                                );
                            }
                            if !answer(&mut sink, &answer_tx, f, result) {
                                return;
                            }
                        }
                        None => rest.push(f),
                    }
                }
                for batch in batches(rest) {
                    let tables: Vec<(Slot, &Table)> = batch.iter().map(|f| (f.slot, &*f.table)).collect();
                    let results = sink.install_tables(&tables);
                    drop(tables);
                    batch.iter().for_each(|f| f.table.drop_resident());
                    for (mut finished, result) in batch.into_iter().zip(results) {
                        let result = finished.adopt(result);
                        if !answer(&mut sink, &answer_tx, finished, result) {
                            return;
                        }
                    }
                }
            }
        });
        match spawned {
            Ok(_) => {
                // The thread exists: it takes the results (sending cannot fail, it waits).
                let _ = handoff_tx.send(results);
                Ok(Self { answers })
            }
            Err(_) => Err(results),
        }
    }
}

/// Registers an installed table's file with the probes (unless it waits for its
/// interpreter's table: the store's thread registers it then) and answers the store; false
/// when the store is gone.
fn answer(sink: &mut Installer, answers: &Sender<Answer>, finished: Finished, result: anyhow::Result<()>) -> bool {
    let registered = result.is_ok()
        && match registration(&finished.path, &finished.table, finished.slot) {
            Some((_, _, Some(_))) => false,
            Some((id, entry, None)) => {
                if let Err(e) = sink.register_file(id, entry) {
                    log::debug!("registering the unwind table of {}: {e:#}", finished.path.display());
                }
                true
            }
            None => true,
        };
    answers.send(Answer { finished, result, registered }).is_ok()
}

/// Splits finished builds into install batches of at most [`BATCH_BYTES`] each (a table
/// larger than that alone).
fn batches(done: Vec<Finished>) -> Vec<Vec<Finished>> {
    let mut out: Vec<Vec<Finished>> = Vec::new();
    let mut bytes = 0;
    for f in done {
        let size = f.table.byte_size();
        match out.last_mut() {
            Some(batch) if bytes + size <= BATCH_BYTES => {
                bytes += size;
                batch.push(f);
            }
            _ => {
                bytes = size;
                out.push(vec![f]);
            }
        }
    }
    out
}

/// Where a file's code lies, for the probes: its first executable segment and, where a
/// second one's address less its offset differs (libLLVM's 2 MiB-aligned hot code), that
/// one too. None: no code.
fn file_table_entry(segments: &[Segment], slot: Slot) -> Option<FileTable> {
    let text = segments.iter().filter(|s| s.executable).min_by_key(|s| s.vaddr).copied()?;
    let delta = text.vaddr.wrapping_sub(text.file_offset);
    let other = segments
        .iter()
        .filter(|s| s.executable && s.vaddr.wrapping_sub(s.file_offset) != delta && s.file_offset & !0xfff != 0)
        .min_by_key(|s| s.vaddr);
    Some(FileTable {
        slot,
        interp_slot: NO_SLOT,
        delta,
        exec_vaddr: text.vaddr,
        exec_size: text.file_size,
        interp_exec_vaddr: 0,
        interp_exec_size: 0,
        exec2_offset: other.map_or(0, |s| s.file_offset & !0xfff),
        exec2_delta: other.map_or(0, |s| s.vaddr.wrapping_sub(s.file_offset)),
    })
}

/// How the probes learn of the file of `slot`: its identity, where its code lies, and
/// the interpreter (ld.so) it asks for, whose table must be ready first. None: nothing to
/// register (no identity, or an empty table: its frames are walked by frame pointers).
fn registration(path: &Path, table: &Table, slot: Slot) -> Option<(FileId, FileTable, Option<PathBuf>)> {
    let id = kernel_file_id(path)?;
    let entry = file_table_entry(&table.segments, slot)?;
    let interp = crate::elf::ElfFile::open(path).ok().and_then(|e| e.interpreter()).map(|interp| {
        // The interpreter as the program will see it: under the same root.
        match path.to_str().and_then(|p| p.strip_prefix("/proc/")).and_then(|p| p.split_once("/root/")) {
            Some((pid, _)) => PathBuf::from(format!("/proc/{pid}/root{interp}")),
            None => PathBuf::from(interp),
        }
    });
    Some((id, entry, interp))
}

pub struct TableStore {
    slots: HashMap<FileKey, Slot>,
    states: Vec<TableState>,
    /// Files (by path as opened) → their key, so a file seen again is not re-read.
    keys: HashMap<PathBuf, (FileKey, Arc<[Segment]>)>,
    jobs: SharedQueue,
    /// The workers' results, until the install thread takes them.
    results: Option<Receiver<Done>>,
    workers: Vec<JoinHandle<()>>,
    /// Builds taken here and not installed yet (without an install thread).
    ready: Vec<Finished>,
    /// A path each slot's file was asked for by.
    paths: Vec<PathBuf>,
    /// Installed files not registered with the probes yet (their interpreter's table is
    /// not ready).
    unregistered: Vec<Slot>,
    /// Tables asked for and not installed yet.
    pending_builds: usize,
    /// The install thread, once a sink offered one.
    installing: Option<InstallThread>,
    /// When each slot's table was asked for.
    asked: Vec<Instant>,
    /// Bytes of the tables given to the probes here (without an install thread).
    installed_bytes: u64,
    stats: StoreStats,
    max_bytes: u64,
    warned_cap: bool,
    /// Slots whose table is read from the probes' array ([`Table::in_probes`]).
    in_probes: Vec<Slot>,
}

/// How long a table read from the probes' array stays mapped after its last lookup.
const VIEW_IDLE: Duration = Duration::from_secs(1);

/// Default cap on the bytes of tables installed in the probes.
pub const DEFAULT_MAX_BYTES: u64 = 1 << 30;

impl TableStore {
    /// A store with `workers` build threads, reading and filling `cache` if given.
    pub fn new(cache: Option<DiskCache>, workers: usize, max_bytes: u64) -> Self {
        let queue: SharedQueue = Arc::default();
        let (done_tx, done_rx) = mpsc::channel::<Done>();
        let cache = cache.map(Arc::new);
        // (No worker at all only in tests, to look at the queue.)
        let workers = (0..workers)
            .map(|i| {
                let jobs = Arc::clone(&queue);
                let done = done_tx.clone();
                let cache = cache.clone();
                std::thread::Builder::new()
                    .name(format!("memtrace-unwind-{i}"))
                    .spawn(move || {
                        while let Some(job) = next_job(&jobs) {
                            let started = Instant::now();
                            let (table, from_cache) = build_or_load(&job, cache.as_deref());
                            let _ = done.send(Done {
                                slot: job.slot,
                                table,
                                from_cache,
                                elapsed: started.elapsed(),
                                path: job.path,
                                asked: job.asked,
                            });
                        }
                    })
                    .expect("spawning an unwind-table worker")
            })
            .collect();
        Self {
            slots: HashMap::new(),
            states: Vec::new(),
            keys: HashMap::new(),
            jobs: queue,
            results: Some(done_rx),
            workers,
            ready: Vec::new(),
            paths: Vec::new(),
            unregistered: Vec::new(),
            pending_builds: 0,
            installing: None,
            asked: Vec::new(),
            installed_bytes: 0,
            stats: StoreStats::default(),
            max_bytes,
            warned_cap: false,
            in_probes: Vec::new(),
        }
    }

    pub fn stats(&self) -> StoreStats {
        self.stats
    }

    /// The key and segments of the file at `path` (read once per path).
    pub fn identify(&mut self, path: &Path) -> Option<(FileKey, Arc<[Segment]>)> {
        if let Some(known) = self.keys.get(path) {
            return Some(known.clone());
        }
        let key = FileKey::of(path).ok()?;
        let segments: Arc<[Segment]> = read_segments(path).ok()?.into();
        if self.keys.len() > 16_384 {
            self.keys.clear();
        }
        self.keys.insert(path.to_path_buf(), (key.clone(), Arc::clone(&segments)));
        Some((key, segments))
    }

    /// The slot of the file at `path` (readable from here), building its table if it is
    /// new (before those asked for earlier and not started); None when the file cannot be
    /// read or every slot is taken.
    pub fn request(&mut self, path: &Path) -> Option<(Slot, Arc<[Segment]>)> {
        self.request_at(path, false)
    }

    /// As [`Self::request`], its build after every one waiting: a file a program may map
    /// later, behind the tables stacks wait for.
    pub fn request_behind(&mut self, path: &Path) -> Option<(Slot, Arc<[Segment]>)> {
        self.request_at(path, true)
    }

    fn request_at(&mut self, path: &Path, behind: bool) -> Option<(Slot, Arc<[Segment]>)> {
        let (key, segments) = self.identify(path)?;
        if let Some(&slot) = self.slots.get(&key) {
            return Some((slot, segments));
        }
        if self.states.len() >= MAX_TABLES as usize {
            return None;
        }
        let slot = self.states.len() as Slot;
        let asked = Instant::now();
        self.states.push(TableState::Building);
        self.paths.push(path.to_path_buf());
        self.asked.push(asked);
        self.slots.insert(key.clone(), slot);
        self.pending_builds += 1;
        let (lock, ready) = &*self.jobs;
        if let Ok(mut q) = lock.lock() {
            // Workers take the last job first.
            let job = Job { slot, key, path: path.to_path_buf(), asked };
            if behind {
                q.jobs.insert(0, job)
            } else {
                q.jobs.push(job)
            }
            ready.notify_one();
        }
        Some((slot, segments))
    }

    /// Moves the build of `slot`, if it has not started, to the front of the queue: a
    /// stack waits for it.
    pub fn prioritize(&mut self, slot: Slot) {
        let (lock, _) = &*self.jobs;
        let Ok(mut q) = lock.lock() else { return };
        if let Some(at) = q.jobs.iter().rposition(|j| j.slot == slot)
            && at + 1 != q.jobs.len()
        {
            let job = q.jobs.remove(at);
            q.jobs.push(job);
        }
    }

    /// The slot of the file at `path`, if its table was asked for (for tests).
    #[cfg(test)]
    pub fn slot_of(&mut self, path: &Path) -> Option<Slot> {
        let (key, _) = self.identify(path)?;
        self.slots.get(&key).copied()
    }

    /// The slots waiting for a worker, the next one first (for tests).
    #[cfg(test)]
    fn queued(&self) -> Vec<Slot> {
        self.jobs.0.lock().map(|q| q.jobs.iter().rev().map(|j| j.slot).collect()).unwrap_or_default()
    }

    pub fn state(&self, slot: Slot) -> Option<&TableState> {
        self.states.get(slot as usize)
    }

    /// Whether every table asked for is built and installed.
    pub fn idle(&self) -> bool {
        self.pending_builds == 0 && self.ready.is_empty()
    }

    /// Learns of the tables installed since the last call (by the install thread, once the
    /// sink offers one: this call then never waits), or takes the builds that finished and
    /// installs them through `sink`. Returns how many tables became ready: userspace
    /// finishes stack copies with them from then on.
    pub fn poll(&mut self, sink: &mut dyn TableSink) -> usize {
        if self.installing.is_none()
            && let Some(installer) = sink.installer()
            && let Some(results) = self.results.take()
        {
            match InstallThread::start(installer, results, self.installed_bytes, self.max_bytes) {
                Ok(thread) => self.installing = Some(thread),
                Err(results) => self.results = Some(results),
            }
        }
        let mut installed = 0;
        if let Some(thread) = &self.installing {
            let answers: Vec<Answer> = thread.answers.try_iter().collect();
            for Answer { finished, result, registered } in answers {
                installed += 1;
                self.installed(finished, result, registered);
            }
        }
        if let Some(results) = &self.results {
            let (bytes, max) = (&mut self.installed_bytes, self.max_bytes);
            self.ready.extend(results.try_iter().map(|done| Finished::of(done, bytes, max)));
        }
        for batch in batches(std::mem::take(&mut self.ready)) {
            let tables: Vec<(Slot, &Table)> = batch.iter().map(|f| (f.slot, &*f.table)).collect();
            let results = sink.install_tables(&tables);
            drop(tables);
            batch.iter().for_each(|f| f.table.drop_resident());
            for (mut finished, result) in batch.into_iter().zip(results) {
                let result = finished.adopt(result);
                installed += 1;
                self.installed(finished, result, false);
            }
        }
        for &slot in &self.in_probes {
            if let Some(TableState::Ready(table)) = self.states.get(slot as usize) {
                table.release_if_idle(VIEW_IDLE);
            }
        }
        if !self.unregistered.is_empty() {
            for slot in std::mem::take(&mut self.unregistered) {
                if !self.register(slot, sink) {
                    self.unregistered.push(slot);
                }
            }
        }
        installed
    }

    /// Counts a table installed in the probes (or not), marks it ready and, unless the
    /// install thread did, queues its file's registration.
    fn installed(&mut self, finished: Finished, result: anyhow::Result<()>, registered: bool) {
        let Finished { slot, table, outcome, path, asked } = finished;
        self.pending_builds = self.pending_builds.saturating_sub(1);
        match outcome {
            Outcome::Built(elapsed) => {
                let ms = elapsed.as_millis() as u64;
                self.stats.built += 1;
                self.stats.build_ms += ms;
                self.stats.longest_build_ms = self.stats.longest_build_ms.max(ms);
                log::debug!(
                    "unwind table of {}: {} rows, {} KiB, built in {ms} ms",
                    path.display(),
                    table.row_count(),
                    table.byte_size() >> 10
                );
            }
            Outcome::FromCache => {
                self.stats.from_cache += 1;
                log::debug!(
                    "unwind table of {}: {} rows, {} KiB, from the cache",
                    path.display(),
                    table.row_count(),
                    table.byte_size() >> 10
                );
            }
            Outcome::WithoutCfi => {
                self.stats.without_cfi += 1;
                log::debug!(
                    "{} has no usable call-frame information: its frames are walked by frame pointers",
                    path.display()
                );
            }
            Outcome::OverCap => {
                self.stats.over_cap += 1;
                if !self.warned_cap {
                    self.warned_cap = true;
                    eprintln!(
                        "memtrace: warning: unwind tables reached {}: {} and later files are walked by frame pointers only (stacks through them are cut short where they keep none)",
                        crate::units::bytes(self.max_bytes),
                        path.display()
                    );
                }
            }
        }
        match result {
            Ok(()) => {
                self.stats.bytes += table.byte_size() as u64;
                self.stats.rows += table.row_count() as u64;
            }
            Err(e) => log::warn!("installing the unwind table in slot {slot}: {e:#}"),
        }
        if registered {
            log::debug!(
                "unwind table of {} in the probes {} ms after it was asked for",
                path.display(),
                asked.elapsed().as_millis()
            );
        }
        // Userspace finishes copies with it either way.
        if table.in_probes() {
            log::debug!("unwind table of {}: read from the probes' array from now on", path.display());
            self.in_probes.push(slot);
        }
        if let Some(state) = self.states.get_mut(slot as usize) {
            *state = TableState::Ready(table);
        }
        if !registered {
            self.unregistered.push(slot);
        }
    }

    /// Registers the file of `slot` with the probes: its identity, where its code lies,
    /// and its interpreter's table. False when that table is not ready yet.
    fn register(&mut self, slot: Slot, sink: &mut dyn TableSink) -> bool {
        let Some(path) = self.paths.get(slot as usize).cloned() else { return true };
        let Some(TableState::Ready(table)) = self.state(slot).cloned() else { return true };
        let Some((id, mut entry, interp)) = registration(&path, &table, slot) else { return true };
        if let Some(interp) = interp
            && let Some((interp_slot, _)) = self.request(&interp)
        {
            match self.state(interp_slot) {
                Some(TableState::Ready(t)) => {
                    if let Some(text) = t.segments.iter().filter(|s| s.executable).min_by_key(|s| s.vaddr) {
                        entry.interp_slot = interp_slot;
                        entry.interp_exec_vaddr = text.vaddr;
                        entry.interp_exec_size = text.file_size;
                    }
                }
                _ => return false,
            }
        }
        log::debug!(
            "unwind table of {} in the probes {} ms after it was asked for",
            path.display(),
            self.asked.get(slot as usize).map_or(0, |t| t.elapsed().as_millis())
        );
        if let Err(e) = sink.register_file(id, entry) {
            log::debug!("registering the unwind table of {}: {e:#}", path.display());
        }
        true
    }

    /// Waits until every requested table is installed, or `timeout` passes.
    /// Waits (at most `timeout`) until the tables of `slots` are installed (or failed).
    pub fn wait_slots(&mut self, slots: &[Slot], sink: &mut dyn TableSink, timeout: Duration) -> bool {
        self.wait_until(sink, timeout, |store| {
            slots.iter().all(|&s| !matches!(store.state(s), Some(TableState::Building)))
        })
    }

    pub fn wait_idle(&mut self, sink: &mut dyn TableSink, timeout: Duration) -> bool {
        self.wait_until(sink, timeout, Self::idle)
    }

    /// Polls until `done` (true) or `timeout` has passed (false).
    fn wait_until(&mut self, sink: &mut dyn TableSink, timeout: Duration, done: impl Fn(&Self) -> bool) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            self.poll(sink);
            if done(self) {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for TableStore {
    fn drop(&mut self) {
        // Closing the queue ends the workers once their current build is done; they are
        // not joined (a huge build must not delay the exit).
        let (lock, ready) = &*self.jobs;
        if let Ok(mut q) = lock.lock() {
            q.closed = true;
            q.jobs.clear();
        }
        ready.notify_all();
        self.workers.clear();
    }
}

/// A file's identity as the kernel gives it (`s_dev` in the kernel's encoding, inode).
pub fn kernel_file_id(path: &Path) -> Option<FileId> {
    use std::os::unix::fs::MetadataExt as _;
    let md = std::fs::metadata(path).ok()?;
    let dev = md.dev();
    let (major, minor) = (libc::major(dev), libc::minor(dev));
    Some(FileId { dev: (major << 20) | (minor & 0xf_ffff), _pad: 0, ino: md.ino() })
}

/// The loadable segments of an ELF file (program headers only: cheap).
pub fn read_segments(path: &Path) -> anyhow::Result<Vec<Segment>> {
    let file = std::fs::File::open(path)?;
    // SAFETY: read-only private mapping while the headers are parsed.
    let map = unsafe { memmap2::Mmap::map(&file) }?;
    let elf = object::File::parse(&*map)?;
    Ok(super::cfi::segments_of(&elf))
}

fn build_or_load(job: &Job, cache: Option<&DiskCache>) -> (Option<Table>, bool) {
    if let Some(cache) = cache {
        match cache.load(&job.key) {
            Ok(table) => return (Some(table), true),
            Err(why) => {
                if why != super::cache::Rejected::Missing {
                    log::debug!("unwind cache entry for {} ({}): {why}; rebuilding", job.path.display(), job.key);
                }
            }
        }
    }
    let Ok(cfi) = Cfi::open(&job.path) else { return (None, false) };
    let Some(table) = cfi.table() else { return (None, false) };
    drop(cfi);
    if let Some(cache) = cache {
        if let Err(e) = cache.store(&job.key, &table) {
            log::debug!("storing the unwind table of {} in the cache: {e}", job.path.display());
        } else if let Ok(mapped) = cache.load(&job.key) {
            // Kept from here on as the cache's entry, read in place, not in the heap.
            return (Some(mapped), false);
        }
    }
    (Some(table), false)
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use super::*;

    #[derive(Default)]
    struct Installed(Vec<(Slot, usize)>);
    impl TableSink for Installed {
        fn install_tables(&mut self, tables: &[(Slot, &Table)]) -> Vec<InstallResult> {
            self.0.extend(tables.iter().map(|(slot, table)| (*slot, table.elements().len())));
            tables.iter().map(|_| Ok(None)).collect()
        }
    }

    #[test]
    fn each_code_segment_a_mapping_may_hold_has_its_delta() {
        let seg = |file_offset, vaddr, file_size, executable| Segment { file_offset, vaddr, file_size, executable };
        // libLLVM.so (rustc 1.95): two code segments, 0x1000 and 0 apart from their offsets.
        let llvm = [
            seg(0, 0, 0x449_a9a4, false),
            seg(0x449_a9a4, 0x449_b9a4, 0x3ee_331c, true),
            seg(0x837_dcc0, 0x837_fcc0, 0x1c_34a8, false),
            seg(0x860_0000, 0x860_0000, 0x215_7044, true),
        ];
        let t = file_table_entry(&llvm, 3).unwrap();
        assert_eq!(
            (t.slot, t.delta, t.exec_vaddr, t.exec2_offset, t.exec2_delta),
            (3, 0x1000, 0x449_b9a4, 0x860_0000, 0)
        );
        assert_eq!((t.delta_at(0x449_a000, 0x3ee_4000), t.delta_at(0x860_0000, 0x215_8000)), (Some(0x1000), Some(0)));
        // One code segment, or two alike: nothing more.
        let libc =
            [seg(0, 0, 0x26000, false), seg(0x26000, 0x26000, 0x155_000, true), seg(0x17c000, 0x17c000, 0x4000, true)];
        let t = file_table_entry(&libc, 1).unwrap();
        assert_eq!((t.delta, t.exec2_offset), (0, 0));
        assert!(file_table_entry(&llvm[..1], 1).is_none());
    }

    #[test]
    fn a_file_gets_one_slot_and_one_build() {
        let exe = std::env::current_exe().unwrap();
        let mut store = TableStore::new(None, 2, DEFAULT_MAX_BYTES);
        let (slot, segments) = store.request(&exe).unwrap();
        assert!(!segments.is_empty());
        assert_eq!(store.request(&exe).unwrap().0, slot, "the same file, the same slot");
        let mut sink = Installed::default();
        assert!(store.wait_idle(&mut sink, Duration::from_secs(60)));
        // The program's table, installed once (and its interpreter's, which registering the
        // program with the probes asks for).
        assert_eq!(sink.0.iter().filter(|(s, _)| *s == slot).count(), 1);
        assert!(store.wait_idle(&mut sink, Duration::from_secs(60)));
        assert_eq!(store.stats().built, sink.0.len() as u64);
        let Some(TableState::Ready(table)) = store.state(slot) else { panic!("not ready") };
        assert!(table.row_count() > 1000);
    }

    /// A table built with a cache at hand is kept as the cache's entry, read in place; the
    /// next run loads that entry, and both answer as the table built without a cache.
    #[test]
    fn a_table_built_with_a_cache_is_kept_as_its_mapped_entry() {
        let exe = std::env::current_exe().unwrap();
        let tmp = tempfile::Builder::new().prefix("memtrace-store-mapped-").tempdir().unwrap();
        let dir = tmp.path().to_path_buf();
        let cache = DiskCache::open(&dir, 1 << 30).unwrap();
        let job = Job { slot: 0, key: FileKey::of(&exe).unwrap(), path: exe.clone(), asked: Instant::now() };
        let (plain, _) = build_or_load(&job, None);
        let plain = plain.unwrap();
        assert!(!plain.is_mapped());
        let (built, from_cache) = build_or_load(&job, Some(&cache));
        let built = built.unwrap();
        assert!(built.is_mapped() && !from_cache);
        let (loaded, from_cache) = build_or_load(&job, Some(&cache));
        let loaded = loaded.unwrap();
        assert!(loaded.is_mapped() && from_cache);
        assert!(built == plain && loaded == plain);
        drop((built, loaded));
    }

    /// What a sink of the install-thread test was asked: (on the install thread, "install"
    /// or "register", slot or inode).
    type Asked = (bool, &'static str, u64);

    /// What the sinks of the install-thread test saw, and on which thread.
    #[derive(Clone, Default)]
    struct Seen(Arc<Mutex<Vec<Asked>>>);

    impl Seen {
        fn note(&self, what: &'static str, n: u64) {
            let on_install_thread = std::thread::current().name() == Some("memtrace-install");
            self.0.lock().unwrap().push((on_install_thread, what, n));
        }
    }

    impl TableSink for Seen {
        fn install_tables(&mut self, tables: &[(Slot, &Table)]) -> Vec<InstallResult> {
            tables.iter().map(|(slot, _)| self.note("install", u64::from(*slot))).map(|()| Ok(None)).collect()
        }
        fn installer(&self) -> Option<Installer> {
            Some(Box::new(self.clone()))
        }
        fn register_file(&mut self, id: FileId, _table: FileTable) -> anyhow::Result<()> {
            self.note("register", id.ino);
            Ok(())
        }
    }

    #[test]
    fn the_install_thread_installs_and_registers_libraries_as_their_builds_end() {
        use std::os::unix::fs::MetadataExt as _;
        let exe = std::env::current_exe().unwrap();
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        // The dynamic linker: a library without an interpreter of its own (libc has one).
        let ld = maps.lines().filter_map(|l| l.split_whitespace().nth(5)).find(|p| p.contains("/ld-linux")).unwrap();
        let ld = PathBuf::from(ld);
        let mut store = TableStore::new(None, 2, DEFAULT_MAX_BYTES);
        let exe_slot = store.request(&exe).unwrap().0;
        let ld_slot = store.request(&ld).unwrap().0;
        let mut sink = Seen::default();
        assert!(store.wait_idle(&mut sink, Duration::from_secs(60)));
        let seen = sink.0.lock().unwrap().clone();
        let installs: Vec<_> = seen.iter().filter(|s| s.1 == "install").collect();
        // The program and its interpreter, once each.
        assert_eq!(installs.len(), 2, "{seen:?}");
        assert!(installs.iter().all(|s| s.0), "every install on the install thread: {seen:?}");
        assert!([exe_slot, ld_slot].iter().all(|&slot| installs.iter().any(|s| s.2 == u64::from(slot))));
        let registered = |path: &Path| {
            let ino = std::fs::metadata(path).unwrap().ino();
            seen.iter().filter(|s| s.1 == "register" && s.2 == ino).map(|s| s.0).collect::<Vec<bool>>()
        };
        // A library is registered by the install thread, a program by the store's thread
        // once its interpreter's table is ready.
        assert_eq!(registered(&ld), [true], "{seen:?}");
        assert_eq!(registered(&exe), [false], "{seen:?}");
        assert_eq!(store.stats().built, 2);
        assert!(matches!(store.state(ld_slot), Some(TableState::Ready(_))));
    }

    #[test]
    fn the_newest_build_goes_first_and_a_build_waited_for_goes_before_it() {
        let mut store = TableStore::new(None, 0, DEFAULT_MAX_BYTES);
        let files = [std::env::current_exe().unwrap(), "/bin/true".into(), "/bin/sh".into()];
        let slots: Vec<Slot> = files.iter().map(|f| store.request(f).unwrap().0).collect();
        assert_eq!(store.queued(), [slots[2], slots[1], slots[0]]);
        store.prioritize(slots[0]);
        assert_eq!(store.queued(), [slots[0], slots[2], slots[1]]);
        store.prioritize(slots[0]);
        store.prioritize(99);
        assert_eq!(store.queued(), [slots[0], slots[2], slots[1]], "nothing else moves");
        // A file a program may map later goes behind them all, and stays behind newer ones.
        let later = store.request_behind(Path::new("/bin/ls")).unwrap().0;
        let newest = store.request(Path::new("/bin/cat")).unwrap().0;
        assert_eq!(store.queued(), [newest, slots[0], slots[2], slots[1], later]);
    }

    #[test]
    fn the_cap_gives_an_empty_table_and_files_without_cfi_too() {
        let exe = std::env::current_exe().unwrap();
        let mut store = TableStore::new(None, 1, 1024);
        let (slot, _) = store.request(&exe).unwrap();
        let tmp = tempfile::Builder::new().prefix("memtrace-not-elf-").tempdir().unwrap();
        let not_elf = tmp.path().join("not-elf");
        std::fs::write(&not_elf, b"not an ELF file").unwrap();
        assert!(store.request(&not_elf).is_none(), "a file that is not ELF has no segments");
        let mut sink = Installed::default();
        assert!(store.wait_idle(&mut sink, Duration::from_secs(60)));
        assert_eq!(store.stats().over_cap, 1);
        let Some(TableState::Ready(table)) = store.state(slot) else { panic!() };
        assert!(table.row_count() == 0);
    }
}
